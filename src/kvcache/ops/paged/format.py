"""The KV formats of a paged pool (``kv_dtype``), in one table used by the config, the ops and validation.

The byte format of each is documented in :mod:`kvcache.paged.config`. Used by the config, the ops and validation
(it imports nothing of kvcache: the ops read it without loading the cache classes).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["KVFormat", "KV_FORMAT_TABLE", "KV_FORMATS", "LAYOUTS", "kv_format"]

LAYOUTS = ("NHD", "HND")


@dataclasses.dataclass(frozen=True, slots=True)
class KVFormat:
    """One ``kv_dtype``.

    Attributes
    ----------
    name : str
        ``"auto"``, ``"fp8"``, ``"int8"`` or ``"int4"``.
    code : int
        The kernels' ``QUANT`` constexpr: 0 auto, 1 fp8, 2 int8, 3 int4.
    storage : torch.dtype or None
        dtype of the data pool; None: the model dtype (``"auto"``).
    bits : int or None
        Bits per stored code of the integer formats (8, 4); None for float formats.
    per_layer_scale : bool
        One float32 scale per layer for K and one for V (fp8: ``PagedKVCache.kv_scales``).
    row_params : bool
        A float32 (scale, zero) per (token, head) in a params pool (int8 / int4).
    """

    name: str
    code: int
    storage: torch.dtype | None
    bits: int | None
    per_layer_scale: bool
    row_params: bool

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the data pool for a model dtype."""
        return model_dtype if self.storage is None else self.storage

    def row_elems(self, head_dim: int) -> int:
        """Stored elements per (token, head) row: ``head_dim``, or ``head_dim // 2`` bytes for int4."""
        return head_dim // 2 if self.bits == 4 else head_dim

    @property
    def qmax(self) -> int:
        """Largest code of an integer format (255, 15); 0 for float formats."""
        return 0 if self.bits is None else 2**self.bits - 1


KV_FORMAT_TABLE: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("auto", 0, None, None, False, False),
        KVFormat("fp8", 1, torch.float8_e4m3fn, None, True, False),
        KVFormat("int8", 2, torch.uint8, 8, False, True),
        KVFormat("int4", 3, torch.uint8, 4, False, True),
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
