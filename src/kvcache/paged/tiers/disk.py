"""The disk tier: one file per block, carrying a checksum and the fingerprint of what made it, under a size budget.

File ``<directory>/<fingerprint[:16]>/<hash:016x>.kvblock``: a safetensors file with tensors ``data``
``[L, *block]`` (the cache's storage dtype) and, with a params pool (int8 / int4 / k8v4 / fp8k), ``params``
(float32), and string metadata:

===========  ==================================================================================================
key          value
===========  ==================================================================================================
format       ``kvcache.block/1``
block_hash   the block's hash (decimal)
fingerprint  :func:`cache_fingerprint` of the cache that wrote it
checksum     ``sha256:<hex>`` over the other metadata and every tensor's name, dtype, shape and bytes (the digest
             of :mod:`kvcache.linear._snapfile`, which snapshot files use)
===========  ==================================================================================================

A file is used only when every field matches what the reading cache expects (format, hash, fingerprint, tensor
names, dtypes and shapes) and the checksum agrees; anything else (a flipped byte, a truncated file, a file of another
model or format copied in) is refused: the file is deleted, the refusal counted, and the block recomputed. Files are
written through :func:`kvcache.linear._snapfile.write_atomic` (temporary file, fsync, rename), so a reader never sees
a half-written file under its name. The budget counts the files of this fingerprint's folder; the least recently
used (file modification time, refreshed on each hit) are deleted first, so the order survives a restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..._validate import check_int
from ...linear._snapfile import _digest, _header, read_file, write_atomic
from ...ops.paged.format import kv_format

if TYPE_CHECKING:
    from ..cache import PagedKVCache

__all__ = ["DiskTier", "cache_fingerprint", "weights_identity"]

FORMAT = "kvcache.block/1"
SUFFIX = ".kvblock"
_SAMPLE = 16  # elements hashed from each end of every weight by weights_identity
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bits of an element, as an int


def weights_identity(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A model's identity from its weights: SHA-256 over every tensor's name, shape and dtype, the bytes of its first
    and last 16 elements, and the sum of every element's bits read as integers (one exact int64 reduction on the
    tensor's own device, the same on any device: an update of any element changes it, save for changes that cancel
    exactly).

    Parameters
    ----------
    named_tensors : iterable of (str, torch.Tensor)
        ``model.named_parameters()`` (and buffers), any device and dtype.

    Returns
    -------
    str
        ``"weights:sha256:<hex>"``.

    Raises
    ------
    TypeError
        An item is not a ``(str, torch.Tensor)`` pair.

    Example
    -------
    >>> w = torch.ones(4, 4)
    >>> before = weights_identity([("w", w)])
    >>> with torch.no_grad():
    ...     _ = w[2, 1].add_(1.0)                      # an update in the middle of the tensor
    >>> before[:15], weights_identity([("w", w)]) != before
    ('weights:sha256:', True)
    """
    h = hashlib.sha256()
    for name, t in named_tensors:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"named_tensors: expected (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                            f"{type(t).__name__})")
        h.update(json.dumps([name, list(t.shape), str(t.dtype)]).encode())
        flat = t.detach().reshape(-1)
        ends = torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]]).cpu().contiguous()
        h.update(ends.view(torch.uint8).numpy().tobytes())
        as_int = _INT_OF_SIZE.get(flat.element_size())
        if as_int is not None and flat.numel():  # integer addition is exact: any order, any device, one result
            h.update(str(int(flat.view(as_int).sum(dtype=torch.int64))).encode())
    return "weights:sha256:" + h.hexdigest()


def cache_fingerprint(cache: PagedKVCache, model_id: str) -> str:
    """What a block's bytes depend on besides its tokens: ``model_id`` (given by the user, or
    :func:`weights_identity`), the cache's layer count, KV heads, head dim, block size, model dtype, kv format and
    storage dtype, layout, the per-layer scales the format reads (``kv_scales``: both for fp8, ``v_scale`` alone for
    fp8k, none for the others), and the cache's RoPE (every field of its ``RopeConfig``).

    Returns
    -------
    str
        64 hex digits (SHA-256). Equal fingerprints: blocks of one cache can be read into the other.

    Raises
    ------
    TypeError, ValueError
        ``model_id`` is not a str, or empty.

    Example
    -------
    >>> fp = cache_fingerprint(cache, "my-model@rev3")       # doctest: +SKIP
    """
    if not isinstance(model_id, str):
        raise TypeError(f"model_id: expected a non-empty str, got {type(model_id).__name__}")
    if not model_id:
        raise ValueError("model_id: expected a non-empty str, got ''")
    c = cache.config
    rope = getattr(cache, "_rope", None)
    fields = {
        "format": FORMAT, "model": model_id, "num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "block_size": c.block_size, "dtype": str(c.dtype), "kv_dtype": c.kv_dtype,
        "storage_dtype": str(c.storage_dtype), "layout": c.layout,
        "kv_scales": cache.kv_scales[:, list(kv_format(c.kv_dtype).layer_scales)].detach().float().cpu().tolist(),
        "rope": None if rope is None else repr(rope),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


class DiskTier:
    """Blocks as files in ``directory`` (module docstring), at most ``capacity_bytes`` of them.

    Parameters
    ----------
    directory : str or os.PathLike
        Created if missing; blocks go to its sub-folder ``fingerprint[:16]``.
    fingerprint : str
        :func:`cache_fingerprint` of the cache.
    capacity_bytes : int
        Budget of this fingerprint's files (>= 1); the least recently used are deleted beyond it.
    shapes : list of (torch.dtype, tuple)
        ``(dtype, [L, *block])`` of ``data`` and, with a params pool, of ``params``: what a file must hold
        (:func:`~kvcache.paged.tiers.host.slot_shapes` of the cache).

    Raises
    ------
    TypeError, ValueError
        A bad argument, named. OSError naming ``directory`` when the folder cannot be created.

    Example
    -------
    >>> import tempfile
    >>> disk = DiskTier(tempfile.mkdtemp(), "ab" * 32, 2**20, [(torch.float16, (2, 2, 2, 4, 16))])
    >>> disk.write(7, [torch.ones(2, 2, 2, 4, 16, dtype=torch.float16)])
    (True, [])
    >>> 7 in disk, disk.read(7)[0].shape
    (True, torch.Size([2, 2, 2, 4, 16]))
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike, fingerprint: str, capacity_bytes: int,
                 shapes: list[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory: expected a str or os.PathLike, got {type(directory).__name__}")
        check_int("capacity_bytes", capacity_bytes, lo=1)
        if not isinstance(shapes, list) or not 1 <= len(shapes) <= 2:
            raise ValueError(f"shapes: expected a list of one or two (dtype, shape) pairs, got {shapes!r}")
        self.root = os.fspath(directory)
        self.capacity_bytes = capacity_bytes
        self._names = ["data", "params"][:len(shapes)]
        self._shapes = shapes
        self.refused = 0
        self.seconds = {"write": 0.0, "read": 0.0}
        self.io_bytes = {"write": 0, "read": 0}
        self.switch(fingerprint)

    def switch(self, fingerprint: str) -> None:
        """Use the folder of ``fingerprint`` from now on (created if missing, its files listed): the blocks of the
        previous fingerprint stay on disk but are no longer found. Counters are kept.

        Raises
        ------
        ValueError
            ``fingerprint`` is not a str of at least 16 characters.
        OSError
            The folder cannot be created (naming ``directory``).

        Example
        -------
        >>> disk.switch(cache_fingerprint(cache, "new-weights"))       # doctest: +SKIP
        """
        if not isinstance(fingerprint, str) or len(fingerprint) < 16:
            raise ValueError(f"fingerprint: expected a str of at least 16 characters, got {fingerprint!r}")
        folder = os.path.join(self.root, fingerprint[:16])
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"directory: cannot create {folder!r}: {e.strerror or e}") from e
        self.fingerprint = fingerprint
        self.directory = folder
        self._size: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self.nbytes = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        for name in os.listdir(self.directory):
            stem = name[:-len(SUFFIX)]
            if not name.endswith(SUFFIX) or len(stem) != 16:
                continue
            try:
                h = int(stem, 16)
                st = os.stat(os.path.join(self.directory, name))
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime_ns, h, st.st_size))
        for _, h, size in sorted(found):
            self._size[h] = size
            self.nbytes += size

    def path_for(self, block_hash: int) -> str:
        """The file of ``block_hash`` (whether it exists or not)."""
        return os.path.join(self.directory, f"{block_hash:016x}{SUFFIX}")

    def __contains__(self, block_hash: int) -> bool:
        if block_hash in self._size:
            return True
        try:  # written by another process since the scan
            size = os.stat(self.path_for(block_hash)).st_size
        except OSError:
            return False
        self._size[block_hash] = size
        self.nbytes += size
        return True

    def __len__(self) -> int:
        return len(self._size)

    def _forget(self, block_hash: int, delete: bool) -> None:
        self.nbytes -= self._size.pop(block_hash, 0)
        if delete:
            try:
                os.unlink(self.path_for(block_hash))
            except OSError:
                pass

    def write(self, block_hash: int, tensors: list[torch.Tensor]) -> tuple[bool, list[int]]:
        """Write one block (``[data]`` or ``[data, params]``, CPU tensors of the shapes given) unless its file exists.
        Returns (written, the hashes deleted to stay within the budget); a block larger than the budget alone is
        not written.

        Example
        -------
        >>> disk.write(block_hash, host.block(slot))        # doctest: +SKIP
        (True, [])
        """
        from safetensors.torch import save

        if block_hash in self:
            self._size.move_to_end(block_hash)
            return False, []
        t0 = time.perf_counter()
        meta = {"format": FORMAT, "block_hash": str(block_hash), "fingerprint": self.fingerprint}
        named = [(n, t.contiguous()) for n, t in zip(self._names, tensors)]
        meta["checksum"] = _digest(meta, named)
        blob = save(dict(named), metadata=meta)
        if len(blob) > self.capacity_bytes:
            return False, []
        dropped = []
        while self._size and self.nbytes + len(blob) > self.capacity_bytes:
            victim = next(iter(self._size))
            self._forget(victim, delete=True)
            dropped.append(victim)
        write_atomic(self.path_for(block_hash), blob)
        self._size[block_hash] = len(blob)
        self.nbytes += len(blob)
        self.seconds["write"] += time.perf_counter() - t0
        self.io_bytes["write"] += len(blob)
        return True, dropped

    def read(self, block_hash: int) -> list[torch.Tensor] | None:
        """The block's tensors if its file exists and passes every check; None otherwise (a refused file is
        deleted and counted in :attr:`refused`; a missing one is forgotten).

        Example
        -------
        >>> data, = disk.read(block_hash)                   # doctest: +SKIP
        >>> data.shape                                      # [L, *block]   # doctest: +SKIP
        torch.Size([2, 2, 2, 4, 16])
        """
        path = self.path_for(block_hash)
        t0 = time.perf_counter()
        try:
            blob = read_file(path)
        except OSError:
            self._forget(block_hash, delete=False)
            return None
        try:
            tensors = self._decode(blob, block_hash, path)
        except ValueError:
            self.refused += 1
            self._forget(block_hash, delete=True)
            return None
        self._size.move_to_end(block_hash)
        try:
            os.utime(path)  # the least-recently-used order survives a restart
        except OSError:
            pass
        self.seconds["read"] += time.perf_counter() - t0
        self.io_bytes["read"] += len(blob)
        return tensors

    def _decode(self, blob: bytes, block_hash: int, path: str) -> list[torch.Tensor]:
        from safetensors.torch import load

        meta: Any = _header(blob, repr(path)).get("__metadata__") or {}
        expect = {"format": FORMAT, "block_hash": str(block_hash), "fingerprint": self.fingerprint}
        for k, v in expect.items():
            if not isinstance(meta, dict) or meta.get(k) != v:
                raise ValueError(f"{path}: metadata {k} does not match")
        try:
            tensors = load(blob)
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ValueError(f"{path}: damaged ({e})") from e
        if sorted(tensors) != sorted(self._names):
            raise ValueError(f"{path}: tensors {sorted(tensors)}, expected {self._names}")
        out = [tensors[n] for n in self._names]
        for t, (dtype, shape) in zip(out, self._shapes):
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
        if _digest(meta, list(zip(self._names, out))) != meta.get("checksum"):
            raise ValueError(f"{path}: checksum mismatch")
        return out

    def hashes(self) -> list[int]:
        """Held hashes (as far as this process knows), least recently used first."""
        return list(self._size)
