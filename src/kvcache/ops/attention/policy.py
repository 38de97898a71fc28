"""Launch policy of the attention kernels: tile sizes, warps, stages and the KV split, from shapes only.

A pure function of host-side shapes (no tensor is read): the same inputs give the same plan, so a launch
captured in a CUDA graph replays with the grid it was captured with. Tune here; the measurements behind the
choices are in docs/tuning-history.md, the current figures in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import functools

from ..._validate import cdiv, check_int, next_pow2

__all__ = ["AttentionPlan", "attention_plan", "attention_workspace_size"]

# Tokens one split should cover at least: below this the second (merge) pass and the per-split setup cost
# more than the extra parallelism gains. Splits chosen here also apply it to each sequence's own length in the kernel
# (AttentionPlan.min_split_keys: a sequence shorter than the block table's capacity uses fewer of the splits).
MIN_SPLIT_TOKENS = 512
MAX_SPLITS = 64
# Programs per SM aimed at by the split heuristic when the batch alone leaves SMs idle. Batches with at least one
# program per SM are not split on 4-warp tiles: the merge pass then costs more than the balance gains
# (docs/tuning-history.md); the one-warp tiles below have their own split rules. The 4-warp fp8 / int8 / int4 decode
# tiles at head_dim > 64 (128 keys) fit two programs per SM, and two per SM is what their split aims at.
PROGRAMS_PER_SM = 4
PROGRAMS_PER_SM_QUANT = 2
# Decode tiles (keys per tile, pipeline stages, warps, warp split) per stored format, measured on the H100 (sweeps
# in docs/tuning-history.md). head_dim > 64: 16-bit caches want short tiles and deep pipelines, 8- and 4-bit caches
# long tiles that amortise the per-tile dequantization and softmax (the one-warp tiles below replace them where they
# apply); int4 splits the tile's keys over the warps (7% faster at 64 x 16k, 3% at 4k, H100) once contexts reach
# WARP_SPLIT_MIN_KV (8% slower at 1k; max_kv_len is the block table's capacity unless the caller passes a tighter
# bound). head_dim <= 64: 64-key tiles, four programs per SM (warp splits measured 11-68% slower there); int4 takes
# 128-key tiles, int8 one-warp tiles of 64 keys, 3 stages (H100, 2026-11-26). k8v4 (int8 keys, two thirds of its
# bytes) takes int8's tiles throughout, fp8k (fp8 with a scale per key) fp8's.
DECODE_TILE = {"auto": (32, 4, 4, False), "fp8": (128, 3, 4, False), "int8": (128, 3, 4, False),
               "int4": (128, 3, 4, True), "k8v4": (128, 3, 4, False), "fp8k": (128, 3, 4, False)}
DECODE_TILE_SMALL = {"auto": (64, 2, 4, False), "fp8": (64, 3, 4, False), "int8": (64, 3, 1, False),
                     "int4": (128, 2, 4, False), "k8v4": (64, 3, 1, False), "fp8k": (64, 3, 4, False)}
# Quantized decode at head_dim 65..128 with 16-bit queries: one-warp tiles (keys, stages). One warp per program needs
# no exchange between warps per tile; KV splits bring the resident warps back. Batches with LONG_MIN_PROGRAMS+
# programs per SM (DECODE_TILE_LONG, int8 / int4): every KV range split LONG_SPLITS ways once the block table holds
# LONG_MIN_KV+ tokens, unsplit below; 64 x 16k / 4k / 1k: int8 -11% / -3% / -2%, int4 -21% / -12% / -5% against the
# 4-warp tiles (int4's two stages leave shared memory for seven programs per SM). Fewer programs over FEW_MIN_KV+
# token tables (DECODE_TILE_FEW, fp8 too): split for FEW_PROGRAMS_PER_SM programs per SM, 32-key tiles on five
# stages, the first depth at which Triton gives a paged tile two shared-memory buffers (it costs programs per SM, so
# the batches above keep fewer stages past DECODE_TILE_WAVE's four per SM): 1 x 128k int8 / int4 / fp8 -10% / -1% /
# -5%, 2 x 40k -11% / -7% / -28% against 64-key two-stage one-warp tiles (fp8: its 4-warp tile). Shorter tables of
# few sequences keep the 4-warp tiles (docs/tuning-history.md).
DECODE_TILE_LONG = {"int8": (32, 3), "int4": (64, 2), "k8v4": (32, 3)}
# int8 / k8v4 batches of LONG_MIN_PROGRAMS..WAVE_PROGRAMS_PER_SM programs per SM take DECODE_TILE_WAVE instead (keys,
# stages), unsplit at every length: five stages, and the batch still runs as one wave (H200, 2026-11-29, 32 / 8 heads
# x 128, fp16 queries): 64 x 512 / 1k / 2k / 4k / 16k, int8 -18 / -19 / -19 / -14 / -4%, k8v4 -19 / -20 / -20 / -14 /
# -7% against DECODE_TILE_LONG with its splits. With more programs a second wave forms and five stages lose up to 24%
# (int8 80 x 768); int4's 64-key tiles keep their place (five stages: -5% at 64 x 1k, +9% at 64 x 16k). In the
# engine's fixed-budget runs they gain int8 +1.4% and k8v4 +1.6% (two alternating pairs each). fp8 / fp8k
# keep their 4-warp tile: five-stage one-warp tiles measured 17-22% faster in the attention bench (L2 flushed) but made
# the engine's fixed-budget fp8 run 5.5% slower (docs/tuning-history.md).
DECODE_TILE_WAVE = {"int8": (32, 5), "k8v4": (32, 5)}
WAVE_PROGRAMS_PER_SM = 4
DECODE_TILE_FEW = {"fp8": (32, 5), "int8": (32, 5), "int4": (32, 5), "k8v4": (32, 5), "fp8k": (32, 5)}
# int4b (keys dequantized per element with each block's per-channel pairs) takes one-warp tiles of BLOCK_KEYS_TILE
# (keys, stages) wherever one warp holds a decode tile (head_dim 65..128, 16-bit queries, GQA groups up to 16), at
# every batch size: at block_size 16 one block per tile index, the full blocks taken BLOCK_GROUP at a time
# (_block_keys). Wider tiles spread each block's pairs over its keys by a reshape: H200, 32 / 8 heads x 128, fp16, HND,
# 64 x 16k, one block a step: (16, 3) 1,235-1,242 us, (32, 3) 1,625, (64, 2) 3,694; int4's 4-warp 128-key tiles at
# 4 x 16k 404 / 335 us (fp16 / bf16). In pairs, one run: (16, 2) / (16, 3) / (16, 4) 64 x 1k 100 / 126 / 123 us,
# 64 x 16k 1,032 / 1,134 / 1,159 (bf16 989 / 1,062 / 1,076). BENCHMARKS.md has the current figures.
BLOCK_KEYS_TILE = (16, 2)
# int4b's one-warp tiles split a batch of fewer programs than SMs for four programs an SM (int4's tiles: two). H200,
# 32 / 8 heads x 128, HND, fp16 / bf16: 4 x 16k 17 splits 105-111 / 112 us against 9 splits' 136-137 / 140-141,
# 8 x 16k 9 splits 178 / 184-196 against 5 splits' 244 / 236 (docs/format-quality.md)
BLOCK_KEYS_PROGRAMS_PER_SM = 4
LONG_MIN_KV = 4096
LONG_MIN_PROGRAMS = 2
LONG_SPLITS = 8
FEW_MIN_KV = 32768
FEW_PROGRAMS_PER_SM = 4
# Prefill tiles of fp8 / int4 caches at head_dim 65..128 (GQA groups up to 64): 64 rows of 4 warps (keys per tile,
# stages) instead of the 16-bit caches' 128 rows of 8 warps, measured faster on the H100; int8 keeps
# the 128-row tile (1-11% faster).
PREFILL_TILE_QUANT = {"fp8": (128, 2), "int4": (128, 3), "fp8k": (128, 2)}
# Prefill stages at head_dim <= 64 (128 rows x 64 keys, 4 warps): int8 / int4 are faster with 3, 16-bit and fp8 caches
# with 2 (H100, docs/tuning-history.md).
PREFILL_STAGES_SMALL = {"auto": 2, "fp8": 2, "int8": 3, "int4": 3, "k8v4": 3, "fp8k": 2}
WARP_SPLIT_MIN_KV = 4096
# Average query rows per sequence at or below which a batch is launched with decode tiles.
DECODE_ROWS = 4


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Constexpr launch parameters of one attention launch.

    Attributes
    ----------
    block_q : int
        Query tokens per program; the program's M dimension is ``block_q * next_pow2(num_q_heads //
        num_kv_heads)`` rows (every q head of one KV head, for ``block_q`` tokens of one sequence).
    block_n : int
        KV tokens per inner-loop tile.
    num_warps, num_stages : int
        Triton launch options.
    num_splits : int
        Programs sharing one (query tile, KV head)'s KV range (flash-decoding); > 1 needs a workspace and a
        second (merge) kernel.
    warp_split : bool
        Decode tiles only (``block_m <= 16``): each warp takes its own ``block_n / num_warps`` keys of a tile with
        its own softmax state, merged once after the KV loop (no exchange between warps per tile); needs
        ``block_n / num_warps >= 16``.
    min_split_keys : int
        Keys of its own sequence each split takes at least (whole tiles), so a sequence shorter than the block
        table's capacity, which sized ``num_splits``, uses fewer splits (the others return empty); 0: exactly
        ``num_splits`` (a split the caller forced).
    """

    block_q: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    warp_split: bool = False
    min_split_keys: int = 0

    def block_m(self, num_q_heads: int, num_kv_heads: int) -> int:
        """Rows of the program's tile: ``block_q`` tokens times the padded GQA group."""
        return self.block_q * next_pow2(num_q_heads // num_kv_heads)


def attention_plan(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    n_tokens: int,
    num_seqs: int,
    max_kv_len: int,
    num_sms: int = 132,
    num_splits: int | None = None,
    kv_dtype: str = "auto",
    q_bytes: int = 2,
) -> AttentionPlan:
    """Choose tiles and the KV split for one attention launch.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim : int
    n_tokens : int
        Query rows of the launch (``q.shape[0]``).
    num_seqs : int
        Sequences of the batch.
    max_kv_len : int
        Upper bound of any sequence's cached length seen by this rank (host int: the block table's capacity
        by default, so the plan never depends on device data).
    num_sms : int
        Streaming multiprocessors of the device (132 on an H100 SXM).
    num_splits : int, optional
        Force the KV split (1 = none); default: the heuristic below.
    kv_dtype : {"auto", "fp8", "int8", "int4", "k8v4", "fp8k", "int4b"}
        Stored format of the cache (decode tiles depend on it).
    q_bytes : int
        Bytes per query element (2 for fp16 / bf16, 4 for fp32: prefill tiles of fp32 queries are halved to fit
        in shared memory).

    Returns
    -------
    AttentionPlan

    Example
    -------
    >>> attention_plan(num_q_heads=32, num_kv_heads=8, head_dim=128, n_tokens=1, num_seqs=1,
    ...                max_kv_len=131072).num_splits
    64
    """
    args = (num_q_heads, num_kv_heads, head_dim, n_tokens, num_seqs, max_kv_len, num_sms, num_splits, kv_dtype,
            q_bytes)
    try:
        hash(args)
    except TypeError:  # an unhashable argument: the checks name it
        return _choose(*args)
    return _choose_cached(*args)


def _choose(num_q_heads: int, num_kv_heads: int, head_dim: int, n_tokens: int, num_seqs: int, max_kv_len: int,
            num_sms: int, num_splits: int | None, kv_dtype: str, q_bytes: int) -> AttentionPlan:
    """:func:`attention_plan`'s checks and choice (a pure function of its arguments)."""
    check_int("num_q_heads", num_q_heads, 1)
    check_int("num_kv_heads", num_kv_heads, 1)
    check_int("head_dim", head_dim, 1)
    check_int("n_tokens", n_tokens, 0)
    check_int("num_seqs", num_seqs, 0)
    check_int("max_kv_len", max_kv_len, 0)
    check_int("num_sms", num_sms, 1)
    check_int("q_bytes", q_bytes, 1, 8)
    block_keys = kv_dtype == "int4b"
    if block_keys:
        kv_dtype = "int4"  # int4's tiles, without warp splits (int4b's are to be tuned)
    if kv_dtype not in DECODE_TILE:
        raise ValueError(f"kv_dtype: expected one of {tuple(DECODE_TILE)}, got {kv_dtype!r}")
    g = next_pow2(max(1, num_q_heads // num_kv_heads))
    decode = n_tokens <= DECODE_ROWS * max(num_seqs, 1)
    programs = max(1, num_seqs) * num_kv_heads  # before KV splits
    if decode:
        # M = 16 rows at least (tensor-core minimum): a decode row's whole GQA group, padded with spare tokens
        block_q = max(1, 16 // g)
        block_n, stages, warps, warp_split = (DECODE_TILE_SMALL if head_dim <= 64 else DECODE_TILE)[kv_dtype]
        if head_dim > 128:
            block_n = max(16, block_n // 2)  # the 128-dim tile's registers and shared memory
        # warp splits as measured: 16-row tiles (GQA groups up to 16), head_dim 65..128, long contexts
        warp_split = (warp_split and block_n // warps >= 16 and max_kv_len >= WARP_SPLIT_MIN_KV and head_dim <= 128
                      and block_q * g <= 16 and not block_keys)
        one_warp = 64 < head_dim <= 128 and block_q * g <= 16 and q_bytes <= 2
        many = programs >= LONG_MIN_PROGRAMS * num_sms
        wave_tiles = one_warp and many and kv_dtype in DECODE_TILE_WAVE and programs <= WAVE_PROGRAMS_PER_SM * num_sms
        long_tiles = wave_tiles or (one_warp and many and kv_dtype in DECODE_TILE_LONG)
        few_tiles = one_warp and not many and max_kv_len >= FEW_MIN_KV and kv_dtype in DECODE_TILE_FEW
        if long_tiles or few_tiles:
            table = DECODE_TILE_WAVE if wave_tiles else DECODE_TILE_LONG if long_tiles else DECODE_TILE_FEW
            (block_n, stages), warps, warp_split = table[kv_dtype], 1, False
        if block_keys and one_warp:
            (block_n, stages), warps, warp_split = BLOCK_KEYS_TILE, 1, False
        elif warps == 1 and (q_bytes > 2 or block_q * g > 16):
            warps, stages = 4, 2  # one warp cannot hold float32 queries' or GQA groups over 16's tiles (spills)
    else:
        # head_dim 65..128: 128 rows x 128 keys, 8 warps, 2 stages for 16-bit queries (the sweep's choice), 64 rows of
        # 4 warps for fp8 / int4 caches (PREFILL_TILE_QUANT); fp32 queries take 64 keys (128 do not fit in an
        # H100's shared memory). head_dim <= 64: 128 rows x 64 keys, 4 warps (the head_dim-64 sweep: 1.2x faster for
        # 16-bit caches, 1.4x for int8 / int4), stages per format (PREFILL_STAGES_SMALL)
        rows = 128 if head_dim <= 128 else 64
        if head_dim <= 64:
            block_n = 64
        else:
            block_n = (128 if q_bytes <= 2 else 64) if head_dim <= 128 else 32
        warps, stages = (8 if rows * head_dim >= 128 * 128 else 4), 2
        if head_dim <= 64:
            stages = PREFILL_STAGES_SMALL[kv_dtype] if q_bytes <= 2 else 2
        elif kv_dtype in PREFILL_TILE_QUANT and head_dim <= 128 and q_bytes <= 2 and g <= 64:
            rows, warps = 64, 4
            block_n, stages = PREFILL_TILE_QUANT[kv_dtype]
        block_q = max(1, rows // g)
        warp_split = long_tiles = few_tiles = wave_tiles = False
    min_split_keys = MIN_SPLIT_TOKENS if num_splits is None else 0
    if num_splits is None:
        num_splits = 1
        if long_tiles:  # DECODE_TILE_WAVE's batches unsplit at every length
            long_split = max_kv_len >= LONG_MIN_KV and not wave_tiles
            num_splits = min(LONG_SPLITS, max_kv_len // MIN_SPLIT_TOKENS) if long_split else 1
        elif few_tiles:
            num_splits = min(cdiv(FEW_PROGRAMS_PER_SM * num_sms, programs), max_kv_len // MIN_SPLIT_TOKENS, MAX_SPLITS)
        elif decode and programs < num_sms:
            per_sm = PROGRAMS_PER_SM_QUANT if kv_dtype != "auto" and head_dim > 64 else PROGRAMS_PER_SM
            if block_keys and one_warp:
                per_sm = BLOCK_KEYS_PROGRAMS_PER_SM
            target = cdiv(per_sm * num_sms, programs)
            num_splits = max(1, min(target, max_kv_len // MIN_SPLIT_TOKENS, MAX_SPLITS))
    check_int("num_splits", num_splits, 1, 1024)
    return AttentionPlan(block_q=block_q, block_n=block_n, num_warps=warps, num_stages=stages,
                         num_splits=num_splits, warp_split=warp_split,
                         min_split_keys=min_split_keys if num_splits > 1 else 0)


# asked once per step with the same arguments: typed, so True is not taken for 1
_choose_cached = functools.lru_cache(maxsize=256, typed=True)(_choose)


def attention_workspace_size(n_tokens: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of the split-KV workspace: partial outputs and log-sum-exps of every split.

    Example
    -------
    >>> attention_workspace_size(64, 32, 128, 4)
    1056768
    """
    check_int("n_tokens", n_tokens, 0)
    check_int("num_q_heads", num_q_heads, 1)
    check_int("head_dim", head_dim, 1)
    check_int("num_splits", num_splits, 1)
    if num_splits == 1:
        return 0
    return num_splits * n_tokens * num_q_heads * (head_dim + 1)
