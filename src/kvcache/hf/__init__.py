"""transformers integration: caches backed by kvcache, and an attention function that reads the paged blocks.

* :class:`LinearCache`: a ``transformers`` Cache over :class:`~kvcache.LinearKVCache` (or
  :class:`~kvcache.KVCacheManager` for layers of different shapes); any attention implementation.
* :class:`PagedCache`: a ``transformers`` Cache over :class:`~kvcache.PagedKVCache` + :class:`~kvcache.BlockAllocator`,
  every kv_dtype (auto, fp8, fp8k, int8, int4, k8v4). With ``attn_implementation="kvcache_paged"`` (registered on
  import), attention reads the blocks in place; with any other implementation the cache hands it gathered K / V.

Importing is cheap: the names above load on first use, and ``"kvcache_paged"`` is registered with transformers'
attention registry as soon as ``transformers.modeling_utils`` (where the registry lives, and which every model
class imports) is loaded: at once if it already is, else right after its import. ``import kvcache.hf`` therefore
imports neither torch nor transformers itself; ``from kvcache.hf import PagedCache`` imports what the cache needs.

Example::

    import kvcache.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvcache_paged")
    cache = kvcache.hf.PagedCache(model.config, max_batch_size=4, max_cache_len=1024, kv_dtype="int8")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

if importlib.util.find_spec("transformers") is None:
    raise ImportError("kvcache.hf needs transformers: pip install 'kvcache[hf]' (or bash scripts/setup.sh hf)")

# public name -> the submodule of kvcache.hf that defines it
_EXPORTS: dict[str, str] = {
    "LinearCache": "linear",
    "PagedCache": "paged",
    "ATTN_IMPLEMENTATION": "paged",
    "kvcache_paged_attention": "attention",
    "register": "attention",
}
__all__ = ["LinearCache", "PagedCache", "ATTN_IMPLEMENTATION", "kvcache_paged_attention", "register"]

# transformers' AttentionInterface lives here; importing it costs about 1.5 s, so registration waits for it
_REGISTRY_MODULE = "transformers.modeling_utils"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _register() -> None:
    importlib.import_module(".attention", __name__).register()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.modeling_utils`` through the other finders and runs :func:`register` right after the
    module executes, then leaves ``sys.meta_path``; every other import passes through untouched."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _REGISTRY_MODULE:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register()
            if self in sys.meta_path:  # kept until it succeeded: a failed import of transformers retries
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_then_register  # type: ignore[union-attr, method-assign]
        return spec


if _REGISTRY_MODULE in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
