"""RopeConfig: cos/sin equal to Hugging Face transformers' rotary embeddings, the reference rotation, validation.

Tests that compare with transformers skip without it (``pytest.importorskip`` inside each); every other
test runs against formulas written independently here (float64 math, or the explicit per-pair rotation).
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvcache.rope import ROPE_TYPES, RopeConfig, RopeKernelParams, apply_rope_reference

# ---------------------------------------------------------------------------------------------------------
# Cases: rope parameters as transformers spells them (rope_parameters dict), plus max_position_embeddings.

LLAMA31 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
    rope_theta=500000.0,
)
HF_CASES: dict[str, tuple[dict, int]] = {
    "default": (dict(rope_type="default", rope_theta=10000.0), 4096),
    "default-theta1e6": (dict(rope_type="default", rope_theta=1000000.0), 32768),
    "linear2": (dict(rope_type="linear", factor=2.0, rope_theta=10000.0), 4096),
    "linear4": (dict(rope_type="linear", factor=4.0, rope_theta=10000.0), 4096),
    "dynamic2": (dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0), 2048),
    "llama3.1": (LLAMA31, 131072),
    # Qwen-style yarn: factor 4 over an original 4096 context
    "yarn4": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, rope_theta=1e6), 16384),
    # DeepSeek-style: mscale / mscale_all_dim (scaling != 1 here)
    "yarn-mscale": (
        dict(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=0.8,
            rope_theta=10000.0,
        ),
        163840,
    ),
    # gpt-oss-style: truncate False, explicit betas
    "yarn-notrunc": (
        dict(
            rope_type="yarn",
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            rope_theta=150000.0,
        ),
        131072,
    ),
    "yarn-attn-factor": (
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, attention_factor=0.75),
        16384,
    ),
}

# transformers module families: (model, partial_rotary_factor). Llama: rotate-half, full rotary; GPT-NeoX:
# rotate-half with partial rotary; Cohere: interleaved (repeat_interleave layout), full rotary.
HF_KINDS = {
    "llama": ("llama", None),
    "neox-0.5": ("gpt_neox", 0.5),
    "neox-0.25": ("gpt_neox", 0.25),
    "cohere-interleaved": ("cohere", None),
}


def _hf_rotary(kind: str, case: str, head_dim: int):
    """(transformers config, fresh rotary embedding module) for a case."""
    pytest.importorskip("transformers")
    import transformers

    model, partial = HF_KINDS[kind]
    params, max_pos = HF_CASES[case]
    params = dict(params)
    if partial is not None:
        params["partial_rotary_factor"] = partial
    heads = 4
    common = dict(hidden_size=head_dim * heads, num_attention_heads=heads, max_position_embeddings=max_pos)
    if model == "llama":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary

        config = transformers.LlamaConfig(head_dim=head_dim, rope_parameters=params, **common)
    elif model == "gpt_neox":
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding as Rotary

        config = transformers.GPTNeoXConfig(rope_parameters=params, **common)
    else:
        from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding as Rotary

        config = transformers.CohereConfig(rope_parameters=params, **common)
    return config, Rotary(config)


def _hf_cos_sin(module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, positions.numel(), 8, dtype=torch.float32)  # float32: no cast after the scaling
    cos, sin = module(x, positions[None])
    return cos[0], sin[0]


def _positions(max_position: int, n: int = 257, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, max_position + 1, (n,), generator=g)
    pos[0], pos[-1] = 0, max_position
    return pos


# ---------------------------------------------------------------------------------------------------------
# Against transformers


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", list(HF_KINDS))
@pytest.mark.parametrize("case", [c for c in HF_CASES if c != "dynamic2"])
def test_cos_sin_equals_transformers(case: str, kind: str, head_dim: int) -> None:
    config, module = _hf_rotary(kind, case, head_dim)
    rope = RopeConfig.from_hf(config)
    partial = HF_KINDS[kind][1]
    assert rope.rotary_dim == (head_dim if partial is None else int(head_dim * partial))
    assert rope.interleaved == (kind == "cohere-interleaved")
    assert torch.equal(rope.inv_freq(), module.inv_freq)
    assert rope.attention_scaling == module.attention_scaling
    # positions up to 2**18: beyond every context length here, still exact in float32
    positions = _positions(1 << 18)
    cos, sin = rope.cos_sin(positions)
    hf_cos, hf_sin = _hf_cos_sin(module, positions)
    assert cos.dtype == torch.float32 and cos.shape == (positions.numel(), rope.rotary_dim)
    assert torch.equal(cos, hf_cos)
    assert torch.equal(sin, hf_sin)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", list(HF_KINDS))
# max_position_embeddings is 2048: lengths (max position + 1) below, at, just past and far past it
@pytest.mark.parametrize("seq_len", [100, 2047, 2048, 2049, 2050, 6000, 70001])
def test_dynamic_ntk_equals_transformers(kind: str, head_dim: int, seq_len: int) -> None:
    config, module = _hf_rotary(kind, "dynamic2", head_dim)  # fresh module: no state from other lengths
    rope = RopeConfig.from_hf(config)
    positions = _positions(seq_len - 1, seed=seq_len)
    cos, sin = rope.cos_sin(positions)  # seq_len defaults to max(positions) + 1, transformers' rule
    hf_cos, hf_sin = _hf_cos_sin(module, positions)
    assert torch.equal(cos, hf_cos)
    assert torch.equal(sin, hf_sin)
    assert torch.equal(rope.inv_freq(seq_len), module.inv_freq)
    assert torch.equal(rope.kernel_params(seq_len).inv_freq, module.inv_freq)


@pytest.mark.parametrize("kind", ["llama", "neox-0.25"])
def test_dynamic_ntk_decode_sequence_equals_transformers(kind: str) -> None:
    """One module fed growing lengths across max_position_embeddings, like generation (one token a step)."""
    config, module = _hf_rotary(kind, "dynamic2", 64)
    rope = RopeConfig.from_hf(config)
    for position in [0, 5, 2045, 2046, 2047, 2048, 2049, 2050, 3000, 3001, 10000]:
        positions = torch.tensor([position])
        hf_cos, hf_sin = _hf_cos_sin(module, positions)
        cos, sin = rope.cos_sin(positions)
        assert torch.equal(cos, hf_cos), position
        assert torch.equal(sin, hf_sin), position


def test_dynamic_ntk_transformers_keeps_grown_frequencies() -> None:
    """Documented difference: transformers' module is stateful; ours equals a fresh module."""
    config, module = _hf_rotary("llama", "dynamic2", 64)
    rope = RopeConfig.from_hf(config)
    _hf_cos_sin(module, torch.tensor([9999]))  # grows to length 10000
    positions = torch.tensor([2999])  # length 3000: > 2048, < 10000 -> transformers keeps length 10000
    hf_cos, _ = _hf_cos_sin(module, positions)
    assert torch.equal(hf_cos, rope.cos_sin(positions, seq_len=10000)[0])
    assert not torch.equal(hf_cos, rope.cos_sin(positions)[0])
    positions = torch.tensor([99])  # length below 2048: transformers resets to the original frequencies
    assert torch.equal(_hf_cos_sin(module, positions)[0], rope.cos_sin(positions)[0])


def test_gptj_interleaved_partial_equals_transformers() -> None:
    """GPT-J: interleaved pairing, rotary_dim 64 of head_dim 256 (its own sinusoid table)."""
    pytest.importorskip("transformers")
    import transformers
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions

    config = transformers.GPTJConfig(n_embd=1024, n_head=4, rotary_dim=64, n_positions=4096)
    rope = RopeConfig.from_hf(config)
    assert (rope.head_dim, rope.rotary_dim, rope.interleaved, rope.rope_type) == (256, 64, True, "default")
    sin, cos = torch.split(create_sinusoidal_positions(4096, 64), 32, dim=-1)
    positions = torch.arange(4096)
    ours_cos, ours_sin = rope.cos_sin(positions)
    assert torch.equal(ours_cos, torch.repeat_interleave(cos, 2, dim=-1))
    assert torch.equal(ours_sin, torch.repeat_interleave(sin, 2, dim=-1))


@pytest.mark.parametrize("case", ["default", "llama3.1", "yarn-mscale", "dynamic2"])
@pytest.mark.parametrize("kind", list(HF_KINDS))
def test_apply_rope_reference_equals_transformers(case: str, kind: str) -> None:
    config, module = _hf_rotary(kind, case, 128)
    model = HF_KINDS[kind][0]
    apply_hf = __import__(f"transformers.models.{model}.modeling_{model}", fromlist=["x"]).apply_rotary_pos_emb
    rope = RopeConfig.from_hf(config)
    n, heads = 33, 3
    positions = _positions(5000, n)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, heads, 128, generator=g)
    cos, sin = _hf_cos_sin(module, positions)
    q = x.transpose(0, 1)[None]  # [1, heads, n, head_dim]
    hf_q, _ = apply_hf(q, q, cos[None], sin[None])
    assert torch.equal(apply_rope_reference(x, positions, rope), hf_q[0].transpose(0, 1))


def test_from_hf_llama31_fields() -> None:
    pytest.importorskip("transformers")
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=dict(LLAMA31)
    )
    assert RopeConfig.from_hf(config) == RopeConfig(
        head_dim=128,
        base=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
        max_position_embeddings=131072,
    )


def test_from_hf_per_layer_type_gemma3() -> None:
    pytest.importorskip("transformers")
    import transformers

    config = transformers.Gemma3TextConfig()
    with pytest.raises(ValueError, match="layer_type"):
        RopeConfig.from_hf(config)
    full = RopeConfig.from_hf(config, layer_type="full_attention")
    local = RopeConfig.from_hf(config, layer_type="sliding_attention")
    assert (full.base, local.base) == (config.rope_parameters["full_attention"]["rope_theta"], 10000.0)
    assert full.head_dim == config.head_dim


# ---------------------------------------------------------------------------------------------------------
# Independent float64 formulas (no transformers)


def _inv_freq64(rope: RopeConfig, seq_len: int | None = None) -> torch.Tensor:
    """inv_freq from the papers / model cards, in float64."""
    d = rope.rotary_dim
    i = torch.arange(0, d, 2, dtype=torch.float64)
    base = rope.base
    if rope.rope_type == "dynamic" and seq_len is not None and seq_len > rope.max_position_embeddings:
        m = rope.max_position_embeddings
        base = base * (rope.factor * seq_len / m - (rope.factor - 1)) ** (d / (d - 2))
    inv = base ** (-i / d)
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        lo, hi, old = rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / rope.factor + smooth * inv
        return torch.where(wavelen < old / hi, inv, torch.where(wavelen > old / lo, inv / rope.factor, mid))
    if rope.rope_type == "yarn":
        beta_fast = 32.0 if rope.beta_fast is None else rope.beta_fast
        beta_slow = 1.0 if rope.beta_slow is None else rope.beta_slow
        orig = rope.original_max_position_embeddings

        def dim_of(rotations: float) -> float:  # dim whose wavelength turns `rotations` times over orig
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.base))

        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        # ramp 0: extrapolate (original frequency); ramp 1: interpolate (frequency / factor)
        return inv * (1 - ramp) + inv / rope.factor * ramp
    return inv


ROPES = {
    "default": RopeConfig(head_dim=64),
    "default-partial": RopeConfig(head_dim=96, rotary_dim=32, base=1e6),
    "linear": RopeConfig(head_dim=64, rope_type="linear", factor=4.0),
    "dynamic": RopeConfig(head_dim=128, rope_type="dynamic", factor=2.0, max_position_embeddings=2048),
    "llama3": RopeConfig(
        head_dim=128,
        base=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    "yarn": RopeConfig(head_dim=128, base=1e6, rope_type="yarn", factor=4.0, original_max_position_embeddings=4096),
    "yarn-partial-interleaved": RopeConfig(
        head_dim=80,
        rotary_dim=40,
        rope_type="yarn",
        factor=16.0,
        original_max_position_embeddings=2048,
        truncate=False,
        mscale=0.9,
        mscale_all_dim=0.5,
        interleaved=True,
    ),
    "interleaved": RopeConfig(head_dim=64, interleaved=True),
}


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("seq_len", [None, 1000, 9000])
def test_inv_freq_matches_float64_formula(name: str, seq_len: int | None) -> None:
    rope = ROPES[name]
    inv = rope.inv_freq(seq_len)
    assert inv.dtype == torch.float32 and inv.shape == (rope.rotary_dim // 2,)
    torch.testing.assert_close(inv.double(), _inv_freq64(rope, seq_len), rtol=2e-6, atol=0)


def test_attention_scaling() -> None:
    assert ROPES["llama3"].attention_scaling == 1.0
    assert ROPES["dynamic"].attention_scaling == 1.0
    assert ROPES["yarn"].attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    mixed = ROPES["yarn-partial-interleaved"]
    expected = (0.1 * 0.9 * math.log(16.0) + 1.0) / (0.1 * 0.5 * math.log(16.0) + 1.0)
    assert mixed.attention_scaling == pytest.approx(expected)
    ds = dataclasses.replace(ROPES["yarn"], mscale=1.0, mscale_all_dim=1.0)  # DeepSeek-V3: exactly 1
    assert ds.attention_scaling == 1.0
    assert dataclasses.replace(ROPES["yarn"], attention_factor=0.5).attention_scaling == 0.5
    assert dataclasses.replace(ROPES["yarn"], factor=1.0).attention_scaling == 1.0


def test_dynamic_seq_len_rule() -> None:
    rope = ROPES["dynamic"]
    plain = RopeConfig(head_dim=128).inv_freq()
    assert torch.equal(rope.inv_freq(), plain)
    assert torch.equal(rope.inv_freq(2048), plain)  # length == max_position_embeddings: unscaled
    assert not torch.equal(rope.inv_freq(2049), plain)
    assert (rope.inv_freq(4096)[1:] < plain[1:]).all()  # a larger base: lower frequencies
    positions = torch.tensor([3, 4000, 17])
    assert torch.equal(rope.cos_sin(positions)[0], rope.cos_sin(positions, seq_len=4001)[0])
    assert not torch.equal(rope.cos_sin(positions)[0], rope.cos_sin(positions, seq_len=8000)[0])
    # the other types ignore seq_len
    assert torch.equal(ROPES["yarn"].inv_freq(10**6), ROPES["yarn"].inv_freq())


@pytest.mark.parametrize("name", list(ROPES))
def test_cos_sin_is_the_kernel_formula(name: str) -> None:
    """cos_sin == cos(float32(position) * inv_freq) * scaling, elementwise in float32: what a kernel computes.

    Also: transformers' K=1 matmul (inv_freq @ positions) equals the elementwise product.
    """
    rope = ROPES[name]
    positions = torch.cat([torch.arange(600), _positions((1 << 24) - 1, 500)])
    params = rope.kernel_params(seq_len=int(positions.max()) + 1)
    assert isinstance(params, RopeKernelParams)
    assert (params.rotary_dim, params.interleaved) == (rope.rotary_dim, rope.interleaved)
    assert params.attention_scaling == rope.attention_scaling
    assert params.inv_freq.dtype == torch.float32 and params.inv_freq.device.type == "cpu"
    inv = params.inv_freq
    pos = positions.to(torch.float32)
    matmul = (inv[None, :, None] @ pos[None, None, :]).transpose(1, 2)[0]
    product = pos[:, None] * inv[None, :]
    assert torch.equal(matmul, product)
    cos, sin = rope.cos_sin(positions)
    for table, fn in ((cos, torch.cos), (sin, torch.sin)):
        half = fn(product) * params.attention_scaling
        if rope.interleaved:
            assert torch.equal(table[:, 0::2], half) and torch.equal(table[:, 1::2], half)
        else:
            d2 = rope.rotary_dim // 2
            assert torch.equal(table[:, :d2], half) and torch.equal(table[:, d2:], half)
        # and against float64 trigonometry of the same float32 angle
        torch.testing.assert_close(half.double(), fn(product.double()) * params.attention_scaling, rtol=0, atol=1e-6)


def test_cos_sin_int32_and_empty_positions() -> None:
    rope = ROPES["dynamic"]
    positions = torch.tensor([0, 9, 5000])
    for a, b in zip(rope.cos_sin(positions), rope.cos_sin(positions.int())):
        assert torch.equal(a, b)
    cos, sin = rope.cos_sin(torch.empty(0, dtype=torch.int64))
    assert cos.shape == sin.shape == (0, 128)


# ---------------------------------------------------------------------------------------------------------
# apply_rope_reference against a from-scratch rotation


def _pairs(rope: RopeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Dim indices (a, b) of each rotated pair, pair i turning at inv_freq[i]."""
    i = torch.arange(rope.rotary_dim // 2)
    if rope.interleaved:
        return 2 * i, 2 * i + 1
    return i, i + rope.rotary_dim // 2


def _rotate64(x: torch.Tensor, positions: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """(a, b) -> s * (a cos t - b sin t, a sin t + b cos t) in float64, t the float32 angle."""
    seq_len = int(positions.max()) + 1
    angle = (positions.to(torch.float32)[:, None] * rope.inv_freq(seq_len)[None, :]).double()[:, None, :]
    s = rope.attention_scaling
    out = x.double().clone()
    a, b = _pairs(rope)
    xa, xb = x[..., a].double(), x[..., b].double()
    out[..., a] = s * (xa * angle.cos() - xb * angle.sin())
    out[..., b] = s * (xa * angle.sin() + xb * angle.cos())
    return out


@pytest.mark.parametrize("name", list(ROPES))
def test_apply_rope_reference_matches_pair_rotation(name: str) -> None:
    rope = ROPES[name]
    g = torch.Generator().manual_seed(3)
    n, heads = 19, 5
    x = torch.randn(n, heads, rope.head_dim, generator=g)
    positions = _positions(9000, n)
    y = apply_rope_reference(x, positions, rope)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), _rotate64(x, positions, rope), rtol=0, atol=2e-6)


def test_pairing_layouts() -> None:
    """Rotate-half pairs dims (i, i + rotary_dim/2); interleaved pairs (2i, 2i + 1)."""
    x = torch.zeros(1, 1, 64)
    x[0, 0, 0] = 1.0
    pos = torch.tensor([1])
    half = apply_rope_reference(x, pos, RopeConfig(head_dim=64, rotary_dim=32))
    inter = apply_rope_reference(x, pos, RopeConfig(head_dim=64, rotary_dim=32, interleaved=True))
    assert half[0, 0].nonzero().flatten().tolist() == [0, 16]
    assert inter[0, 0].nonzero().flatten().tolist() == [0, 1]
    # angle of pair 0 is position * 1: (cos 1, sin 1)
    torch.testing.assert_close(half[0, 0, [0, 16]], torch.tensor([math.cos(1.0), math.sin(1.0)]))
    torch.testing.assert_close(inter[0, 0, [0, 1]], torch.tensor([math.cos(1.0), math.sin(1.0)]))


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_apply_rope_reference_inverse_round_trip(name: str, dtype: torch.dtype) -> None:
    rope = ROPES[name]
    g = torch.Generator().manual_seed(4)
    n, heads = 17, 3
    x = torch.randn(n, heads, rope.head_dim, generator=g).to(dtype)
    positions = _positions(20000, n)
    y = apply_rope_reference(x, positions, rope)
    assert y.dtype == dtype
    back = apply_rope_reference(y, positions, rope, inverse=True)
    assert back.dtype == dtype
    # float32: a few ulps; fp16/bf16: the rotated values were rounded once to the storage dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(back.float(), x.float(), rtol=0, atol=(8 if dtype == torch.float32 else 3) * eps * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("inverse", [False, True])
def test_partial_rotary_tail_bit_identical(dtype: torch.dtype, inverse: bool) -> None:
    rope = RopeConfig(head_dim=80, rotary_dim=20, rope_type="yarn", factor=4.0, original_max_position_embeddings=512)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(11, 2, 80, generator=g).to(dtype)
    x[0, 0, 20:25] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-40])
    y = apply_rope_reference(x, _positions(3000, 11), rope, inverse=inverse)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    assert torch.equal(y[..., 20:].view(ints), x[..., 20:].view(ints))
    assert not torch.equal(y[..., :20], x[..., :20])


def test_low_precision_input_uses_float32_math() -> None:
    rope = ROPES["llama3"]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 2, 128, generator=g).to(torch.bfloat16)
    positions = _positions(100000, 7)
    assert torch.equal(
        apply_rope_reference(x, positions, rope), apply_rope_reference(x.float(), positions, rope).bfloat16()
    )


# ---------------------------------------------------------------------------------------------------------
# from_hf on plain objects (no transformers needed)


def _cfg(**kw) -> SimpleNamespace:
    base = dict(hidden_size=512, num_attention_heads=8, max_position_embeddings=4096)
    base.update(kw)
    return SimpleNamespace(**base)


def test_from_hf_legacy_rope_scaling() -> None:
    cfg = _cfg(rope_theta=500000, rope_scaling={"type": "linear", "factor": 2.0})
    assert RopeConfig.from_hf(cfg) == RopeConfig(
        head_dim=64, base=500000.0, rope_type="linear", factor=2.0, max_position_embeddings=4096
    )
    assert RopeConfig.from_hf(_cfg(rope_scaling=None)) == RopeConfig(head_dim=64, max_position_embeddings=4096)


def test_from_hf_resolves_yarn_defaults() -> None:
    cfg = _cfg(
        max_position_embeddings=163840,
        rope_parameters=dict(
            rope_type="yarn", factor=None, original_max_position_embeddings=4096, beta_fast=0, rope_theta=1e4
        ),
    )
    rope = RopeConfig.from_hf(cfg)
    assert (rope.factor, rope.beta_fast, rope.beta_slow, rope.truncate) == (40.0, 32.0, 1.0, True)
    cfg.rope_parameters["truncate"] = False
    assert RopeConfig.from_hf(cfg).truncate is False
    # Phi-3 style: a top-level original_max_position_embeddings wins over the rope dict
    cfg.original_max_position_embeddings = 2048
    assert RopeConfig.from_hf(cfg).original_max_position_embeddings == 2048


def test_from_hf_partial_head_dim_and_pairing() -> None:
    rope = RopeConfig.from_hf(_cfg(head_dim=None, partial_rotary_factor=0.25, rope_parameters={"rope_theta": 1e4}))
    assert (rope.head_dim, rope.rotary_dim, rope.interleaved) == (64, 16, False)
    rope = RopeConfig.from_hf(_cfg(head_dim=128, rope_parameters={"partial_rotary_factor": 0.5}))
    assert (rope.head_dim, rope.rotary_dim) == (128, 64)
    neox4 = _cfg(rotary_pct=0.25, rotary_emb_base=20000)  # GPT-NeoX in transformers 4.x
    assert (RopeConfig.from_hf(neox4).rotary_dim, RopeConfig.from_hf(neox4).base) == (16, 20000.0)
    gptj = _cfg(model_type="gptj", rotary_dim=32)
    assert (RopeConfig.from_hf(gptj).rotary_dim, RopeConfig.from_hf(gptj).interleaved) == (32, True)
    assert RopeConfig.from_hf(gptj, interleaved=False).interleaved is False
    assert RopeConfig.from_hf(_cfg(model_type="llama"), interleaved=True).interleaved is True


def test_from_hf_per_layer_type() -> None:
    cfg = _cfg(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    assert RopeConfig.from_hf(cfg, layer_type="full_attention").factor == 8.0
    assert RopeConfig.from_hf(cfg, layer_type="sliding_attention").base == 1e4
    for layer_type, match in [(None, "one rope per layer type"), ("global", "expected one of")]:
        with pytest.raises(ValueError, match=match):
            RopeConfig.from_hf(cfg, layer_type=layer_type)
    cfg.rope_parameters["sliding_attention"] = None
    with pytest.raises(ValueError, match="NoPE"):
        RopeConfig.from_hf(cfg, layer_type="sliding_attention")
    with pytest.raises(ValueError, match="single rope"):
        RopeConfig.from_hf(_cfg(), layer_type="full_attention")


@pytest.mark.parametrize(
    "params, match",
    [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "rope_type"),
        ({"rope_type": "proportional"}, "rope_type"),
        ({"rope_type": "default", "mrope_section": [16, 24, 24]}, "mrope_section"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor"),
        # a rope parameter the type needs, missing (was KeyError) or None (was TypeError naming `factor` only)
        ({"rope_type": "linear"}, r"config\.rope_parameters\['factor'\]: required by rope_type 'linear'"),
        ({"rope_type": "dynamic", "factor": None}, r"rope_parameters\['factor'\]: required.*got None"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, r"rope_parameters\['low_freq_factor'\]"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, r"rope_parameters\['high_freq_factor'\]"),
        # was "cannot convert float NaN to integer"
        ({"partial_rotary_factor": float("nan")}, r"rope_parameters\['partial_rotary_factor'\]"),
        ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
    ],
)
def test_from_hf_rejects(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RopeConfig.from_hf(_cfg(rope_parameters=params))


@pytest.mark.parametrize(
    "config, exc, match",
    [
        # head_dim absent / None: hidden_size // num_attention_heads (each was an AttributeError)
        (SimpleNamespace(), ValueError, "config.hidden_size, config.num_attention_heads: required"),
        (SimpleNamespace(hidden_size=512), ValueError, "config.num_attention_heads: required"),
        (SimpleNamespace(head_dim=None, num_attention_heads=8), ValueError, "config.hidden_size: required"),
        (_cfg(num_attention_heads=0), ValueError, "config.num_attention_heads"),  # was ZeroDivisionError
        (_cfg(hidden_size=512.0), TypeError, "config.hidden_size"),
        # yarn without factor: the ratio of the context lengths, which needs both (was a TypeError on None)
        (
            _cfg(
                max_position_embeddings=None,
                rope_parameters={"rope_type": "yarn", "original_max_position_embeddings": 64},
            ),
            ValueError,
            r"rope_parameters\['factor'\]: required by rope_type 'yarn'",
        ),
        (_cfg(rope_parameters={"rope_type": "yarn"}, original_max_position_embeddings=0), ValueError, "original_max"),
        # wrong types (were AttributeError / unnamed errors)
        (dict(hidden_size=512, num_attention_heads=8), TypeError, "config: expected a transformers config object"),
        (_cfg(rope_parameters=[("rope_type", "linear")]), TypeError, "config.rope_parameters"),
        (_cfg(rope_scaling="linear"), TypeError, "config.rope_scaling"),
        (_cfg(partial_rotary_factor="0.5"), TypeError, "config.partial_rotary_factor"),
        (
            _cfg(layer_types=["full_attention"], rope_parameters={"full_attention": 1.0}),
            TypeError,
            r"config.rope_parameters\['full_attention'\]",
        ),
    ],
)
def test_from_hf_rejects_config(config: object, exc: type, match: str) -> None:
    layer_type = "full_attention" if getattr(config, "layer_types", None) else None
    with pytest.raises(exc, match=match):
        RopeConfig.from_hf(config, layer_type=layer_type)


def test_from_hf_head_dim_without_hidden_size() -> None:
    rope = RopeConfig.from_hf(SimpleNamespace(head_dim=64))  # hidden_size / num_attention_heads not needed
    assert (rope.head_dim, rope.rotary_dim) == (64, 64)


def test_module_does_not_import_transformers() -> None:
    code = "import sys, kvcache.rope; sys.exit(1 if 'transformers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# ---------------------------------------------------------------------------------------------------------
# Validation


def test_defaults_frozen_hashable() -> None:
    rope = RopeConfig(head_dim=64)
    assert (rope.rotary_dim, rope.base, rope.rope_type, rope.interleaved) == (64, 10000.0, "default", False)
    assert ROPE_TYPES == ("default", "linear", "dynamic", "llama3", "yarn")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rope.base = 1.0  # type: ignore[misc]
    assert hash(rope) == hash(RopeConfig(head_dim=64, base=10000))
    assert isinstance(RopeConfig(head_dim=64, base=10000).base, float)


_L3 = dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)
_Y = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(head_dim=64.0), TypeError, "head_dim"),
        (dict(head_dim=1), ValueError, "head_dim"),
        (dict(head_dim=64, rotary_dim=96), ValueError, "rotary_dim"),
        (dict(head_dim=64, rotary_dim=31), ValueError, "rotary_dim: expected an even"),
        (dict(head_dim=64, rotary_dim=0), ValueError, "rotary_dim"),
        (dict(head_dim=64, base="1e4"), TypeError, "base"),
        (dict(head_dim=64, base=0.0), ValueError, "base"),
        (dict(head_dim=64, base=float("inf")), ValueError, "base"),
        (dict(head_dim=64, base=True), TypeError, "base"),
        (dict(head_dim=64, rope_type="longrope"), ValueError, "rope_type"),
        (dict(head_dim=64, rope_type=None), TypeError, "rope_type"),
        (dict(head_dim=64, factor=2.0), ValueError, "factor: rope_type 'default'"),
        (dict(head_dim=64, rope_type="linear", factor=0.0), ValueError, "factor"),
        (dict(head_dim=64, rope_type="linear", factor=-2.0), ValueError, "factor"),
        (dict(head_dim=64, rope_type="dynamic", factor=2.0), ValueError, "max_position_embeddings: required"),
        (dict(head_dim=64, rope_type="linear", factor=2.0, max_position_embeddings=0), ValueError, "max_position"),
        (dict(head_dim=64, rope_type="yarn", factor=4.0), ValueError, "original_max_position_embeddings"),
        (dict(head_dim=64, **_L3), ValueError, "low_freq_factor: required"),
        (dict(head_dim=64, low_freq_factor=1.0, high_freq_factor=1.0, **_L3), ValueError, "high_freq_factor"),
        (dict(head_dim=64, low_freq_factor=0.0, high_freq_factor=4.0, **_L3), ValueError, "low_freq_factor"),
        (dict(head_dim=64, low_freq_factor=1.0, **_Y), ValueError, "low_freq_factor: only used by"),
        (dict(head_dim=64, beta_fast=32.0), ValueError, "beta_fast: only used by rope_type 'yarn'"),
        (dict(head_dim=64, rope_type="linear", factor=2.0, attention_factor=1.0), ValueError, "attention_factor"),
        (dict(head_dim=64, mscale="1"), TypeError, "mscale"),
        (dict(head_dim=64, beta_fast=1.0, beta_slow=2.0, **_Y), ValueError, "beta_fast"),
        (dict(head_dim=64, beta_slow=0.0, **_Y), ValueError, "beta_slow"),
        (dict(head_dim=64, attention_factor=0.0, **_Y), ValueError, "attention_factor"),
        # dynamic NTK raises the base to d / (d - 2): rotary dim 2 divides by zero (as in transformers)
        (
            dict(head_dim=8, rotary_dim=2, rope_type="dynamic", factor=2.0, max_position_embeddings=16),
            ValueError,
            "rotary_dim: rope_type 'dynamic'",
        ),
        # a factor so large that the initial base (factor * m / m - (factor - 1)) ** ... rounds to <= 0 or overflows
        (dict(head_dim=8, rope_type="dynamic", factor=1e300, max_position_embeddings=7), ValueError, "factor"),
        (dict(head_dim=8, rope_type="dynamic", factor=1e20, max_position_embeddings=3), ValueError, "factor"),
        # yarn divides by log(base)
        (dict(head_dim=8, base=1.0, **_Y), ValueError, "base: rope_type 'yarn'"),
        (dict(head_dim=8, base=1, **_Y), ValueError, "base: rope_type 'yarn'"),
        # correction dim log(original / (beta * 2 pi)): log(0) (math domain error) or log(inf) (OverflowError)
        (dict(head_dim=64, beta_fast=1e308, **_Y), ValueError, "beta_fast: expected a float giving a finite"),
        (dict(head_dim=64, beta_slow=1e-320, **_Y), ValueError, "beta_slow: expected a float giving a finite"),
        # get_mscale(factor, mscale_all_dim) == 0 (ZeroDivisionError), or a scaling <= 0
        (dict(head_dim=64, mscale=1.0, mscale_all_dim=-10.0, **dict(_Y, factor=math.e)), ValueError, "mscale_all_dim"),
        (dict(head_dim=64, mscale=-20.0, mscale_all_dim=1.0, **_Y), ValueError, "mscale"),
        # lengths are int64 (and floats in the formulas): was OverflowError in inv_freq
        (
            dict(head_dim=64, rope_type="yarn", factor=4.0, original_max_position_embeddings=2**63),
            ValueError,
            "original_max_position_embeddings",
        ),
        (
            dict(head_dim=64, rope_type="dynamic", factor=2.0, max_position_embeddings=10**400),
            ValueError,
            "max_position_embeddings",
        ),
        (dict(head_dim=64, truncate=1), TypeError, "truncate"),
        (dict(head_dim=64, interleaved="yes"), TypeError, "interleaved"),
    ],
)
def test_config_validation(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        RopeConfig(**kwargs)


def test_validation_boundaries_still_accepted() -> None:
    """Next to the rejected values: each constructs and gives finite frequencies and cos / sin."""
    ropes = [
        RopeConfig(head_dim=8, rotary_dim=4, rope_type="dynamic", factor=2.0, max_position_embeddings=16),
        RopeConfig(head_dim=8, base=1.0, rope_type="dynamic", factor=2.0, max_position_embeddings=16),
        RopeConfig(head_dim=8, base=1.0, low_freq_factor=1.0, high_freq_factor=4.0, **_L3),
        RopeConfig(head_dim=8, base=0.5, **_Y),
        RopeConfig(head_dim=8, base=1.0 + 2**-52, **_Y),
        RopeConfig(head_dim=8, rotary_dim=2, **_Y),
        RopeConfig(head_dim=8, mscale=1.0, mscale_all_dim=0.0, **_Y),  # 0 means unset, as in transformers
    ]
    for rope in ropes:
        params = rope.kernel_params(seq_len=100)
        cos, sin = rope.cos_sin(torch.arange(100))
        assert params.inv_freq.isfinite().all() and cos.isfinite().all() and sin.isfinite().all(), rope


def test_call_validation() -> None:
    rope = RopeConfig(head_dim=64)
    x = torch.zeros(3, 2, 64)
    pos = torch.arange(3)
    cases = [
        (lambda: rope.cos_sin(pos.float()), ValueError, "positions: expected an integer dtype"),
        (lambda: rope.cos_sin(pos[None]), ValueError, "positions: expected a 1-d"),
        (lambda: rope.cos_sin([0, 1]), TypeError, "positions"),
        (lambda: rope.inv_freq(seq_len=0), ValueError, "seq_len"),
        (lambda: rope.inv_freq(seq_len=torch.tensor(5)), TypeError, "seq_len"),
        # dynamic NTK makes seq_len an int64 tensor (was "Overflow when unpacking long long")
        (lambda: ROPES["dynamic"].inv_freq(seq_len=2**63), ValueError, "seq_len"),
        (lambda: ROPES["dynamic"].kernel_params(seq_len=2**63), ValueError, "seq_len"),
        (lambda: apply_rope_reference(x, pos, "rope"), TypeError, "config"),
        (
            lambda: apply_rope_reference(torch.zeros(3, 2, 32), pos, rope),
            ValueError,
            r"x: expected shape \[n, num_heads, 64\]",
        ),
        (lambda: apply_rope_reference(torch.zeros(3, 64), pos, rope), ValueError, "x: expected shape"),
        (lambda: apply_rope_reference(x.long(), pos, rope), ValueError, "x: expected a floating"),
        (lambda: apply_rope_reference(x, pos[:2], rope), ValueError, r"positions: expected shape \[3\]"),
        (lambda: apply_rope_reference(x, pos.to("meta"), rope), ValueError, "positions: expected device"),
        (lambda: apply_rope_reference(x, pos, rope, inverse=1), TypeError, "inverse"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
