"""KVSnapshot: the saved prefix (for example a system prompt) of one sequence, all layers."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from .._validate import KV_DTYPES, check_contiguous, check_int, check_ndim, check_tensor, fmt_shape

__all__ = ["KVSnapshot"]


class KVSnapshot:
    """The first ``seq_len`` tokens of one sequence: per layer ``i`` a tensor ``[2, H_i, seq_len, D_i]``.

    Snapshots made by the caches are *packed*: all layers are consecutive views of one flat buffer, layer
    after layer, which lets one kernel launch address every layer from one base pointer. Any list of
    contiguous tensors of one dtype and device is accepted too (restored through a per-call table).

    Parameters
    ----------
    layers : sequence of torch.Tensor
        Layer ``i``: shape ``[2, H_i, seq_len, D_i]``, dtype float16 / bfloat16 / float8_e4m3fn (one dtype),
        one device, contiguous.
    """

    __slots__ = ("_layers", "_seq_len", "_flat", "_specs")

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            raise TypeError(f"layers: expected a list of tensors [2, H_i, seq_len, D_i], got {type(layers).__name__}")
        if len(layers) == 0:
            raise ValueError("layers: expected at least one layer, got an empty list")
        out = []
        for i, t in enumerate(layers):
            name = f"layers[{i}]"
            check_tensor(name, t)
            check_ndim(name, t, 4, "[2, num_kv_heads, seq_len, head_dim]")
            if t.shape[0] != 2:
                raise ValueError(f"{name}: expected shape [2, H, seq_len, D], got {fmt_shape(t.shape)}")
            if t.dtype not in KV_DTYPES:
                raise ValueError(f"{name}: expected dtype in {[str(d) for d in KV_DTYPES]}, got {t.dtype}")
            check_contiguous(name, t)
            if i:
                if t.dtype != out[0].dtype:
                    raise ValueError(f"{name}: expected dtype {out[0].dtype} (the dtype of layers[0]), got {t.dtype}")
                if t.device != out[0].device:
                    raise ValueError(f"{name}: expected device {out[0].device} (of layers[0]), got {t.device}")
                if t.shape[2] != out[0].shape[2]:
                    raise ValueError(f"{name}: expected seq_len {out[0].shape[2]} (of layers[0]), got {t.shape[2]}")
            out.append(t)
        self._layers = tuple(out)
        self._seq_len = int(out[0].shape[2])
        self._specs = tuple((int(t.shape[1]), int(t.shape[3])) for t in out)
        self._flat = self._packed_base(self._layers)

    @staticmethod
    def _packed_base(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The flat buffer behind the layers if they lie back to back in order, else None."""
        first = layers[0]
        elt = first.element_size()
        pos = first.data_ptr()
        for t in layers:
            if t.data_ptr() != pos:
                return None
            pos += t.numel() * elt
        total = (pos - first.data_ptr()) // elt
        storage_off = first.storage_offset()
        if (storage_off + total) * elt > first.untyped_storage().nbytes():
            return None
        return first.new_empty(0).set_(first.untyped_storage(), storage_off, (total,), (1,))

    @classmethod
    def empty(
        cls,
        layer_specs: Sequence[tuple[int, int]],
        seq_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> KVSnapshot:
        """A packed, uninitialised snapshot for layers of ``(num_kv_heads, head_dim)`` given by ``layer_specs``."""
        check_int("seq_len", seq_len, 0)
        sizes = [2 * h * seq_len * d for h, d in layer_specs]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device, pin_memory=pin_memory)
        layers, off = [], 0
        for (h, d), n in zip(layer_specs, sizes):
            layers.append(flat[off : off + n].view(2, h, seq_len, d))
            off += n
        snap = cls(layers)
        snap._flat = flat
        return snap

    # ---------------------------------------------------------------------------------------------- info

    @property
    def layers(self) -> tuple[torch.Tensor, ...]:
        """Per-layer tensors ``[2, H_i, seq_len, D_i]`` (K = ``[0]``, V = ``[1]``)."""
        return self._layers

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def dtype(self) -> torch.dtype:
        return self._layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self._layers[0].device

    @property
    def layer_specs(self) -> tuple[tuple[int, int], ...]:
        """``(num_kv_heads, head_dim)`` of each layer."""
        return self._specs

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._layers)

    @property
    def flat(self) -> torch.Tensor | None:
        """The packed buffer holding every layer back to back, or None if the layers are separate tensors."""
        return self._flat

    def __repr__(self) -> str:
        return (
            f"KVSnapshot(num_layers={self.num_layers}, seq_len={self.seq_len}, dtype={self.dtype}, "
            f"device={self.device}, nbytes={self.nbytes})"
        )

    # ---------------------------------------------------------------------------------------------- moves

    def to(self, device: torch.device | str, *, non_blocking: bool = False, pin_memory: bool = False) -> KVSnapshot:
        """A packed copy on ``device`` (``pin_memory=True`` for a page-locked host copy)."""
        out = KVSnapshot.empty(self.layer_specs, self.seq_len, dtype=self.dtype, device=device,
                               pin_memory=pin_memory)
        if self._flat is not None:
            out._flat.copy_(self._flat, non_blocking=non_blocking)  # type: ignore[union-attr]
        else:
            for d, s in zip(out.layers, self._layers):
                d.copy_(s, non_blocking=non_blocking)
        return out

    def equal(self, other: KVSnapshot) -> bool:
        """Bit-exact equality of shapes, dtype and stored bytes."""
        if not isinstance(other, KVSnapshot) or other.layer_specs != self.layer_specs:
            return False
        if other.seq_len != self.seq_len or other.dtype != self.dtype:
            return False
        return all(
            torch.equal(a.view(torch.uint8), b.to(a.device).view(torch.uint8))
            for a, b in zip(self.layers, other.layers)
        )

    # ---------------------------------------------------------------------------------------------- files

    def save_file(self, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None) -> None:
        """Write the snapshot to a safetensors file, atomically (needs ``pip install kvcache[io]``).

        Tensors ``layer.{i}`` (``[2, H_i, seq_len, D_i]``) and metadata ``format``, ``seq_len``, ``num_layers``,
        ``dtype``, ``layer_specs`` and ``checksum`` (SHA-256 of the other metadata and every tensor's name, dtype,
        shape and bytes), plus yours. The file is written to a temporary file in the same directory, flushed,
        fsynced and renamed over ``path`` (``os.replace``): a reader sees the old file or the new one, never a
        part. The temporary file is removed on failure; one left by a killed process is removed by the next
        save to the same path.

        Parameters
        ----------
        path : str | os.PathLike
            The file to write (replaced if it exists). Its directory must exist.
        metadata : mapping of str to str, optional
            Your keys (not one of the reserved names above), stored and covered by the checksum.

        Raises
        ------
        TypeError, ValueError
            Bad metadata (nothing written).
        OSError
            The file system refused (missing directory, no permission, a directory at ``path``, disk full);
            the cause is chained, ``path`` is untouched and no temporary file is left.

        Examples
        --------
        >>> snap = KVSnapshot([torch.zeros(2, 1, 3, 8, dtype=torch.float16)])
        >>> snap.save_file(tmp_dir / "prompt.safetensors", metadata={"model": "tiny"})  # doctest: +SKIP
        >>> KVSnapshot.load_file(tmp_dir / "prompt.safetensors").equal(snap)            # doctest: +SKIP
        True
        """
        from ._snapfile import encode, write_atomic

        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata: expected a mapping of str to str, got {type(metadata).__name__}")
        tensors = [t.detach().to("cpu").contiguous() for t in self.layers]
        data = encode(tensors, self.seq_len, metadata or {})
        write_atomic(path, data)

    @classmethod
    def load_file(
        cls, path: str | os.PathLike[str], device: torch.device | str = "cpu", *, verify: bool = True
    ) -> KVSnapshot:
        """Read a snapshot written by :meth:`save_file`, packed, on ``device``.

        Every metadata field is checked against the tensors (format, ``seq_len``, ``num_layers``, ``dtype``,
        ``layer_specs``; exactly the tensors ``layer.0 .. layer.{n-1}``, each ``[2, H_i, seq_len, D_i]`` of one
        storage dtype), and with ``verify`` the checksum.

        Parameters
        ----------
        path : str | os.PathLike
            A file written by :meth:`save_file`.
        device : torch.device | str
            Where the snapshot goes.
        verify : bool
            Check the SHA-256 checksum of the metadata and tensor bytes (default). ``False`` skips it (and
            accepts files without one); the structure is checked either way.

        Raises
        ------
        ValueError
            The file is not a kvcache snapshot, is truncated or damaged, or its metadata disagrees with its
            tensors (the parser's error chained as the cause).
        OSError
            The file cannot be read (cause chained).

        Examples
        --------
        >>> snap = KVSnapshot.load_file("prompt.safetensors", device="cuda")  # doctest: +SKIP
        """
        from ._snapfile import decode, read_file

        if not isinstance(verify, bool):
            raise TypeError(f"verify: expected a bool, got {type(verify).__name__}")
        data = read_file(path)
        layers = decode(data, os.fspath(path), verify=verify)
        return cls(layers).to(device)
