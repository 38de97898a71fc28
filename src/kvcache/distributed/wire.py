"""Wire format of KV transfers (version 2): a sealed int64 header, an int64 answer, then the payload in chunks,
each chunk one message carrying its own checksum.

::

    sender                                  receiver
    header  int64[HEADER_LEN]   ------->    seal, format and shape checked against its own (nothing written yet)
            int64[ACK_LEN]      <-------    ACCEPT, NO_ROOM (allocator full) or REJECT (field, its value)
    chunk 0 uint8[body + 16]    ------->    only after ACCEPT; its checksum computed here and compared with the
    chunk 1 ...                 ------->    trailer's; a chunk lands in the cache only if they are equal
    ...

One round trip (header, answer) per transfer; the sender packs chunk 0 while it waits for the answer, then packs
chunk ``i + 1`` while chunk ``i`` is on the wire; the receiver checks and scatters chunk ``i`` while chunk
``i + 1`` arrives.

**Header** (``HEADER_LEN`` int64): magic (format version), kind (BLOCKS / SNAPSHOT), kv_dtype / layout / model
dtype codes, layers, KV heads, head_dim, block size, count (blocks, or a snapshot's seq_len), then the payload's
:class:`Layout` (prefix bytes, bytes per row of each part, rows, rows per chunk, chunks, body bytes in all),
whether chunks carry checksums, and the header's own checksum (:func:`seal`: the two lanes of
:func:`checksum` of fields ``0 .. F_SEAL_A - 1`` at chunk index :data:`HEADER_CHUNK`).

**Payload.** A sequence of rows of equal size, each row made of parts (blocks: row ``l * n + j`` is block
``block_ids[j]`` of layer ``l``: its data pool bytes, then its int8 / int4 scale / zero bytes; a snapshot: rows
of 16 bytes of its layers' bytes back to back), plus a prefix sent at the front of chunk 0 (fp8 K / V scales
float32 ``[L, 2]``; a snapshot's layer specs int64 ``[L, 2]``). Chunk ``c`` holds rows ``[c * R, min((c + 1) *
R, rows))`` (``R`` rows per chunk, the sender's choice: its ``chunk_bytes`` rounded down to whole rows, one at
least; the last chunk may be shorter). A chunk's body: the prefix (chunk 0 only), then each part of its rows,
part by part (``[k, part bytes]``), every section zero-padded to 16 bytes. The message is the body followed by
a 16-byte trailer: int32 ``[A, B, 0, 0]``, the body's :func:`checksum` at the chunk's index (zeros when the
header says no checksums).

**Checksum**: see :mod:`kvcache.distributed._kernels` for the definition. Two 32-bit lanes of position-mixed
words: a change confined to one 4-byte word is always detected; other damage (several words, moved words,
swapped or repeated chunks: the chunk index seeds the mix) is missed with probability about ``2**-64``. It
guards against corruption, not against an adversary (not cryptographic).
"""

from __future__ import annotations

import dataclasses

import torch

from .._validate import cdiv
from ..ops.paged.format import KV_FORMAT_TABLE
from ._kernels import checksum_into, reference_sums

MAGIC = 0x6B7663616368_02  # "kvcach" + format version 2
HEADER_LEN = 32
ACK_LEN = 3
ALIGN = 16  # every section of a chunk body starts on a 16-byte boundary
TRAILER = 16  # bytes after each body: int32 [A, B, 0, 0]
HEADER_CHUNK = -1  # chunk index of the header's own checksum
DEFAULT_CHUNK_MIN = 16 << 20  # automatic chunk size: an eighth of the payload, within these bounds
DEFAULT_CHUNK_MAX = 64 << 20
MAX_CHUNK = 1 << 30  # chunk_bytes at most (word offsets inside a body stay int32)

# header fields
F_MAGIC, F_KIND, F_KV_DTYPE, F_LAYOUT, F_DTYPE, F_LAYERS, F_HEADS, F_HEAD_DIM, F_BLOCK_SIZE, F_COUNT = range(10)
F_PREFIX, F_DATA, F_PARAMS, F_ROWS, F_CHUNK_ROWS, F_CHUNKS, F_NBYTES, F_HAS_SUM = range(10, 18)
F_SEAL_A, F_SEAL_B = HEADER_LEN - 2, HEADER_LEN - 1

FIELD_NAMES = {
    F_MAGIC: "protocol (magic)", F_KIND: "kind", F_KV_DTYPE: "kv_dtype", F_LAYOUT: "layout", F_DTYPE: "dtype",
    F_LAYERS: "num_layers", F_HEADS: "num_kv_heads", F_HEAD_DIM: "head_dim", F_BLOCK_SIZE: "block_size",
    F_COUNT: "count", F_PREFIX: "prefix bytes", F_DATA: "data bytes", F_PARAMS: "params bytes", F_ROWS: "rows",
    F_CHUNK_ROWS: "rows per chunk", F_CHUNKS: "chunks", F_NBYTES: "payload bytes", F_HAS_SUM: "checksum flag",
    F_SEAL_A: "header checksum", F_SEAL_B: "header checksum",
}

KIND_BLOCKS, KIND_SNAPSHOT = 1, 2
ACCEPT, NO_ROOM, REJECT = 0, 1, 2

KV_DTYPE_CODES = {name: fmt.code for name, fmt in KV_FORMAT_TABLE.items()}  # the kernels' QUANT codes
LAYOUT_CODES = {"NHD": 0, "HND": 1}
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float8_e4m3fn: 4}
DECODE = {
    F_KV_DTYPE: {v: k for k, v in KV_DTYPE_CODES.items()},
    F_LAYOUT: {v: k for k, v in LAYOUT_CODES.items()},
    F_DTYPE: {v: k for k, v in DTYPE_CODES.items()},
    F_KIND: {KIND_BLOCKS: "blocks", KIND_SNAPSHOT: "snapshot"},
}


def describe(field: int, value: int) -> str:
    """A header value as a person reads it (``'NHD'``, ``torch.float16``, ``12``)."""
    dec = DECODE.get(field)
    if dec is not None and value in dec:
        return repr(dec[value]) if isinstance(dec[value], str) else str(dec[value])
    return str(value)


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _words(body: object, name: str = "body") -> torch.Tensor:
    if not isinstance(body, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(body).__name__}")
    if body.dtype != torch.uint8 or body.dim() != 1 or not body.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous 1-d uint8 tensor, got {body.dtype} {list(body.shape)}")
    if body.numel() % 4 or body.storage_offset() % 4:
        raise ValueError(f"{name}: expected whole int32 words (length and offset multiples of 4 bytes), got "
                         f"{body.numel()} bytes at offset {body.storage_offset()}")
    if body.numel() // 4 >= 1 << 31:
        raise ValueError(f"{name}: expected fewer than 2**31 words, got {body.numel() // 4}")
    return body.view(torch.int32)


def _chunk_index(chunk: object) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(f"chunk: expected an int, got {type(chunk).__name__}")
    return chunk


def checksum(body: torch.Tensor, chunk: int) -> torch.Tensor:
    """Checksum of a chunk body at chunk index ``chunk``, computed on the body's device.

    Parameters
    ----------
    body : torch.Tensor
        uint8 ``[nbytes]``, contiguous, ``nbytes`` and its storage offset multiples of 4 (read as int32 words).
    chunk : int
        The chunk's index in its transfer (it seeds the mix: a chunk received in another's place is noticed).

    Returns
    -------
    torch.Tensor
        int32 ``[2]`` on ``body``'s device: lanes A and B (uint32 sums, as int32 bit patterns). Triton kernel on
        CUDA and under the interpreter (``KVCACHE_TRITON_INTERPRET=1``), pure torch for other CPU tensors: the
        same bits everywhere. No host sync.

    Example
    -------
    >>> import torch
    >>> from kvcache.distributed.wire import checksum
    >>> body = torch.arange(64, dtype=torch.uint8)
    >>> a = checksum(body, 0)
    >>> body[5] ^= 1
    >>> bool(torch.equal(a, checksum(body, 0)))
    False
    """
    words = _words(body)
    out = torch.zeros(2, dtype=torch.int32, device=body.device)
    checksum_into(words, _chunk_index(chunk), out)
    return out


def checksum_reference(body: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`checksum` by pure torch whatever the device and backend (the definition the kernel follows).

    Example
    -------
    >>> import torch
    >>> from kvcache.distributed.wire import checksum, checksum_reference
    >>> body = torch.arange(64, dtype=torch.uint8)
    >>> bool(torch.equal(checksum(body, 3), checksum_reference(body, 3)))
    True
    """
    return reference_sums(_words(body), _chunk_index(chunk))


def seal(fields: list[int]) -> list[int]:
    """``fields`` (``HEADER_LEN`` ints) with the header checksum written into ``F_SEAL_A`` / ``F_SEAL_B``."""
    out = list(fields)
    a, b = _header_sum(out)
    out[F_SEAL_A], out[F_SEAL_B] = a, b
    return out


def sealed(fields: list[int]) -> bool:
    """True when the header checksum of ``fields`` matches its fields (a header received intact)."""
    return len(fields) == HEADER_LEN and _header_sum(fields) == (fields[F_SEAL_A], fields[F_SEAL_B])


def _header_sum(fields: list[int]) -> tuple[int, int]:
    t = torch.tensor(fields[:F_SEAL_A], dtype=torch.int64)
    a, b = reference_sums(t.view(torch.int32), HEADER_CHUNK).tolist()
    return a & 0xFFFFFFFF, b & 0xFFFFFFFF


def new_header(kind: int) -> list[int]:
    h = [0] * HEADER_LEN
    h[F_MAGIC] = MAGIC
    h[F_KIND] = kind
    return h


def default_chunk_bytes(total: int) -> int:
    """The sender's chunk size when not given: an eighth of the payload, 16 MiB at least (a payload up to 16 MiB
    travels as one chunk), 64 MiB at most.

    A chunk costs the host tens of microseconds (two messages posted, about five launches) whatever its size,
    and a 16 MiB chunk about 53 us on a 314 GB/s link: smaller chunks would leave the link waiting for the
    host. Larger chunks lengthen what cannot overlap (packing the first chunk, scattering the last). An
    estimate, not a measurement: ``benchmarks/distributed_transfer.py --chunk-mib`` times the alternatives."""
    return min(DEFAULT_CHUNK_MAX, max(DEFAULT_CHUNK_MIN, cdiv(total, 8)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a payload is cut into chunks (see the module docstring).

    ``prefix``: bytes at the front of chunk 0; ``parts``: bytes of each part of a row; ``rows``: rows in all;
    ``chunk_rows``: rows per chunk (the last chunk may have fewer).

    Example
    -------
    >>> from kvcache.distributed.wire import Layout
    >>> lay = Layout.build(prefix=8, parts=(100, 24), rows=10, chunk_bytes=300)
    >>> lay.chunk_rows, lay.chunks, lay.rows_of(4), lay.body_bytes(0), lay.body_bytes(4)
    (2, 5, (8, 10), 272, 256)
    """

    prefix: int
    parts: tuple[int, ...]
    rows: int
    chunk_rows: int

    @staticmethod
    def build(prefix: int, parts: tuple[int, ...], rows: int, chunk_bytes: int | None) -> Layout:
        """A layout whose chunks hold ``chunk_bytes`` of rows, rounded down to whole rows (one at least);
        ``None``: :func:`default_chunk_bytes` of the payload."""
        row = sum(parts)
        if chunk_bytes is None:
            chunk_bytes = default_chunk_bytes(prefix + rows * row)
        return Layout(prefix, tuple(parts), rows, max(1, chunk_bytes // max(row, 1)))

    @property
    def chunks(self) -> int:
        return max(cdiv(self.rows, self.chunk_rows), 1 if self.prefix else 0)

    def rows_of(self, c: int) -> tuple[int, int]:
        """Rows ``[r0, r1)`` of chunk ``c``."""
        return min(c * self.chunk_rows, self.rows), min((c + 1) * self.chunk_rows, self.rows)

    def sections(self, c: int) -> list[tuple[int, int]]:
        """``(offset, bytes)`` in chunk ``c``'s body of its prefix (chunk 0 only: else ``(0, 0)``) and of each
        part of its rows."""
        r0, r1 = self.rows_of(c)
        out, pos = [], 0
        for nbytes in [self.prefix if c == 0 else 0] + [(r1 - r0) * p for p in self.parts]:
            out.append((pos, nbytes))
            pos = align(pos + nbytes)
        return out

    def body_bytes(self, c: int) -> int:
        off, nbytes = self.sections(c)[-1]
        return align(off + nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes of every chunk's body together (trailers not counted)."""
        n = self.chunks
        if n <= 1:
            return self.body_bytes(0) if n else 0
        return self.body_bytes(0) + (n - 2) * self.body_bytes(1) + self.body_bytes(n - 1)  # the middle ones alike

    def fields(self, h: list[int]) -> None:
        """Write the layout into header ``h``."""
        h[F_PREFIX], h[F_ROWS], h[F_CHUNK_ROWS], h[F_CHUNKS], h[F_NBYTES] = (
            self.prefix, self.rows, self.chunk_rows, self.chunks, self.nbytes)
