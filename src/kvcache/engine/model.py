"""The engine's Llama-family forward over a Hugging Face model's weights, with attention on kvcache.

The decoder's norms, projections and MLPs are the Hugging Face model's own modules (so their numerics are
the model's); what changes is attention: the new keys and values go to a kvcache cache through its write
(for the paged cache: ``PagedKVCache.append(layer, k, v, plan)`` with the cache's fused RoPE, so keys are rotated
by the append, never by the model), queries are rotated with transformers' cos / sin tables of the same
:class:`kvcache.RopeConfig` (here, or on the fused path inside the attention kernel: the step plan's ``q_rope``,
read by ``PagedKVCache.attention(layer, q, plan)``), and attention reads the cache. The attention itself is a
callable the runner passes in (paged or linear), built once per step.

Supported: the families of :data:`kvcache.support.ENGINE_FAMILIES` (Llama, SmolLM2, Mistral and Qwen2, with a
sliding window: the runners give each layer its window; Qwen3 with its q / k norms; StableLM with its partial
rotary and LayerNorm; Phi-3 with its qkv projection; Gemma 2 with its query scale, soft-caps and norms around the
MLP; Gemma 3 text as Gemma 2 plus q / k norms and a rope per layer type (:attr:`LlamaForward.ropes`); gpt-oss with
its sinks (:meth:`LlamaForward.layer_sinks`, added to the softmax by the attention kernels) and its
mixture-of-experts MLP run as its own module), rotate-half RoPE as transformers computes it; any other model
property is refused by name (:mod:`kvcache.support`).

Where kvcache's kernels run (CUDA, or the CPU under ``KVCACHE_TRITON_INTERPRET=1``) the decoder runs *fused*:
q / k / v are one GEMM and gate / up another (the modules' weights become views of the concatenated matrices,
so memory is unchanged; update weights in place afterwards, a replaced parameter is refused at the next step),
the residual add and RMSNorm are one kernel, SiLU-and-multiply one, the query rotation one
(:mod:`kvcache.engine.kernels`) unless the attention rotates the queries itself (the paged engine's does). Models whose
layers are not plain (quantized linear subclasses, Gemma norms, other activations) keep the module path. Elsewhere
(the CPU's torch backend) the modules themselves run, so the engine's tokens are transformers' own numerics there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._backend import use_triton
from ..rope import RopeConfig
from ..support import _family, _num, _rope_layer_types, check_supported, unsupported_features
from . import kernels as fused

__all__ = ["LlamaForward", "AttentionFn"]

# attention(layer, q [N, Hq, D] rotated, k [N, H, D] un-rotated, v [N, H, D]) -> out [N, Hq, D]. A callable with
# ``rotates_queries = True`` takes q un-rotated on the fused path (it rotates the queries itself, at their positions,
# with the model's cos / sin tables: the q_rope of the paged cache's StepPlan)
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LlamaForward:
    """A Llama-family decoder run token-ragged: ``[N]`` input ids of many sequences in one flat batch.

    Parameters
    ----------
    hf_model : transformers.PreTrainedModel
        A causal LM (``model.model.layers``, ``model.model.embed_tokens``, ``model.model.norm``, ``lm_head``).

    Raises
    ------
    ValueError
        The model has a property the engine does not implement (:func:`kvcache.support.check_supported` with
        ``"engine-module"``: another layer layout or rotary embedding, sinks of an unverified attention, ALiBi,
        an unverified architecture); the message names it.

    Attributes
    ----------
    ropes : list of RopeConfig
        One per rotary embedding, full-attention layers' first; ``rope`` (the paged cache's own) is ``ropes[0]``.
    rope_of : list of int
        Layer ``i`` rotates with ``ropes[rope_of[i]]`` (Gemma 3: its sliding layers with the local base).
    softcaps : list of float or None
        Each layer's attention logit soft-cap.

    Example
    -------
    >>> fwd = LlamaForward(hf_model)                          # doctest: +SKIP
    >>> fwd.num_layers, fwd.num_kv_heads, fwd.head_dim        # doctest: +SKIP
    (30, 3, 64)
    """

    def __init__(self, hf_model: Any) -> None:
        if not isinstance(hf_model, torch.nn.Module) or getattr(hf_model, "config", None) is None:
            raise ValueError(f"hf_model: expected a transformers causal LM with .model.layers and .lm_head, got "
                             f"{type(hf_model).__name__}")
        # every property the engine does not implement (another layer layout or rotary embedding, sinks, an
        # unverified architecture, ...) is refused here, by name, before any work
        check_supported(hf_model, "engine-module")
        config = hf_model.config
        base = getattr(hf_model, "model", None)
        layers = getattr(base, "layers", None)
        if config is None or base is None or layers is None or not hasattr(hf_model, "lm_head"):
            raise ValueError(f"hf_model: expected a transformers causal LM with .model.layers and .lm_head, got "
                             f"{type(hf_model).__name__}")
        self.hf_model = hf_model
        self.config = config
        self.embed = base.embed_tokens
        self.layers = list(layers)
        self.norm = base.norm
        self.lm_head = hf_model.lm_head
        self.num_layers = len(self.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        # the query scale each attention applies (transformers' ``scaling``: Gemma 2's query_pre_attn_scalar^-0.5),
        # attention logit soft-capping per layer, and the final logits' soft-cap (Gemma 2)
        scales = {_num(getattr(layer.self_attn, "scaling", None)) or self.head_dim ** -0.5
                  for layer in self.layers}
        if len(scales) > 1:
            raise ValueError(f"hf_model: expected one query scale for every layer, got {sorted(scales)}")
        self.scale = scales.pop()
        self.softcaps = [_num(getattr(layer.self_attn, "attn_logit_softcapping", None))
                         for layer in self.layers]
        self.final_softcap = _num(getattr(config, "final_logit_softcapping", None))
        self.vocab_size = config.vocab_size
        # one RopeConfig per rotary embedding (Gemma 3: the global layers' and the sliding layers'), full-attention
        # layers' first: ``rope`` (the paged cache's own) is ``ropes[0]``, layer i uses ``ropes[rope_of[i]]``
        types = _rope_layer_types(config)
        first = sorted(range(self.num_layers), key=lambda i: types[i] not in (None, "full_attention"))
        self.ropes = list(dict.fromkeys(RopeConfig.from_hf(config, layer_type=types[i]) for i in first))
        self.rope_of = [self.ropes.index(RopeConfig.from_hf(config, layer_type=t)) for t in types]
        self.rope = self.ropes[0]
        # each attention's sinks (gpt-oss): one logit per query head joining its softmax, else None
        self.sinks = [getattr(layer.self_attn, "sinks", None) for layer in self.layers]
        # gpt-oss's MLP takes [B, S, hidden] and returns (hidden, router scores)
        self._mlp_pair = [_family(type(layer)) == "gpt_oss" for layer in self.layers]
        p = next(hf_model.parameters())
        self.dtype = p.dtype
        self.device = p.device
        # why a decode step cannot be captured in a CUDA graph on this model, or None: transformers' gpt-oss
        # mixture-of-experts module in float32 copies host tensors to the GPU inside its forward (H200, torch 2.11:
        # the capture raises; bf16 captures and gives eager's tokens)
        self.graph_blocker = ("gpt-oss's mixture-of-experts MLP in float32 (transformers' module copies host tensors "
                              "to the GPU, which a CUDA graph cannot capture)"
                              if any(self._mlp_pair) and self.dtype == torch.float32 else None)
        self._cos = self._sin = None
        self._tables: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.ropes)
        self._fused: list[dict[str, Any]] | None = None
        self._mods: list[tuple[str, Any, str, Any]] = []
        self._views: list[tuple[str, Any, str, Any, int]] = []
        if use_triton(self.device) and type(self).forward is LlamaForward.forward:
            self._fused = self._fuse()
        if self._fused is not None:
            self._watch()

    def _watch(self) -> None:
        """Record what the fused forward reads, and what its CUDA graphs capture: (path, owner, name, module) for
        every module from the model down to the projections and norms, and (path, module, parameter name, the
        parameter, its address) for each of their own parameters (the fused matrices' rows among them)."""
        base = self.hf_model.model
        layers = base.layers
        entries = [("model.embed_tokens", base, "embed_tokens"), ("model.norm", base, "norm"),
                   ("lm_head", self.hf_model, "lm_head")]
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}"
            if isinstance(layers, torch.nn.ModuleList):
                entries.append((pre, layers, str(i)))
            entries += [(f"{pre}.{n}", layer, n) for n in ("input_layernorm", "post_attention_layernorm", "self_attn",
                                                            "mlp")]
            attn, mlp = layer.self_attn, layer.mlp
            entries += [(f"{pre}.self_attn.{n}", attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                                      "k_norm") if n in attn._modules]
            entries += [(f"{pre}.mlp.{n}", mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        for path, owner, name in entries:
            m = owner._modules[name]
            self._mods.append((path, owner, name, m))
            for pname, p in m._parameters.items():
                if p is not None:
                    self._views.append((path, m, pname, p, p.data_ptr()))

    def _fuse(self) -> list[dict[str, Any]] | None:
        """Concatenate each layer's q / k / v and gate / up weights (the modules keep views of them); None where
        a layer is not the plain Llama layout (then the modules run)."""
        if unsupported_features(self.hf_model, "engine-fused"):  # norm formulas, activation, MLP layout
            return None
        if len(self.ropes) > 1:  # the fused query rotation takes one rope
            return None
        norms = [self.norm] + [m for layer in self.layers for m in (layer.input_layernorm,
                                                                        layer.post_attention_layernorm)]
        if not all(_plain_rms_norm(m, self.dtype) for m in norms):
            return None
        for layer in self.layers:  # every layer qualifies before any weight is touched
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
            if not all(_plain_linear(m, self.dtype) for m in linears) or any(m.bias is not None for m in linears[4:]):
                return None
            if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
                return None
            if len({m.bias is None for m in linears[:3]}) != 1:
                return None
        out = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = [attn.q_proj, attn.k_proj, attn.v_proj]
            out.append({"qkv_w": _concat(projs), "qkv_b": _concat(projs, "bias") if projs[0].bias is not None else None,
                        "gu_w": _concat([mlp.gate_proj, mlp.up_proj])})
        return out

    @property
    def fused(self) -> bool:
        """The decoder runs fused (kvcache's kernels: CUDA, or the interpreter): it then passes un-rotated queries
        to an attention callable that declares ``rotates_queries``."""
        return self._fused is not None

    def check_weights(self) -> None:
        """Raise RuntimeError if a module or parameter the fused decoder reads (and its CUDA graphs captured) was
        replaced since the engine fused them; weights updated in place pass. A no-op where the modules run
        themselves (the CPU's torch backend, models that are not plain Llama layers).

        Example
        -------
        >>> fwd.check_weights()                                   # doctest: +SKIP
        """
        if self._fused is not None:
            self._check_fused()

    def _check_fused(self) -> None:
        """The model still holds the modules and parameters the engine fused and captured (a module or parameter
        replaced rather than written in place would leave the fused matrices, and any captured CUDA graph, on the
        old values): each keeps its object, and each parameter the address it had. Runs every eager step, so it
        reads the modules' dicts directly (no module attribute lookups, no views)."""
        replaced = [path for path, owner, name, m in self._mods if owner._modules.get(name) is not m]
        replaced += [f"{path}.{name}" for path, m, name, p, ptr in self._views
                     if m._parameters.get(name) is not p or p.data_ptr() != ptr]
        if replaced:
            raise RuntimeError(f"model: {replaced[0]} was replaced after the engine fused the weights; update weights "
                               "in place (copy_, load_state_dict without assign=True) or build a new engine")

    def rope_tables(self, max_len: int, kind: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[max_len, rotary_dim]`` of ``ropes[kind]`` in the model dtype (transformers casts them so),
        on the device; every kind's tables are grown to ``max_len`` together."""
        tables = self._tables[kind]
        if tables is None or tables[0].shape[0] < max_len:
            pos = torch.arange(max_len, device=self.device)
            for k, rope in enumerate(self.ropes):
                cos, sin = rope.cos_sin(pos)
                self._tables[k] = (cos.to(self.dtype), sin.to(self.dtype))
            self._cos, self._sin = self._tables[0]
        return self._tables[kind]  # type: ignore[return-value]

    def layer_sinks(self, layer: int) -> torch.Tensor | None:
        """float32 ``[num_heads]``: layer ``layer``'s attention sinks (the attention kernels' ``sinks``), read
        from the model each call (weights updated in place are seen), or None."""
        s = self.sinks[layer]
        return None if s is None else s.detach().float().contiguous()

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """transformers' ``apply_rotary_pos_emb`` for ``x`` ``[N, heads, D]`` with ``cos`` / ``sin`` ``[N, rd]``."""
        rd = cos.shape[-1]
        c, s = cos[:, None, :], sin[:, None, :]
        xr = x[..., :rd]
        half = rd // 2
        rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        out = xr * c + rot * s
        return out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Hidden states after the final norm.

        Parameters
        ----------
        input_ids : torch.Tensor
            int64 ``[N]`` on the model's device: the step's tokens, sequence after sequence.
        positions : torch.Tensor
            int64 ``[N]``: each token's position in its sequence.
        attention : AttentionFn
            Writes the layer's new K / V into the cache and attends: ``(layer, q, k, v) -> out``.

        Returns
        -------
        torch.Tensor
            ``[N, hidden]`` in the model dtype.
        """
        n = input_ids.shape[0]
        h = self.embed(input_ids)
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self._fused is not None:
            self._check_fused()
            return self._forward_fused(h, positions, attention)
        # each rope's cos / sin at the step's positions (Gemma 3: the global and the local one)
        rows = [(t[0][positions], t[1][positions]) for t in self._tables if t is not None]
        # the model's own layer list, read each step: the module path runs whatever modules the model holds now
        for i, layer in enumerate(self.hf_model.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            if "qkv_proj" in attn._modules:  # Phi-3: one projection, query heads then key heads then value heads
                q, k, v = attn.qkv_proj(x).split([H * D, Hk * D, Hk * D], dim=-1)
                q, k, v = q.reshape(n, H, D), k.reshape(n, Hk, D), v.reshape(n, Hk, D)
            else:
                q = attn.q_proj(x).view(n, H, D)
                k = attn.k_proj(x).view(n, Hk, D)
                v = attn.v_proj(x).view(n, Hk, D)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = self.rotate(q, *rows[self.rope_of[i]])
            o = attention(i, q, k, v)
            a = attn.o_proj(o.reshape(n, H * D))
            if "pre_feedforward_layernorm" in layer._modules:  # Gemma 2 / 3: norms after attention, around the MLP
                h = h + layer.post_attention_layernorm(a)
                h = h + layer.post_feedforward_layernorm(self._mlp(i, layer, layer.pre_feedforward_layernorm(h)))
            else:
                h = h + a
                h = h + self._mlp(i, layer, layer.post_attention_layernorm(h))
        return self.norm(h)

    def _mlp(self, i: int, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MLP module on ``x`` ``[N, hidden]`` (gpt-oss's: on ``[1, N, hidden]``, its router scores
        dropped, as its decoder layer does)."""
        if self._mlp_pair[i]:
            return layer.mlp(x[None])[0][0]
        return layer.mlp(x)

    def _forward_fused(self, h: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        n = h.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        layers = self.layers
        rotates = getattr(attention, "rotates_queries", False)
        x, h = fused.rms_norm(h, layers[0].input_layernorm.weight, layers[0].input_layernorm.variance_epsilon)
        for i, (layer, f) in enumerate(zip(layers, self._fused)):
            attn = layer.self_attn
            qkv = torch.nn.functional.linear(x, f["qkv_w"], f["qkv_b"])
            q = qkv[:, :H * D].view(n, H, D)
            k = qkv[:, H * D:(H + Hk) * D].view(n, Hk, D)
            v = qkv[:, (H + Hk) * D:].view(n, Hk, D)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            if not rotates:
                q = fused.rope_rotate(q, self._cos, self._sin, positions)
            o = attention(i, q, k, v)
            a = attn.o_proj(o.reshape(n, H * D))
            post = layer.post_attention_layernorm
            x, h = fused.rms_norm(a, post.weight, post.variance_epsilon, residual=h)
            m = layer.mlp.down_proj(fused.silu_mul(torch.nn.functional.linear(x, f["gu_w"])))
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x, h = fused.rms_norm(m, nxt.weight, nxt.variance_epsilon, residual=h)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head`` of ``hidden`` ``[M, hidden]`` -> ``[M, vocab]`` in the model dtype (transformers' values:
        its ``generate`` converts them to float32, which is exact, before picking: the same argmax without a
        float32 copy of every step's logits); soft-capped as the model caps them (Gemma 2)."""
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _plain_rms_norm(m: Any, dtype: torch.dtype) -> bool:
    """A transformers RMSNorm computing ``weight * normalized`` (Llama / Qwen / Mistral; not Gemma's ``1 + w``)."""
    name = type(m).__name__
    w = getattr(m, "weight", None)
    return (name.endswith("RMSNorm") and not name.startswith("Gemma") and hasattr(m, "variance_epsilon")
            and type(w) in (torch.Tensor, torch.nn.Parameter) and w.ndim == 1 and w.dtype == dtype
            and w.is_contiguous())


def _plain_linear(m: Any, dtype: torch.dtype) -> bool:
    """Exactly ``torch.nn.Linear`` with plain weights of the model dtype (not a quantized subclass: bitsandbytes,
    FP8 or tensor-subclass weights keep the module path)."""
    return (type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter and m.weight.dtype == dtype
            and (m.bias is None or (type(m.bias) is torch.nn.Parameter and m.bias.dtype == dtype)))


def _concat(mods: list[torch.nn.Linear], name: str = "weight") -> torch.Tensor:
    """The modules' ``name`` parameters (``weight`` or ``bias``) concatenated along dim 0; each module's parameter
    becomes a view of its rows, so memory is unchanged."""
    big = torch.cat([getattr(m, name).detach() for m in mods])
    row = 0
    for m in mods:
        p = getattr(m, name)
        p.data = big[row:row + p.shape[0]]
        row += p.shape[0]
    return big
