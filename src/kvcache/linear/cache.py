"""LinearKVCache: one static buffer ``[L, B, 2, H, S, D]`` with a slot per sequence (TensorRT Edge-LLM)."""

from __future__ import annotations

import torch

from .._validate import bits, check_dtype, check_ndim, check_tensor, fmt_shape
from ._slots import SlotCache
from .config import CacheConfig

__all__ = ["LinearKVCache"]


def append_slots(cache: SlotCache, layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k`` / ``v`` ``[active_batch_size, H, T, D]`` into ``layer`` ``[B, 2, H, S, D]`` at each active
    sequence's current length; lengths are not changed. Every check runs before the first byte is written."""
    n = cache.active_batch_size
    shape = (n, layer.shape[2], None, layer.shape[4])
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t)
        check_ndim(name, t, 4, "[active_batch_size, num_kv_heads, num_tokens, head_dim]")
        if any(want is not None and got != want for got, want in zip(t.shape, shape)):
            want = fmt_shape([x if x is not None else t.shape[2] for x in shape])
            raise ValueError(f"{name}: expected shape {want} (active_batch_size, H, T, D), got {fmt_shape(t.shape)}")
        check_dtype(name, t, layer.dtype)
        if t.device != layer.device:
            raise ValueError(f"{name}: expected device {layer.device} (the cache's), got {t.device}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {fmt_shape(k.shape)} (as k), got {fmt_shape(v.shape)}")
    T = k.shape[2]
    if n == 0 or T == 0:
        return
    held = cache.host_lengths()  # no sync while the host mirror is exact (after resets and host commits)
    S = layer.shape[3]
    for b, length in enumerate(held):
        if length + T > S:
            raise ValueError(
                f"k: sequence {b} holds {length} tokens, {T} more would pass max_seq_len={S}; nothing was written"
            )
    # write through the same-width integer view: fp8 has no index_put on every backend, and bits move unchanged
    dst = bits(layer)
    if min(held) == max(held):
        start = held[0]
        dst[:n, 0, :, start : start + T].copy_(bits(k))
        dst[:n, 1, :, start : start + T].copy_(bits(v))
        return
    pos = torch.tensor(held, dtype=torch.long, device=layer.device)[:, None] + torch.arange(T, device=layer.device)
    rows = torch.arange(n, device=layer.device)[:, None]
    dst[rows, 0, :, pos] = bits(k).transpose(1, 2)  # advanced indices first: [n, T, H, D]
    dst[rows, 1, :, pos] = bits(v).transpose(1, 2)


class LinearKVCache(SlotCache):
    """Static KV cache for every decoder layer, allocated once for ``max_batch_size`` sequences.

    Layout: ``buffer`` is ``[num_layers, max_batch_size, 2, num_kv_heads, max_seq_len, head_dim]``
    (``[:, :, 0]`` keys, ``[:, :, 1]`` values), zero-initialised on ``config.device``. Sequences occupy slots
    ``0 .. active_batch_size - 1``; ``lengths[b]`` tokens of slot ``b`` are valid, the rest is stale and never
    read.

    Parameters
    ----------
    config : CacheConfig

    Examples
    --------
    >>> cache = LinearKVCache(CacheConfig(num_layers=2, max_batch_size=4, max_seq_len=128,
    ...                                   num_kv_heads=2, head_dim=64, device="cpu"))
    >>> cache.reset_for_new_sequences([0, 0])
    >>> cache.commit(torch.tensor([5, 7], dtype=torch.int32))   # after prefill writes 5 and 7 tokens
    >>> cache.commit(1)                                          # after a decode step
    >>> cache.lengths.tolist()
    [6, 8]
    """

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig, got {type(config).__name__}")
        self._config = config
        self._init_state([(config.num_kv_heads, config.head_dim)] * config.num_layers, config.max_batch_size,
                         config.max_seq_len, config.dtype, config.device)  # type: ignore[arg-type]

    @property
    def config(self) -> CacheConfig:
        return self._config

    @property
    def num_layers(self) -> int:
        return self._config.num_layers

    @property
    def buffer(self) -> torch.Tensor:
        """The whole cache: ``[L, B, 2, H, S, D]``."""
        return self._store.buffer  # type: ignore[return-value]

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``: a view ``[B, 2, H, S, D]`` of :attr:`buffer`."""
        return self._store.layers[self._check_layer_index(i)]

    def kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer ``i``: two views ``[B, H, S, D]`` of the same memory."""
        layer = self.layer(i)
        return layer[:, 0], layer[:, 1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys and values of layer ``layer`` at each active sequence's current length.

        Lengths are not changed: after the last layer of a step, :meth:`commit` the number of tokens written.
        Reads the lengths on the host (a device sync only when the host does not know them, e.g. after a
        ``commit`` of a device tensor on a GPU).

        Parameters
        ----------
        layer : int
            ``0 <= layer < num_layers``.
        k, v : torch.Tensor
            shape ``[active_batch_size, num_kv_heads, T, head_dim]`` (the Hugging Face layout; any strides),
            dtype ``config.dtype``, on the cache's device. Token ``t`` of sequence ``b`` goes to position
            ``lengths[b] + t``.

        Raises
        ------
        ValueError
            Wrong shape, dtype or device, or a sequence would pass ``max_seq_len`` (nothing written).

        Examples
        --------
        >>> cache = LinearKVCache(CacheConfig(num_layers=1, max_batch_size=2, max_seq_len=16,
        ...                                   num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu"))
        >>> cache.reset_for_new_sequences([0, 3])
        >>> k = torch.randn(2, 2, 4, 8)
        >>> cache.append(0, k, k)
        >>> cache.commit(4)
        >>> torch.equal(cache.kv(0)[0][1, :, 3:7], k[1])
        True
        """
        append_slots(self, self.layer(layer), k, v)

    def __repr__(self) -> str:
        c = self._config
        return (
            f"LinearKVCache(layers={c.num_layers}, max_batch={c.max_batch_size}, max_seq={c.max_seq_len}, "
            f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, dtype={c.dtype}, device={c.device}, "
            f"active={self.active_batch_size})"
        )
