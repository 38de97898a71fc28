"""kvcache: the KV-cache layer of an LLM inference engine (PyTorch + Triton)."""

from . import ops
from .config import CacheConfig, KVLayerConfig, ManagerConfig

__version__ = "0.1.0"

__all__ = ["ops", "CacheConfig", "KVLayerConfig", "ManagerConfig", "__version__"]
