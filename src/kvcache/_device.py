"""Devices and memory: resolve a device argument, and refuse an allocation larger than the device can hold."""

from __future__ import annotations

import os

import torch

__all__ = ["resolve_device", "check_memory", "available_memory"]


def resolve_device(device: object, name: str = "device") -> torch.device:
    """Normalise ``device`` (str, int or torch.device); ``cuda`` without an index becomes the current GPU.

    ``None`` means the current CUDA device when one is available, else the CPU.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"{name}: expected a device such as 'cuda', 'cuda:0' or 'cpu', got {device!r}") from e
    if not isinstance(device, torch.device):
        raise TypeError(f"{name}: expected a torch.device, str or int, got {type(device).__name__}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: expected an available device, got {device} but CUDA is not available")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"{name}: expected a CUDA index < {torch.cuda.device_count()}, got {index}")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"{name}: expected a 'cuda' or 'cpu' device, got {device}")
    return device


def available_memory(device: torch.device) -> tuple[int, int]:
    """``(available, total)`` bytes that a new allocation on ``device`` can use.

    CUDA: the driver's free memory plus what torch's caching allocator holds unused. CPU: ``MemAvailable`` of
    ``/proc/meminfo`` (Linux), else the physical memory.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + max(cached, 0), total
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, total
    except OSError:
        pass
    return total, total


def check_memory(nbytes: int, device: torch.device, name: str = "config") -> None:
    """Raise ValueError naming ``name`` when ``nbytes`` exceed the memory available on ``device``.

    Called by the caches before they allocate, so that a config far too large for the device fails with this
    message rather than torch's out-of-memory error (or, on the CPU, the kernel's OOM killer).

    Parameters
    ----------
    nbytes : int
        Bytes the cache is about to allocate.
    device : torch.device
        A resolved device (``resolve_device``).
    name : str
        The argument named in the error.

    Examples
    --------
    >>> check_memory(1 << 20, torch.device("cpu"))
    >>> check_memory(1 << 50, torch.device("cpu"))
    Traceback (most recent call last):
    ...
    ValueError: config: the cache needs 1048576.0 GiB, more than the ... available on cpu ...
    """
    available, total = available_memory(device)
    if nbytes > available:
        raise ValueError(
            f"{name}: the cache needs {nbytes / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB "
            f"available on {device} ({total / 2**30:.1f} GiB total); lower max_batch_size, max_seq_len, "
            "num_layers or num_blocks"
        )
