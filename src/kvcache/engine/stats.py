"""``LLM.stats``: the last :meth:`~kvcache.engine.LLM.generate` call's counters, and running totals beside them.

:class:`GenerateStats` is an :class:`~kvcache.engine.EngineStats` (the last call's fields, as before: code reading
``llm.stats.generated_tokens`` or ``dataclasses.asdict(llm.stats)`` is unchanged) with one more attribute,
``total``: a :class:`TotalStats` over every completed call of the engine. Each call makes new objects, so a
``GenerateStats`` kept from an earlier call keeps that call's figures and the totals as they were after it.
"""

from __future__ import annotations

import dataclasses

from ..paged.tiers.stats import TierStats
from .core import EngineStats

__all__ = ["GenerateStats", "GroupStats", "TotalStats", "accumulate"]

# summed over calls; the rates are recomputed from the sums, blocks_used is the peak over calls, and the engine's
# settings (num_blocks, cache_bytes, kv_dtype, cache, attention) are copied
_SUMMED = ("requests", "prompt_tokens", "generated_tokens", "elapsed_s", "cached_prompt_tokens", "preemptions",
           "steps", "graph_steps", "overlapped_steps")


@dataclasses.dataclass
class GroupStats:
    """One layer group's pool of the paged engine (:mod:`kvcache.paged.groups`): layers with one sliding window
    (None: full attention) and their blocks.

    Attributes
    ----------
    window : int or None
    num_layers : int
    num_blocks : int
        Blocks in the group's pool (each holds ``block_size`` tokens of the group's layers).
    blocks_used : int
        Peak blocks held by running requests (a window group holds only what its window still reads).

    Example
    -------
    >>> llm.stats.groups                                        # doctest: +SKIP
    [GroupStats(window=None, num_layers=1, num_blocks=120, blocks_used=15), GroupStats(window=8, ...)]
    """

    window: int | None
    num_layers: int
    num_blocks: int
    blocks_used: int = 0


@dataclasses.dataclass
class TotalStats(EngineStats):
    """Running totals over the completed :meth:`~kvcache.engine.LLM.generate` calls of one engine.

    The counters of :class:`~kvcache.engine.EngineStats` (``requests``, ``prompt_tokens``, ``generated_tokens``,
    ``elapsed_s``, ``cached_prompt_tokens``, ``preemptions``, ``steps``, ``graph_steps``, ``overlapped_steps``)
    are sums over the calls; ``tokens_per_s`` and ``prefix_cache_hit_rate`` are recomputed from the sums (not
    averages of per-call rates); ``blocks_used`` is the peak over the calls; ``num_blocks``, ``cache_bytes``,
    ``kv_dtype``, ``cache`` and ``attention`` are the engine's.

    Attributes
    ----------
    calls : int
        Completed ``generate`` calls (a call that raised is not counted, nor are its counters).
    tiers : dict of str to TierStats
        The memory tiers' counters (``"device"``, ``"host"``, ``"disk"``: :class:`~kvcache.paged.tiers.TierStats`)
        summed over the calls; ``{}`` without tiers. An attribute, not a field.
    groups : list of GroupStats
        The paged engine's layer groups, each ``blocks_used`` the peak over the calls; ``[]`` for the linear cache.
        An attribute, not a field.

    Example
    -------
    >>> llm.generate(["a"], sp); llm.generate(["b", "c"], sp)    # doctest: +SKIP
    >>> llm.stats.total.calls, llm.stats.total.requests          # doctest: +SKIP
    (2, 3)
    """

    calls: int = 0

    def __post_init__(self) -> None:
        self.tiers: dict[str, TierStats] = {}
        self.groups: list[GroupStats] = []


@dataclasses.dataclass
class GenerateStats(EngineStats):
    """``LLM.stats``: the counters of the last :meth:`~kvcache.engine.LLM.generate` call, and the running totals.

    Its dataclass fields are :class:`~kvcache.engine.EngineStats`' and cover the last call only (a call that
    raised leaves the counters it reached); ``total`` covers every completed call, this one included.
    ``dataclasses.asdict`` gives the last call's fields (``total`` is an attribute, not a field: take
    ``dataclasses.asdict(stats.total)`` for the totals).

    Parameters
    ----------
    total : TotalStats, optional
        The running totals (default: none yet, the engine's settings copied from this object).

    Attributes
    ----------
    total : TotalStats
        Totals over the engine's completed calls.
    tiers : dict of str to TierStats
        This call's counters of the prefix cache's tiers (``"device"``, ``"host"``, ``"disk"``): blocks
        brought back (``hits``), stored, removed, refused, bytes and GB/s each way (see
        :class:`~kvcache.paged.tiers.TierStats`); ``{}`` without tiers. An attribute, not a field.
    groups : list of GroupStats
        The paged engine's layer groups (one for a model without sliding windows): each pool's size and this
        call's peak blocks; ``[]`` for the linear cache. An attribute, not a field.

    Example
    -------
    >>> outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))   # doctest: +SKIP
    >>> llm.stats.generated_tokens, llm.stats.total.generated_tokens                  # doctest: +SKIP
    (64, 192)
    """

    total: dataclasses.InitVar[TotalStats | None] = None

    def __post_init__(self, total: TotalStats | None) -> None:
        if total is not None and not isinstance(total, TotalStats):
            raise TypeError(f"total: expected a TotalStats or None, got {type(total).__name__}")
        self.total = total if total is not None else TotalStats(**_settings(self))  # type: ignore[misc]
        self.tiers: dict[str, TierStats] = {}
        self.groups: list[GroupStats] = []


def _settings(stats: EngineStats) -> dict[str, object]:
    return {k: getattr(stats, k) for k in ("num_blocks", "cache_bytes", "kv_dtype", "cache", "attention")}


def accumulate(total: TotalStats, last: EngineStats) -> TotalStats:
    """The totals after one more completed call: ``total`` plus ``last`` (a new object; neither is changed).

    Parameters
    ----------
    total : TotalStats
        The totals before the call.
    last : EngineStats
        The call's counters.

    Returns
    -------
    TotalStats
        Sums, recomputed rates, the peak ``blocks_used`` (also each group's) and ``calls + 1``; the settings are
        ``last``'s.

    Example
    -------
    >>> t = accumulate(TotalStats(), EngineStats(requests=2, prompt_tokens=10, cached_prompt_tokens=5))
    >>> t.calls, t.requests, t.prefix_cache_hit_rate
    (1, 2, 0.5)
    """
    if not isinstance(total, TotalStats):
        raise TypeError(f"total: expected a TotalStats, got {type(total).__name__}")
    if not isinstance(last, EngineStats):
        raise TypeError(f"last: expected an EngineStats, got {type(last).__name__}")
    sums = {k: getattr(total, k) + getattr(last, k) for k in _SUMMED}
    out = TotalStats(
        **sums, **_settings(last), calls=total.calls + 1, blocks_used=max(total.blocks_used, last.blocks_used),
        tokens_per_s=sums["generated_tokens"] / sums["elapsed_s"] if sums["elapsed_s"] > 0 else 0.0,
        prefix_cache_hit_rate=sums["cached_prompt_tokens"] / sums["prompt_tokens"] if sums["prompt_tokens"] else 0.0,
    )
    last_tiers = getattr(last, "tiers", {})
    out.tiers = {k: total.tiers.get(k, TierStats()) + last_tiers.get(k, TierStats())
                 for k in {**total.tiers, **last_tiers}}
    before = {(g.window, g.num_layers): g.blocks_used for g in total.groups}
    out.groups = [dataclasses.replace(g, blocks_used=max(g.blocks_used, before.get((g.window, g.num_layers), 0)))
                  for g in getattr(last, "groups", ())]
    return out
