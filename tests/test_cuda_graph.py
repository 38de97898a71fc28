"""CUDA-graph capture of the linear-cache ops: a decode step (commit + eviction) and save / restore,
captured once and replayed on new data. Needs a GPU: CUDA graphs do not exist on the CPU backends."""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, KVLayerConfig, KVSnapshot, LinearKVCache, ManagerConfig, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
]


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: compiles kernels, builds layer tables
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.parametrize("heterogeneous", [False, True])
def test_decode_step_graph_commit_and_compaction(heterogeneous: bool) -> None:
    dev = torch.device("cuda")
    B, S = 8, 64
    if heterogeneous:
        layer_cfgs = [KVLayerConfig(2, 96), KVLayerConfig(3, 80), KVLayerConfig(1, 128)]
        cache = KVCacheManager(ManagerConfig(max_batch_size=B, max_seq_len=S, device=dev, layers=layer_cfgs))
    else:
        cache = LinearKVCache(CacheConfig(num_layers=3, max_batch_size=B, max_seq_len=S, num_kv_heads=2,
                                          head_dim=96, device=dev))
    layers = [cache.layer(i) for i in range(cache.num_layers)]
    lengths = cache.lengths_buffer
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    mapping = torch.empty(B, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)

    def step() -> None:
        ops.increment_lengths(lengths, 1)  # commit the token written by this decode step
        ops.build_batch_mapping(finished, out=mapping, new_active_out=count)
        # new_active is only an upper bound inside a graph: the mapping decides where rows go
        ops.compact_kv_layers(layers, mapping, lengths, B, B, dst_lengths=lengths)

    lengths.fill_(1)
    graph = _capture(step)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        for t in layers:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        lens0 = torch.randint(0, S - 1, (B,), generator=gen, dtype=torch.int32)
        fin0 = torch.rand(B, generator=gen) < 0.4
        lengths.copy_(lens0)
        finished.copy_(fin0)
        before = [t.clone() for t in layers]
        graph.replay()
        torch.cuda.synchronize()
        kept = [i for i in range(B) if not bool(fin0[i])]
        assert int(count.item()) == len(kept)
        assert mapping.tolist() == [kept.index(i) if i in kept else -1 for i in range(B)]
        for j, i in enumerate(kept):
            n = int(lens0[i]) + 1
            assert int(lengths[j]) == n
            for t, b in zip(layers, before):
                assert torch.equal(t[j, :, :, :n], b[i, :, :, :n])


def test_save_restore_graph() -> None:
    dev = torch.device("cuda")
    cache = LinearKVCache(CacheConfig(num_layers=2, max_batch_size=4, max_seq_len=32, num_kv_heads=2,
                                      head_dim=80, dtype=torch.bfloat16, device=dev))
    cache.reset_for_new_sequences([32, 32, 32, 32])
    snap = KVSnapshot.empty([(2, 80)] * 2, 12, dtype=torch.bfloat16, device=dev)

    def fn() -> None:
        cache.save(1, 12, out=snap)
        cache.restore(snap, 3)

    graph = _capture(fn)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=gen).to(torch.bfloat16))
        before = cache.buffer.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(snap.flat.view(2, 2, 2, 12, 80), before[:, 1, :, :, :12])
        expected = before.clone()
        expected[:, 3, :, :, :12] = before[:, 1, :, :, :12]
        assert torch.equal(cache.buffer, expected)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4"])
def test_paged_decode_append_graph(kv_dtype: str, pdl: bool) -> None:
    """A captured decode step of appends (with or without programmatic dependent launch between them) replayed
    on new data equals the same appends run eagerly with the same launch. With PDL: ``PagedKVCache.append``,
    whose decode appends speculate (RoPE's cos / sin before the wait, which may move a rotated key by an ulp
    against a launch that waits first; both are checked against the reference in tests/paged). Without: the
    policy's launch planned with ``pdl=False``, through the launcher (``KVCACHE_PDL=0`` does the same for the
    cache, read at import)."""
    from kvcache import PagedConfig, PagedKVCache, RopeConfig
    from kvcache._backend import pdl_enabled
    from kvcache.ops.paged import PagedLayer, append_paged_kv_launch, plan_append
    from kvcache.ops.paged.launch import pdl_supported

    dev = torch.device("cuda")
    if pdl and not (pdl_enabled() and pdl_supported(dev)):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0 (and KVCACHE_PDL not 0)")

    cfg = PagedConfig(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=64, kv_dtype=kv_dtype,
                      device=dev)
    rope = RopeConfig(head_dim=64)
    graphed, eager = PagedKVCache(cfg, rope=rope), PagedKVCache(cfg, rope=rope)
    n = 8
    k = torch.empty(n, 4, 64, dtype=torch.float16, device=dev)
    v = torch.empty_like(k)
    cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
    kv_lens = torch.empty(n, dtype=torch.int32, device=dev)
    tables = torch.arange(n * 4, dtype=torch.int32, device=dev).view(n, 4)
    params = rope.kernel_params(device=dev)
    launch = plan_append(n_rows=n, n_seqs=n, num_kv_heads=4, head_dim=64, kv_dtype=kv_dtype, rope="full", pdl=False,
                         ptx=True, rope_ready=True)
    assert not (launch.pdl or launch.index_first or launch.speculate)

    def append(cache: PagedKVCache, layer: int) -> None:
        if pdl:
            cache.append(layer, k, v, cache.plan(block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens))
        else:
            storage = PagedLayer(cache.pool(layer), cache.params(layer), cache.kv_scales[layer], kv_dtype, "NHD")
            append_paged_kv_launch(k, v, storage, cache.plan(tables, cu_q, kv_lens, rope=params), launch)

    def step() -> None:
        for layer in range(cfg.num_layers):
            append(graphed, layer)

    kv_lens.zero_()
    k.normal_()
    v.normal_()
    graph = _capture(step)
    graphed.buffer.zero_()  # the warm-up before capture wrote tokens the eager cache never saw
    if graphed.params_buffer is not None:
        graphed.params_buffer.zero_()
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
        kv_lens.copy_(torch.randint(0, 63, (n,), generator=gen, dtype=torch.int32))
        graph.replay()
        for layer in range(cfg.num_layers):
            append(eager, layer)
        torch.cuda.synchronize()
        assert torch.equal(graphed.buffer.view(torch.uint8), eager.buffer.view(torch.uint8))
        if graphed.params_buffer is not None:
            assert torch.equal(graphed.params_buffer, eager.params_buffer)
