"""``EngineConfig``: every argument of :class:`~kvcache.engine.LLM` but the model, validated in one place.

The optional sizes (``max_num_batched_tokens``, ``kv_cache_memory``, ``max_model_len``) default to values that
depend on the model and its device; :meth:`EngineConfig.batched_tokens`, :meth:`EngineConfig.cache_memory` and
:meth:`EngineConfig.model_len` work them out for the engine's cores.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from .._validate import check_choice, check_int
from ..ops.paged.format import LAYOUTS, kv_format
from ..paged.tiers import DEFAULT_DISK_BYTES
from .loader import _resolve_dtype

if TYPE_CHECKING:
    from .model import LlamaForward

__all__ = ["EngineConfig", "CACHE_MODES", "check_config"]

CACHE_MODES = ("paged", "linear")
CPU_CACHE_BYTES = 256 * 2**20  # default KV memory on the CPU (no device memory to size it from)
DEFAULT_MAX_MODEL_LEN = 4096  # the longest request by default, when the model allows it


def _check_optional_int(name: str, value: object) -> None:
    if value is not None:
        check_int(name, value, lo=1)


def _check_bool(name: str, value: object, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise TypeError(f"{name}: expected a bool{' or None' if optional else ''}, got {type(value).__name__}")


def _check_device(device: object) -> None:
    if device is None:
        return
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected a str, a torch.device or None, got {type(device).__name__}")
    try:
        torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: expected a device name such as 'cpu' or 'cuda', got {device!r}") from None


def _check_tp_group(group: object) -> None:
    if group is None:
        return
    dist = torch.distributed
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"tp_group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's settings: cache mode and format, sizes, device, batching, CUDA graphs, tensor parallel.

    Every field is validated when the config is built (TypeError / ValueError naming the field, the expected and
    the actual value); ``LLM(model, config=EngineConfig(...))`` and ``LLM(model, **fields)`` are the same engine.

    Parameters
    ----------
    tokenizer : transformers tokenizer, optional
        Required with an already loaded model; otherwise loaded with the model. The engine calls its ``decode``
        (outputs, stop strings), ``__call__`` (string prompts) and ``apply_chat_template`` (conversations).
    kv_dtype : str
        A format of the :data:`~kvcache.ops.paged.format.KV_FORMAT_TABLE`: ``"auto"`` (the model dtype),
        ``"fp8"``, ``"fp8k"`` (fp8 keys with a scale per token and head), ``"int8"``, ``"k8v4"`` (int8 keys, int4
        values), ``"int4"``, ``"int4b"`` (int4, keys per channel over each block; full-attention models) (paged cache;
        the linear cache stores the model dtype: ``"auto"`` only).
    block_size : int
        Tokens per block (paged).
    max_num_seqs : int
        Requests running at once (slots of the linear cache).
    gpu_memory_utilization : float
        In (0, 1]. On CUDA: fraction of the device memory the process may use; the KV cache takes what the weights
        and a working reserve leave of it.
    cache : str
        ``"paged"`` or ``"linear"``.
    device : str or torch.device, optional
        Where to load the model (default: CUDA if available, else the CPU). Ignored for a loaded model.
    dtype : torch.dtype or str, optional
        The model's dtype when loaded (float32, float16 or bfloat16; default float32 on the CPU, bfloat16 on CUDA).
        Ignored for a loaded model.
    enable_prefix_caching : bool
        Reuse the KV of equal prompt prefixes across requests (paged: hash-chained blocks; linear: the shared
        prompt prefix saved once and restored).
    max_num_batched_tokens : int, optional
        Token budget of a step (prefill chunks + decodes); default 2048 on the CPU, 8192 on CUDA.
    num_blocks : int, optional
        Pool size (paged); default: what ``kv_cache_memory`` holds (e.g. a tiny pool to force preemption). A model
        whose layers have different sliding windows has one pool per layer group (:mod:`kvcache.paged.groups`):
        ``num_blocks`` then stands for the memory of that many blocks of every layer, split between the groups as
        ``kv_cache_memory`` is.
    max_model_len : int, optional
        Longest request (prompt + max_tokens); default ``min(max_position_embeddings, 4096)`` (linear: also at
        most what ``kv_cache_memory`` holds for ``max_num_seqs`` slots).
    kv_cache_memory : int, optional
        Bytes for the KV cache (overrides ``gpu_memory_utilization``; default 256 MiB on the CPU). Paged, with
        sliding-window layers: split between the layer groups by what a ``max_model_len`` sequence needs in each (a
        window layer at most ``ceil(window / block_size) + 1`` blocks).
    layout : str
        Paged pool layout, ``"HND"`` (default: each head's rows of a block contiguous; the int8 engine runs 2%
        faster on it than on NHD and matches bf16; H100, 2026-11-26) or ``"NHD"``.
    cuda_graphs : bool, optional
        Run pure decode steps as CUDA graphs, captured per batch-size bucket (default: on with CUDA and no
        ``tp_group``). ``True`` on the CPU runs them through the same static, padded buffers without capture.
        On (either way), each step is also launched before the host reads the previous step's greedy tokens
        (:mod:`kvcache.engine.paged_loop`); off, every step is run and read before the next is scheduled.
    tp_group : torch.distributed.ProcessGroup, optional
        Tensor parallel over this group (see :mod:`kvcache.engine.tp`): every rank builds the same ``LLM`` from the
        same weights and calls ``generate`` with the same arguments. Paged cache only, no CUDA graphs.
    host_cache_memory : int
        Bytes of pinned host memory for a host tier behind the prefix cache (see :mod:`kvcache.paged.tiers`):
        blocks evicted from the pool are copied there and brought back on a prefix hit. 0 (default): off. Paged
        cache with prefix caching only, no ``tp_group``.
    disk_cache_dir : str or os.PathLike, optional
        A directory for a disk tier (off by default): blocks leaving the host tier (or the pool, without a host
        tier) are written there as checksummed files, reusable by later engines of the same model and cache format
        (a file of anything else, or damaged, is refused and its block recomputed).
    disk_cache_bytes : int
        The disk tier's budget (default 16 GiB); its least recently used files are deleted beyond it. Only with
        ``disk_cache_dir``.
    cache_model_id : str, optional
        The model's identity in the disk tier's fingerprint (``"org/model@revision"``), kept for the engine's life:
        the user vouches that it names the weights (after updating weights in place, give a new engine a new id).
        Default: :func:`~kvcache.paged.tiers.weights_identity` of the weights, recomputed on
        ``llm.reset_prefix_cache()``, so weights updated in place never read blocks of the old ones.
        Only with ``disk_cache_dir``.
    kv_events : bool
        Record the prefix cache's events (blocks stored / removed per tier: ``LLM.kv_events()``). Paged cache only.
    decode_reserve : float, optional
        Paged cache: the fraction of each running request's remaining ``max_tokens`` the scheduler keeps blocks for
        before it admits another request (:mod:`kvcache.engine.admission`). None (default): learned from the
        requests that finished, starting at 1.0. ``1.0``: requests that run to ``max_tokens`` are not preempted
        (TensorRT-LLM's guaranteed-no-evict); ``0.0``: no reserve, admit while the next prompt chunk fits and preempt
        when a running request runs out (vLLM's policy).

    Raises
    ------
    TypeError, ValueError
        A field of the wrong type or out of range, ``kv_dtype`` other than ``"auto"`` with the linear cache,
        ``tp_group`` with the linear cache or with ``cuda_graphs=True``; ``host_cache_memory``,
        ``disk_cache_dir`` or ``kv_events`` with the linear cache, the tiers without prefix caching or with
        ``tp_group``; ``cache_model_id`` or a non-default ``disk_cache_bytes`` without ``disk_cache_dir``;
        ``decode_reserve`` with the linear cache.

    Example
    -------
    >>> cfg = EngineConfig(kv_dtype="int8", block_size=32, max_num_seqs=16)
    >>> cfg.kv_dtype, cfg.cache, cfg.layout
    ('int8', 'paged', 'HND')
    >>> dataclasses.replace(cfg, max_num_seqs=8).max_num_seqs
    8
    """

    tokenizer: Any = dataclasses.field(default=None, repr=False, compare=False)
    kv_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    cache: str = "paged"
    device: torch.device | str | None = None
    dtype: torch.dtype | str | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    num_blocks: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    layout: str = "HND"
    cuda_graphs: bool | None = None
    tp_group: Any = None
    host_cache_memory: int = 0
    disk_cache_dir: str | os.PathLike | None = None
    disk_cache_bytes: int = DEFAULT_DISK_BYTES
    cache_model_id: str | None = None
    kv_events: bool = False
    decode_reserve: float | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None and not callable(getattr(self.tokenizer, "decode", None)):
            raise TypeError(f"tokenizer: expected a tokenizer (with a decode method) or None, got "
                            f"{type(self.tokenizer).__name__}")
        check_choice("cache", self.cache, CACHE_MODES)
        kv_format(self.kv_dtype)
        if self.cache == "linear" and self.kv_dtype != "auto":
            raise ValueError(f"kv_dtype: the linear cache stores the model dtype, expected 'auto', got "
                             f"{self.kv_dtype!r}")
        check_int("block_size", self.block_size, lo=1)
        check_int("max_num_seqs", self.max_num_seqs, lo=1)
        for name in ("max_num_batched_tokens", "num_blocks", "max_model_len", "kv_cache_memory"):
            _check_optional_int(name, getattr(self, name))
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)):
            raise TypeError(f"gpu_memory_utilization: expected a float in (0, 1], got {type(g).__name__}")
        if not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a float in (0, 1], got {g!r}")
        _check_device(self.device)
        if self.dtype is not None:
            _resolve_dtype(self.dtype, torch.device("cpu"))
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_choice("layout", self.layout, LAYOUTS)
        _check_bool("cuda_graphs", self.cuda_graphs, optional=True)
        _check_tp_group(self.tp_group)
        if self.tp_group is not None and self.cache != "paged":
            raise ValueError(f"cache: tensor parallel (tp_group) needs the paged cache, got {self.cache!r}")
        if self.tp_group is not None and self.cuda_graphs:
            raise ValueError("cuda_graphs: not supported with tp_group (expected None or False)")
        self._check_tiers()
        r = self.decode_reserve
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float))):
            raise TypeError(f"decode_reserve: expected a float in [0, 1] or None, got {type(r).__name__}")
        if r is not None and not 0 <= r <= 1:
            raise ValueError(f"decode_reserve: expected a float in [0, 1] or None, got {r!r}")
        if r is not None and self.cache != "paged":
            raise ValueError(f"decode_reserve: the linear cache admits by free slots, expected None, got {r!r}")

    def _check_tiers(self) -> None:
        check_int("host_cache_memory", self.host_cache_memory, lo=0)
        check_int("disk_cache_bytes", self.disk_cache_bytes, lo=1)
        d = self.disk_cache_dir
        if d is not None and (not isinstance(d, (str, os.PathLike)) or not os.fspath(d)):
            raise TypeError(f"disk_cache_dir: expected a directory path (str or os.PathLike) or None, got {d!r}")
        m = self.cache_model_id
        if m is not None and (not isinstance(m, str) or not m):
            raise TypeError(f"cache_model_id: expected a non-empty str or None, got {m!r}")
        _check_bool("kv_events", self.kv_events)
        used = [name for name, on in (("host_cache_memory", self.host_cache_memory > 0),
                                      ("disk_cache_dir", d is not None), ("kv_events", self.kv_events)) if on]
        if used and self.cache != "paged":
            raise ValueError(f"{used[0]}: the memory tiers and KV events need the paged cache, got cache="
                             f"{self.cache!r}")
        if d is None and m is not None:
            raise ValueError("cache_model_id: the disk tier's model identity, given without disk_cache_dir "
                             "(expected None)")
        if d is None and self.disk_cache_bytes != DEFAULT_DISK_BYTES:
            raise ValueError(f"disk_cache_bytes: the disk tier's budget, given without disk_cache_dir (expected the "
                             f"default {DEFAULT_DISK_BYTES})")
        tiers = [n for n in used if n != "kv_events"]
        if tiers and not self.enable_prefix_caching:
            raise ValueError(f"{tiers[0]}: the memory tiers hold prefix-cache blocks, expected "
                             "enable_prefix_caching=True")
        if tiers and self.tp_group is not None:
            raise ValueError(f"{tiers[0]}: the memory tiers do not run with tp_group (expected 0 / None)")

    # ---------------------------------------------------------------------------------- sizes for a model

    def batched_tokens(self, device: torch.device) -> int:
        """Token budget of a step: ``max_num_batched_tokens``, else 8192 on CUDA and 2048 elsewhere.

        Example
        -------
        >>> EngineConfig().batched_tokens(torch.device("cpu"))
        2048
        """
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device.type == "cuda" else 2048

    def model_len(self, model: LlamaForward) -> int:
        """Longest request: ``max_model_len``, else ``min(max_position_embeddings, 4096)`` of the model's config.

        Example
        -------
        >>> EngineConfig(max_model_len=512).model_len(llm.model)   # doctest: +SKIP
        512
        """
        if self.max_model_len is not None:
            return self.max_model_len
        limit = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        return min(limit, DEFAULT_MAX_MODEL_LEN)

    def cache_memory(self, model: LlamaForward) -> int:
        """Bytes for the KV cache: ``kv_cache_memory``; else on CUDA ``gpu_memory_utilization`` of the device less
        what is in use (the weights) and a working reserve, at least 64 MiB; else 256 MiB.

        Example
        -------
        >>> EngineConfig(kv_cache_memory=2**30).cache_memory(llm.model)   # doctest: +SKIP
        1073741824
        """
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if model.device.type != "cuda":
            return CPU_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(model.device)
        cfg = model.config
        # working memory of the largest step: ~16 hidden-sized float32 rows and the MLP's intermediate rows per
        # token, the sampled rows' float32 logits, plus 1 GiB for graphs, workspaces and the allocator's slack
        inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
        budget = self.batched_tokens(model.device)
        reserve = 2**30 + budget * (16 * cfg.hidden_size + 2 * inter) * 4 + 2 * self.max_num_seqs * model.vocab_size * 4
        return max(int(total * self.gpu_memory_utilization) - (total - free) - reserve, 64 * 2**20)


def check_config(config: object, name: str = "config") -> EngineConfig:
    """``config`` if it is an :class:`EngineConfig`; TypeError naming ``name`` otherwise.

    Example
    -------
    >>> check_config(EngineConfig()).cache
    'paged'
    """
    if not isinstance(config, EngineConfig):
        raise TypeError(f"{name}: expected an EngineConfig, got {type(config).__name__}")
    return config
