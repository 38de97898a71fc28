"""Which properties of a transformers model kvcache implements on each of its paths; the rest is refused by name.

A model property that a path does not implement (a window, soft-capping, another query scale, sinks, a different
norm, layer or attention) is refused with one ``ValueError`` naming the property and the path, never approximated:
a silently wrong token is the worst outcome an inference library can have. The model is *inspected*, not trusted
on one flag: its config (every way a config sets a window: ``sliding_window`` with or without
``use_sliding_window``, ``layer_types``, ``max_window_layers``), its modules (each decoder layer's and attention's
children, sinks parameters, each attention's ``scaling``, the q / k norms' width), the classes whose ``forward``
the engine re-implements (verified against transformers' tokens), and the rotary embedding itself (its cos / sin
compared with :class:`~kvcache.RopeConfig`'s).

Paths (:data:`PATHS`):

* ``"engine-module"`` / ``"engine-linear"``: :class:`kvcache.engine.LLM` (paged or linear cache). The engine runs
  the model's own norms, projections and MLPs, and its own attention (causal, each attention module's ``scaling``,
  rotate-half RoPE with each layer type's rope, each layer's sliding window as transformers applies it
  (:func:`layer_window`), its attention logit soft-cap and gpt-oss's sinks, on either cache); the layer, model and
  LM-head wiring is re-implemented, so only verified families pass (:data:`ENGINE_FAMILIES`).
* ``"engine-fused"``: the engine's fused decoder (CUDA or the Triton interpreter) additionally needs plain RMSNorm
  (``w * x / rms``), a gated SiLU MLP and plain ``nn.Linear`` projections; a model without them runs the module path
  (slower, the same tokens): these features are reasons, not refusals.
* ``"hf-paged"``: :class:`kvcache.hf.PagedCache` with ``attn_implementation="kvcache_paged"``: transformers runs the
  model; kvcache's kernel attends with transformers' ``scaling``, ``sliding_window``, ``softcap`` and sinks
  (``s_aux``).
* ``"hf-gathered"`` / ``"hf-linear"``: :class:`~kvcache.hf.PagedCache` with another attention, or
  :class:`~kvcache.hf.LinearCache`: the cache hands transformers' own attention every key; only the cache's layout
  (one ``[B, H, S, D]`` K and V per attention layer) is assumed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._validate import check_int

__all__ = ["PATHS", "ENGINE_FAMILIES", "Feature", "unsupported_features", "check_supported", "layer_window",
           "model_windows"]

PATHS: dict[str, str] = {
    "engine-fused": "the kvcache engine's fused decoder",
    "engine-module": "the kvcache engine",
    "engine-linear": "the kvcache engine (linear cache)",
    "hf-paged": "kvcache.hf's PagedCache with attn_implementation='kvcache_paged'",
    "hf-gathered": "kvcache.hf's PagedCache (gathered K / V)",
    "hf-linear": "kvcache.hf's LinearCache",
}
# transformers model families whose CausalLM, model, decoder-layer and attention forwards the engine re-implements
# (each checked equal to transformers' greedy tokens in tests/engine/test_support.py)
ENGINE_FAMILIES = ("gemma2", "gemma3", "gpt_oss", "llama", "mistral", "phi3", "qwen2", "qwen3", "stablelm")
_ENGINE = ("engine-fused", "engine-module", "engine-linear")
_HF = ("hf-paged", "hf-gathered", "hf-linear")
_ALL = _ENGINE + _HF
_LAYER_KINDS = ("full_attention", "sliding_attention")
_LAYER_CHILDREN = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_ATTN_CHILDREN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_FUSED_QKV = ("qkv_proj", "c_attn", "query_key_value", "Wqkv", "W_pack")
_GEMMA2_NORMS = ("post_feedforward_layernorm", "pre_feedforward_layernorm")
_GEMMA_FAMILIES = ("gemma2", "gemma3")  # decoder layers with norms after attention and around the MLP
_SINK_FAMILIES = ("gpt_oss",)  # attentions whose forward adds their sinks to the softmax (s_aux)


@dataclasses.dataclass(frozen=True)
class Feature:
    """A model property, the paths that do not implement it, and where it was found.

    Attributes
    ----------
    name : str
        What it is: ``"sliding-window attention"``, ``"attention logit soft-capping"``, ...
    where : str
        Where it was found: ``"MistralConfig.sliding_window=16"``, ``"model.layers.0.self_attn.sinks"``, ...
    paths : tuple of str
        The :data:`PATHS` that do not implement it.

    Example
    -------
    >>> str(Feature("attention sinks", "model.layers.0.self_attn.sinks", ("hf-paged",)))
    'attention sinks (model.layers.0.self_attn.sinks)'
    """

    name: str
    where: str
    paths: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.name} ({self.where})"


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def layer_window(config: Any, layer: int) -> int | None:
    """The sliding window of attention layer ``layer`` as transformers applies it (None: full attention).

    ``layer_types`` decides where the config has it (Gemma 2 / 3, Qwen2 / Qwen3, gpt-oss, ...); otherwise
    ``sliding_window`` applies to every layer unless ``use_sliding_window`` is False (Mistral, Phi-3, Starcoder2
    have no such flag), and only from ``max_window_layers`` on where the config has that (Qwen2 before
    ``layer_types``).

    Example
    -------
    >>> from transformers import MistralConfig
    >>> layer_window(MistralConfig(sliding_window=16), 0)
    16
    """
    cfg = _text_config(config)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return window if layer < len(types) and types[layer] == "sliding_attention" else None
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    start = getattr(cfg, "max_window_layers", None)
    if isinstance(start, int) and getattr(cfg, "use_sliding_window", None) is not None and layer < start:
        return None
    return int(window)


def _window_features(cfg: Any, cname: str) -> list[Feature]:
    # every path attends each layer with its own window (layer_window): the engine's caches through the kernels'
    # window option, kvcache.hf through the window transformers passes or its mask
    out = []
    types = getattr(cfg, "layer_types", None)
    other = sorted({t for t in types or () if t not in _LAYER_KINDS})
    if other:
        out.append(Feature("layers other than full or sliding-window attention", f"{cname}.layer_types has {other}",
                           _ALL))
    if getattr(cfg, "attention_chunk_size", None):
        out.append(Feature("chunked attention", f"{cname}.attention_chunk_size={cfg.attention_chunk_size}", _ALL))
    return out


def _config_features(config: Any) -> list[Feature]:
    """Every property the config alone shows (each with the paths that do not implement it)."""
    cfg = _text_config(config)
    cname = type(cfg).__name__
    out = _window_features(cfg, cname)

    def flag(attr: str, name: str, paths: tuple[str, ...], off: Any = None) -> None:
        value = getattr(cfg, attr, None)
        if value is not None and value is not False and value != off:
            out.append(Feature(name, f"{cname}.{attr}={value!r}", paths))

    # both engines cap each layer's attention logits (the kernels' softcap) and the final logits, and attend with
    # each attention module's own ``scaling`` (_attention_features checks it is there)
    head_dim = _head_dim(cfg)
    flag("alibi", "ALiBi position biases", _ENGINE + ("hf-paged",))
    if getattr(cfg, "position_embedding_type", None) == "alibi" or getattr(cfg, "model_type", None) == "bloom":
        out.append(Feature("ALiBi position biases", f"{cname}", _ENGINE + ("hf-paged",)))
    for attr in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "logit_scale", "scale_emb",
                 "scale_depth"):
        flag(attr, "a scaled embedding, residual or logits", _ENGINE, off=1.0)
    flag("use_parallel_residual", "parallel attention and MLP residual", _ENGINE)
    # Gemma 3's bidirectional option: every key (or the whole window) in both directions, not causal
    flag("use_bidirectional_attention", "bidirectional attention", _ENGINE + ("hf-paged",))
    flag("qk_layernorm", "q / k LayerNorm", _ENGINE)
    flag("clip_qkv", "clipped q / k / v", _ENGINE)
    nope = getattr(cfg, "no_rope_layers", None)
    if nope and not all(nope):
        out.append(Feature("layers without RoPE", f"{cname}.no_rope_layers", _ENGINE))
    v_dim = getattr(cfg, "v_head_dim", None)
    if getattr(cfg, "kv_lora_rank", None) or (v_dim is not None and v_dim != head_dim):
        out.append(Feature("latent attention (keys and values of other widths)", f"{cname}.kv_lora_rank", _ALL))
    flag("num_kv_shared_layers", "layers sharing another layer's K / V", _ALL, off=0)
    return out


def _head_dim(cfg: Any) -> int | None:
    heads, hidden = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
    return getattr(cfg, "head_dim", None) or (hidden // heads if heads and hidden else None)


def _forward_owner(obj: Any) -> type:
    return next(c for c in type(obj).__mro__ if "forward" in c.__dict__)


def _family(cls: type) -> str | None:
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def _structure_features(model: Any) -> list[Feature]:
    """The engine's layout: ``model.layers`` of verified decoder layers with separate q / k / v projections."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(model, "lm_head"):
        named = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
                 if n.rsplit(".", 1)[-1] in _FUSED_QKV][:1]
        named += [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Embedding) and n.rsplit(".", 1)[-1] in ("wpe", "embed_positions")][:1]
        return [Feature("a decoder not laid out as model.layers + lm_head", f"{type(model).__name__}: "
                        f"{', '.join(named) or 'no model.layers'}", _ENGINE)]
    out: list[Feature] = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        pre = f"model.layers.{i}"
        fused = [n for n in _FUSED_QKV if attn is not None and n in attn._modules]
        if fused:
            # Phi-3's qkv_proj (query, key, value heads in that order) runs on the module path, which splits it
            # (its family verified); the fused decoder concatenates separate projections only
            split = fused[0] == "qkv_proj" and _family(type(attn)) == "phi3"
            out.append(Feature("a fused q / k / v projection", f"{pre}.self_attn.{fused[0]}",
                               ("engine-fused",) if split else _ENGINE))
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and "gate_up_proj" in mlp._modules:
            out.append(Feature("a fused gate / up projection", f"{pre}.mlp.gate_up_proj", ("engine-fused",)))
        if mlp is not None and any(n in mlp._modules for n in ("experts", "router")):
            out.append(Feature("a mixture-of-experts MLP", f"{pre}.mlp ({type(mlp).__name__})", ("engine-fused",)))
        for name in [n for n, _ in ([] if attn is None else attn.named_parameters(recurse=False)) if "sink" in n]:
            # the engine adds a layer's ``sinks`` to its softmax as gpt-oss's attention does; another attention's
            # sink parameter (its forward unverified) is refused
            if name != "sinks" or _family(_forward_owner(attn)) not in _SINK_FAMILIES:
                out.append(Feature("attention sinks", f"{pre}.self_attn.{name}", _ENGINE))
        missing = [n for n in _LAYER_CHILDREN if n not in layer._modules]
        missing += [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if attn is not None and not fused
                    and n not in attn._modules]
        extra = [n for n, m in layer.named_children() if n not in _LAYER_CHILDREN and _runs_something(m)]
        extra += [f"self_attn.{n}" for n, m in ([] if attn is None else attn.named_children())
                  if n not in _ATTN_CHILDREN + _FUSED_QKV and _runs_something(m)]
        if sorted(extra) == list(_GEMMA2_NORMS) and _family(type(layer)) in _GEMMA_FAMILIES:
            extra = []  # Gemma 2 / 3's norms around the MLP: the engine wires them as their decoder layers do
        if extra:
            kind = "extra norms" if all("norm" in n for n in extra) else "extra modules"
            out.append(Feature(f"{kind} the engine does not run", f"{pre}: {', '.join(extra)}", _ENGINE))
        if missing and not fused:
            out.append(Feature("a decoder layer without the Llama layout", f"{pre} lacks {', '.join(missing)}",
                               _ENGINE))
        out += _attention_features(model, attn, pre)
        if any("engine-module" in f.paths for f in out):
            break  # the first layer the engine cannot run is named; the others are usually alike
    return out


def _runs_something(m: torch.nn.Module) -> bool:
    return any(True for _ in m.parameters()) or not isinstance(m, (torch.nn.Dropout, torch.nn.Identity))


def _attention_features(model: Any, attn: Any, pre: str) -> list[Feature]:
    if attn is None:
        return []
    head_dim = _head_dim(_text_config(model.config))
    out: list[Feature] = []
    if not head_dim:
        return out
    scaling = _num(getattr(attn, "scaling", None))
    cfg = _text_config(model.config)
    other = [a for a in ("query_pre_attn_scalar", "attention_multiplier") if getattr(cfg, a, None) is not None]
    if scaling is None and other:  # the engine reads the scale from the attention module
        out.append(Feature("a query scale other than 1/sqrt(head_dim)", f"{type(cfg).__name__}.{other[0]}, "
                           f"{pre}.self_attn has no scaling", _ENGINE))
    for n in ("q_norm", "k_norm"):
        w = getattr(getattr(attn, n, None), "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() != head_dim:
            out.append(Feature("a q / k norm over all heads (not per head)", f"{pre}.self_attn.{n}: "
                               f"{w.numel()} weights, head_dim {head_dim}", _ENGINE))
            break
    return out


def _family_features(model: Any) -> list[Feature]:
    """The classes whose forward the engine re-implements must be of a verified family."""
    base = model.model
    parts = [model, base, base.layers[0], getattr(base.layers[0], "self_attn", None)]
    for part in parts:
        if part is None:
            continue
        owner = _forward_owner(part)
        if _family(owner) not in ENGINE_FAMILIES:
            return [Feature("an architecture the engine has not verified", f"{owner.__qualname__}.forward of "
                            f"{owner.__module__} (verified: {', '.join(ENGINE_FAMILIES)})", _ENGINE)]
    return []


def _rope_layer_types(config: Any) -> list[str | None]:
    """Per layer, the layer type whose rotary embedding it uses where the config holds one per layer type (Gemma 3:
    ``rope_parameters[layer_types[i]]``, the global layers' ``rope_theta`` with its scaling and the sliding layers'
    local base), else None (one rope for every layer): the ``layer_type`` of :meth:`kvcache.RopeConfig.from_hf`."""
    cfg = _text_config(config)
    n = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    types = getattr(cfg, "layer_types", None)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if types is None or not isinstance(params, dict) or set(params).isdisjoint(types):
        return [None] * n
    return [types[i] if i < len(types) else None for i in range(n)]


def _rope_features(model: Any) -> list[Feature]:
    """The model's rotary embedding must give :class:`~kvcache.RopeConfig`'s cos / sin (rotate-half pairs), for
    each layer type that has its own (Gemma 3)."""
    from .rope import RopeConfig

    cfg = _text_config(model.config)
    rotary = getattr(model.model, "rotary_emb", None)
    where = f"model.model.rotary_emb ({type(rotary).__name__})"
    for layer_type in dict.fromkeys(_rope_layer_types(cfg)) or [None]:
        try:
            rope = RopeConfig.from_hf(cfg, layer_type=layer_type)
        except (TypeError, ValueError) as e:
            return [Feature("a rotary embedding kvcache does not compute", str(e), _ENGINE)]
        if rope.interleaved:
            return [Feature("interleaved (GPT-J) RoPE pairs", f"{type(cfg).__name__}.model_type={cfg.model_type!r}",
                            _ENGINE)]
        if rotary is None:
            return [Feature("a rotary embedding kvcache does not compute", "no model.model.rotary_emb", _ENGINE)]
        try:
            same = _same_rope(model, cfg, rotary, rope, layer_type)
        except (TypeError, ValueError, RuntimeError) as e:
            return [Feature("a rotary embedding kvcache does not compute", f"{where}: {e}", _ENGINE)]
        if not same:
            kind = "" if layer_type is None else f" ({layer_type})"
            return [Feature("a rotary embedding kvcache does not compute", f"{where}{kind}: its cos / sin differ "
                            f"from RopeConfig {rope.rope_type!r}", _ENGINE)]
    return []


def _same_rope(model: Any, cfg: Any, rotary: Any, rope: Any, layer_type: str | None) -> bool:
    """The rotary embedding's cos / sin at positions 0..63 equal ``rope``'s (atol 1e-5). gpt-oss's gives the
    first half of each row (its attention rotates the two halves of the head with it: rotate-half pairs)."""
    pos = torch.arange(min(64, int(getattr(cfg, "max_position_embeddings", 64) or 64)))  # no dynamic growth
    p = next(rotary.buffers(), None)
    dev = p.device if p is not None else torch.device("cpu")
    with torch.no_grad():
        args = () if layer_type is None else (layer_type,)
        cos, sin = rotary(torch.zeros(1, device=dev), pos[None].to(dev), *args)
    cos, sin = cos[0].float().cpu(), sin[0].float().cpu()
    want_cos, want_sin = rope.cos_sin(pos)
    half = want_cos.shape[-1] // 2
    if _family(_forward_owner(rotary)) == "gpt_oss" and cos.shape[-1] == half:
        want_cos, want_sin = want_cos[:, :half], want_sin[:, :half]
    return (cos.shape == want_cos.shape and torch.allclose(cos, want_cos, atol=1e-5)
            and torch.allclose(sin, want_sin, atol=1e-5))


def _fused_features(model: Any) -> list[Feature]:
    """Why the engine's fused decoder cannot run the model's norms and MLP (it then runs the modules): each
    norm's formula and each activation are checked on a probe input, not by class name."""
    base = model.model
    layer = base.layers[0]
    norms = [("model.norm", base.norm)] + [(f"model.layers.0.{n}", getattr(layer, n, None))
                                           for n in ("input_layernorm", "post_attention_layernorm")]
    for path, norm in norms:
        if norm is not None and not _is_plain_rms_norm(norm):
            return [Feature("a norm other than RMSNorm w * x / rms(x)", f"{path} ({type(norm).__name__})",
                            ("engine-fused",))]
    mlp = getattr(layer, "mlp", None)
    act = getattr(mlp, "act_fn", None)
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return [Feature("an MLP other than down(act(gate(x)) * up(x))", f"model.layers.0.mlp ({type(mlp).__name__})",
                        ("engine-fused",))]
    x = torch.linspace(-4, 4, 33)
    if not callable(act) or not torch.allclose(act(x), torch.nn.functional.silu(x), atol=1e-6):
        return [Feature("an activation other than SiLU", f"model.layers.0.mlp.act_fn ({type(act).__name__})",
                        ("engine-fused",))]
    return []


def _is_plain_rms_norm(norm: torch.nn.Module) -> bool:
    w = getattr(norm, "weight", None)
    eps = _num(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)))
    if not isinstance(w, torch.Tensor) or w.ndim != 1 or eps is None:
        return False
    x = torch.randn(2, w.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    with torch.no_grad():
        got = norm(x.to(device=w.device, dtype=w.dtype)).float().cpu()
    want = w.float().cpu() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    tol = 1e-5 if w.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got, want, atol=tol, rtol=tol))


def unsupported_features(model: Any, path: str) -> list[Feature]:
    """The properties of ``model`` that ``path`` does not implement (empty: the path runs the model exactly).

    Parameters
    ----------
    model : transformers.PreTrainedModel or transformers.PretrainedConfig
        A causal LM (config and modules inspected) or its config (config inspected: the hf caches see only it).
    path : str
        One of :data:`PATHS`.

    Returns
    -------
    list of Feature
        In order: config properties, then module properties, then the architecture.

    Raises
    ------
    ValueError
        ``path`` is not one of :data:`PATHS`.

    Example
    -------
    >>> from transformers import Gemma3TextConfig
    >>> [str(f) for f in unsupported_features(Gemma3TextConfig(use_bidirectional_attention=True), "hf-paged")]
    ['bidirectional attention (Gemma3TextConfig.use_bidirectional_attention=True)']
    >>> unsupported_features(Gemma3TextConfig(use_bidirectional_attention=True), "hf-linear")
    []
    """
    if path not in PATHS:
        raise ValueError(f"path: expected one of {tuple(PATHS)}, got {path!r}")
    is_model = isinstance(model, torch.nn.Module)
    config = model.config if is_model else model
    found = _config_features(config)
    if is_model and path in _ENGINE:
        found += _structure_features(model)
        if not any(f.name.startswith(("a decoder", "a fused q")) and "engine-module" in f.paths for f in found):
            found += _rope_features(model) + _family_features(model)
            if path == "engine-fused":
                found += _fused_features(model)
    elif is_model:
        found += [f for f in _structure_features(model) if f.name == "attention sinks"]
    out, seen = [], set()
    for f in found:
        if path in f.paths and f.name not in seen:
            seen.add(f.name)
            out.append(f)
    return out


def check_supported(model: Any, path: str, name: str = "model") -> None:
    """Raise one ValueError naming the first property of ``model`` that ``path`` does not implement (and the
    others), and the paths that do implement them all; nothing otherwise.

    ``"engine-fused"`` is a preference, not a requirement: check ``"engine-module"`` to decide whether the engine
    can run a model at all.

    Raises
    ------
    ValueError
        ``"model: bidirectional attention (Gemma3TextConfig.use_bidirectional_attention=True) is not implemented by
        the kvcache engine; also: ...; paths that run it: hf-gathered, hf-linear"``.

    Example
    -------
    >>> from transformers import LlamaConfig
    >>> check_supported(LlamaConfig(), "hf-paged")
    """
    found = unsupported_features(model, path)
    if not found:
        return
    msg = f"{name}: {found[0]} is not implemented by {PATHS[path]}"
    if len(found) > 1:
        msg += f"; also: {', '.join(f.name for f in found[1:])}"
    # a config shows only what the hf caches need to know: name the engine's paths only for a model
    others = [p for p in PATHS if p != "engine-fused" and (isinstance(model, torch.nn.Module) or p in _HF)]
    ok = [p for p in others if p != path and not unsupported_features(model, p)]
    msg += f"; paths that run it: {', '.join(ok)}" if ok else "; no kvcache path runs it"
    raise ValueError(msg)


def model_windows(config: Any, num_layers: int) -> list[int | None]:
    """Each layer's window as transformers applies it (:func:`layer_window`; None: full attention).

    Example
    -------
    >>> from transformers import MistralConfig
    >>> model_windows(MistralConfig(sliding_window=16, num_hidden_layers=2), 2)
    [16, 16]
    """
    check_int("num_layers", num_layers, 1)
    return [layer_window(config, i) for i in range(num_layers)]
