"""The snapshot file format and its atomic write (the file half of :class:`kvcache.KVSnapshot`).

A snapshot file is a safetensors file: tensors ``layer.0 .. layer.{n-1}``, each ``[2, H_i, seq_len, D_i]`` of
one storage dtype, and string metadata:

=============  ==========================================================================================
key            value
=============  ==========================================================================================
format         ``kvcache.snapshot/1``
seq_len        tokens held, equal to dim 2 of every tensor
num_layers     number of tensors
dtype          their dtype, as torch names it without ``torch.`` (``float16``)
layer_specs    JSON list of ``[num_kv_heads, head_dim]`` per layer
checksum       ``sha256:<hex>`` of the JSON of every other metadata key (the user's too, sorted) followed,
               per layer in order, by its name, dtype and shape (JSON) and its bytes
=============  ==========================================================================================

Reading validates every field against the tensors and refuses extra or missing tensors, so a damaged file
is an error, never a wrong snapshot: a flipped data byte fails the checksum, a flipped header byte fails the
parser, a field check or the checksum (the header is covered). Content errors are ``ValueError``, file system
errors ``OSError``, each with the underlying error chained.

Writing goes to ``.{name}.{host}.{pid}.{random}.kvtmp`` in the target's directory, is flushed and fsynced,
then renamed over the target (``os.replace``, atomic on POSIX) and the directory fsynced. Any failure removes
the temporary file. A process killed mid-write cannot remove its own: the next save to the same path removes
temporary files of that name left by processes of this host that no longer run.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence

import torch

from .._validate import KV_DTYPES

FORMAT = "kvcache.snapshot/1"
RESERVED = ("format", "seq_len", "num_layers", "dtype", "layer_specs", "checksum")
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in KV_DTYPES}
_TMP_SUFFIX = ".kvtmp"


# ------------------------------------------------------------------------------------------------ content


def _digest(meta: Mapping[str, str], tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    for name, t in tensors:
        h.update(json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return "sha256:" + h.hexdigest()


def encode(tensors: Sequence[torch.Tensor], seq_len: int, metadata: Mapping[str, str]) -> bytes:
    """The file's bytes for CPU-contiguous ``tensors`` (validated snapshot layers) and the user's metadata."""
    from safetensors.torch import save

    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(
                f"metadata: expected str keys and values, got {type(k).__name__} -> {type(v).__name__}"
            )
        if k in RESERVED:
            raise ValueError(f"metadata: key {k!r} is reserved (reserved: {', '.join(RESERVED)})")
    meta = {
        "format": FORMAT,
        "seq_len": str(seq_len),
        "num_layers": str(len(tensors)),
        "dtype": str(tensors[0].dtype).removeprefix("torch."),
        "layer_specs": json.dumps([[int(t.shape[1]), int(t.shape[3])] for t in tensors]),
        **metadata,
    }
    named = [(f"layer.{i}", t) for i, t in enumerate(tensors)]
    meta["checksum"] = _digest(meta, named)
    return save(dict(named), metadata=meta)


def _header(data: bytes, where: str) -> dict:
    if len(data) < 8:
        raise ValueError(f"path: {where} is truncated ({len(data)} bytes, no safetensors header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"path: {where} is truncated (header of {n} bytes, {len(data) - 8} left in the file)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"path: {where} has a damaged header ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"path: {where} has a damaged header (not a JSON object)")
    return header


def _int_field(meta: Mapping[str, str], key: str, where: str, lo: int) -> int:
    raw = meta[key]
    if not raw.isdigit() or int(raw) < lo:
        raise ValueError(f"path: {where} metadata {key}: expected an int >= {lo}, got {raw!r}")
    return int(raw)


def decode(data: bytes, where: str, *, verify: bool) -> list[torch.Tensor]:
    """The layers of a snapshot file's bytes, every field checked (module doc). ``where``: the path, for
    messages."""
    from safetensors.torch import load

    where = repr(where)
    meta = _header(data, where).get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError(f"path: {where} has damaged metadata (expected str keys and values)")
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"path: {where} is not a kvcache snapshot (format {meta.get('format')!r}, expected {FORMAT!r})"
        )
    required = RESERVED if verify else ("format", "seq_len", "num_layers")
    for key in required:
        if key not in meta:
            hint = " (load_file(..., verify=False) reads a file without a checksum)" if key == "checksum" else ""
            raise ValueError(f"path: {where} metadata: key {key!r} is missing{hint}")
    try:
        tensors = load(data)
    except Exception as e:  # safetensors raises its own SafetensorError (and others) for damaged files
        raise ValueError(f"path: {where} is damaged or truncated ({type(e).__name__}: {e})") from e
    seq_len = _int_field(meta, "seq_len", where, 0)
    n = _int_field(meta, "num_layers", where, 1)
    names = [f"layer.{i}" for i in range(n)]
    missing = [k for k in names if k not in tensors]
    extra = sorted(set(tensors) - set(names))
    if missing:
        raise ValueError(f"path: {where} lacks tensors {missing} (metadata num_layers={n})")
    if extra:
        raise ValueError(f"path: {where} holds unexpected tensors {extra} (metadata num_layers={n})")
    layers = [tensors[k] for k in names]
    first = layers[0]
    for name, t in zip(names, layers):
        if t.dim() != 4 or t.shape[0] != 2 or t.shape[2] != seq_len:
            raise ValueError(
                f"path: {where} tensor {name}: expected shape [2, H, {seq_len}, D] (metadata seq_len), got "
                f"{list(t.shape)}"
            )
        if t.dtype not in KV_DTYPES or t.dtype != first.dtype:
            raise ValueError(f"path: {where} tensor {name}: expected dtype {first.dtype} in {list(_DTYPE_NAMES)}, "
                             f"got {t.dtype}")
    dtype_name = str(first.dtype).removeprefix("torch.")
    if "dtype" in meta and meta["dtype"] != dtype_name:
        raise ValueError(f"path: {where} metadata dtype: expected {dtype_name!r} (the tensors'), got {meta['dtype']!r}")
    specs = [[int(t.shape[1]), int(t.shape[3])] for t in layers]
    if "layer_specs" in meta:
        try:
            stored = json.loads(meta["layer_specs"])
        except ValueError:
            stored = meta["layer_specs"]
        if stored != specs:
            raise ValueError(
                f"path: {where} metadata layer_specs: expected {specs} (the tensors'), got {meta['layer_specs']!r}"
            )
    if verify:
        actual = _digest(meta, list(zip(names, layers)))
        if actual != meta["checksum"]:
            raise ValueError(
                f"path: {where} is damaged: checksum {meta['checksum']!r} in the file, {actual!r} computed"
            )
    return layers


# ------------------------------------------------------------------------------------------------ files


def _os_error(e: OSError, what: str, path: str) -> OSError:
    """kvcache's OSError for ``e`` (the subclass matching its errno), to be raised ``from e``."""
    err = OSError(e.errno, f"path: cannot {what} {path!r}: {e.strerror or e}")
    return err


def read_file(path: str | os.PathLike[str]) -> bytes:
    """All bytes of ``path`` (OSError chained on failure)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            return f.read()
    except OSError as e:
        raise _os_error(e, "read the snapshot file", p) from e


def _tmp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.{socket.gethostname()}."


def _remove_stale(directory: str, prefix: str) -> None:
    """Remove ``prefix{pid}.{random}.kvtmp`` files of processes that no longer run (this host's only)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(_TMP_SUFFIX)):
            continue
        pid_str = name[len(prefix) :].split(".", 1)[0]
        if not pid_str.isdigit() or int(pid_str) == os.getpid():
            continue
        try:
            os.kill(int(pid_str), 0)
            continue  # still running: its write may be in progress
        except ProcessLookupError:
            pass
        except OSError:
            continue  # exists, not ours to signal
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory (module doc)."""
    p = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(p))
    prefix = _tmp_prefix(p)
    _remove_stale(directory, prefix)
    tmp = os.path.join(directory, f"{prefix}{os.getpid()}.{os.urandom(6).hex()}{_TMP_SUFFIX}")
    created = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        created = True
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        created = False
    except OSError as e:
        raise _os_error(e, "write the snapshot file", p) from e
    finally:
        if created:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    try:  # make the rename durable; some file systems refuse to fsync a directory
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
