"""The KV formats of a paged pool (``kv_dtype``), in one table used by the config, the ops and validation.

The byte format of each is documented in :mod:`kvcache.paged.config`. Used by the config, the ops and validation
(it imports nothing of kvcache: the ops read it without loading the cache classes).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["KVFormat", "KV_FORMAT_TABLE", "KV_FORMATS", "LAYOUTS", "block_key_words", "kv_format", "pack_codes",
           "stored_planes", "unpack_codes"]

LAYOUTS = ("NHD", "HND")


@dataclasses.dataclass(frozen=True, slots=True)
class KVFormat:
    """One ``kv_dtype``.

    Attributes
    ----------
    name : str
        ``"auto"``, ``"fp8"``, ``"int8"``, ``"int4"``, ``"k8v4"``, ``"fp8k"`` or ``"int4b"``.
    code : int
        The kernels' ``QUANT`` constexpr: 0 auto, 1 fp8, 2 int8, 3 int4, 4 k8v4, 5 fp8k, 6 int4b.
    storage : torch.dtype or None
        dtype of the data pool; None: the model dtype (``"auto"``).
    key_bits, value_bits : int or None
        Bits per stored code of keys and of values in the integer formats (8 or 4); None for float formats.
    per_layer_scale : bool
        One float32 scale per layer for K and one for V (fp8: ``PagedKVCache.kv_scales``; fp8k: V's only).
    row_params : bool
        A float32 (scale, zero) per (token, head) in a params pool (int8 / int4 / k8v4).
    planes : int
        Planes of a block in the data pool (dim 1): 2 (K, V); k8v4: 3 (the first and second halves of the int8 key
        rows, then the int4 value rows), each of ``row_elems`` bytes per (token, head).
    key_scale : bool
        A float32 scale per (token, head) of the keys alone in a params pool (fp8k: ``amax / 448``).
    block_keys : bool
        int4b: a full block's keys as int4 codes with an fp16 (scale, zero) per (block, head, channel); the partial
        last block of a sequence keeps its keys as int8 rows, each half in its own and in the next block's key plane
        (the next block is empty until then). Values as int4 rows. One params plane of :meth:`params_width` float32
        words per (token slot, head): the value row's (scale, zero), then the block's key area.
    """

    name: str
    code: int
    storage: torch.dtype | None
    key_bits: int | None
    value_bits: int | None
    per_layer_scale: bool
    row_params: bool
    planes: int = 2
    key_scale: bool = False
    block_keys: bool = False

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the data pool for a model dtype."""
        return model_dtype if self.storage is None else self.storage

    def row_elems(self, head_dim: int) -> int:
        """Stored elements per (token, head) row of one plane: ``head_dim``, or ``head_dim // 2`` bytes where values
        are int4 (int4, k8v4)."""
        return head_dim // 2 if self.value_bits == 4 else head_dim

    @property
    def is_float(self) -> bool:
        """A float format (auto, fp8, fp8k): no integer codes, no (scale, zero)."""
        return self.key_bits is None

    @property
    def bits(self) -> int | None:
        """Bits per code where keys and values share them (8 int8, 4 int4); None otherwise (float formats, k8v4)."""
        return self.key_bits if self.key_bits == self.value_bits else None

    def qmax_of(self, kind: int) -> int:
        """Largest code of keys (``kind`` 0) or values (1): 255 or 15; 0 for float formats."""
        bits = self.key_bits if _kind(kind) == 0 else self.value_bits
        return 0 if bits is None else 2**bits - 1

    @property
    def qmax(self) -> int:
        """Largest code where keys and values share their bits (255, 15); 0 otherwise."""
        return 0 if self.bits is None else 2**self.bits - 1

    @property
    def layer_scales(self) -> tuple[int, ...]:
        """Which of a layer's ``(k_scale, v_scale)`` the format reads: both for fp8, v_scale alone for fp8k (its keys
        carry their own scales), none for the others."""
        if not self.per_layer_scale:
            return ()
        return (1,) if self.key_scale else (0, 1)

    @property
    def has_params(self) -> bool:
        """A params pool beside the data: (scale, zero) pairs of K and V (int8 / int4 / k8v4), or the keys' scales
        (fp8k)."""
        return self.row_params or self.key_scale or self.block_keys

    @property
    def param_planes(self) -> int:
        """Planes of a block in the params pool (dim 1): 2 (K, V) for (scale, zero) pairs, 1 (K) for fp8k, 1 for
        int4b, else 0."""
        return 2 if self.row_params else (1 if self.key_scale or self.block_keys else 0)

    @property
    def param_width(self) -> int:
        """float32 values per (token, head) of a params plane (last dim): 2 (scale, zero), 1 (fp8k's scale), else 0.
        int4b's width depends on the geometry: :meth:`params_width`."""
        return 2 if self.row_params else (1 if self.key_scale else 0)

    def params_width(self, head_dim: int, block_size: int) -> int:
        """float32 words per (token slot, head) of a params plane: :attr:`param_width`, or for int4b 2 (the value
        row's scale, zero) + :func:`block_key_words` (the key area)."""
        return 2 + block_key_words(head_dim, block_size) if self.block_keys else self.param_width

    @property
    def needs_even_head_dim(self) -> bool:
        """int4 values pack elements ``i`` and ``D/2 + i`` in one byte: head_dim must be even."""
        return self.value_bits == 4

    def token_head_bytes(self, head_dim: int, model_dtype: torch.dtype, block_size: int = 16) -> int:
        """Bytes of one (token, head) over K and V, their scales (and zeros) included (int4b's key scales per block
        spread over its ``block_size`` slots)."""
        elt = torch.empty((), dtype=self.storage_dtype(model_dtype)).element_size()
        width = self.params_width(head_dim, block_size)
        return self.planes * self.row_elems(head_dim) * elt + self.param_planes * width * 4


KV_FORMAT_TABLE: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("auto", 0, None, None, None, False, False),
        KVFormat("fp8", 1, torch.float8_e4m3fn, None, None, True, False),
        KVFormat("int8", 2, torch.uint8, 8, 8, False, True),
        KVFormat("int4", 3, torch.uint8, 4, 4, False, True),
        KVFormat("k8v4", 4, torch.uint8, 8, 4, False, True, planes=3),
        KVFormat("fp8k", 5, torch.float8_e4m3fn, None, None, True, False, key_scale=True),
        KVFormat("int4b", 6, torch.uint8, 4, 4, False, False, block_keys=True),
    )
}
KV_FORMATS = tuple(KV_FORMAT_TABLE)  # the values of kv_dtype


def kv_format(kv_dtype: object, name: str = "kv_dtype") -> KVFormat:
    """The :class:`KVFormat` of ``kv_dtype``; TypeError / ValueError naming ``name`` otherwise."""
    if not isinstance(kv_dtype, str):
        raise TypeError(f"{name}: expected one of {KV_FORMATS}, got {type(kv_dtype).__name__}")
    fmt = KV_FORMAT_TABLE.get(kv_dtype)
    if fmt is None:
        raise ValueError(f"{name}: expected one of {KV_FORMATS}, got {kv_dtype!r}")
    return fmt


def block_key_words(head_dim: int, block_size: int) -> int:
    """int4b: float32 words of the key area per (token slot, head), ``ceil(head_dim / block_size)``: a block's
    ``block_size`` slots hold ``head_dim`` words per head, the channels' fp16 scales then their fp16 zeros, two
    channels a word (a full block), or a float32 (scale, zero) per int8 row (the partial block: ``2 * block_size <=
    head_dim`` words)."""
    return -(-head_dim // block_size)


def _kind(kind: object) -> int:
    if kind not in (0, 1) or type(kind) is not int:
        raise ValueError(f"kind: expected 0 (keys) or 1 (values), got {kind!r}")
    return kind


def stored_planes(kv_dtype: str, kind: int) -> tuple[int, ...]:
    """Planes (dim 1 of a pool) that hold the key (``kind`` 0) or value (1) rows of ``kv_dtype``.

    Example
    -------
    >>> stored_planes("k8v4", 0), stored_planes("k8v4", 1), stored_planes("int8", 1)
    ((0, 1), (2,), (1,))
    """
    if kv_format(kv_dtype).planes == 3:
        return (0, 1) if _kind(kind) == 0 else (2,)
    return (_kind(kind),)


def _bits(kv_dtype: str, kind: int) -> int | None:
    fmt = kv_format(kv_dtype)
    if fmt.is_float:
        raise ValueError(f"kv_dtype: expected an integer format, got {kv_dtype!r}")
    return fmt.key_bits if _kind(kind) == 0 else fmt.value_bits


def pack_codes(kv_dtype: str, kind: int, q: torch.Tensor) -> list[torch.Tensor]:
    """Integer codes ``q`` ``[..., D]`` (D even where 4-bit) of key (``kind`` 0) or value (1) rows as stored: one
    uint8 tensor per plane of :func:`stored_planes` (int4: planar nibbles, ``byte[i] = q[i] | q[D/2 + i] << 4``;
    k8v4 keys: elements ``[0, D/2)`` then ``[D/2, D)``).

    Example
    -------
    >>> [t.tolist() for t in pack_codes("k8v4", 0, torch.tensor([1, 2, 3, 4]))]
    [[1, 2], [3, 4]]
    """
    half = q.shape[-1] // 2
    if _bits(kv_dtype, kind) == 4:
        return [(q[..., :half] | (q[..., half:] << 4)).to(torch.uint8)]
    if kv_format(kv_dtype).planes == 3:
        return [q[..., :half].to(torch.uint8), q[..., half:].to(torch.uint8)]
    return [q.to(torch.uint8)]


def unpack_codes(kv_dtype: str, kind: int, planes: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: int32 codes ``[..., D]`` from the stored rows of each plane.

    Example
    -------
    >>> unpack_codes("int4", 1, [torch.tensor([0x31, 0x42], dtype=torch.uint8)]).tolist()
    [1, 2, 3, 4]
    """
    raw = [t.to(torch.int32) for t in planes]
    if _bits(kv_dtype, kind) == 4:
        return torch.cat([raw[0] & 15, (raw[0] >> 4) & 15], dim=-1)
    return torch.cat(raw, dim=-1)
