"""Wire format of KV transfers: a fixed int64 header, an int64 answer, one packed byte payload, its checksum.

A transfer is three messages, one payload whatever the pools::

    sender                                  receiver
    header  int64[HEADER_LEN]   ------->    checks format / shape against its own (nothing written yet)
            int64[ACK_LEN]      <-------    ACCEPT, NO_ROOM (allocator full) or REJECT (field, its value)
    payload uint8[nbytes]       ------->    only after ACCEPT; checksum checked, then scattered into blocks

Header fields (indices below): magic, kind (BLOCKS / SNAPSHOT), kv_dtype / layout / model dtype codes, layers,
KV heads, head_dim, block size, count (blocks, or a snapshot's seq_len), payload bytes, bytes of each part
(data, params, fp8 scales, snapshot layer specs), whether a checksum is present and its value.

Payload of blocks: the data pool's bytes ``[L, n, *block]``, then the params pool's ``[L, n, *param_block]``
(int8 / int4), then the fp8 scales ``[L, 2]`` float32, each part starting on a 16-byte boundary; of a snapshot:
its layer specs int64 ``[L, 2]`` (heads, head_dim), then its layers back to back. The payload is zero-padded to
a multiple of :data:`CHUNK` bytes, the checksum's unit.
"""

from __future__ import annotations

import torch

MAGIC = 0x6B7663616368_01  # "kvcach" + format version 1
HEADER_LEN = 32
ACK_LEN = 3
CHUNK = 4096  # payload padding and checksum chunk, bytes
_PRIME = 2_147_483_629  # < 2**31: a chunk sum mod P times its weight stays below 2**62

# header fields
F_MAGIC, F_KIND, F_KV_DTYPE, F_LAYOUT, F_DTYPE, F_LAYERS, F_HEADS, F_HEAD_DIM, F_BLOCK_SIZE, F_COUNT = range(10)
F_NBYTES, F_DATA, F_PARAMS, F_SCALES, F_SPECS, F_HAS_SUM, F_SUM = range(10, 17)

FIELD_NAMES = {
    F_MAGIC: "protocol (magic)", F_KIND: "kind", F_KV_DTYPE: "kv_dtype", F_LAYOUT: "layout", F_DTYPE: "dtype",
    F_LAYERS: "num_layers", F_HEADS: "num_kv_heads", F_HEAD_DIM: "head_dim", F_BLOCK_SIZE: "block_size",
    F_COUNT: "count", F_NBYTES: "payload bytes", F_DATA: "data bytes", F_PARAMS: "params bytes",
    F_SCALES: "scales bytes", F_SPECS: "layer-spec bytes", F_HAS_SUM: "checksum flag", F_SUM: "checksum",
}

KIND_BLOCKS, KIND_SNAPSHOT = 1, 2
ACCEPT, NO_ROOM, REJECT = 0, 1, 2

KV_DTYPE_CODES = {"auto": 0, "fp8": 1, "int8": 2, "int4": 3}
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


def align(n: int, to: int = 16) -> int:
    return -(-n // to) * to


def checksum(payload: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of a payload (uint8, length a multiple of :data:`CHUNK`), as a 0-d int64 tensor on
    its device: ``sum_i ((sum of chunk i's int32 words) mod P) * (i + 1) mod P``. Exact integer arithmetic, so
    every device gives the same value; it notices changed bytes and reordered chunks. No host sync."""
    if payload.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=payload.device)
    words = payload.view(torch.int32).view(-1, CHUNK // 4)
    sums = torch.remainder(words.sum(dim=1, dtype=torch.int64), _PRIME)
    weights = torch.arange(1, sums.shape[0] + 1, dtype=torch.int64, device=payload.device)
    return torch.remainder(sums * weights, _PRIME).sum()


def new_header(kind: int) -> list[int]:
    h = [0] * HEADER_LEN
    h[F_MAGIC] = MAGIC
    h[F_KIND] = kind
    return h


def header_tensor(fields: list[int], csum: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The header as an int64 tensor on ``device``, the checksum written on the device (no sync)."""
    t = torch.tensor(fields, dtype=torch.int64, device=device)
    if csum is not None:
        t[F_HAS_SUM] = 1
        t[F_SUM] = csum.to(device)
    return t
