"""PagedBatch: one step's batch, described once and read by every layer's append, gather and attention."""

from __future__ import annotations

import dataclasses

import torch

from ..._validate import check_index_vector, check_int, fmt_shape

__all__ = ["PagedBatch"]


@dataclasses.dataclass(slots=True)
class PagedBatch:
    """Where one step's new rows go: a ragged batch (block tables + lengths) or a slot mapping, positions and
    context-parallel rank / size. Built once per step (validated here, on the host, without a device sync), then
    handed to every layer's :meth:`PagedKVCache.append`, :meth:`PagedKVCache.gather` and attention.

    Build it with :meth:`ragged` or :meth:`slots`; the fields are the tensors the ops take (see
    :func:`kvcache.ops.append_paged_kv` for their meaning).

    Attributes
    ----------
    block_tables : torch.Tensor or None
        int32 ``[B, max_blocks]`` (ragged).
    cu_q_lens : torch.Tensor or None
        int32 ``[B + 1]``: rows of sequence ``b`` are ``cu_q_lens[b] .. cu_q_lens[b + 1]`` (ragged).
    kv_lens : torch.Tensor or None
        int32 ``[B]``: tokens each sequence held before this step (ragged; or ``cu_k_lens``).
    cu_k_lens : torch.Tensor or None
        int32 ``[B + 1]``: cumulative lengths after this step (ragged, TurboMind's form).
    slot_mapping : torch.Tensor or None
        int64 / int32 ``[num_rows]``: slot of each row, ``-1`` skips it (slot mapping).
    positions : torch.Tensor or None
        int64 / int32 ``[num_rows]``: RoPE positions (slot mapping with RoPE).
    cp_rank, cp_size : int
        Context parallelism (ragged only).

    Example
    -------
    >>> bt = torch.tensor([[3, 7], [5, 0]], dtype=torch.int32)
    >>> batch = PagedBatch.ragged(bt, cu_q_lens=torch.tensor([0, 1, 4], dtype=torch.int32),
    ...                           kv_lens=torch.tensor([17, 0], dtype=torch.int32))
    >>> batch.seq_lens.tolist()  # tokens held after the step
    [18, 3]
    """

    block_tables: torch.Tensor | None = None
    cu_q_lens: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    cu_k_lens: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    cp_rank: int = 0
    cp_size: int = 1
    _seq_lens: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def ragged(
        cls,
        block_tables: torch.Tensor,
        cu_q_lens: torch.Tensor,
        kv_lens: torch.Tensor | None = None,
        *,
        cu_k_lens: torch.Tensor | None = None,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> PagedBatch:
        """A ragged batch: ``B`` sequences with their block tables, new rows ``cu_q_lens`` and exactly one of
        ``kv_lens`` (tokens held before the step) / ``cu_k_lens`` (cumulative lengths after it). All on one
        device; ValueError / TypeError naming the argument otherwise."""
        if not isinstance(block_tables, torch.Tensor):
            raise TypeError(f"block_tables: expected a torch.Tensor, got {type(block_tables).__name__}")
        dev = block_tables.device
        cu = check_index_vector("cu_q_lens", cu_q_lens, None, dev, ref="block_tables")
        b = cu.shape[0] - 1
        if b < 0:
            raise ValueError("cu_q_lens: expected B + 1 >= 1 entries, got 0")
        if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != b or (
                block_tables.shape[1] > 1 and block_tables.stride(1) != 1):
            raise ValueError(f"block_tables: expected int32 [{b}, max_blocks] with contiguous rows, got "
                             f"{block_tables.dtype} {fmt_shape(block_tables.shape)}")
        if (kv_lens is None) == (cu_k_lens is None):
            raise ValueError("kv_lens: expected exactly one of kv_lens / cu_k_lens")
        if kv_lens is not None:
            check_index_vector("kv_lens", kv_lens, b, dev, ref="block_tables")
        else:
            check_index_vector("cu_k_lens", cu_k_lens, b + 1, dev, ref="block_tables")
        cp_size = check_int("cp_size", cp_size, 1)
        cp_rank = check_int("cp_rank", cp_rank, 0, cp_size - 1)
        return cls(block_tables=block_tables, cu_q_lens=cu, kv_lens=kv_lens, cu_k_lens=cu_k_lens, cp_rank=cp_rank,
                   cp_size=cp_size)

    @classmethod
    def slots(cls, slot_mapping: torch.Tensor, positions: torch.Tensor | None = None) -> PagedBatch:
        """A batch by slot mapping: row ``n`` goes to slot ``slot_mapping[n]`` (``-1`` skips it); ``positions``
        (same length) are its RoPE positions, required when the append rotates keys."""
        if not isinstance(slot_mapping, torch.Tensor):
            raise TypeError(f"slot_mapping: expected a torch.Tensor, got {type(slot_mapping).__name__}")
        ints = (torch.int64, torch.int32)
        sm = check_index_vector("slot_mapping", slot_mapping, None, slot_mapping.device, dtypes=ints,
                                ref="slot_mapping")
        if positions is not None:
            check_index_vector("positions", positions, sm.shape[0], sm.device, dtypes=ints, ref="slot_mapping")
        return cls(slot_mapping=sm, positions=positions)

    @property
    def is_ragged(self) -> bool:
        """True for a ragged batch (block tables + lengths), False for a slot mapping."""
        return self.slot_mapping is None

    @property
    def device(self) -> torch.device:
        """The device of the batch's tensors."""
        t = self.slot_mapping if self.slot_mapping is not None else self.block_tables
        return t.device  # type: ignore[union-attr]

    @property
    def num_seqs(self) -> int:
        """Sequences of a ragged batch (``B``); 0 for a slot mapping."""
        return 0 if self.cu_q_lens is None else self.cu_q_lens.shape[0] - 1

    @property
    def seq_lens(self) -> torch.Tensor:
        """int32 ``[B]``: tokens each sequence holds after this step's rows (ragged batches), computed on the
        device once per batch (what gather and attention read)."""
        if self.slot_mapping is not None:
            raise ValueError("seq_lens: a slot-mapping batch describes no sequences; build it with PagedBatch.ragged")
        if self._seq_lens is None:
            if self.cu_k_lens is not None:
                self._seq_lens = (self.cu_k_lens[1:] - self.cu_k_lens[:-1]).to(torch.int32)
            else:
                self._seq_lens = (self.kv_lens + (self.cu_q_lens[1:] - self.cu_q_lens[:-1])).to(torch.int32)
        return self._seq_lens

    def unwritable_rows(self, num_rows: int, *, block_size: int, num_blocks: int) -> torch.Tensor:
        """Rows of an append of ``num_rows`` rows that the kernel would skip although they are meant to be
        written: a block index past the sequence's block table, a block id outside ``[0, num_blocks)``, or a
        slot past the pool (padding rows, slot ``-1`` and another context-parallel rank's tokens are not
        counted). An int64 0-d tensor on the batch's device, from a few torch ops with no host sync: read it
        when convenient (``int(...)`` syncs).

        Example
        -------
        >>> b = PagedBatch.slots(torch.tensor([3, -1, 99]))
        >>> int(b.unwritable_rows(3, block_size=4, num_blocks=8))  # slot 99 is past the 32-slot pool
        1
        """
        check_int("num_rows", num_rows, 0)
        check_int("block_size", block_size, 1)
        check_int("num_blocks", num_blocks, 0)
        if self.slot_mapping is not None:
            s = self.slot_mapping.long()
            return ((s < -1) | (s >= num_blocks * block_size)).sum()
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
        bi = local // block_size
        in_table = bi < width
        if width == 0:
            return want.sum()
        blk = self.block_tables.long()[b, bi.clamp(max=width - 1)]  # type: ignore[union-attr]
        ok = in_table & (blk >= 0) & (blk < num_blocks)
        return (want & ~ok).sum()


def unpack_append_batch(batch: object, block_tables: object, cu_q_lens: object, kv_lens: object, cu_k_lens: object,
                        slot_mapping: object, positions: object, cp_rank: object, cp_size: object) -> tuple:
    """The append's index arguments: ``batch``'s when it is given (then it must come alone), else those given."""
    given = (block_tables, cu_q_lens, kv_lens, cu_k_lens, slot_mapping, positions, cp_rank, cp_size)
    if batch is None:
        return given
    if not isinstance(batch, PagedBatch):
        raise TypeError(f"batch: expected a PagedBatch, got {type(batch).__name__}")
    if any(x is not None for x in given[:6]) or cp_rank != 0 or cp_size != 1:
        raise ValueError("batch: expected alone, without block_tables / cu_q_lens / kv_lens / cu_k_lens / "
                         "slot_mapping / positions / cp_rank / cp_size")
    return (batch.block_tables, batch.cu_q_lens, batch.kv_lens, batch.cu_k_lens, batch.slot_mapping,
            batch.positions, batch.cp_rank, batch.cp_size)


def unpack_gather_batch(batch: object, block_tables: object, kv_lens: object, cu_k_lens: object, cp_rank: object,
                        cp_size: object) -> tuple:
    """The gather's arguments: a ragged ``batch``'s sequences as they stand after the step (``seq_lens``) when it
    is given (then it must come alone), else those given; ``block_tables`` is required either way."""
    if batch is not None:
        if not isinstance(batch, PagedBatch) or not batch.is_ragged:
            got = "a slot-mapping PagedBatch" if isinstance(batch, PagedBatch) else type(batch).__name__
            raise TypeError(f"batch: expected a ragged PagedBatch (block tables + lengths), got {got}")
        if any(x is not None for x in (block_tables, kv_lens, cu_k_lens)) or cp_rank != 0 or cp_size != 1:
            raise ValueError("batch: expected alone, without block_tables / kv_lens / cu_k_lens / cp_rank / cp_size")
        return batch.block_tables, batch.seq_lens, None, batch.cp_rank, batch.cp_size
    if block_tables is None:
        raise TypeError("block_tables: expected a torch.Tensor int32 [B, max_blocks] (or batch=), got NoneType")
    return block_tables, kv_lens, cu_k_lens, cp_rank, cp_size
