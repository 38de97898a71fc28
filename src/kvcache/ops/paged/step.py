"""The step plan: one step's batch (where its rows go), the query-side attention options and the launches derived
from them, validated once and read by every layer's append, attention and gather.

:class:`StepPlan` is built by :meth:`kvcache.PagedKVCache.plan` (exported as :class:`kvcache.paged.StepPlan`); the
loose keyword ops (:func:`~kvcache.ops.append_paged_kv`, :func:`~kvcache.ops.paged_attention`,
:func:`~kvcache.ops.gather_paged_kv`) build one per call through :meth:`StepPlan.build`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..._validate import check_cp, check_index_vector, check_int, check_tensor_arg, fmt_shape
from ...rope import RopeKernelParams
from .checks import check_attention_options, check_rope, host_check_ragged, host_check_rope_bound, host_check_slots
from .format import kv_format

__all__ = ["StepPlan", "Geometry"]

# (num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, layout) of the pools a plan is built for
Geometry = tuple[int, int, int, int, str, str]
_INTS = (torch.int64, torch.int32)
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(slots=True, eq=False)
class StepPlan:
    """One step of a paged cache, described once: a ragged batch (block tables + lengths) or a slot mapping,
    positions, context-parallel rank / size, the query-side attention options and host hints for the launches.

    Build it with :meth:`kvcache.PagedKVCache.plan` (validated there, on the host, without a device sync unless
    ``check=True``) and hand it to every layer's :meth:`~kvcache.PagedKVCache.append`,
    :meth:`~kvcache.PagedKVCache.attention` and :meth:`~kvcache.PagedKVCache.gather`. The launches (the append's
    launch description and compiled launch, the attention's :class:`~kvcache.ops.attention.AttentionPlan`) are
    derived by the first layer that needs them and reused by the others. Layers whose window or soft-cap differ
    take plans of their own (:meth:`with_options`: same tensors, own launches).

    Attributes
    ----------
    block_tables : torch.Tensor or None
        int32 ``[B, max_blocks]``: each sequence's blocks in order (ragged).
    cu_q_lens : torch.Tensor or None
        int32 ``[B + 1]``: rows ``cu_q_lens[b] .. cu_q_lens[b + 1]`` of the step's k / v / q belong to sequence
        ``b`` (ragged; None for a plan that only gathers).
    kv_lens : torch.Tensor or None
        int32 ``[B]``: tokens each sequence held before the step (or ``cu_k_lens``).
    cu_k_lens : torch.Tensor or None
        int32 ``[B + 1]``: cumulative lengths after the step (TurboMind's form).
    seq_lens : torch.Tensor
        int32 ``[B]``: tokens each sequence holds after the step (what attention and gather read); given by the
        caller, else computed on the device by the first read (a plan replayed in a CUDA graph: build it inside
        the capture, or give ``seq_lens``). ValueError for a slot-mapping plan.
    slot_mapping, positions : torch.Tensor or None
        int64 / int32 ``[num_rows]``: the slot of each row (``-1`` skips it) and its RoPE position.
    cp_rank, cp_size : int
        Context parallelism (ragged only).
    rope : RopeKernelParams or None
        The keys' RoPE in the append.
    rope_seq_len : int or None
        The current length for ``"dynamic"`` RoPE scaling (a gather that rotates keys reads it too).
    scale, window, softcap, q_rope
        Attention options of every layer of the plan (see :func:`kvcache.ops.paged_attention`); ``scale`` None
        means ``1 / sqrt(head_dim)``.
    max_kv_len, num_decode, num_splits, workspace
        Host hints and scratch of the attention launch (see :func:`kvcache.ops.paged_attention`).
    metadata_ready, check : bool
        The append's promise about its index tensors and its debug mode (see :func:`kvcache.ops.append_paged_kv`).
    num_seqs : int
        ``B`` (0 for a slot mapping).
    geometry : tuple
        ``(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, layout)`` of the pools the plan is for.

    Example
    -------
    >>> import kvcache
    >>> cache = kvcache.PagedKVCache(kvcache.PagedConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4,
    ...                                                  num_blocks=8, dtype=torch.float32, device="cpu"))
    >>> plan = cache.plan(torch.tensor([[3, 7], [5, 0]], dtype=torch.int32),
    ...                   cu_q_lens=torch.tensor([0, 1, 4], dtype=torch.int32),
    ...                   kv_lens=torch.tensor([4, 0], dtype=torch.int32))
    >>> plan.seq_lens.tolist()  # tokens held after the step
    [5, 3]
    """

    block_tables: torch.Tensor | None
    cu_q_lens: torch.Tensor | None
    kv_lens: torch.Tensor | None
    cu_k_lens: torch.Tensor | None
    _seq_lens: torch.Tensor | None
    slot_mapping: torch.Tensor | None
    positions: torch.Tensor | None
    cp_rank: int
    cp_size: int
    rope: RopeKernelParams | None
    rope_seq_len: int | None
    scale: float | None
    window: int | None
    softcap: float | None
    q_rope: tuple[torch.Tensor, torch.Tensor] | None
    max_kv_len: int | None
    num_decode: int
    num_splits: int | None
    workspace: torch.Tensor | None
    metadata_ready: bool
    check: bool
    num_seqs: int
    geometry: Geometry
    device: torch.device
    # no running kernel writes rope.inv_freq (the cache's own frequencies, written once)
    rope_ready: bool = False
    # launches derived by the first layer that needs them: (key, value) of the append and of the attention
    append_memo: tuple | None = dataclasses.field(default=None, repr=False)
    attention_memo: tuple | None = dataclasses.field(default=None, repr=False)
    # derived append launches shared by the plans of one cache, keyed by what selects them (see run.append_rows)
    launch_store: dict | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        geometry: Geometry,
        device: torch.device,
        index: dict[str, object],
        options: dict[str, object] | None = None,
        *,
        rope: RopeKernelParams | None = None,
        rope_ready: bool = False,
        rope_seq_len: int | None = None,
        lens_name: str = "seq_lens",
        q_dtype: torch.dtype | None = None,
        launch_store: dict | None = None,
    ) -> StepPlan:
        """Validate and build a plan for pools of ``geometry`` on ``device``.

        ``index``: ``block_tables``, ``cu_q_lens``, ``kv_lens``, ``cu_k_lens``, ``seq_lens``, ``slot_mapping``,
        ``positions``, ``cp_rank``, ``cp_size`` (absent: None / 0 / 1). ``options``: ``scale``, ``window``,
        ``softcap``, ``q_rope``, ``max_kv_len``, ``num_decode``, ``num_splits``, ``workspace``,
        ``metadata_ready``, ``check``. ``rope``: the keys' RoPE parameters (``rope_ready``: no running kernel
        writes its ``inv_freq``; ``rope_seq_len``: the length it was built for, kept for gathers). ``lens_name``: what
        errors call ``seq_lens`` (the loose ops' ``kv_lens``); ``q_dtype``: the queries' dtype where it is known
        (``q_rope`` must have it); ``launch_store``: a dict, kept by the caller across steps, in which appends find
        the launches derived by an earlier plan of the same kind.
        TypeError / ValueError naming the argument, before anything is written.
        """
        opts = dict(options or {})
        unknown = (set(index) - set(_INDEX)) | (set(opts) - set(_OPTIONS))
        if unknown:
            raise TypeError(f"{sorted(unknown)[0]}: not an argument of a step plan")
        idx = {**_INDEX, **index}
        opts = {**_OPTIONS, **opts}
        cp_rank, cp_size = check_cp(idx["cp_rank"], idx["cp_size"])
        for name in ("metadata_ready", "check"):
            if type(opts[name]) is not bool:
                raise TypeError(f"{name}: expected a bool, got {opts[name]!r} ({type(opts[name]).__name__})")
        if idx["slot_mapping"] is not None:
            n_seqs = _check_slots(idx, device, cp_size, rope)
        else:
            n_seqs = _check_ragged(idx, device, lens_name)
        rope = check_rope(rope, geometry[3], device)
        plan = cls(
            block_tables=idx["block_tables"], cu_q_lens=idx["cu_q_lens"], kv_lens=idx["kv_lens"],
            cu_k_lens=idx["cu_k_lens"], _seq_lens=idx["seq_lens"], slot_mapping=idx["slot_mapping"],
            positions=idx["positions"], cp_rank=cp_rank, cp_size=cp_size, rope=rope, rope_seq_len=rope_seq_len,
            num_seqs=n_seqs, geometry=geometry, device=device, rope_ready=rope_ready, launch_store=launch_store,
            **_check_options(opts, geometry[3], n_seqs, device, q_dtype),
        )
        return plan

    @property
    def seq_lens(self) -> torch.Tensor:
        """int32 ``[B]``: tokens each sequence holds after the step (computed on the device once, on first read,
        unless given)."""
        if self._seq_lens is None:
            if self.slot_mapping is not None:
                raise ValueError("seq_lens: a slot-mapping plan describes no sequences; build a ragged plan")
            self._seq_lens = _seq_lens(self)
        return self._seq_lens

    @property
    def is_ragged(self) -> bool:
        """True for a ragged batch (block tables + lengths), False for a slot mapping."""
        return self.slot_mapping is None

    def with_options(self, **options: object) -> StepPlan:
        """A plan of the same step (the same tensors) with other query-side options, e.g. a layer's own
        ``window`` / ``softcap``; its launches are derived anew.

        Example
        -------
        >>> import kvcache
        >>> cache = kvcache.PagedKVCache(kvcache.PagedConfig(num_layers=1, num_kv_heads=1, head_dim=8,
        ...                              block_size=4, num_blocks=4, dtype=torch.float32, device="cpu"))
        >>> plan = cache.plan(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        ...                   torch.zeros(1, dtype=torch.int32))
        >>> plan.with_options(window=128).window
        128
        """
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise TypeError(f"{sorted(unknown)[0]}: not a query-side option of a step plan (one of "
                            f"{tuple(_OPTIONS)})")
        opts = {name: getattr(self, name) for name in _OPTIONS}
        opts.update(options)
        checked = _check_options(opts, self.geometry[3], self.num_seqs, self.device)
        return dataclasses.replace(self, **checked, append_memo=None, attention_memo=None)

    def host_check(self, num_rows: int) -> None:
        """Debug checks of an append of ``num_rows`` rows that read the index tensors (a device sync): lengths,
        block-table capacity, block ids, slots written twice, RoPE's frequency bound. ValueError naming the
        argument (``check=True``: every append runs them)."""
        nb, bs = self.geometry[0], self.geometry[1]
        host_check_rope_bound(self.rope)
        if self.slot_mapping is not None:
            host_check_slots(self.slot_mapping.tolist(), nb, bs)
        elif self.cu_q_lens is not None:
            host_check_ragged(num_rows, nb, bs, self.block_tables, self.cu_q_lens, self.kv_lens, self.cu_k_lens,
                              self.cp_rank, self.cp_size, spare=kv_format(self.geometry[4]).block_keys)

    def require(self, what: str, *, ragged: bool, rows: bool, writes: bool = False) -> None:
        """TypeError naming ``plan`` unless it is ragged (``ragged``: attention, gather), describes the step's
        rows (``rows``: append, attention; a plan built without ``cu_q_lens`` serves gathers only) and, for an
        append (``writes``), where its first new token goes (``kv_lens`` or ``cu_k_lens``)."""
        if ragged and self.slot_mapping is not None:
            raise TypeError(f"plan: {what} needs a ragged plan (block tables + lengths), got a slot-mapping plan")
        if rows and self.slot_mapping is None and self.cu_q_lens is None:
            raise TypeError(f"plan: {what} needs the step's rows (cu_q_lens), got a plan built for gathers only")
        if writes and self.slot_mapping is None and self.kv_lens is None and self.cu_k_lens is None:
            raise TypeError(f"plan: {what} needs kv_lens or cu_k_lens (where each sequence's new rows start), got "
                            f"a plan with seq_lens only")

    def unwritable_rows(self, num_rows: int) -> torch.Tensor:
        """Rows of an append of ``num_rows`` rows that the kernel would skip although they are meant to be
        written: a block index past the sequence's block table, a block id outside the pool, or a slot past it
        (padding rows, slot ``-1`` and another context-parallel rank's tokens are not counted). An int64 0-d
        tensor on the plan's device, from a few torch ops with no host sync (``int(...)`` syncs).

        Example
        -------
        >>> import kvcache
        >>> cache = kvcache.PagedKVCache(kvcache.PagedConfig(num_layers=1, num_kv_heads=1, head_dim=8,
        ...                              block_size=4, num_blocks=8, dtype=torch.float32, device="cpu"))
        >>> int(cache.plan(slot_mapping=torch.tensor([3, -1, 99])).unwritable_rows(3))  # 99: past 32 slots
        1
        """
        check_int("num_rows", num_rows, 0)
        num_blocks, block_size = self.geometry[0], self.geometry[1]
        if self.slot_mapping is not None:
            s = self.slot_mapping.long()
            return ((s < -1) | (s >= num_blocks * block_size)).sum()
        self.require("unwritable_rows", ragged=False, rows=True)
        cu = self.cu_q_lens.long()  # type: ignore[union-attr]
        n_seqs = cu.shape[0] - 1
        if n_seqs == 0 or num_rows == 0:
            return torch.zeros((), dtype=torch.int64, device=cu.device)
        rows = torch.arange(num_rows, device=cu.device)
        b = torch.searchsorted(cu[1:].contiguous(), rows, right=True).clamp(max=n_seqs - 1)  # first end past row
        q0, q1 = cu[b], cu[b + 1]
        if self.kv_lens is not None:
            start = self.kv_lens.long()[b]
        else:
            ck = self.cu_k_lens.long()  # type: ignore[union-attr]
            start = (ck[b + 1] - ck[b]) - (q1 - q0)
        pos = start + (rows - q0)
        want = (rows >= q0) & (rows < q1) & (pos >= 0) & (pos % self.cp_size == self.cp_rank)
        local = pos.clamp(min=0) // self.cp_size
        width = self.block_tables.shape[1]  # type: ignore[union-attr]
        if width == 0:
            return want.sum()
        bi = local // block_size
        table = self.block_tables.long()  # type: ignore[union-attr]
        blk = table[b, bi.clamp(max=width - 1)]
        ok = (bi < width) & (blk >= 0) & (blk < num_blocks)
        if kv_format(self.geometry[4]).block_keys:
            # int4b: a block left partial, or filled from a partial one, needs the block after it (key rows' halves)
            need_next = (start > bi * block_size) | (start + (q1 - q0) < (bi + 1) * block_size)
            nxt = table[b, (bi + 1).clamp(max=width - 1)]
            ok = ok & (~need_next | ((bi + 1 < width) & (nxt >= 0) & (nxt < num_blocks)))
        return (want & ~ok).sum()


_INDEX: dict[str, object] = dict(block_tables=None, cu_q_lens=None, kv_lens=None, cu_k_lens=None, seq_lens=None,
                                 slot_mapping=None, positions=None, cp_rank=0, cp_size=1)
_OPTIONS: dict[str, object] = dict(scale=None, window=None, softcap=None, q_rope=None, max_kv_len=None,
                                   num_decode=0, num_splits=None, workspace=None, metadata_ready=False, check=False)


def _check_slots(idx: dict, device: torch.device, cp_size: int, rope: object) -> int:
    sm = idx["slot_mapping"]
    if any(idx[name] is not None for name in ("block_tables", "cu_q_lens", "kv_lens", "cu_k_lens", "seq_lens")):
        raise ValueError("slot_mapping: expected alone, without block_tables / cu_q_lens / kv_lens / cu_k_lens / "
                         "seq_lens")
    if not isinstance(sm, torch.Tensor):
        raise TypeError(f"slot_mapping: expected a torch.Tensor, got {type(sm).__name__}")
    check_index_vector("slot_mapping", sm, None, device, dtypes=_INTS)
    if cp_size != 1:
        raise ValueError(f"cp_size: slot mapping addresses local slots directly; expected 1, got {cp_size}")
    pos = idx["positions"]
    if pos is not None:
        check_index_vector("positions", pos, sm.shape[0], device, dtypes=_INTS)
    elif rope is not None:
        raise ValueError("positions: expected int32/int64 [num_tokens] with rope in slot-mapping mode")
    return 0


def _check_ragged(idx: dict, device: torch.device, lens_name: str) -> int:
    bt, cu = idx["block_tables"], idx["cu_q_lens"]
    kv, ck, sl = idx["kv_lens"], idx["cu_k_lens"], idx["seq_lens"]
    if bt is None and cu is not None:
        raise ValueError("cu_q_lens: expected block_tables, cu_q_lens and exactly one of kv_lens / cu_k_lens "
                         "(or slot_mapping alone)")
    if bt is None:
        raise TypeError("block_tables: expected a torch.Tensor int32 [B, max_blocks] with cu_q_lens and exactly one "
                        "of kv_lens / cu_k_lens (or slot_mapping alone), got None")
    if cu is not None and kv is None and ck is None and sl is None:
        raise ValueError("cu_q_lens: expected block_tables, cu_q_lens and exactly one of kv_lens / cu_k_lens "
                         "(or slot_mapping alone)")
    if idx["positions"] is not None:
        raise ValueError("positions: expected None in ragged mode (positions follow from kv_lens / cu_k_lens)")
    if cu is not None:
        check_index_vector("cu_q_lens", cu, None, device)
        b = cu.shape[0] - 1
        if b < 0:
            raise ValueError("cu_q_lens: expected B + 1 >= 1 entries, got 0")
    else:
        b = bt.shape[0] if isinstance(bt, torch.Tensor) and bt.dim() == 2 else -1
    check_tensor_arg("block_tables", bt, dtypes=(torch.int32,), ndim=2, device=device, ref="pool")
    if bt.shape[0] != b or (bt.shape[1] > 1 and bt.stride(1) != 1):
        raise ValueError(f"block_tables: expected int32 [{b}, max_blocks] with contiguous rows, got "
                         f"{fmt_shape(bt.shape)} strides {tuple(bt.stride())}")
    if kv is not None and ck is not None:
        raise ValueError("kv_lens: expected exactly one of kv_lens / cu_k_lens, got both")
    if cu is None and kv is not None:
        raise ValueError("cu_q_lens: expected with kv_lens (the tokens held before the step's rows); a plan for "
                         "gathers only takes seq_lens or cu_k_lens")
    if cu is None and (sl is None) == (ck is None):
        raise ValueError(f"{lens_name}: expected exactly one of {lens_name} / cu_k_lens without cu_q_lens, got "
                         f"{'both' if sl is not None else 'neither'}")
    for name, t, n in (("kv_lens", kv, b), ("cu_k_lens", ck, b + 1), (lens_name, sl, b)):
        if t is not None:
            check_index_vector(name, t, n, device)
    return b


def _check_options(opts: dict, head_dim: int, n_seqs: int, device: torch.device,
                   q_dtype: torch.dtype | None = None) -> dict:
    """The query-side options and launch hints, validated (``scale`` stays None for the default)."""
    scale, window, softcap = check_attention_options(opts["scale"], opts["window"], opts["softcap"])
    if opts["max_kv_len"] is not None:
        check_int("max_kv_len", opts["max_kv_len"], 0)
    if opts["num_splits"] is not None:
        check_int("num_splits", opts["num_splits"], 1, 1024)
    check_int("num_decode", opts["num_decode"], 0, n_seqs)
    ws = opts["workspace"]
    if ws is not None:
        check_tensor_arg("workspace", ws, dtypes=(torch.float32,), ndim=1, device=device, ref="pool")
        if ws.numel() > 1 and ws.stride(0) != 1:
            raise ValueError(f"workspace: expected a contiguous float32 tensor, got strides {tuple(ws.stride())}")
    q_rope = _check_q_rope(opts["q_rope"], head_dim, device, q_dtype)
    return dict(scale=scale, window=window, softcap=softcap, q_rope=q_rope,
                max_kv_len=opts["max_kv_len"], num_decode=opts["num_decode"], num_splits=opts["num_splits"],
                workspace=ws, metadata_ready=opts["metadata_ready"], check=opts["check"])


def _check_q_rope(q_rope: object, d: int, device: torch.device, q_dtype: torch.dtype | None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``q_rope``: None or (cos, sin), contiguous float tables ``[max_pos, D]`` (D even) of ``q_dtype`` (when
    known; else of one dtype, which attention checks against q's) on the plan's device."""
    if q_rope is None:
        return None
    if not isinstance(q_rope, (tuple, list)) or len(q_rope) != 2:
        raise TypeError(f"q_rope: expected None or a (cos, sin) pair of tensors, got {type(q_rope).__name__}")
    if d % 2:
        raise ValueError(f"q_rope: rotate-half RoPE needs an even head_dim, got {d}")
    dtypes = (q_dtype,) if q_dtype is not None else _Q_DTYPES
    for name, t in zip(("cos", "sin"), q_rope):
        check_tensor_arg(f"q_rope {name}", t, dtypes=dtypes, ndim=2, device=device, ref="q")
        if t.shape[1] != d or t.shape[0] < 1 or not t.is_contiguous():
            raise ValueError(f"q_rope {name}: expected a contiguous [max_pos, {d}] table (one row per position, "
                             f"its head_dim / 2 frequencies twice), got {fmt_shape(t.shape)}")
        dtypes = (t.dtype,)  # sin: cos's dtype
    if q_rope[0].shape != q_rope[1].shape:
        raise ValueError(f"q_rope: cos and sin differ in shape: {fmt_shape(q_rope[0].shape)} / "
                         f"{fmt_shape(q_rope[1].shape)}")
    return q_rope[0], q_rope[1]


def _seq_lens(plan: StepPlan) -> torch.Tensor:
    """int32 ``[B]``: tokens each sequence holds after the step (one or two device ops, no sync)."""
    if plan.cu_k_lens is not None:
        return (plan.cu_k_lens[1:] - plan.cu_k_lens[:-1]).to(torch.int32)
    return (plan.kv_lens + (plan.cu_q_lens[1:] - plan.cu_q_lens[:-1])).to(torch.int32)  # type: ignore[index,operator]
