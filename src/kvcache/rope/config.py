"""RopeConfig: the frequencies, cos / sin and kernel parameters of one rotary embedding (see :mod:`kvcache.rope`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch

from .._validate import check_int, check_tensor, fmt_shape

__all__ = ["ROPE_TYPES", "RopeConfig", "RopeKernelParams"]

#: Rope types reproduced exactly (see :class:`RopeConfig`).
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")



_INT_POSITION_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_INT64_MAX = 2**63 - 1  # lengths are int64 tensors (dynamic NTK) and floats in the formulas


class RopeKernelParams(NamedTuple):
    """What a fused RoPE kernel needs to rotate like transformers.

    Attributes
    ----------
    inv_freq : torch.Tensor
        ``shape: [rotary_dim // 2]``, float32, on the requested device. Pair ``i`` rotates by the angle
        ``float32(position) * inv_freq[i]`` (one float32 product, no FMA with other terms).
    attention_scaling : float
        Multiply cos and sin by this (as a float32) after computing them; 1.0 except for yarn.
    rotary_dim : int
        Rotate dims ``[0, rotary_dim)`` of each head; dims ``[rotary_dim, head_dim)`` pass through.
    interleaved : bool
        False: pair ``i`` is dims ``(i, i + rotary_dim // 2)`` (rotate-half). True: dims ``(2i, 2i + 1)``.
    max_inv_freq : float
        An upper bound of ``|inv_freq|`` as a Python float (``RopeConfig.kernel_params`` gives the maximum), or
        0.0 when unknown (the default). Kernels use it to bound a row's angles without reading ``inv_freq``:
        with it, the fused append evaluates cos / sin with a short polynomial while
        ``|position| * max_inv_freq <= 1e5``; without it, always with the full-range functions. A value below
        the true maximum gives wrong keys (``check=True`` on the append verifies it).
    """

    inv_freq: torch.Tensor
    attention_scaling: float
    rotary_dim: int
    interleaved: bool
    max_inv_freq: float = 0.0


def _check_float(name: str, value: object, *, positive: bool = False, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        want = "a float or None" if allow_none else "a float"
        raise TypeError(f"{name}: expected {want}, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value}")
    if positive and value <= 0.0:
        raise ValueError(f"{name}: expected a float > 0, got {value}")
    return value


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # Same expression (and so the same double rounding) as transformers' yarn `get_mscale`.
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one attention layer, as Hugging Face transformers computes it.

    Parameters
    ----------
    head_dim : int
        Size of each head (>= 2).
    rotary_dim : int | None
        Number of leading dims of each head that are rotated (even, 2..head_dim; 4.. for ``"dynamic"``,
        whose exponent ``d / (d - 2)`` needs ``d > 2``); the rest pass through unchanged. ``None``:
        ``head_dim``. transformers: ``int(head_dim * partial_rotary_factor)``.
    base : float
        ``rope_theta`` (> 0; not 1.0 for ``"yarn"``, which divides by ``log(base)``).
    rope_type : str
        One of :data:`ROPE_TYPES`:

        * ``"default"``: ``inv_freq[i] = 1 / base ** (2i / rotary_dim)``.
        * ``"linear"``: default ``inv_freq / factor`` (position interpolation).
        * ``"dynamic"``: dynamic NTK. While the current length ``seq_len`` (max position + 1) is at most
          ``max_position_embeddings`` the default frequencies; beyond it the base grows to
          ``base * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (d / (d - 2))``.
        * ``"llama3"``: Llama 3.1 frequency-dependent scaling (``factor``, ``low_freq_factor``,
          ``high_freq_factor``, ``original_max_position_embeddings``).
        * ``"yarn"``: YaRN ramp between interpolated and extrapolated frequencies (``factor``,
          ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``truncate``) and cos/sin
          scaled by :attr:`attention_scaling`.
    factor : float
        Scaling factor (> 0); must be 1.0 for ``"default"``. ``"dynamic"``: the initial scaled base
        (see above, ``seq_len = max_position_embeddings``) must be a finite float > 0.
    original_max_position_embeddings : int | None
        Pre-training context length; required by ``"llama3"`` and ``"yarn"``.
    max_position_embeddings : int | None
        Required by ``"dynamic"`` (the length above which the base grows); informational otherwise.
    low_freq_factor, high_freq_factor : float | None
        ``"llama3"`` only (required there; ``high_freq_factor > low_freq_factor``).
    beta_fast, beta_slow : float | None
        ``"yarn"`` only; ``None`` means transformers' defaults 32 and 1. ``beta_fast > beta_slow > 0``, each
        giving a finite correction dim ``d * log(original_max_position_embeddings / (beta * 2 pi)) / (2 log(base))``.
    mscale, mscale_all_dim : float | None
        ``"yarn"`` only (DeepSeek style): when both are non-zero and ``attention_factor`` is None,
        ``attention_scaling = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)``, which must
        then be finite and > 0 (like ``attention_factor``).
    attention_factor : float | None
        ``"yarn"`` only: explicit cos/sin scaling (> 0); ``None`` infers it from ``factor`` (and mscale).
    truncate : bool
        ``"yarn"`` only: round the correction range outwards to whole dims (transformers' default True;
        gpt-oss uses False). Ignored by the other types.
    interleaved : bool
        False: rotate-half pairing (Llama, GPT-NeoX, HF default): pairs ``(i, i + rotary_dim // 2)``.
        True: GPT-J pairing: pairs ``(2i, 2i + 1)``.

    Raises
    ------
    TypeError
        A field of the wrong type (the message names the field).
    ValueError
        A field out of range, an unknown ``rope_type``, a field required by ``rope_type`` missing, or a
        field that only another rope type uses set.

    Note
    ----
    Instances are frozen and hashable. Numeric fields are stored as Python floats.
    """

    head_dim: int
    rotary_dim: int | None = None
    base: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        check_int("head_dim", self.head_dim, 2)
        rotary_dim = self.head_dim if self.rotary_dim is None else self.rotary_dim
        check_int("rotary_dim", rotary_dim, 2, self.head_dim)
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim: expected an even int (dims are rotated in pairs), got {rotary_dim}")
        set_("rotary_dim", rotary_dim)
        set_("base", _check_float("base", self.base, positive=True))
        if not isinstance(self.rope_type, str):
            raise TypeError(f"rope_type: expected a str, got {type(self.rope_type).__name__}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type: expected one of {', '.join(map(repr, ROPE_TYPES))}, got {self.rope_type!r}")
        set_("factor", _check_float("factor", self.factor, positive=True))
        for name in ("original_max_position_embeddings", "max_position_embeddings"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, _INT64_MAX)
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            set_(name, _check_float(name, getattr(self, name), allow_none=True))
        set_(
            "attention_factor", _check_float("attention_factor", self.attention_factor, positive=True, allow_none=True)
        )
        for name in ("truncate", "interleaved"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")

        rope_type = self.rope_type
        if rope_type == "default" and self.factor != 1.0:
            raise ValueError(
                f"factor: rope_type 'default' does not scale, expected 1.0, got {self.factor} "
                "(use rope_type 'linear', 'dynamic', 'llama3' or 'yarn')"
            )
        only = {
            "low_freq_factor": "llama3",
            "high_freq_factor": "llama3",
            "beta_fast": "yarn",
            "beta_slow": "yarn",
            "mscale": "yarn",
            "mscale_all_dim": "yarn",
            "attention_factor": "yarn",
        }
        for name, owner in only.items():
            if getattr(self, name) is not None and rope_type != owner:
                raise ValueError(
                    f"{name}: only used by rope_type {owner!r}, expected None with rope_type {rope_type!r}, "
                    f"got {getattr(self, name)}"
                )
        if rope_type == "dynamic":
            self._check_dynamic()
        if rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"original_max_position_embeddings: required by rope_type {rope_type!r}, got None")
        if rope_type == "llama3":
            self._check_llama3()
        if rope_type == "yarn":
            self._check_yarn()

    def _check_dynamic(self) -> None:
        """rope_type 'dynamic': the length it scales from, and a finite initial base."""
        if self.max_position_embeddings is None:
            raise ValueError("max_position_embeddings: required by rope_type 'dynamic', got None")
        if self.rotary_dim == 2:
            raise ValueError(
                "rotary_dim: rope_type 'dynamic' raises the base to the power d / (d - 2) (d = rotary_dim), "
                "expected an even int >= 4, got 2"
            )
        try:
            initial_base = self._dynamic_initial_base()
        except OverflowError:
            initial_base = math.inf
        # a negative power base gives a complex number; an overflow, inf
        if not (isinstance(initial_base, float) and math.isfinite(initial_base) and initial_base > 0.0):
            raise ValueError(
                "factor: rope_type 'dynamic' expected a factor for which the initial base "
                "base * (factor * m / m - (factor - 1)) ** (d / (d - 2)) (m = max_position_embeddings) is a "
                f"finite float > 0, got factor {self.factor} (base {initial_base})"
            )

    def _check_llama3(self) -> None:
        """rope_type 'llama3': both frequency factors, 0 < low < high."""
        for name in ("low_freq_factor", "high_freq_factor"):
            if getattr(self, name) is None:
                raise ValueError(f"{name}: required by rope_type 'llama3', got None")
        if self.low_freq_factor <= 0.0:
            raise ValueError(f"low_freq_factor: expected a float > 0, got {self.low_freq_factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor: expected a float > low_freq_factor ({self.low_freq_factor}), "
                f"got {self.high_freq_factor}"
            )

    def _check_yarn(self) -> None:
        """rope_type 'yarn': the betas, a base other than 1, finite correction dims and attention scaling."""
        beta_fast, beta_slow = self._yarn_betas()
        if beta_slow <= 0.0:
            raise ValueError(f"beta_slow: expected a float > 0, got {beta_slow}")
        if beta_fast <= beta_slow:
            raise ValueError(f"beta_fast: expected a float > beta_slow ({beta_slow}), got {beta_fast}")
        if self.base == 1.0:
            raise ValueError(
                "base: rope_type 'yarn' divides by log(base), expected a float > 0 other than 1.0, got 1.0"
            )
        for name, beta in (("beta_fast", beta_fast), ("beta_slow", beta_slow)):
            try:
                dim = self._yarn_correction_dim(beta)
            except ValueError:  # math.log(0.0): original / (beta * 2 pi) underflowed
                dim = math.nan
            if not math.isfinite(dim):
                raise ValueError(
                    f"{name}: expected a float giving a finite yarn correction dim "
                    f"d * log(original_max_position_embeddings / ({name} * 2 pi)) / (2 log(base)), got {beta}"
                )
        if self.attention_factor is None and self.mscale and self.mscale_all_dim:
            numerator = _yarn_mscale(self.factor, self.mscale)
            denominator = _yarn_mscale(self.factor, self.mscale_all_dim)
            scaling = numerator / denominator if denominator != 0.0 else math.nan
            if not (math.isfinite(scaling) and scaling > 0.0):
                raise ValueError(
                    "mscale, mscale_all_dim: expected an attention scaling get_mscale(factor, mscale) / "
                    "get_mscale(factor, mscale_all_dim) that is finite and > 0, got "
                    f"{numerator} / {denominator} (factor {self.factor}, mscale {self.mscale}, "
                    f"mscale_all_dim {self.mscale_all_dim})"
                )

    # ------------------------------------------------------------------------------------------------
    # Construction from transformers

    @classmethod
    def from_hf(cls, config: Any, *, layer_type: str | None = None, interleaved: bool | None = None) -> RopeConfig:
        """Build from a transformers ``PretrainedConfig`` (or any object with the same attributes): see
        :func:`kvcache.rope.hf.rope_config_from_hf`."""
        from .hf import rope_config_from_hf

        return rope_config_from_hf(cls, config, layer_type=layer_type, interleaved=interleaved)

    # ------------------------------------------------------------------------------------------------
    # Frequencies

    @property
    def is_dynamic(self) -> bool:
        """True when the frequencies depend on the current sequence length (``"dynamic"``)."""
        return self.rope_type == "dynamic"

    @property
    def attention_scaling(self) -> float:
        """Factor that multiplies cos and sin: yarn's mscale (or ``attention_factor``), 1.0 otherwise."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:  # truthiness, as transformers (0 means unset)
            return float(_yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim))
        return _yarn_mscale(self.factor)

    def _yarn_betas(self) -> tuple[float, float]:
        return (32.0 if self.beta_fast is None else self.beta_fast, 1.0 if self.beta_slow is None else self.beta_slow)

    def _uses_grown_base(self, seq_len: int | None) -> bool:
        return self.rope_type == "dynamic" and seq_len is not None and seq_len > self.max_position_embeddings

    def inv_freq(self, seq_len: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """Inverse frequencies, equal to the ``inv_freq`` buffer of transformers' rotary embedding.

        Parameters
        ----------
        seq_len : int | None
            Current sequence length (max position in the batch + 1); used by ``"dynamic"`` only. ``None``
            or ``<= max_position_embeddings``: the unscaled frequencies (what transformers holds after
            construction).
        device : torch.device | str | None
            Where the result lives (default CPU). Static types are computed on the CPU and moved, as
            transformers does at construction; a grown dynamic base is computed on ``device``, as
            transformers does in the forward pass.

        Returns
        -------
        torch.Tensor
            ``shape: [rotary_dim // 2]``, float32.
        """
        if seq_len is not None:
            check_int("seq_len", seq_len, 1, _INT64_MAX)
        if self._uses_grown_base(seq_len):
            return self._dynamic_inv_freq(seq_len, torch.device("cpu") if device is None else torch.device(device))
        out = {
            "default": self._default_inv_freq,
            "linear": self._linear_inv_freq,
            "dynamic": self._dynamic_initial_inv_freq,
            "llama3": self._llama3_inv_freq,
            "yarn": self._yarn_inv_freq,
        }[self.rope_type]()
        return out if device is None else out.to(device)

    def _exponents(self, device: torch.device | None = None) -> torch.Tensor:
        # float32 (2i / d); exact integers divided once, like arange(0, d, 2).float() / d in transformers.
        d = self.rotary_dim
        return torch.arange(0, d, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / d

    def _default_inv_freq(self) -> torch.Tensor:
        # float32(base) ** exponent, then Tensor.__rtruediv__: reciprocal(t) * 1.0 (exact).
        return 1.0 / (self.base ** self._exponents())

    def _linear_inv_freq(self) -> torch.Tensor:
        return self._default_inv_freq() / self.factor  # divided by float32(factor)

    def _dynamic_initial_base(self) -> float:
        # transformers at construction: seq_len = max_position_embeddings, base scaled in Python doubles
        # (a factor of 1 up to double rounding). Checked finite and > 0 in __post_init__.
        d, m, f = self.rotary_dim, self.max_position_embeddings, self.factor
        return self.base * ((f * m / m) - (f - 1)) ** (d / (d - 2))

    def _dynamic_initial_inv_freq(self) -> torch.Tensor:
        # the double base is rounded to float32 by the pow
        return 1.0 / (self._dynamic_initial_base() ** self._exponents())

    def _dynamic_inv_freq(self, seq_len: int, device: torch.device) -> torch.Tensor:
        # transformers in the forward pass: seq_len is a 0-d integer tensor (max(position_ids) + 1), so the
        # new base is computed in float32 tensor arithmetic, one rounding per operation, on the input's device.
        d, m, f = self.rotary_dim, self.max_position_embeddings, self.factor
        length = torch.tensor(seq_len, dtype=torch.int64, device=device)
        base = self.base * ((f * length / m) - (f - 1)) ** (d / (d - 2))  # 0-d float32 tensor
        return 1.0 / (base ** self._exponents(device))

    def _llama3_inv_freq(self) -> torch.Tensor:
        inv_freq = self._default_inv_freq()
        old_len = self.original_max_position_embeddings
        low, high, factor = self.low_freq_factor, self.high_freq_factor, self.factor
        low_freq_wavelen = old_len / low  # Python doubles, compared as float32
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq  # reciprocal(inv_freq) * float32(2 pi)
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def _yarn_correction_dim(self, num_rotations: float) -> float:
        # dim index at which a wavelength makes `num_rotations` turns over the original context (Python
        # doubles, transformers' expression). Checked finite in __post_init__ (base != 1, no log(0) / log(inf)).
        d, base, original = self.rotary_dim, self.base, self.original_max_position_embeddings
        return (d * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def _yarn_inv_freq(self) -> torch.Tensor:
        d, base, factor = self.rotary_dim, self.base, self.factor
        beta_fast, beta_slow = self._yarn_betas()
        low, high = self._yarn_correction_dim(beta_fast), self._yarn_correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

        pos_freqs = base ** self._exponents()
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (factor * pos_freqs)
        extrapolation_weight = 1 - ramp
        return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight

    # ------------------------------------------------------------------------------------------------
    # cos / sin

    def kernel_params(self, seq_len: int | None = None, device: torch.device | str | None = None) -> RopeKernelParams:
        """Parameters for a fused RoPE kernel (see :class:`RopeKernelParams`).

        Parameters
        ----------
        seq_len : int | None
            ``"dynamic"`` only: the current length, ``max(positions in the batch) + 1`` (transformers' rule;
            the frequencies then apply to every token of that forward pass). Ignored by the other types.
        device : torch.device | str | None
            Device of ``inv_freq`` (default CPU).

        Returns
        -------
        RopeKernelParams

        Note
        ----
        Allocates ``inv_freq``: call it once (static types) or once per step (``"dynamic"``), outside a
        CUDA graph.
        """
        if seq_len is not None:
            check_int("seq_len", seq_len, 1, _INT64_MAX)
        grown = self._uses_grown_base(seq_len)
        # a grown dynamic base is computed on `device` (as transformers does) and not read back: its frequencies
        # are 1 / grown_base ** e with e in [0, 1) and grown_base >= base, so 1.0 bounds them when base >= 1
        inv = self.inv_freq(seq_len, device if grown else None)
        top = (1.0 if self.base >= 1 else 0.0) if grown else float(inv.max())
        if not grown and device is not None:
            inv = inv.to(device)
        return RopeKernelParams(inv, self.attention_scaling, self.rotary_dim, self.interleaved, top)

    def cos_sin(self, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables, equal to transformers' rotary embedding output before its dtype cast.

        Parameters
        ----------
        positions : torch.Tensor
            ``shape: [n]``, an integer dtype, any device. Positions below 2**24 are exact (transformers
            casts them to float32).
        seq_len : int | None
            ``"dynamic"`` only; ``None``: ``max(positions) + 1``, as transformers does per forward pass.

        Returns
        -------
        cos, sin : torch.Tensor
            ``shape: [n, rotary_dim]``, float32, on ``positions.device``, multiplied by
            :attr:`attention_scaling`. Layout: ``cat(freqs, freqs)`` (rotate-half) or
            ``repeat_interleave(freqs, 2)`` (interleaved), with ``freqs = positions * inv_freq``.

        Note
        ----
        Stateless. transformers' ``"dynamic"`` module is stateful: after a length above
        ``max_position_embeddings`` it keeps the grown frequencies for shorter lengths that are still above
        it. This equals a freshly built module, or one fed non-decreasing lengths (generation).
        """
        return self._cos_sin(positions, seq_len, self.attention_scaling)

    def _cos_sin(
        self, positions: torch.Tensor, seq_len: int | None, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_positions("positions", positions)
        if seq_len is None and self.is_dynamic and positions.numel() > 0:
            seq_len = int(positions.max()) + 1
        inv_freq = self.inv_freq(seq_len, positions.device)
        # transformers: (inv_freq[:, None] @ positions[None, :].float()).T, a matmul with an inner dimension
        # of 1, i.e. one float32 product per element (tested equal).
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        if self.interleaved:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scaling, emb.sin() * scaling


def _check_positions(name: str, positions: object) -> torch.Tensor:
    positions = check_tensor(name, positions)
    if positions.dim() != 1:
        raise ValueError(f"{name}: expected a 1-d tensor [n], got shape {fmt_shape(positions.shape)}")
    if positions.dtype not in _INT_POSITION_DTYPES:
        raise ValueError(f"{name}: expected an integer dtype (int64 or int32), got {positions.dtype}")
    return positions
