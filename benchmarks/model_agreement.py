"""bf16 agreement of the engine with transformers, per architecture, on the GPU: tiny random-weight models from
transformers' own configs (tests/support_models.py: windows of 8, soft-caps, sinks, fused projections) built in
bf16, ``--prompts`` random prompts of ``--prompt-len`` tokens, ``--new`` greedy tokens; transformers' ``generate``
(eager attention, one prompt at a time) against ``LLM.generate`` on the paged cache in CUDA graphs and eager.
Reports, per architecture and engine mode, the requests whose tokens are identical and the mean first divergence
(bf16 reorders sums, so near-ties flip: reported, not required; fp32 equality is tests/engine/test_support_cuda.py).

    PYTHONPATH=src:tests python benchmarks/model_agreement.py
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _tokens(model, prompts: list[list[int]], new: int) -> list[list[int]]:  # noqa: ANN001
    outs = []
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p], device="cuda")
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
            outs.append(y[0, len(p):].tolist())
    return outs


def main() -> int:
    import support_models as sm
    from kvcache.engine import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="llama,qwen3,mistral_window,qwen2_window,phi3,gemma2,gemma3,gpt_oss")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()

    class Tok:
        def decode(self, ids, **kwargs):  # noqa: ANN001, ANN003, ANN201
            return ""

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, sm.VOCAB, (a.prompts, a.prompt_len), generator=g).tolist()
    sp = SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True)
    print(f"{'architecture':<16} {'engine':<18} {'identical':>10} {'first divergence':>17}")
    for name in a.archs.split(","):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # parameters in bf16, RoPE frequencies computed in fp32
        try:
            model = sm.build(name).to("cuda")
        finally:
            torch.set_default_dtype(old)
        want = _tokens(model, prompts, a.new)
        for graphs in (True, False):
            llm = LLM(model, tokenizer=Tok(), cuda_graphs=graphs, max_num_seqs=a.prompts,
                      max_model_len=a.prompt_len + a.new)
            got = [o.token_ids for o in llm.generate(prompts, sp)]
            del llm
            same = sum(x == y for x, y in zip(got, want))
            firsts = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), a.new) for x, y in zip(got, want)]
            print(f"{name:<16} {'paged, graphs' if graphs else 'paged, eager':<18} {same:>6}/{len(want):<3} "
                  f"{statistics.mean(firsts):>17.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
