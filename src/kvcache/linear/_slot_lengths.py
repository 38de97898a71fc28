"""The lengths state of :class:`kvcache.linear._slots.SlotCache`, in its base class ``SlotLengths``: the per-sequence
lengths on the device, their host mirror, the active batch size, ``reset_for_new_sequences`` and ``commit``.

The mirror is trusted only while the lengths tensor's version counter (``_version``, shared by every view of
it) is the one recorded when the mirror was last set. Torch's in-place ops bump it (``cache.lengths[1] = 12``,
``cache.lengths.add_(1)``), and so does every kvcache op that writes a tensor through a kernel
(``ops.increment_lengths(cache.lengths, -5)``); a changed counter drops the mirror and the next path that
needs the values reads the device. Writes torch cannot see (a CUDA-graph replay, a foreign kernel) must be
followed by :meth:`SlotCache.invalidate_host_lengths`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._device import check_memory
from .._validate import check_dtype, check_int, check_ndim, fmt_shape
from ..ops.lengths import launch_increment
from ._store import LayerStore


class SlotLengths:
    """Per-sequence lengths, their host mirror and the active batch size: the base of
    :class:`~kvcache.linear._slots.SlotCache` (which adds attention, eviction and snapshots)."""

    _store: LayerStore

    def _init_state(
        self, specs: Sequence[tuple[int, int]], max_batch: int, max_seq: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Allocate the layers ``(num_kv_heads, head_dim)`` of ``specs`` and the per-sequence state."""
        elt = torch.empty((), dtype=dtype).element_size()
        check_memory(sum(2 * h * d for h, d in specs) * max_batch * max_seq * elt, device, "config")
        store = LayerStore(specs, max_batch, max_seq, dtype, device)
        self._store = store
        dev = store.device
        B = store.max_batch
        # A normal tensor even under torch.inference_mode(): inference tensors have no version counter.
        with torch.inference_mode(False):
            self._lengths = torch.zeros(B, dtype=torch.int32, device=dev)
        self._mapping = torch.full((B,), -1, dtype=torch.int32, device=dev)
        self._overflow = torch.zeros(1, dtype=torch.int32, device=dev)
        self._all_empty: bool | None = True  # None: unknown (read from the device when asked)
        self._set_active(0)
        self._set_mirror([])

    # Host mirror of lengths[:active]: base values + a pending integer offset (so a decode-step commit is
    # O(1) on the host), with the min and max of the real values. None when only the device knows them.
    # Valid while self._lengths._version == self._known_ver (module doc).

    def _set_mirror(self, values: list[int] | None) -> None:
        self._mirror = values
        self._mirror_off = 0
        if values:
            self._mirror_min, self._mirror_max = min(values), max(values)
        else:
            self._mirror_min = self._mirror_max = 0
        self._known_ver = self._lengths._version
        self._outside_write = False

    def _refresh(self) -> None:
        """Drop the mirror and the all-empty flag if anyone wrote the lengths since they were recorded."""
        ver = self._lengths._version
        if ver != self._known_ver:
            self._mirror = None
            self._mirror_off = 0
            self._all_empty = None
            self._known_ver = ver
            self._outside_write = True  # commit reads the device before its bound check

    def invalidate_host_lengths(self) -> None:
        """Forget the host copy of the lengths; the next call that needs them reads the device (one sync).

        Writes through torch (``cache.lengths[b] = n``, ``cache.lengths.add_(1)``) and through kvcache's ops
        are noticed without this call (they bump the tensor's version counter). Call it after writes torch
        cannot see: a CUDA-graph replay that changes ``lengths``, or a kernel of your own.

        Examples
        --------
        >>> graph.replay()                     # doctest: +SKIP
        >>> cache.invalidate_host_lengths()    # doctest: +SKIP
        """
        self._mirror = None
        self._mirror_off = 0
        self._all_empty = None
        self._known_ver = self._lengths._version
        self._outside_write = True

    def _mirror_values(self) -> list[int] | None:
        if self._mirror is not None and self._mirror_off:
            off = self._mirror_off
            self._mirror = [v + off for v in self._mirror]
            self._mirror_off = 0
        return self._mirror

    def _set_active(self, n: int) -> None:
        self._active = n
        self._lengths_view = self._lengths[:n]

    # ------------------------------------------------------------------------------------------ state

    @property
    def max_batch_size(self) -> int:
        return self._store.max_batch

    @property
    def max_seq_len(self) -> int:
        return self._store.max_seq

    @property
    def dtype(self) -> torch.dtype:
        return self._store.dtype

    @property
    def device(self) -> torch.device:
        return self._store.device

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens held by each active sequence: int32 ``[active_batch_size]`` on the cache's device (a view of
        static storage: its address never changes, so it can be used inside CUDA graphs)."""
        return self._lengths_view

    @property
    def lengths_buffer(self) -> torch.Tensor:
        """The static int32 ``[max_batch_size]`` storage behind :attr:`lengths`."""
        return self._lengths

    @property
    def active_batch_size(self) -> int:
        return self._active

    @active_batch_size.setter
    def active_batch_size(self, value: int) -> None:
        check_int("active_batch_size", value, 0, self._store.max_batch)
        self._refresh()
        values = self._mirror_values()
        if values is not None:
            # lengths of newly active slots are on the device only
            self._set_mirror(values[:value] if value <= self._active else None)
        self._set_active(value)

    @property
    def all_empty(self) -> bool:
        """True while no active sequence holds a token (after a reset with all-zero reuse lengths, before a
        commit). Reads the device (one sync) after the lengths were written outside the cache's own calls."""
        self._refresh()
        if self._all_empty is None:
            self._all_empty = not any(self.host_lengths())
        return self._all_empty

    def host_lengths(self) -> list[int]:
        """Lengths of the active sequences on the host (syncs when the host mirror is not exact: after a
        commit of device counts, or after anyone else wrote :attr:`lengths`)."""
        self._refresh()
        values = self._mirror_values()
        if values is None:
            values = self._lengths_view.tolist()
            self._set_mirror(values)
        return list(values)

    # ------------------------------------------------------------------------------------------ lengths

    def reset_for_new_sequences(self, reuse_lengths: Sequence[int]) -> None:
        """Start a new batch of ``len(reuse_lengths)`` sequences; sequence ``b`` starts with
        ``reuse_lengths[b]`` tokens already in its slot (0, or a restored prefix: see :meth:`restore`).

        Parameters
        ----------
        reuse_lengths : sequence of int
            Host ints, ``0 <= reuse_lengths[b] <= max_seq_len``, at most ``max_batch_size`` of them.
        """
        if isinstance(reuse_lengths, torch.Tensor):
            if reuse_lengths.device.type != "cpu":
                raise ValueError(f"reuse_lengths: expected host ints, got a tensor on {reuse_lengths.device}")
            check_ndim("reuse_lengths", reuse_lengths, 1, "of host ints")
            reuse_lengths = [int(x) for x in reuse_lengths.tolist()]
        if isinstance(reuse_lengths, (str, bytes)) or not isinstance(reuse_lengths, Sequence):
            raise TypeError(f"reuse_lengths: expected a sequence of int, got {type(reuse_lengths).__name__}")
        n = len(reuse_lengths)
        if n > self._store.max_batch:
            raise ValueError(f"reuse_lengths: expected at most {self._store.max_batch} sequences, got {n}")
        values = [check_int(f"reuse_lengths[{b}]", v, 0, self._store.max_seq) for b, v in enumerate(reuse_lengths)]
        if n:
            self._lengths[:n].copy_(torch.tensor(values, dtype=torch.int32))
        self._set_active(n)
        self._set_mirror(values)
        self._all_empty = not any(values)

    def commit(self, new_lengths: torch.Tensor | int, *, check: bool = False) -> None:
        """Add tokens to the active sequences: an int to every one (decode), or per-sequence counts.

        Parameters
        ----------
        new_lengths : int | torch.Tensor
            int: added to every active length. Tensor: int32 ``[active_batch_size]`` counts, on the host or on
            the cache's device.
        check : bool
            When the bound cannot be checked on the host (after a commit of device counts, until something
            reads the lengths back), the kernel still refuses an update that would take any length past
            ``max_seq_len`` or below 0 (all or nothing) and raises a device flag; ``check=True`` syncs, reads
            the flag and raises ValueError. After a write to :attr:`lengths` that the cache did not make, the
            lengths are read back (one sync) and checked on the host.

        Raises
        ------
        ValueError
            A length would pass ``max_seq_len`` or go below 0 (nothing changed), when checkable on the host.

        Examples
        --------
        >>> cache.reset_for_new_sequences([3, 0])                        # doctest: +SKIP
        >>> cache.commit(torch.tensor([4, 9], dtype=torch.int32))        # doctest: +SKIP
        >>> cache.commit(1)                                              # doctest: +SKIP
        >>> cache.host_lengths()                                         # doctest: +SKIP
        [8, 10]
        """
        S = self._store.max_seq
        n = self._active
        self._refresh()
        if self._mirror is None and (self.device.type == "cpu" or (
                self._outside_write and not torch.cuda.is_current_stream_capturing())):
            # On the CPU reading the lengths costs no sync; after a write the cache did not make, one sync
            # buys the host bound check (a refused commit raises).
            self._set_mirror(self._lengths_view.tolist())
        if check and self._mirror is None:
            self._overflow.zero_()  # report only this commit's refusal
        if type(new_lengths) is int:
            inc = new_lengths
            if not -(2**31 - 1) <= inc <= 2**31 - 1:
                check_int("new_lengths", inc, -(2**31 - 1), 2**31 - 1)
            if self._mirror is not None:
                if n and not (self._mirror_min + inc >= 0 and self._mirror_max + inc <= S):
                    self._raise_host_bound([v + inc for v in self._mirror_values()])  # type: ignore[union-attr]
                self._mirror_off += inc
                self._mirror_min += inc
                self._mirror_max += inc
            if n:
                launch_increment(self._lengths_view, inc, S, self._overflow)
                self._known_ver = self._lengths._version
                if self._mirror is not None:
                    self._all_empty = self._mirror_min == 0 and self._mirror_max == 0
                elif inc > 0:
                    self._all_empty = False
                elif inc < 0:
                    self._all_empty = None
            if self._mirror is None and check:
                self._raise_on_overflow()
            return
        if not isinstance(new_lengths, torch.Tensor):
            check_int("new_lengths", new_lengths)  # raises TypeError
        check_ndim("new_lengths", new_lengths, 1, "of per-sequence counts [active_batch_size]")
        check_dtype("new_lengths", new_lengths, torch.int32)
        if new_lengths.shape[0] != n:
            raise ValueError(
                f"new_lengths: expected shape [{n}] (active_batch_size), got {fmt_shape(new_lengths.shape)}"
            )
        on_host = new_lengths.device.type == "cpu"
        if not on_host and new_lengths.device != self.device:
            raise ValueError(f"new_lengths: expected device {self._devices_allowed()}, got {new_lengths.device}")
        if on_host:
            counts = [int(x) for x in new_lengths.tolist()]
            values = self._mirror_values()
            if values is not None:
                new_values = [v + c for v, c in zip(values, counts)]
                if n and not (min(new_values) >= 0 and max(new_values) <= S):
                    self._raise_host_bound(new_values)
            if n:
                launch_increment(self._lengths_view, new_lengths.to(self.device).contiguous(), S, self._overflow)
            if values is not None:
                self._set_mirror(new_values)
                self._all_empty = not any(new_values)
            elif any(counts):
                self._all_empty = False
            self._known_ver = self._lengths._version
            if values is None and check:
                self._raise_on_overflow()
            return
        if n:
            launch_increment(self._lengths_view, new_lengths.contiguous(), S, self._overflow)
        self._set_mirror(None)
        self._all_empty = False
        if check:
            self._raise_on_overflow()

    def _devices_allowed(self) -> str:
        return "cpu" if self.device.type == "cpu" else f"{self.device} or cpu"

    def _raise_host_bound(self, new_values: list[int]) -> None:
        S = self._store.max_seq
        b = next(i for i, v in enumerate(new_values) if not 0 <= v <= S)
        raise ValueError(
            f"new_lengths: sequence {b} would hold {new_values[b]} tokens, expected 0..{S} (max_seq_len); "
            "nothing was changed"
        )

    def _raise_on_overflow(self) -> None:
        if int(self._overflow.item()):
            self._overflow.zero_()
            raise ValueError(
                f"new_lengths: a sequence would have passed max_seq_len={self._store.max_seq} (or gone below 0); "
                "the commit was refused on the device and nothing was changed"
            )
