"""``EngineConfig``: every field validated (the error names it), the config and the keyword form of ``LLM`` give the
same engine, and one config runs both cores (paged, linear)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from kvcache.engine import LLM, EngineConfig, SamplingParams
from kvcache.engine.linear_runner import LinearEngineCore
from kvcache.engine.paged_core import PagedEngineCore
from kvcache.ops.paged.format import KV_FORMATS
from kvcache.paged import cache_block_bytes
from support_models import IdsTokenizer

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def _group():
    """A one-rank process group that is not the default group (torch.distributed stays uninitialized)."""
    return dist.ProcessGroup(dist.HashStore(), 0, 1)


# (field, a bad value, the error): one row per field at least; every field has one (checked below)
BAD = [
    ("tokenizer", 3, TypeError),
    ("kv_dtype", "int3", ValueError),
    ("kv_dtype", 8, TypeError),
    ("block_size", 0, ValueError),
    ("block_size", 16.0, TypeError),
    ("block_size", True, TypeError),
    ("max_num_seqs", 0, ValueError),
    ("gpu_memory_utilization", 1.5, ValueError),
    ("gpu_memory_utilization", 0, ValueError),
    ("gpu_memory_utilization", "0.9", TypeError),
    ("gpu_memory_utilization", True, TypeError),
    ("cache", "ring", ValueError),
    ("cache", None, TypeError),
    ("device", "gpu0", ValueError),
    ("device", 3, TypeError),
    ("dtype", "float64", ValueError),
    ("dtype", torch.int8, ValueError),
    ("dtype", 3, TypeError),
    ("enable_prefix_caching", 1, TypeError),
    ("max_num_batched_tokens", 0, ValueError),
    ("num_blocks", -1, ValueError),
    ("max_model_len", 0, ValueError),
    ("kv_cache_memory", 2.0**20, TypeError),
    ("layout", "HDN", ValueError),
    ("cuda_graphs", "yes", TypeError),
    ("tp_group", "world", TypeError),
    ("host_cache_memory", -1, ValueError),
    ("host_cache_memory", 1.0, TypeError),
    ("disk_cache_dir", 3, TypeError),
    ("disk_cache_bytes", 0, ValueError),
    ("cache_model_id", "", TypeError),
    ("kv_events", 1, TypeError),
    ("decode_reserve", 1.5, ValueError),
    ("decode_reserve", -0.1, ValueError),
    ("decode_reserve", "0.5", TypeError),
    ("decode_reserve", True, TypeError),
]


def test_every_field_has_a_bad_value_case():
    assert {name for name, _, _ in BAD} == FIELDS


@pytest.mark.parametrize(("field", "bad", "err"), BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_bad_field_raises_naming_it(field, bad, err):
    with pytest.raises(err, match=rf"^{field}: expected"):
        EngineConfig(**{field: bad})


@pytest.mark.parametrize(("kw", "field"), [
    (dict(cache="linear", kv_dtype="int8"), "kv_dtype"),
    (dict(cache="linear", tp_group="group"), "cache"),
    (dict(cuda_graphs=True, tp_group="group"), "cuda_graphs"),
    (dict(cache_model_id="org/model@1"), "cache_model_id"),  # a disk tier setting without disk_cache_dir
    (dict(disk_cache_bytes=2**30), "disk_cache_bytes"),
    (dict(cache="linear", decode_reserve=1.0), "decode_reserve"),
])
def test_fields_that_exclude_each_other(kw, field):
    kw = {k: _group() if v == "group" else v for k, v in kw.items()}
    with pytest.raises(ValueError, match=rf"^{field}:"):
        EngineConfig(**kw)


def test_good_values_are_kept():
    for kv in KV_FORMATS:  # every format of the one table
        assert EngineConfig(kv_dtype=kv).kv_dtype == kv
    with pytest.raises(ValueError, match=str(KV_FORMATS).replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(kv_dtype="fp4")
    g = _group()
    cfg = EngineConfig(tokenizer=IdsTokenizer(), block_size=8, max_num_seqs=3, gpu_memory_utilization=1, cache="paged",
                       device=torch.device("cpu"), dtype="bf16", enable_prefix_caching=False,
                       max_num_batched_tokens=64, num_blocks=20, max_model_len=100, kv_cache_memory=2**20,
                       layout="NHD", cuda_graphs=False, tp_group=g)
    assert (cfg.block_size, cfg.max_num_seqs, cfg.layout, cfg.num_blocks, cfg.tp_group) == (8, 3, "NHD", 20, g)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 4
    assert dataclasses.replace(cfg, block_size=4).block_size == 4
    with pytest.raises(ValueError, match="^block_size:"):  # replace validates too
        dataclasses.replace(cfg, block_size=0)


def test_sizes_for_a_model(model):
    cpu = torch.device("cpu")
    assert EngineConfig().batched_tokens(cpu) == 2048
    assert EngineConfig(max_num_batched_tokens=96).batched_tokens(cpu) == 96
    llm = LLM(model, tokenizer=IdsTokenizer())
    assert EngineConfig().model_len(llm.model) == 256  # min(max_position_embeddings, 4096)
    assert EngineConfig(max_model_len=40).model_len(llm.model) == 40
    assert EngineConfig().cache_memory(llm.model) == 256 * 2**20  # the CPU default
    assert EngineConfig(kv_cache_memory=12345).cache_memory(llm.model) == 12345


# ------------------------------------------------------------------------------------------ LLM with a config


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(2, 256, (12,), generator=g).tolist()
    return [shared + torch.randint(2, 256, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]


SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _hf(model, p: list[int], n: int) -> list[int]:
    x = torch.tensor([p])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(p):].tolist()


@pytest.mark.parametrize("cache", ["paged", "linear"])
def test_config_and_keywords_give_the_same_engine(model, cache):
    kw = dict(tokenizer=IdsTokenizer(), cache=cache, max_num_seqs=2, block_size=4, max_num_batched_tokens=16,
              max_model_len=48, kv_cache_memory=2**20)
    by_kw = LLM(model, **kw)
    by_cfg = LLM(model, config=EngineConfig(**kw))
    assert by_kw.config == by_cfg.config == EngineConfig(**kw)
    assert type(by_kw.core) is type(by_cfg.core) is {"paged": PagedEngineCore, "linear": LinearEngineCore}[cache]
    a, b = by_kw.generate(_prompts(), SP), by_cfg.generate(_prompts(), SP)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    sa, sb = dataclasses.asdict(by_kw.stats), dataclasses.asdict(by_cfg.stats)
    for st in (sa, sb):
        st.pop("elapsed_s"), st.pop("tokens_per_s")
    assert sa == sb
    assert sa["cache"] == cache and sa["generated_tokens"] == 8 * len(a)
    # keywords equal to the defaults: the same config as the default one
    assert LLM(model, tokenizer=IdsTokenizer()).config == EngineConfig()


def test_one_config_runs_both_cores(model):
    cfg = EngineConfig(tokenizer=IdsTokenizer(), max_num_seqs=2, block_size=4, max_num_batched_tokens=16,
                       max_model_len=48)
    paged = LLM(model, config=cfg)
    linear = LLM(model, config=dataclasses.replace(cfg, cache="linear"))
    assert isinstance(paged.core, PagedEngineCore) and isinstance(linear.core, LinearEngineCore)
    assert (paged.stats.attention, linear.stats.attention) == ("paged_attention", "slot-sdpa")
    assert paged.max_model_len == linear.max_model_len == 48
    assert linear.stats.num_blocks == 2  # the slots
    prompts = _prompts()
    want = [_hf(model, p, SP.max_tokens) for p in prompts]
    for llm in (paged, linear):
        outs = llm.generate(prompts, SP)
        assert [o.token_ids for o in outs] == want, llm.config.cache
        assert llm.stats.steps > 0 and 0 < llm.stats.blocks_used <= llm.stats.num_blocks
    # the shared 12-token prefix was reused: whole blocks (paged), the saved snapshot (linear)
    assert paged.stats.cached_prompt_tokens == 3 * 12 and linear.stats.cached_prompt_tokens == 3 * 12
    assert paged.allocator.num_used_blocks == 0 and linear.cache.active_batch_size == 0


def test_pool_and_slots_sized_from_kv_cache_memory(model):
    mem = 2**16
    for kv in KV_FORMATS:
        llm = LLM(model, tokenizer=IdsTokenizer(), kv_dtype=kv, block_size=4, kv_cache_memory=mem)
        m = llm.model
        block = cache_block_bytes(m.num_layers, m.num_kv_heads, m.head_dim, 4, m.dtype, kv)
        assert llm.stats.num_blocks == mem // block
        assert llm.cache.config.num_blocks == llm.stats.num_blocks + 1  # and the scratch block
        assert llm.cache.config.kv_dtype == kv
    # linear: max_model_len = what the memory holds for max_num_seqs slots (K and V of 2 layers x 2 heads x 16 fp32)
    per_token = 2 * 2 * 2 * 16 * 4
    lin = LLM(model, tokenizer=IdsTokenizer(), cache="linear", max_num_seqs=4, kv_cache_memory=mem)
    assert lin.max_model_len == mem // (per_token * 4) == 32
    assert lin.stats.cache_bytes == 4 * 32 * per_token
    tiny = LLM(model, tokenizer=IdsTokenizer(), cache="linear", max_num_seqs=4, kv_cache_memory=1024)
    assert tiny.max_model_len == 16


def test_llm_argument_errors(model):
    cfg = EngineConfig(tokenizer=IdsTokenizer())
    with pytest.raises(TypeError, match="^config: .*not both .*block_size"):
        LLM(model, config=cfg, block_size=8)
    with pytest.raises(TypeError, match="^config: expected an EngineConfig"):
        LLM(model, config={"block_size": 8})
    with pytest.raises(TypeError, match="^blocksize: not an argument of LLM"):
        LLM(model, tokenizer=IdsTokenizer(), blocksize=8)
    with pytest.raises(ValueError, match="^tokenizer: expected the tokenizer"):
        LLM(model, config=EngineConfig())
    with pytest.raises(ValueError, match="^kv_dtype:"):  # validated before anything is loaded or built
        LLM(model, tokenizer=IdsTokenizer(), kv_dtype="int3")
