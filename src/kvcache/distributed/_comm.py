"""Process-group plumbing shared by the distributed helpers: rank / size of a group, where messages live, byte
views.

Messages travel on the device the group's backend reads: a CUDA device under NCCL (host data is staged onto the
current one), host memory under gloo (CUDA data is staged through the host, so gloo also works for CUDA caches,
slowly).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["group_rank_size", "comm_device", "check_peer", "as_bytes"]


def _check_group(group: object) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized (call torch.distributed.init_process_group "
                           "first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank in group, group size)``; ValueError if this process is not a member of ``group``."""
    _check_group(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    return rank, dist.get_world_size(group)


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Device of the message buffers for data that lives on ``device``: under NCCL a CUDA device (``device``
    itself, or the current CUDA device for host data, staged onto it); under gloo the host."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and ("gloo" not in backend or device.type == "cuda"):
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_peer(name: str, peer: object, group: dist.ProcessGroup | None) -> int:
    """A global rank of ``group`` other than this process's (``dst`` / ``src`` of point-to-point messages)."""
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise TypeError(f"{name}: expected an int (a global rank), got {type(peer).__name__}")
    _check_group(group)
    me = dist.get_rank()
    if peer == me:
        raise ValueError(f"{name}: expected another rank than this process's own ({me}), got {peer}")
    if group is None:
        world = dist.get_world_size()
        if not 0 <= peer < world:
            raise ValueError(f"{name}: expected a rank in [0, {world}), got {peer}")
    elif peer not in dist.get_process_group_ranks(group):
        raise ValueError(f"{name}: expected a global rank in the group {dist.get_process_group_ranks(group)}, "
                         f"got {peer}")
    return peer


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (collectives then move bits, never values:
    no backend support for a dtype is needed, and NaN payloads and fp8 codes are kept)."""
    return t.reshape(-1).view(torch.uint8)
