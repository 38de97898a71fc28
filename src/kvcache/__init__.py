"""kvcache: the KV-cache layer of an LLM inference engine (PyTorch + Triton).

The public names below load on first use (module ``__getattr__``): ``import kvcache`` alone imports neither torch
nor triton, so ``kvcache --help`` answers at once; ``from kvcache import PagedKVCache`` imports what it needs.

Example
-------
>>> import kvcache
>>> cfg = kvcache.PagedConfig(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=8)
>>> cfg.kv_dtype
'auto'
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS: dict[str, str] = {
    "CacheConfig": "linear",
    "KVLayerConfig": "linear",
    "ManagerConfig": "linear",
    "LinearKVCache": "linear",
    "KVCacheManager": "linear",
    "KVSnapshot": "linear",
    "PagedConfig": "paged",
    "PagedKVCache": "paged",
    "BlockAllocator": "paged",
    "StepPlan": "paged",
    "cache_block_bytes": "paged",
    "TieredCache": "paged",
    "RopeConfig": "rope",
}
# submodules reachable as attributes of the package after a plain ``import kvcache``
_SUBMODULES = ("ops", "linear", "paged", "rope", "_backend", "_device", "_validate")

__all__ = ["ops", *_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
