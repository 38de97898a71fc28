"""Context parallelism across real ranks: shares reassemble the single-rank cache exactly; partial attention
merged by lse equals full attention."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache import BlockAllocator
from kvcache.distributed import (
    cp_append,
    cp_attention,
    cp_blocks_needed,
    cp_gather,
    cp_local_len,
    cp_merge_attention,
    cp_plan,
)

from .conftest import world_params
from .helpers import block_table, cu, ints, make_cache, merge_reference, partial_attention, randn
from .world import RankContext

pytestmark = pytest.mark.timeout(180)

# new tokens per sequence at each step: a prefill, a decode step, a chunk for one sequence only
STEPS = [[7, 10, 1], [1, 1, 1], [4, 0, 5]]


def _setup(ctx: RankContext, steps: list[list[int]] = STEPS, **cache_kw):  # type: ignore[no-untyped-def]
    totals = [sum(col) for col in zip(*steps)]
    local = make_cache(ctx.device, **cache_kw)
    ref = make_cache(ctx.device, **cache_kw)
    bs, nb = local.config.block_size, local.config.num_blocks
    t_local = block_table(BlockAllocator(nb, bs), [cp_blocks_needed(t, bs, ctx.rank, ctx.size) for t in totals],
                          ctx.device)
    t_ref = block_table(BlockAllocator(nb, bs), [cp_blocks_needed(t, bs, 0, 1) for t in totals], ctx.device,
                        reverse=True)
    return local, ref, t_local, t_ref


def _cp_roundtrip(ctx: RankContext, kv_dtype: str, layout: str, dtype_name: str, rope: bool,
                  steps: list[list[int]] = STEPS, num_layers: int = 2) -> list[int]:
    dtype = getattr(torch, dtype_name)
    local, ref, t_local, t_ref = _setup(ctx, steps, kv_dtype=kv_dtype, layout=layout, dtype=dtype, rope=rope,
                                        num_layers=num_layers)
    H, D = local.config.num_kv_heads, local.config.head_dim
    gen = torch.Generator().manual_seed(1234)  # the same K / V on every rank
    lens = [0] * len(steps[0])
    for step in steps:
        k, v = randn(gen, (sum(step), H, D), dtype, ctx.device), randn(gen, (sum(step), H, D), dtype, ctx.device)
        # one plan per step and rank, read by every layer
        plan = cp_plan(local, t_local, cu(step, ctx.device), ints(lens, ctx.device), check=True)
        ref_plan = ref.plan(t_ref, cu(step, ctx.device), ints(lens, ctx.device), check=True)
        for layer in range(local.num_layers):
            kl = k * (layer + 1)
            cp_append(local, layer, kl, v, plan)
            ref.append(layer, kl, v, ref_plan)
        lens = [a + b for a, b in zip(lens, step)]
        for layer in range(local.num_layers):
            kg, vg = cp_gather(local, layer, plan)  # the sequences as they stand after the step
            kr, vr = ref.gather(layer, ref_plan)
            assert kg.shape == kr.shape == (len(lens), H, max(lens), D)
            assert torch.equal(kg, kr), f"K of layer {layer} after {lens} differs"
            assert torch.equal(vg, vr), f"V of layer {layer} after {lens} differs"
    # this rank holds only its share: its own gather has cp_local_len tokens per sequence
    kl, _ = local.gather(0, cp_plan(local, t_local, seq_lens=ints(lens, ctx.device)))
    nonzero = (kl.float().abs().sum(dim=(1, 3)) != 0).sum(dim=1)
    return nonzero.tolist()


@pytest.mark.parametrize("world", world_params(2, 3), indirect=True)
@pytest.mark.parametrize("kv_dtype,layout,dtype,rope", [
    ("auto", "NHD", "float16", True),
    ("auto", "HND", "bfloat16", False),
    ("fp8", "HND", "float16", True),
    ("int8", "NHD", "bfloat16", True),
    ("int4", "HND", "float16", False),
])
def test_cp_gather_reassembles_single_rank_cache(world, kv_dtype: str, layout: str, dtype: str, rope: bool) -> None:
    res = world.run(_cp_roundtrip, kv_dtype, layout, dtype, rope)
    totals = [sum(col) for col in zip(*STEPS)]
    for r, counts in enumerate(res):
        assert counts == [cp_local_len(t, r, world.size) for t in totals]


@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_cp_gather_under_triton_interpreter(world) -> None:
    # the Triton append / gather kernels themselves (through the interpreter): one small prefill + decode
    world.run(_cp_roundtrip, "int4", "NHD", "float16", True, [[5, 3], [1, 1]], 1,
              env={"KVCACHE_TRITON_INTERPRET": "1"}, timeout=120)


def _cp_merge(ctx: RankContext, hq: int, use_ops: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank: its share appended and gathered, fp32 partial attention over it, merged across ranks;
    compared with attention over every key."""
    local, ref, t_local, t_ref = _setup(ctx, dtype=torch.float32, num_kv_heads=2, head_dim=8)
    H, D = 2, 8
    gen = torch.Generator().manual_seed(99)
    lens = [0] * len(STEPS[0])
    outs, lses = [], []
    for step in STEPS:
        k, v = randn(gen, (sum(step), H, D), torch.float32, ctx.device), randn(gen, (sum(step), H, D), torch.float32,
                                                                                ctx.device)
        q = randn(gen, (sum(step), hq, D), torch.float32, ctx.device)
        plan = cp_plan(local, t_local, cu(step, ctx.device), ints(lens, ctx.device))
        ref_plan = ref.plan(t_ref, cu(step, ctx.device), ints(lens, ctx.device))
        cp_append(local, 0, k, v, plan)
        ref.append(0, k, v, ref_plan)
        new = [a + b for a, b in zip(lens, step)]
        kl, vl = local.gather(0, plan)  # this rank's share only
        kr, vr = ref.gather(0, ref_plan)
        part_o, part_l, full_o, full_l = [], [], [], []
        row = 0
        for b, n_new in enumerate(step):
            qb = q[row:row + n_new]
            q_pos = torch.arange(lens[b], new[b])
            n_loc = cp_local_len(new[b], ctx.rank, ctx.size)
            k_pos = torch.arange(n_loc) * ctx.size + ctx.rank
            o, s = partial_attention(qb.cpu(), q_pos, kl[b, :, :n_loc].cpu(), vl[b, :, :n_loc].cpu(), k_pos)
            part_o.append(o)
            part_l.append(s)
            o, s = partial_attention(qb.cpu(), q_pos, kr[b, :, :new[b]].cpu(), vr[b, :, :new[b]].cpu(),
                                     torch.arange(new[b]))
            full_o.append(o)
            full_l.append(s)
            row += n_new
        out, lse = cp_merge_attention(torch.cat(part_o).to(ctx.device), torch.cat(part_l).to(ctx.device),
                                      merge=None if use_ops else merge_reference)
        torch.testing.assert_close(out.cpu(), torch.cat(full_o), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.cpu(), torch.cat(full_l), rtol=1e-5, atol=1e-5)
        outs.append(out.cpu())
        lses.append(lse.cpu())
        lens = new
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("world", world_params(2, 3), indirect=True)
@pytest.mark.parametrize("use_ops", [False, pytest.param(True, marks=pytest.mark.skipif(
    not hasattr(kvcache.ops, "merge_attention_states"), reason="kvcache.ops.merge_attention_states not here"))],
    ids=["reference-merge", "ops-merge"])
def test_cp_merge_of_partial_attention_equals_full_attention(world, use_ops: bool) -> None:
    res = world.run(_cp_merge, 4, use_ops)
    for out, lse in res[1:]:  # the fold runs in rank order everywhere: the same bits on every rank
        assert torch.equal(out, res[0][0]) and torch.equal(lse, res[0][1])
    assert torch.isfinite(res[0][1]).all()  # every query sees at least itself


def _cp_attention(ctx: RankContext, kv_dtype: str) -> None:
    local, ref, t_local, t_ref = _setup(ctx, kv_dtype=kv_dtype, dtype=torch.float16)
    H, D, hq = 2, 16, 4
    gen = torch.Generator().manual_seed(7)
    lens = [0] * len(STEPS[0])
    for step in STEPS:
        k, v = randn(gen, (sum(step), H, D), torch.float16, ctx.device), randn(gen, (sum(step), H, D), torch.float16,
                                                                                ctx.device)
        q = randn(gen, (sum(step), hq, D), torch.float16, ctx.device)
        c, old = cu(step, ctx.device), ints(lens, ctx.device)
        plan = cp_plan(local, t_local, c, old, scale=0.3)
        ref_plan = ref.plan(t_ref, c, old, scale=0.3)
        if step is STEPS[0]:  # a plan of another rank / size, or a rank given by hand: refused before writing
            with pytest.raises(ValueError, match="plan: expected cp_rank / cp_size"):
                cp_append(local, 0, k, v, local.plan(t_local, c, old))
            with pytest.raises(ValueError, match="cp_rank: set by cp_plan"):
                cp_plan(local, t_local, c, old, cp_rank=ctx.rank)
            assert not local.buffer.any()
        cp_append(local, 0, k, v, plan)
        ref.append(0, k, v, ref_plan)
        lens = [a + b for a, b in zip(lens, step)]
        out, lse = cp_attention(q, local, 0, plan)
        want_l = torch.empty(q.shape[:2], dtype=torch.float32, device=ctx.device)
        want_o = ref.attention(0, q, ref_plan, lse=want_l)
        # fp16 outputs merged in float32 per pair of ranks: within a few fp16 steps of the single-rank result
        torch.testing.assert_close(out.float(), want_o.float(), rtol=4e-3, atol=4e-3)
        torch.testing.assert_close(lse, want_l, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(kvcache.ops, "paged_attention"), reason="kvcache.ops.paged_attention not in this "
                    "version yet (issue 14); the merge across ranks is tested above with a reference attention")
@pytest.mark.parametrize("world", world_params(2, 3), indirect=True)
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int4"])
def test_cp_attention_equals_single_rank_attention(world, kv_dtype: str) -> None:
    world.run(_cp_attention, kv_dtype)


# ------------------------------------------------------------------------------------------ single process


def test_cp_local_len_and_blocks() -> None:
    for total in range(12):
        for size in (1, 2, 3, 4):
            counts = [cp_local_len(total, r, size) for r in range(size)]
            assert sum(counts) == total
            assert counts == [len(range(r, total, size)) for r in range(size)]
    assert cp_blocks_needed(9, 4, 0, 2) == 2 and cp_blocks_needed(9, 4, 1, 2) == 1
    with pytest.raises(ValueError, match="cp_rank"):
        cp_local_len(5, 2, 2)
    with pytest.raises(ValueError, match="cp_size"):
        cp_local_len(5, 0, 0)
    with pytest.raises(TypeError, match="total"):
        cp_local_len(5.0, 0, 1)  # type: ignore[arg-type]


def test_cp_merge_attention_validates_before_communicating() -> None:
    out, lse = torch.zeros(3, 4, 8), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="lse: expected float32"):
        cp_merge_attention(out, lse.half(), merge=merge_reference)
    with pytest.raises(ValueError, match=r"lse: expected float32 \[3, 4\]"):
        cp_merge_attention(out, torch.zeros(3, 5), merge=merge_reference)
    with pytest.raises(ValueError, match="out: expected"):
        cp_merge_attention(out[0], lse, merge=merge_reference)
    with pytest.raises(TypeError, match="merge"):
        cp_merge_attention(out, lse, merge=3)  # type: ignore[arg-type]
    if not hasattr(kvcache.ops, "merge_attention_states"):
        with pytest.raises(RuntimeError, match="merge_attention_states"):
            cp_merge_attention(out, lse)
    # not initialized: a clear error, not a hang
    with pytest.raises(RuntimeError, match="not initialized"):
        cp_merge_attention(out, lse, merge=merge_reference)
