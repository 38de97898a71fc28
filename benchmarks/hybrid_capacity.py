"""Sliding-window layers holding only their window, measured: a Gemma-3-shaped random model (5 window layers per
global layer) on 8k-token sequences at a fixed KV budget, run twice on the paged engine: with its window groups
(each window layer holds at most ``ceil(window / block_size) + 1`` blocks of a sequence) and with every layer global
(the same weights, ``layer_types`` all ``full_attention``). Prints one table: the sequences the pool fits (from its
sizing: each group's blocks over what a ``prompt + new``-token sequence needs there), the peak of running sequences,
generated tokens/s (and prompt + generated tokens/s), preemptions, elapsed time.

Each variant first runs a warm-up (short requests of every decode batch size: kernels compiled, CUDA graphs
captured), then the timed ``generate`` of ``--requests`` random prompts (EOS ignored, greedy, prefix caching off).

    python benchmarks/hybrid_capacity.py                  # H200: 64 x (8064 + 128) tokens, 8 GiB of KV, bf16
    python benchmarks/hybrid_capacity.py --kv-gib 4 --out hybrid.json
    python benchmarks/hybrid_capacity.py --quick          # a tiny float32 model on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import torch


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny float32 model on the CPU, small sizes (seconds)")
    p.add_argument("--kv-gib", type=float, default=8.0, help="the KV budget of each variant")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=8064, help="prompt tokens of each request")
    p.add_argument("--new", type=int, default=128, help="generated tokens of each request (EOS ignored)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12, help="a multiple of 6: 5 window layers per global one")
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--intermediate", type=int, default=10240)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="token budget of a step: a prefill chunk's window blocks are held for one step")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    if a.quick:
        a.kv_gib, a.requests, a.prompt, a.new, a.window, a.layers = 200 * 1024 / 2**30, 8, 48, 8, 16, 6
        a.hidden, a.intermediate, a.heads, a.kv_heads, a.head_dim, a.vocab = 64, 128, 4, 2, 16, 128
        a.block_size, a.max_batched_tokens = 4, 16
    if a.layers % 6:
        raise SystemExit(f"--layers: expected a multiple of 6 (5 window layers per global one), got {a.layers}")
    return a


class _Ids:
    """The engine's tokenizer for token-id prompts (outputs are not read)."""

    def decode(self, ids, **kwargs) -> str:
        return ""


def _config(a: argparse.Namespace, hybrid: bool):
    from transformers import Gemma3TextConfig

    types = ["full_attention" if not hybrid or i % 6 == 5 else "sliding_attention" for i in range(a.layers)]
    return Gemma3TextConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim, sliding_window=a.window,
        layer_types=types, query_pre_attn_scalar=a.head_dim, max_position_embeddings=a.prompt + a.new,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)


def _build(config, device: torch.device, dtype: torch.dtype, state: dict | None = None):
    """A random-weight model of ``config`` built on ``device`` in ``dtype`` (seed 0), or with ``state``'s weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    finally:
        torch.set_default_dtype(prev)
    if state is not None:
        model.load_state_dict(state)
    return model


def _run(model, a: argparse.Namespace, label: str) -> dict:
    from kvcache.engine import LLM, SamplingParams
    from kvcache.paged.groups import blocks_per_seq

    seq_len = a.prompt + a.new
    llm = LLM(model, tokenizer=_Ids(), max_model_len=seq_len, block_size=a.block_size,
              kv_cache_memory=int(a.kv_gib * 2**30), max_num_seqs=a.requests,
              max_num_batched_tokens=a.max_batched_tokens, enable_prefix_caching=False)
    core = llm.core
    fits = min(alloc.num_blocks // blocks_per_seq(g.window, seq_len, a.block_size)
               for g, alloc in zip(core.groups, core.allocators))
    g = torch.Generator().manual_seed(1)
    # warm-up: requests of 1.. n new tokens, so every decode batch size (every graph bucket) runs once, and one
    # full-length prompt (the long prefill chunks' and decode steps' launches)
    n = min(a.requests, max(fits, 1))
    warm = [torch.randint(3, a.vocab, (32,), generator=g).tolist() for _ in range(n)]
    warm.append(torch.randint(3, a.vocab, (a.prompt,), generator=g).tolist())
    llm.generate(warm, [SamplingParams(max_tokens=i + 1, temperature=0, ignore_eos=True) for i in range(n)]
                 + [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)])
    prompts = [torch.randint(3, a.vocab, (a.prompt,), generator=g).tolist() for _ in range(a.requests)]
    peak, sched = [0], llm.scheduler

    def progress(done: int, total: int, generated: int) -> None:
        peak[0] = max(peak[0], len(sched.running))

    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True), progress=progress)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    elapsed = time.perf_counter() - t0
    st = llm.stats
    assert all(len(o.token_ids) == a.new for o in outs)
    row = {"variant": label, "groups": "; ".join(str(x) for x in core.groups), "kv_gib": a.kv_gib,
           "cache_gib": st.cache_bytes / 2**30, "fits": fits, "peak_running": peak[0],
           "generated_tok_s": st.generated_tokens / elapsed,
           "total_tok_s": (st.generated_tokens + st.prompt_tokens) / elapsed, "preemptions": st.preemptions,
           "elapsed_s": elapsed, "steps": st.steps, "graph_steps": st.graph_steps,
           "group_blocks": [(x.window, x.num_blocks, x.blocks_used) for x in st.groups]}
    return row


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """Build the model, run both variants, print the table; returns 0."""
    a = _args(argv)
    cuda = torch.cuda.is_available() and not a.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    # tiny matrices: one intra-op thread (a second one mostly waits on a shared CPU)
    torch.set_num_threads(1 if a.quick else min(torch.get_num_threads(), 8))
    t0 = time.perf_counter()
    hybrid = _build(_config(a, True), device, dtype)
    rows = [_run(hybrid, a, "window groups")]
    _free(device)  # the first engine's pools
    state = copy.copy(hybrid.state_dict())
    full = _build(_config(a, False), device, dtype, state)  # the same weights, every layer global
    del hybrid, state
    _free(device)
    rows.append(_run(full, a, "every layer global"))
    print(f"{a.requests} requests x ({a.prompt} prompt + {a.new} new tokens), {a.layers} layers (window {a.window} "
          f"on 5 of 6), {a.kv_heads} KV heads x {a.head_dim}, {str(dtype).removeprefix('torch.')} on {device.type}, "
          f"{a.kv_gib:.3g} GiB of KV, blocks of {a.block_size}, step budget {a.max_batched_tokens} tokens\n")
    print("| variant | fits (sizing) | peak running | generated tok/s | total tok/s | preemptions | elapsed s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['fits']} | {r['peak_running']} | {r['generated_tok_s']:,.0f} | "
              f"{r['total_tok_s']:,.0f} | {r['preemptions']} | {r['elapsed_s']:.1f} |")
    w, f = rows
    print(f"\nwindow groups / every layer global: fits {w['fits'] / max(f['fits'], 1):.2f}x, peak running "
          f"{w['peak_running'] / max(f['peak_running'], 1):.2f}x, generated tok/s "
          f"{w['generated_tok_s'] / f['generated_tok_s']:.2f}x (wall {time.perf_counter() - t0:.0f} s in all)")
    for r in rows:
        print(f"{r['variant']}: {r['groups']}; (window, blocks, peak used) per group {r['group_blocks']}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"args": vars(a), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
