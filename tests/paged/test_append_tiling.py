"""The append kernel's tokens-per-program tiling (TOK) changes nothing but speed: every TOK writes the same
bytes, across sequence boundaries, empty sequences, padding rows and a partial last program, and agrees with
the pure-torch reference."""

from __future__ import annotations

import pytest
import torch

from kvcache import PagedConfig, PagedKVCache, RopeConfig
from kvcache.ops.paged import append_paged_kv_launch, append_paged_kv_reference


def _values(cache: PagedKVCache, kv_dtype: str) -> torch.Tensor:
    """The stored values as float32 (dequantized codes for int8 / int4: code * scale + zero)."""
    pool = cache.pool(0).cpu()
    if kv_dtype in ("auto", "fp8"):
        return pool.float()
    codes = pool.int()
    if kv_dtype == "int4":
        codes = torch.cat([codes & 15, codes >> 4], dim=-1)
    par = cache.params(0).cpu()
    return codes.float() * par[..., :1] + par[..., 1:]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4"])
@pytest.mark.parametrize("rope_case", ["none", "rotate_half", "interleaved_partial"])
@pytest.mark.parametrize("mode", ["kv_lens", "cu_k_lens", "slots"])
def test_every_tok_writes_the_same_bytes(monkeypatch: pytest.MonkeyPatch, kv_dtype: str, rope_case: str,
                                         mode: str) -> None:
    # the tiling exists only in the Triton kernel: compiled on a GPU, else through the interpreter
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    monkeypatch.setenv("KVCACHE_TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(7)
    H, D, bs, nb = 3, 64, 4, 24
    cfg = PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype,
                      device=device)
    k = torch.randn(13, H, D, generator=gen).to(torch.float16)
    v = torch.randn(13, H, D, generator=gen).to(torch.float16)
    rope = None
    if rope_case != "none":
        rope = RopeConfig(head_dim=D, rotary_dim=D if rope_case == "rotate_half" else 32,
                          interleaved=rope_case != "rotate_half").kernel_params()
    i32 = dict(dtype=torch.int32)
    args: dict = dict(block_tables=None, cu_q_lens=None, kv_lens=None, cu_k_lens=None, slot_mapping=None,
                      positions=None)
    if mode == "slots":
        slots = torch.randperm(nb * bs, generator=gen)[:13]
        slots[3] = -1
        args.update(slot_mapping=slots, positions=torch.randint(0, 500, (13,), generator=gen))
    else:  # sequences of 5, 0 and 6 new tokens; rows 11 and 12 are padding
        args.update(block_tables=torch.randperm(nb, generator=gen)[:18].view(3, 6).to(**i32),
                    cu_q_lens=torch.tensor([0, 5, 5, 11], **i32))
        if mode == "kv_lens":
            args.update(kv_lens=torch.tensor([3, 0, 9], **i32))
        else:
            args.update(cu_k_lens=torch.tensor([0, 8, 8, 23], **i32))
    scales = torch.tensor([0.5, 2.0])
    ref = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                   kv_dtype=kv_dtype, device="cpu"))
    append_paged_kv_reference(k, v, ref.pool(0), ref.params(0), kv_dtype=kv_dtype, layout="NHD", rope=rope,
                              fp8_scales=scales, cp_rank=0, cp_size=1, **args)
    dev_args = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    dev_rope = None if rope is None else rope._replace(inv_freq=rope.inv_freq.to(device))
    first = None
    for tok in (1, 2, 4, 8):
        got = PagedKVCache(cfg)
        append_paged_kv_launch(k.to(device), v.to(device), got.pool(0), got.params(0), kv_dtype=kv_dtype,
                               layout="NHD", rope=dev_rope, fp8_scales=scales.to(device), cp_rank=0, cp_size=1,
                               tok=tok, **dev_args)
        data = got.pool(0).cpu().view(torch.uint8)
        if first is None:
            first = data.clone()
            if rope is None and kv_dtype in ("auto", "fp8"):  # pure moves / conversions: bit-exact
                assert torch.equal(data, ref.pool(0).view(torch.uint8))
            else:  # float32 cos / sin and codes round alike up to an ulp or one code: compare the values
                step = 1e-2 if kv_dtype == "int8" else (0.2 if kv_dtype == "int4" else 2e-2)
                assert torch.allclose(_values(got, kv_dtype), _values(ref, kv_dtype), atol=step, rtol=1e-2)
        else:
            assert torch.equal(data, first), f"tok={tok} differs from tok=1"
