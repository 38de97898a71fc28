"""RopeConfig from a transformers config (``from_hf``): transformers is never imported, its config object's
attributes are read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._validate import check_int
from .config import _INT64_MAX, ROPE_TYPES, RopeConfig, _check_float

# transformers models whose attention pairs dims (2i, 2i + 1) (GPT-J style). The pairing is not in the
# config: it is fixed in each model's modeling code (rotate_every_two / interleaved rotate_half), so
# `from_hf` needs this table. Each entry was read in transformers 5.17's modeling files; pass
# `interleaved=` explicitly to override (e.g. for a model not listed).
_INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "cohere", "cohere2", "glm", "glm4"})


def rope_config_from_hf(cls: type[RopeConfig], config: Any, *, layer_type: str | None = None,
                        interleaved: bool | None = None) -> RopeConfig:
    """Build from a transformers ``PretrainedConfig`` (or any object with the same attributes).

    Reads ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` + ``rope_theta`` (4.x),
    ``partial_rotary_factor`` (or GPT-J's ``rotary_dim``), ``head_dim`` (else
    ``hidden_size // num_attention_heads``), ``max_position_embeddings`` and
    ``original_max_position_embeddings``, resolving defaults the way transformers 5.17 does (yarn:
    ``factor`` None -> ``max_position_embeddings / original_max_position_embeddings``, ``beta_fast`` /
    ``beta_slow`` None or 0 -> 32 / 1, ``truncate`` read from the top-level ``rope_parameters``).

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model (or text sub-model) config. transformers is not imported.
    layer_type : str | None
        For configs with one rope per layer type (Gemma 3: ``"full_attention"``,
        ``"sliding_attention"``): which one. Required there, must be None otherwise.
    interleaved : bool | None
        Pairing. ``None``: True for the model types whose modeling code pairs ``(2i, 2i + 1)``
        (gptj, codegen, cohere, cohere2, glm, glm4), else False (rotate-half). Not detected: DeepSeek-V2/V3
        (``rope_interleave=True``) rotate pairs ``(2i, 2i + 1)`` but write the result in rotate-half order
        (a permutation of the dims); ``interleaved=True`` rotates the same pairs in place.

    Returns
    -------
    RopeConfig

    Raises
    ------
    TypeError
        ``config`` is a dict (wrap a ``config.json`` dict: ``types.SimpleNamespace(**d)``), or a field of
        the wrong type.
    ValueError
        An unsupported rope type (longrope, proportional, multimodal ``mrope_section``...), a missing
        ``layer_type``, a missing attribute or rope parameter (``head_dim`` and ``hidden_size`` /
        ``num_attention_heads``; ``factor``...), or parameters that :class:`RopeConfig` rejects.
    """
    if isinstance(config, Mapping):
        raise TypeError(
            "config: expected a transformers config object (read through its attributes), got a "
            f"{type(config).__name__} (wrap a config.json dict: types.SimpleNamespace(**d))"
        )
    params = _hf_rope_params(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"config.rope_parameters['rope_type']: expected one of {', '.join(map(repr, ROPE_TYPES))}, "
            f"got {rope_type!r}"
        )
    if params.get("mrope_section") is not None:
        raise ValueError(
            "config.rope_parameters['mrope_section']: multimodal (3-d position) rope is not supported, "
            f"got {params['mrope_section']!r}"
        )

    head_dim = getattr(config, "head_dim", None)
    if not head_dim:
        missing = [name for name in ("hidden_size", "num_attention_heads") if getattr(config, name, None) is None]
        if missing:
            raise ValueError(
                f"{', '.join('config.' + name for name in missing)}: required when config.head_dim is missing, "
                f"None or 0 (head_dim = hidden_size // num_attention_heads), got a {type(config).__name__} "
                f"without {' and '.join(missing)}"
            )
        hidden_size = check_int("config.hidden_size", config.hidden_size, 1)
        head_dim = hidden_size // check_int("config.num_attention_heads", config.num_attention_heads, 1)
    if "partial_rotary_factor" in params:
        partial_name, partial = "config.rope_parameters['partial_rotary_factor']", params["partial_rotary_factor"]
    else:
        partial_name, partial = "config.partial_rotary_factor", getattr(config, "partial_rotary_factor", None)
    if partial is None:
        partial_name, partial = "config.rotary_pct", getattr(config, "rotary_pct", None)  # GPT-NeoX, 4.x
    gptj_rotary_dim = getattr(config, "rotary_dim", None)
    if partial is not None:
        rotary_dim = int(head_dim * _check_float(partial_name, partial, positive=True))
    elif isinstance(gptj_rotary_dim, int) and not isinstance(gptj_rotary_dim, bool):
        rotary_dim = gptj_rotary_dim  # GPT-J / CodeGen
    else:
        rotary_dim = head_dim

    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        base = getattr(config, "rotary_emb_base", None)  # GPT-NeoX in transformers 4.x
    if base is None:
        base = getattr(config, "default_theta", 10000.0)
    max_pos = getattr(config, "max_position_embeddings", None)

    if interleaved is None:
        interleaved = getattr(config, "model_type", None) in _INTERLEAVED_MODEL_TYPES

    kwargs: dict[str, Any] = {
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "base": base,
        "rope_type": rope_type,
        "max_position_embeddings": max_pos,
        "interleaved": interleaved,
    }

    def required(key: str) -> Any:
        if params.get(key) is None:
            got = "None" if key in params else "no such key"
            raise ValueError(f"config.rope_parameters[{key!r}]: required by rope_type {rope_type!r}, got {got}")
        return params[key]

    if rope_type in ("linear", "dynamic", "llama3"):
        kwargs["factor"] = required("factor")
    if rope_type in ("llama3", "yarn"):
        # transformers' standardize_rope_params: a top-level config attribute wins (Phi-3 style),
        # then the rope dict, then max_position_embeddings.
        original = getattr(config, "original_max_position_embeddings", None)
        if original is None:
            original = params.get("original_max_position_embeddings") or max_pos
        kwargs["original_max_position_embeddings"] = original
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = required("low_freq_factor")
        kwargs["high_freq_factor"] = required("high_freq_factor")
    if rope_type == "yarn":
        factor = params.get("factor")
        if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
            original = kwargs["original_max_position_embeddings"]
            if max_pos is None or original is None:
                raise ValueError(
                    "config.rope_parameters['factor']: required by rope_type 'yarn' unless "
                    "config.max_position_embeddings and original_max_position_embeddings are both set "
                    f"(factor = their ratio), got None (max_position_embeddings {max_pos}, "
                    f"original_max_position_embeddings {original})"
                )
            max_pos = check_int("config.max_position_embeddings", max_pos, 1, _INT64_MAX)
            factor = max_pos / check_int("original_max_position_embeddings", original, 1, _INT64_MAX)
        kwargs["factor"] = factor
        kwargs["beta_fast"] = params.get("beta_fast") or 32.0
        kwargs["beta_slow"] = params.get("beta_slow") or 1.0
        kwargs["mscale"] = params.get("mscale")
        kwargs["mscale_all_dim"] = params.get("mscale_all_dim")
        kwargs["attention_factor"] = params.get("attention_factor")
        # transformers 5.17 reads `truncate` from the top-level rope_parameters even for per-layer-type
        # dicts (where it is then always missing, so True).
        top = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        kwargs["truncate"] = bool(top.get("truncate", True))
    return cls(**kwargs)


def _hf_rope_params(config: Any, layer_type: str | None) -> dict[str, Any]:
    """The rope dict of a transformers config (5.x ``rope_parameters``; 4.x ``rope_scaling`` + attributes)."""
    name, params = "config.rope_parameters", getattr(config, "rope_parameters", None)
    if params is None:
        name, params = "config.rope_scaling", getattr(config, "rope_scaling", None)
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"{name}: expected a dict or None, got {type(params).__name__}")
    params = dict(params or {})
    layer_types = getattr(config, "layer_types", None)
    nested = bool(params) and layer_types is not None and not set(params).isdisjoint(set(layer_types))
    if nested:
        if layer_type is None:
            raise ValueError(
                f"layer_type: this config has one rope per layer type ({', '.join(sorted(params))}), "
                "expected one of them, got None"
            )
        if layer_type not in params:
            raise ValueError(f"layer_type: expected one of {', '.join(sorted(params))}, got {layer_type!r}")
        if params[layer_type] is None:
            raise ValueError(f"layer_type: layer type {layer_type!r} has no rotary embedding (NoPE)")
        if not isinstance(params[layer_type], Mapping):
            raise TypeError(f"{name}[{layer_type!r}]: expected a dict or None, got {type(params[layer_type]).__name__}")
        return dict(params[layer_type])
    if layer_type is not None:
        raise ValueError(f"layer_type: this config has a single rope, expected None, got {layer_type!r}")
    return params
