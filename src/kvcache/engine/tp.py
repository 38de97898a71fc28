"""Tensor-parallel forward of the engine (Megatron-style) over a ``torch.distributed`` process group.

Each rank of the group holds:

* the column-parallel shards of ``q_proj`` (its query heads), ``k_proj`` / ``v_proj`` (its KV heads, from
  :func:`kvcache.distributed.kv_heads_for_rank`: contiguous runs, or one head replicated on several ranks when
  the model has fewer KV heads than ranks), ``gate_proj`` / ``up_proj`` (its slice of the intermediate size);
* the row-parallel shards of ``o_proj`` and ``down_proj`` (the matching input columns); their partial outputs
  are summed with ``torch.distributed.all_reduce`` and the bias, if any, is added once after the sum;
* everything else replicated: embeddings, norms, ``lm_head``.

Its paged cache holds only its KV heads (:func:`kvcache.distributed.shard_paged_config`); block ids mean the same
on every rank, so every rank runs the same scheduler on the same inputs and takes the same decisions. The
sampled rows' logits are broadcast from the group's first rank, so every rank samples the same token even if
the all-reduce were not bit-identical across ranks.

Every rank must call :meth:`TPLlamaForward.forward` and :meth:`TPLlamaForward.logits` in the same order (the
engine does: same prompts, same parameters, same steps).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.tensor import kv_heads_for_rank
from .model import AttentionFn, LlamaForward

__all__ = ["TPLlamaForward"]


@dataclasses.dataclass
class _LayerShard:
    q: torch.Tensor
    bq: torch.Tensor | None
    k: torch.Tensor
    bk: torch.Tensor | None
    v: torch.Tensor
    bv: torch.Tensor | None
    o: torch.Tensor
    bo: torch.Tensor | None
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    bdown: torch.Tensor | None


def _rows(lin: Any, sl: slice, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output rows ``sl`` (in units of ``width``) of a linear layer's weight and bias, as new tensors."""
    rows = slice(sl.start * width, sl.stop * width)
    b = lin.bias
    return lin.weight.detach()[rows].clone(), None if b is None else b.detach()[rows].clone()


class TPLlamaForward(LlamaForward):
    """:class:`~kvcache.engine.model.LlamaForward` with attention and MLP sharded over a process group.

    ``num_heads`` and ``num_kv_heads`` are this rank's (the cache's heads); ``tp_rank`` / ``tp_size`` its place in
    the group; ``shard`` the :class:`~kvcache.distributed.KVHeadShard` of its heads.

    Parameters
    ----------
    hf_model : transformers.PreTrainedModel
        The full model, identical on every rank (same weights); the shards are copied out of it.
    group : torch.distributed.ProcessGroup
        The tensor-parallel ranks (``torch.distributed.group.WORLD`` for all of them). NCCL for CUDA models,
        gloo for CPU ones.

    Raises
    ------
    ValueError
        The heads do not split over the group (query heads must be a multiple of the group size; KV heads a
        multiple or a divisor of it), the intermediate size does not divide by it, or the MLP is not
        ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.

    Example
    -------
    >>> fwd = TPLlamaForward(hf_model, torch.distributed.group.WORLD)   # doctest: +SKIP
    >>> fwd.num_heads, fwd.num_kv_heads                                 # doctest: +SKIP
    (2, 1)
    """

    def __init__(self, hf_model: Any, group: Any) -> None:
        super().__init__(hf_model)
        # the sharded forward below is the Llama layer: what the single-GPU engine runs beyond it is refused here
        for i, layer in enumerate(self.layers):
            if "pre_feedforward_layernorm" in layer._modules or "qkv_proj" in layer.self_attn._modules:
                raise ValueError(f"tp_group: tensor parallelism runs Llama-layout layers only (separate q / k / v "
                                 f"projections, one norm before attention and one before the MLP); layer {i} of "
                                 f"{type(hf_model).__name__} is not")
        if len(self.ropes) > 1 or any(s is not None for s in self.sinks):
            raise ValueError(f"tp_group: tensor parallelism runs one rope for every layer and no attention sinks; "
                             f"{type(hf_model).__name__} has {len(self.ropes)} ropes"
                             f"{' and sinks' if any(s is not None for s in self.sinks) else ''}")
        if self.final_softcap is not None:
            raise ValueError(f"tp_group: tensor parallelism does not soft-cap the final logits "
                             f"(final_logit_softcapping={self.final_softcap:g})")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("tp_group: torch.distributed is not initialized (call init_process_group first)")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"tp_group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
        self.group = group
        self.tp_size = dist.get_world_size(group)
        self.tp_rank = dist.get_rank(group)
        if self.tp_rank < 0:
            raise ValueError("tp_group: this rank is not a member of the group")
        self.src = dist.get_global_rank(group, 0)
        try:
            shard = kv_heads_for_rank(self.num_kv_heads, self.tp_rank, self.tp_size, num_q_heads=self.num_heads)
        except ValueError as e:
            raise ValueError(f"tp_group: {self.num_heads} query / {self.num_kv_heads} KV heads do not split over "
                             f"{self.tp_size} ranks ({e})") from None
        self.shard = shard
        inter = getattr(self.config, "intermediate_size", None)
        if not isinstance(inter, int) or inter % self.tp_size:
            raise ValueError(f"tp_group: intermediate_size {inter} is not a multiple of the group size {self.tp_size}")
        D = self.head_dim
        qs, ks = shard.q_slice, shard.kv_slice
        per = inter // self.tp_size
        ms = slice(self.tp_rank * per, (self.tp_rank + 1) * per)
        self.shards: list[_LayerShard] = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                raise ValueError(f"hf_model: layer {i}'s MLP is not gate / up / down with act_fn (tensor parallel "
                                 f"supports Llama-style MLPs only)")
            q, bq = _rows(attn.q_proj, qs, D)
            k, bk = _rows(attn.k_proj, ks, D)
            v, bv = _rows(attn.v_proj, ks, D)
            gate, bg = _rows(mlp.gate_proj, ms, 1)
            up, bu = _rows(mlp.up_proj, ms, 1)
            if bg is not None or bu is not None:
                raise ValueError(f"hf_model: layer {i}'s gate / up projections have biases (not supported with "
                                 f"tensor parallel)")
            o = attn.o_proj.weight.detach()[:, qs.start * D:qs.stop * D].clone()
            down = mlp.down_proj.weight.detach()[:, ms].clone()
            bo = None if attn.o_proj.bias is None else attn.o_proj.bias.detach().clone()
            bd = None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach().clone()
            self.shards.append(_LayerShard(q, bq, k, bk, v, bv, o, bo, gate, up, down, bd))
        self.num_heads = len(shard.q_heads or ())
        self.num_kv_heads = shard.num_kv_heads

    def _reduce(self, part: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dist.all_reduce(part, group=self.group)
        return part if bias is None else part + bias

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Hidden states after the final norm, ``[N, hidden]``, equal on every rank (see
        :meth:`LlamaForward.forward`; ``attention`` gets this rank's query and KV heads)."""
        n = input_ids.shape[0]
        cos, sin = self._cos[positions], self._sin[positions]
        h = self.embed(input_ids)
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            attn, w = layer.self_attn, self.shards[i]
            x = layer.input_layernorm(h)
            q = F.linear(x, w.q, w.bq).view(n, H, D)
            k = F.linear(x, w.k, w.bk).view(n, Hk, D)
            v = F.linear(x, w.v, w.bv).view(n, Hk, D)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = self.rotate(q, cos, sin)
            o = attention(i, q, k, v)
            h = h + self._reduce(F.linear(o.reshape(n, H * D), w.o), w.bo)
            x = layer.post_attention_layernorm(h)
            act = layer.mlp.act_fn(F.linear(x, w.gate)) * F.linear(x, w.up)
            h = h + self._reduce(F.linear(act, w.down), w.bdown)
        return self.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head`` of ``hidden`` ``[M, hidden]`` -> float32 ``[M, vocab]``, the group's first rank's on every
        rank (broadcast), so every rank samples the same tokens."""
        out = self.lm_head(hidden).float().contiguous()
        dist.broadcast(out, src=self.src, group=self.group)
        return out
