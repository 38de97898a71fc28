"""Layer groups of a paged cache: layers with the same sliding window (None: full attention) share one pool and
one block allocator, and a window group holds only the blocks its window can still read.

A key at position ``p`` is visible from a query at ``q`` when ``q - window < p <= q`` (the attention kernels' rule,
transformers' ``sliding_window``). Every later query of a sequence that has ``c`` tokens in its cache sits at
``q >= c``, so no query reads a position below ``c - window + 1`` again: the blocks wholly below it,
``(c - window + 1) // block_size`` of them, go back to the allocator (:func:`first_live_block`). A decode step then
holds at most ``ceil(window / block_size) + 1`` blocks of a window group (the ``window + 1`` positions from the
first one its query reads to the step scheduled one ahead touch at most that many blocks), a prefill chunk of ``n``
tokens at most ``ceil((window - 2 + n) / block_size) + 1``.

Pure Python (no torch): the engine's scheduler and ``kvcache plan`` use the same rules (each layer's window:
:func:`kvcache.support.model_windows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .._validate import cdiv, check_int
from .allocator import BlockAllocator

__all__ = ["LayerGroup", "layer_groups", "first_live_block", "blocks_per_seq", "peak_blocks", "split_blocks",
           "match_groups"]


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Attention layers sharing one sliding window (``window=None``: full attention).

    Attributes
    ----------
    window : int or None
        The window in tokens (each query sees itself and the ``window - 1`` positions before it).
    layers : tuple of int
        The model's layer indices, ascending; layer ``layers[j]`` is layer ``j`` of the group's cache.

    Example
    -------
    >>> g = LayerGroup(1024, (0, 1, 2, 3, 4))
    >>> g.window, len(g.layers), str(g)
    (1024, 5, 'sliding window 1024: 5 layers')
    """

    window: int | None
    layers: tuple[int, ...]

    def __str__(self) -> str:
        kind = "full attention" if self.window is None else f"sliding window {self.window}"
        return f"{kind}: {len(self.layers)} layer{'s' * (len(self.layers) != 1)}"


def layer_groups(windows: Sequence[int | None]) -> tuple[LayerGroup, ...]:
    """The groups of layers with equal windows: the full-attention group first (if any), then the window groups
    in the order of their first layer.

    Parameters
    ----------
    windows : sequence of int or None
        Each layer's window (``kvcache.support.layer_window``; None: full attention).

    Example
    -------
    >>> layer_groups([8, 8, None, 8, 16])
    (LayerGroup(window=None, layers=(2,)), LayerGroup(window=8, layers=(0, 1, 3)), LayerGroup(window=16, layers=(4,)))
    >>> layer_groups([None, None])
    (LayerGroup(window=None, layers=(0, 1)),)
    """
    if not windows:
        raise ValueError("windows: expected one window (or None) per layer, got none")
    by: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        if w is not None:
            check_int(f"windows[{i}]", w, lo=1)
        by.setdefault(w, []).append(i)
    order = sorted(by, key=lambda w: (w is not None, by[w][0]))
    return tuple(LayerGroup(w, tuple(by[w])) for w in order)


def _check(window: object, block_size: object, **counts: object) -> None:
    # cheap checks (the scheduler calls these every step): ints, window and block_size >= 1, counts >= 0
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"window: expected an int >= 1 or None, got {window!r}")
    for name, v in counts.items():
        if type(v) is not int or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")


def first_live_block(window: int | None, num_computed: int, block_size: int) -> int:
    """Blocks at the front of a sequence that no query reads any more once ``num_computed`` tokens are in the cache:
    ``max(0, (num_computed - window + 1) // block_size)`` for a window, 0 for full attention.

    Example
    -------
    >>> first_live_block(8, 11, 4), first_live_block(8, 12, 4), first_live_block(None, 100, 4)
    (1, 1, 0)
    >>> first_live_block(8, 15, 4)   # positions 0..7 lie below 15 - 8 + 1 = 8
    2
    """
    _check(window, block_size, num_computed=num_computed)
    if window is None:
        return 0
    return max(0, (num_computed - window + 1) // block_size)


def blocks_per_seq(window: int | None, seq_len: int, block_size: int) -> int:
    """Blocks a sequence of ``seq_len`` tokens holds at most in decode: ``ceil(seq_len / block_size)``, for a window
    at most ``ceil(window / block_size) + 1`` (what the pool is sized by; :func:`peak_blocks` of one token a step,
    the step scheduled one ahead included).

    Example
    -------
    >>> blocks_per_seq(None, 8192, 16), blocks_per_seq(1024, 8192, 16), blocks_per_seq(1024, 100, 16)
    (512, 65, 7)
    """
    return peak_blocks(window, seq_len, 1, block_size)


def peak_blocks(window: int | None, seq_len: int, chunk: int, block_size: int) -> int:
    """Blocks a sequence of ``seq_len`` tokens holds at most at any step when it is fed at most ``chunk`` tokens a
    step: for a window, the blocks that ``window - 1 + n`` consecutive tokens can touch, ``ceil((window - 2 + n) /
    block_size) + 1`` with ``n = max(chunk, 2)`` (from the block the step's first query reads to the one its last
    token goes to; a decode step scheduled one ahead holds blocks for two tokens past the cache; never more than the
    whole sequence).

    Example
    -------
    >>> peak_blocks(8, 64, 12, 4), peak_blocks(None, 64, 12, 4)
    (6, 16)
    """
    _check(window, block_size, seq_len=seq_len, chunk=chunk)
    full = cdiv(seq_len, block_size)
    if window is None:
        return full
    return min(full, cdiv(window - 2 + max(min(chunk, seq_len), 2), block_size) + 1)


def split_blocks(groups: Sequence[LayerGroup], budget: int, block_bytes: Sequence[int], seq_len: int,
                 block_size: int) -> list[int]:
    """Each group's pool out of ``budget`` bytes, in proportion to what a sequence of ``seq_len`` tokens needs of
    each (:func:`blocks_per_seq` blocks of ``block_bytes[g]`` bytes each), at least 2 blocks each.

    One group takes ``budget // block_bytes[0]`` blocks (the whole budget).

    Example
    -------
    >>> gs = layer_groups([8, None])
    >>> split_blocks(gs, 100 * 1000, [1000, 1000], 64, 4)   # 16 blocks of the full layer per 3 of the window one
    [84, 15]
    """
    if len(block_bytes) != len(groups):
        raise ValueError(f"block_bytes: expected one size per group ({len(groups)}), got {len(block_bytes)}")
    _check(None, block_size, budget=budget, seq_len=seq_len)
    for i, b in enumerate(block_bytes):
        check_int(f"block_bytes[{i}]", b, lo=1)
    if len(groups) == 1:
        return [max(2, budget // block_bytes[0])]
    need = [blocks_per_seq(g.window, seq_len, block_size) for g in groups]
    per_seq = sum(n * b for n, b in zip(need, block_bytes))
    return [max(2, budget * n // per_seq) for n in need]


def match_groups(allocators: Sequence[BlockAllocator], windows: Sequence[int | None], hashes: Sequence[int],
                 ) -> list[list[int]] | None:
    """Take the longest cached prefix of a hash chain that every layer group can serve: ``k`` blocks such that a full
    group caches the chain's first ``k`` and a window group the ones from ``first_live_block(window, k * block_size)``
    to ``k`` (the only ones a query after the prefix reads).

    Parameters
    ----------
    allocators : sequence of BlockAllocator
        One per group, the same ``block_size`` and prefix caching setting.
    windows : sequence of int or None
        Each group's sliding window (None: full attention).
    hashes : sequence of int
        The hash chain of the request's full blocks (``BlockAllocator.hash_blocks``).

    Returns
    -------
    list of list of int or None
        Each group's block table (a window group's starts with slots of ``allocators[g].num_blocks``, the id no
        request holds), the blocks taken (their ref counts raised); None when no block of the chain can be served
        (nothing taken).

    Raises
    ------
    ValueError
        No allocator, or not one window per allocator.

    Example
    -------
    >>> full, win = BlockAllocator(8, 4), BlockAllocator(8, 4)
    >>> h = full.hash_blocks(list(range(12)))
    >>> full.cache_blocks(full.allocate(3), h); win.cache_blocks(win.allocate(3)[2:], h[2:])
    >>> match_groups([full, win], [None, 4], h)   # window 4 after 12 tokens reads block 2 only
    [[0, 1, 2], [8, 8, 2]]
    """
    if not allocators:
        raise ValueError("allocators: expected at least one BlockAllocator, got none")
    if len(allocators) != len(windows):
        raise ValueError(f"windows: expected one per allocator ({len(allocators)}), got {len(windows)}")
    n, bs = len(hashes), allocators[0].block_size
    if not n or not allocators[0].enable_prefix_caching:
        return None
    k, gaps = n, []
    for a, w in zip(allocators, windows):
        present = [a.lookup(h) is not None for h in hashes]
        if w is None:
            k = min(k, present.index(False) if False in present else n)
            continue
        last = [-1] * (n + 1)  # last[j]: the last block before j that this group does not cache
        for j, ok in enumerate(present):
            last[j + 1] = last[j] if ok else j
        gaps.append((w, last))
    while k > 0 and any(last[k] >= first_live_block(w, k * bs, bs) for w, last in gaps):
        k -= 1
    if k == 0:
        return None
    tables = []
    for g, (a, w) in enumerate(zip(allocators, windows)):
        lo = first_live_block(w, k * bs, bs)
        blocks = a.match_prefix(list(hashes[lo:k]))
        if len(blocks) != k - lo:  # every block was just looked up: the allocator changed in between
            raise RuntimeError(f"allocator: group {g} matched {len(blocks)} of {k - lo} cached blocks")
        tables.append([a.num_blocks] * lo + blocks)
    return tables
