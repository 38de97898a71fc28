"""The engine's fused decoder ops (kvcache.engine.kernels) against their torch formulas, and the fused decoder
against transformers: Triton's interpreter on the CPU (compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvcache.engine import LLM, SamplingParams
from kvcache.engine.kernels import rms_norm, rope_rotate, silu_mul


def _hf_rms(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_with_and_without_residual(device, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(device, dtype)
    r = torch.randn(5, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    y, h = rms_norm(x, w, 1e-5)
    assert h is x
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.float(), _hf_rms(x, w, 1e-5).float(), atol=tol, rtol=tol)
    y2, h2 = rms_norm(x, w, 1e-5, residual=r)
    # the residual sum is rounded to the dtype like torch's add (to one bf16 ulp: the interpreter truncates bf16)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(h2, x + r, atol=0, rtol=ulp)
    torch.testing.assert_close(y2.float(), _hf_rms(x + r, w, 1e-5).float(), atol=tol, rtol=tol)
    assert y2.dtype == dtype and y2.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(device, dtype):
    x = torch.randn(7, 2 * 300, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    want = torch.nn.functional.silu(x[:, :300]) * x[:, 300:]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(silu_mul(x).float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rope_rotate_matches_rotate_half(device, rot_dim):
    g = torch.Generator().manual_seed(rot_dim)
    x = torch.randn(6, 3 * 16, generator=g).to(device).view(6, 3, 16)[:, :, :]  # head_dim 16
    qkv = torch.randn(6, 5 * 16, generator=g).to(device)
    q = qkv[:, :48].view(6, 3, 16)  # strided rows, as the engine's fused q / k / v GEMM gives
    inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    ang = torch.arange(40).float()[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    pos = torch.tensor([0, 3, 39, 7, 7, 1], device=device)
    for t in (x, q):
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        xr = t[..., :rot_dim]
        rot = torch.cat((-xr[..., rot_dim // 2:], xr[..., :rot_dim // 2]), -1)
        want = torch.cat((xr * c + rot * s, t[..., rot_dim:]), -1)
        got = rope_rotate(t, cos, sin, pos)
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_bad_inputs_raise(device):
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8, device=device), torch.ones(4, device=device), 1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="positions"):
        rope_rotate(torch.randn(2, 1, 8, device=device), torch.ones(4, 8, device=device),
                    torch.ones(4, 8, device=device), torch.tensor([0, 1], dtype=torch.int32, device=device))


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.mark.parametrize("graphs", [False, True], ids=["step-by-step", "overlapped"])
def test_fused_decoder_tokens_equal_transformers(backend, graphs):
    # under the interpreter (and on CUDA) the engine runs its fused decoder: fused q / k / v and gate / up GEMMs,
    # add + RMSNorm, SiLU-mul, the queries rotated inside the attention kernel; greedy tokens equal transformers'
    # (float32), with every step read before the next and with steps launched ahead (graph buffers uncaptured)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (5, 19)]
    refs = []
    for p in prompts:
        x = torch.tensor([p])
        with torch.inference_mode():
            refs.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8,
                                       do_sample=False)[0, len(p):].tolist())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    llm = LLM(model, tokenizer=_NoText(), max_num_seqs=2, block_size=4, max_num_batched_tokens=16, max_model_len=40,
              cuda_graphs=graphs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    # fusing left the model's weights as they were (its modules now view the concatenated matrices)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k


@pytest.mark.parametrize("how", ["new_parameter", "data", "bias", "module", "layer", "o_proj", "lm_head"])
def test_fused_decoder_refuses_replaced_weights(backend, how):
    # the fused decoder's q / k / v and gate / up matrices (and q / k / v biases) are what the modules' parameters
    # view: a parameter replaced (not written in place) after the engine was built is refused, not silently ignored:
    # a new Parameter object, new storage under the same object (`.data =`), a replaced bias, a replaced projection
    # module (an injected adapter), a replaced decoder layer, and modules outside the fused matrices that CUDA graphs
    # capture (o_proj's weight, lm_head)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=64, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1, attention_bias=how == "bias")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    llm = LLM(model, tokenizer=_NoText(), max_num_seqs=1, block_size=4, max_model_len=32, cuda_graphs=False)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], sp)[0].token_ids
    layer = model.model.layers[0]
    up = layer.mlp.up_proj
    with torch.no_grad():
        up.weight.copy_(up.weight * 1.0)  # in place: fine
    assert llm.generate([[5, 6, 7]], sp)[0].token_ids == first
    if how == "new_parameter":
        up.weight = torch.nn.Parameter(up.weight.detach().clone())
    elif how == "data":
        layer.self_attn.k_proj.weight.data = layer.self_attn.k_proj.weight.detach().clone()
    elif how == "bias":
        layer.self_attn.q_proj.bias = torch.nn.Parameter(layer.self_attn.q_proj.bias.detach().clone())
    elif how == "module":  # the same values in a new module
        new = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        new.load_state_dict(up.state_dict())
        layer.mlp.up_proj = new
    elif how == "layer":  # the same values in a new decoder layer
        new = type(layer)(cfg, 0).eval()
        new.load_state_dict(layer.state_dict())
        model.model.layers[0] = new
    elif how == "o_proj":
        layer.self_attn.o_proj.weight = torch.nn.Parameter(layer.self_attn.o_proj.weight.detach().clone())
    else:  # the same values in a new output head
        new = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        new.load_state_dict(model.lm_head.state_dict())
        model.lm_head = new
    if backend == "interpreter":
        with pytest.raises(RuntimeError, match="replaced"):
            llm.generate([[5, 6, 7]], sp)
        assert llm.allocator.num_used_blocks == 0
    else:  # the torch backend runs the model's modules themselves: the new ones are simply used
        assert llm.generate([[5, 6, 7]], sp)[0].token_ids == first
