"""GPU benchmark of Hugging Face ``generate`` through kvcache's transformers caches (run by hand on a GPU):

    PYTHONPATH=src python -m tests.hf.bench_generate --out $OUT/hf_generate.json
    PYTHONPATH=src python -m kvcache plot $OUT/hf_generate.json

A random-weight Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 / 8 heads, head_dim 64, vocab 128256,
bfloat16), ``--requests`` prompts of ``--prompt`` random tokens, ``--new`` greedy tokens each (no EOS), one
``generate`` call per cache: DynamicCache, StaticCache, kvcache.hf.LinearCache, PagedCache with gathered K / V
(sdpa) and PagedCache with the ``kvcache_paged`` attention (auto, fp8, int8, int4). Generated tokens / s and
peak GPU memory per row; token agreement with DynamicCache. The JSON's ``throughput`` rows plot with
``kvcache plot``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--out", default="hf_generate.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate: needs a CUDA device")
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from kvcache.hf import LinearCache, PagedCache

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    B, P, N = args.requests, args.prompt, args.new
    ids = torch.randint(0, cfg.vocab_size, (B, P), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    total = P + N

    def run(name: str, attn: str, make_cache, **gen_kw) -> dict:
        model.set_attn_implementation(attn)

        def generate(n_prompt: int, n_new: int) -> torch.Tensor:
            cache = make_cache()
            kw = dict(gen_kw, **({"past_key_values": cache} if cache is not None else {}))
            return model.generate(input_ids=ids[:, :n_prompt], attention_mask=mask[:, :n_prompt],
                                  max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0, **kw)

        generate(16, 4)  # warm-up: kernels compiled, allocator primed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        out = generate(P, N)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        row = {"impl": name, "tok_s": B * N / dt, "seconds": dt,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "tokens": out[:, P:].cpu()}
        print(f"{name:55s} {row['tok_s']:9.0f} tok/s  {dt:7.2f} s  peak {row['peak_gib']:.1f} GiB", flush=True)
        return row

    rows = [
        run("generate + DynamicCache", "sdpa", lambda: DynamicCache(config=model.config)),
        run("generate + StaticCache", "sdpa", lambda: None, cache_implementation="static"),
        run("generate + kvcache.hf.LinearCache (auto)", "sdpa",
            lambda: LinearCache(model.config, max_batch_size=B, max_cache_len=total)),
        run("generate + kvcache.hf.PagedCache (auto, gathered K/V, sdpa)", "sdpa",
            lambda: PagedCache(model.config, max_batch_size=B, max_cache_len=total)),
    ]
    for kv in ("auto", "fp8", "int8", "int4"):
        rows.append(run(f"generate + kvcache.hf.PagedCache ({kv}, kvcache_paged attention)", "kvcache_paged",
                        lambda kv=kv: PagedCache(model.config, max_batch_size=B, max_cache_len=total, kv_dtype=kv)))
    ref = rows[0]["tokens"]
    for r in rows:
        r["tokens_equal_dynamic"] = float((r.pop("tokens") == ref).float().mean())
        print(f"{r['impl']:55s} tokens equal to DynamicCache: {r['tokens_equal_dynamic']:.1%}")
    result = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="minutes"), "torch": torch.__version__, "transformers": transformers.__version__,
        "workload": f"{B} requests x {P} prompt + {N} new tokens, greedy, Llama-3.2-1B-shaped bf16 (random)",
        "rows": [], "throughput": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
