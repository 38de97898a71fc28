"""Shared pieces of the rank functions: caches, block tables from an allocator, seeded K / V, an fp32 reference
of (partial) causal attention and its log-sum-exp merge."""

from __future__ import annotations

import math

import torch

from kvcache import BlockAllocator, PagedConfig, PagedKVCache, RopeConfig


def make_cache(device: torch.device, *, kv_dtype: str = "auto", layout: str = "NHD", dtype: torch.dtype = torch.float16,
               num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 16, block_size: int = 4,
               num_blocks: int = 24, rope: bool = False) -> PagedKVCache:
    cfg = PagedConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                      num_blocks=num_blocks, dtype=dtype, kv_dtype=kv_dtype, layout=layout, device=device)
    cache = PagedKVCache(cfg, rope=RopeConfig(head_dim=head_dim) if rope else None)
    if kv_dtype in ("fp8", "fp8k"):  # scales other than 1 so a lost or wrong scale shows (fp8k: v_scale)
        vals = torch.tensor([[0.5, 2.0], [1.5, 0.25], [0.75, 3.0], [2.5, 0.125]])[:num_layers]
        cache.kv_scales.copy_(vals.to(device))
    return cache


def block_table(allocator: BlockAllocator, blocks_per_seq: list[int], device: torch.device,
                reverse: bool = False) -> torch.Tensor:
    """int32 [B, max(blocks_per_seq)] of blocks taken from ``allocator`` (padding 0)."""
    width = max(max(blocks_per_seq), 1)
    t = torch.zeros(len(blocks_per_seq), width, dtype=torch.int32)
    for b, nb in enumerate(blocks_per_seq):
        ids = allocator.allocate(nb)
        if ids is None:
            raise RuntimeError("test allocator too small")
        t[b, :nb] = torch.tensor(ids[::-1] if reverse else ids, dtype=torch.int32)
    return t.to(device)


def ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def cu(values: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for x in values:
        out.append(out[-1] + x)
    return ints(out, device)


def randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def partial_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 causal attention of one sequence's queries over the keys given (any subset of its tokens).

    q ``[n, Hq, D]`` at positions ``q_pos`` ``[n]``; k / v ``[H, S, D]`` at positions ``k_pos`` ``[S]``. Returns
    out ``[n, Hq, D]`` (0 where no key is visible) and the natural-log lse ``[n, Hq]`` (-inf there).
    """
    q, k, v = q.double(), k.double(), v.double()
    hq, h = q.shape[1], k.shape[0]
    kk = k.repeat_interleave(hq // h, dim=0)  # [Hq, S, D]
    vv = v.repeat_interleave(hq // h, dim=0)
    s = torch.einsum("nhd,hsd->nhs", q, kk) / math.sqrt(q.shape[-1])
    visible = (k_pos[None, :] <= q_pos[:, None])[:, None, :]  # [n, 1, S]
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("nhs,hsd->nhd", p, vv)
    return out.float(), lse.float()


def merge_reference(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural-log merge of two partials in fp32; both -inf stays (0, -inf)."""
    m = torch.maximum(lse_a, lse_b)
    m0 = torch.where(torch.isinf(m), 0.0, m)
    wa, wb = torch.exp(lse_a - m0), torch.exp(lse_b - m0)
    tot = wa + wb
    safe = torch.where(tot == 0, 1.0, tot)
    out = (out_a.float() * (wa / safe)[..., None] + out_b.float() * (wb / safe)[..., None]).to(out_a.dtype)
    return out, torch.where(tot == 0, float("-inf"), m0 + torch.log(safe))
