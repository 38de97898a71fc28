"""The engine with memory tiers behind its prefix cache (LLM(host_cache_memory=..., disk_cache_dir=...)): a toy
Llama with random weights on the CPU, a pool too small to keep every prompt, so revisited prompts come back from the
host or the disk instead of being recomputed; tokens equal to the engine without tiers; persistence across engines;
damaged entries refused and recomputed; events and stats; refusals by name."""

from __future__ import annotations

import os

import pytest
import torch

from kvcache.engine import LLM, SamplingParams
from kvcache.paged.events import BlockRemoved, BlockStored
from support_models import IdsTokenizer

BS = 8
SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 256, (41,), generator=g).tolist() for _ in range(4)]  # 5 full blocks each


def _llm(model, **kw) -> LLM:
    kw.setdefault("num_blocks", 12)  # two prompts' blocks: the others are evicted
    return LLM(model, tokenizer=IdsTokenizer(), max_num_seqs=2, max_model_len=64, block_size=BS, **kw)


def _visit_twice(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, then each again (its blocks evicted meanwhile by the others)."""
    return [llm.generate([p], SP)[0].token_ids for _ in range(2) for p in prompts]


@pytest.fixture(scope="module")
def reference(model, prompts) -> list[list[int]]:
    llm = _llm(model)
    out = _visit_twice(llm, prompts)
    assert llm.stats.total.cached_prompt_tokens == 0  # the pool alone keeps nothing across the visits
    return out


@pytest.mark.parametrize(("kv_dtype", "cuda_graphs"), [("auto", False), ("auto", True), ("int8", False)])
def test_host_tier_brings_prefixes_back_with_equal_tokens(model, prompts, reference, kv_dtype, cuda_graphs):
    llm = _llm(model, host_cache_memory=2**20, kv_dtype=kv_dtype, cuda_graphs=cuda_graphs)
    out = _visit_twice(llm, prompts)
    # int8: the blocks come back bit-exact, so the tokens equal the int8 engine's without tiers
    assert out == (reference if kv_dtype == "auto" else _visit_twice(_llm(model, kv_dtype="int8"), prompts))
    total = llm.stats.total
    # the second visit of each prompt: its 5 full blocks (40 tokens) from the host tier
    assert total.cached_prompt_tokens >= 4 * 5 * BS
    host = total.tiers["host"]
    assert host.hits >= 4 * 5 and host.stored > 0 and host.bytes_out > 0 and host.bytes_in > 0
    assert llm.stats.tiers["host"].hits <= host.hits  # the last call's share
    dev = total.tiers["device"]
    assert dev.removed >= host.stored and dev.stored > 0  # the host holds only what the pool evicted
    assert total.cached_prompt_tokens == (dev.hits + host.hits) * BS  # every cached token from one of the two


@pytest.mark.parametrize("host_blocks", [0, 4])  # disk alone, or under a host tier of 4 blocks that spills to it
def test_disk_tier_persists_across_engines(model, prompts, reference, tmp_path, host_blocks):
    first = _llm(model, disk_cache_dir=tmp_path, host_cache_memory=host_blocks * 4096)  # 4096 bytes a block
    assert _visit_twice(first, prompts) == reference
    assert first.stats.total.tiers["disk"].stored > 0
    # a new engine of the same model on the same directory: the first visits already hit the disk
    second = _llm(model, disk_cache_dir=tmp_path)
    out = [second.generate([p], SP)[0].token_ids for p in prompts]
    assert out == reference[:4]
    assert second.stats.total.tiers["disk"].hits > 0 and second.stats.total.cached_prompt_tokens > 0


def test_damaged_disk_entries_are_refused_and_recomputed(model, prompts, reference, tmp_path):
    first = _llm(model, disk_cache_dir=tmp_path)
    _visit_twice(first, prompts)
    folder = first.tiers.disk.directory
    files = sorted(os.listdir(folder))
    for name in files:  # one byte flipped in every entry
        path = os.path.join(folder, name)
        raw = bytearray(open(path, "rb").read())
        raw[-3] ^= 0x40
        open(path, "wb").write(raw)
    second = _llm(model, disk_cache_dir=tmp_path)
    out = [second.generate([p], SP)[0].token_ids for p in prompts]
    assert out == reference[:4]
    disk = second.stats.total.tiers["disk"]
    assert disk.hits == 0 and disk.refused > 0 and second.stats.total.cached_prompt_tokens == 0


def test_another_model_id_or_format_finds_nothing(model, prompts, reference, tmp_path):
    _visit_twice(_llm(model, disk_cache_dir=tmp_path, cache_model_id="a"), prompts)
    for kw in (dict(cache_model_id="b"), dict(cache_model_id="a", kv_dtype="int8")):
        other = _llm(model, disk_cache_dir=tmp_path, **kw)
        [other.generate([p], SP) for p in prompts]
        assert other.stats.total.tiers["disk"].hits == 0


@pytest.mark.parametrize("host_blocks", [0, 4])
def test_weights_updated_in_place_never_read_old_disk_blocks(tiny_llama, prompts, tmp_path, host_blocks):
    # the disk tier's fingerprint is recomputed from the weights on reset_prefix_cache: blocks written with the
    # old weights stay in their own folder, and the tokens equal a fresh engine's on the new weights
    model = tiny_llama()
    llm = _llm(model, disk_cache_dir=tmp_path, host_cache_memory=host_blocks * 4096)
    _visit_twice(llm, prompts)
    assert llm.stats.total.tiers["disk"].stored > 0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert llm.allocator.reset_prefix_cache()
    out = _visit_twice(llm, prompts)
    fresh = tiny_llama()
    fresh.load_state_dict(model.state_dict())
    assert out == _visit_twice(_llm(fresh), prompts)
    assert llm.stats.total.tiers["disk"].refused == 0  # the old files were never looked at


def test_a_given_cache_model_id_is_kept_across_reset(model, prompts, tmp_path):
    # cache_model_id: the user vouches for the weights; a reset keeps the folder (and its hits)
    llm = _llm(model, disk_cache_dir=tmp_path, cache_model_id="toy@1")
    _visit_twice(llm, prompts)
    folder = llm.tiers.disk.directory
    assert llm.allocator.reset_prefix_cache()
    assert llm.tiers.disk.directory == folder
    hits = llm.stats.total.tiers["disk"].hits
    llm.generate([prompts[0]], SP)
    assert llm.stats.total.tiers["disk"].hits > hits


def test_kv_events_report_the_tiers(model, prompts):
    llm = _llm(model, host_cache_memory=2**20, kv_events=True)
    _visit_twice(llm, prompts)
    ev = llm.kv_events()
    media = {(type(e).__name__, e.medium) for e in ev}
    assert {("BlockStored", "device"), ("BlockRemoved", "device"), ("BlockStored", "host")} <= media
    stored_host = {h for e in ev if isinstance(e, BlockStored) and e.medium == "host" for h in e.block_hashes}
    removed_dev = {h for e in ev if isinstance(e, BlockRemoved) and e.medium == "device" for h in e.block_hashes}
    assert stored_host <= removed_dev  # only evicted blocks reach the host
    assert llm.kv_events() == []
    with pytest.raises(ValueError, match="^kv_events: "):
        _llm(model, host_cache_memory=2**20).kv_events()


@pytest.mark.parametrize(("kw", "field"), [
    (dict(cache="linear", host_cache_memory=2**20), "host_cache_memory"),
    (dict(cache="linear", disk_cache_dir="/tmp/x"), "disk_cache_dir"),
    (dict(cache="linear", kv_events=True), "kv_events"),
    (dict(enable_prefix_caching=False, host_cache_memory=2**20), "host_cache_memory"),
    (dict(host_cache_memory=100), "host_cache_memory"),
    (dict(cache_model_id="toy@1"), "cache_model_id"),
    (dict(host_cache_memory=2**20, disk_cache_bytes=2**20), "disk_cache_bytes"),
])
def test_refused_by_name(model, kw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LLM(model, tokenizer=IdsTokenizer(), max_model_len=64, kv_cache_memory=2**20, **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the side stream, events, pinned slots)")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_host_tier_on_cuda_equals_recompute(tiny_llama, prompts, cuda_graphs):
    # copies back run on the tiers' stream and a request waits for its own blocks: tokens equal the engine
    # without tiers; several requests at once, so some run while others' blocks are still in flight
    many = prompts * 2
    # one model per engine: each engine fuses the weights of its own model (the same seed, the same weights)
    ref_llm = _llm(tiny_llama().to("cuda"), num_blocks=16, cuda_graphs=cuda_graphs)
    llm = _llm(tiny_llama().to("cuda"), num_blocks=16, host_cache_memory=2**20, cuda_graphs=cuda_graphs)
    for _ in range(3):
        want = [o.token_ids for o in ref_llm.generate(many, SP)]
        assert [o.token_ids for o in llm.generate(many, SP)] == want
    assert llm.stats.total.tiers["host"].hits > 0


def test_a_request_waits_only_for_its_own_blocks():
    from kvcache.engine.scheduler import Scheduler
    from kvcache.engine.sequence import Sequence
    from kvcache.paged import BlockAllocator, PagedConfig, PagedKVCache, TieredCache

    class InFlight(TieredCache):
        """Copies back stay in flight until wait() (what the tiers' CUDA stream does)."""

        inflight: set = set()
        waited = 0

        def load(self, fetched, block_ids):
            super().load(fetched, block_ids)
            self.inflight = self.inflight | set(block_ids)

        def ready(self, block_ids):
            return not self.inflight.intersection(block_ids)

        @property
        def loading(self):
            return bool(self.inflight)

        def wait(self):
            self.waited += 1
            self.inflight = set()

    cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=8,
                                     dtype=torch.float32, device="cpu"))
    tiers = InFlight(cache, host_bytes=2**16)
    alloc = BlockAllocator(8, 4)
    alloc.set_listener(tiers)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=64, max_blocks_per_seq=8, tiers=tiers)
    a_tokens = list(range(2, 19))  # 17 tokens: 4 full blocks before the last token
    hashes = alloc.hash_blocks(a_tokens[:-1])
    blocks = alloc.allocate(4)
    alloc.cache_blocks(blocks, hashes)
    alloc.free(blocks)
    alloc.free(alloc.allocate(8))  # A's prefix leaves the pool for the host tier
    assert tiers.lookup(hashes) == 4
    a = Sequence(0, a_tokens, SamplingParams(max_tokens=1))
    b = Sequence(1, [50, 51, 52], SamplingParams(max_tokens=1))
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    # A's 4 blocks are coming back: it holds them and runs later; B runs now, nobody waited
    assert [s.request_id for s in step.seqs] == [1] and a in sched.running and len(a.block_table) == 4
    assert a.num_computed == 16 and tiers.waited == 0 and tiers.loading
    sched.postprocess(step, [7])
    sched.finish(b, "length")
    # only A is left, its blocks still in flight: the step waits for them, then runs A's last token
    step = sched.schedule()
    assert tiers.waited == 1 and [(s.request_id, n) for s, n in zip(step.seqs, step.num_tokens)] == [(0, 1)]


def test_demo_refuses_bad_tier_options_by_name(capsys):
    from kvcache.engine.demo import demo_main

    assert demo_main(["--host-cache-mib", "-1"]) == 2
    assert demo_main(["--disk-cache-dir", ""]) == 2
    err = capsys.readouterr().err
    assert "--host-cache-mib: expected an int >= 0, got -1" in err and "--disk-cache-dir: expected" in err
