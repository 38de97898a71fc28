"""``python -m kvcache.bench.engine``: the offline engine's generated tokens/s against Hugging Face ``generate``.

Workload (issue 15): a random-weight Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 / 8 heads, head_dim 64,
vocab 128256, bf16, llama3 RoPE; built with transformers' ``LlamaConfig`` + ``LlamaForCausalLM`` on the GPU, no
download), 64 requests x 512 random prompt tokens + 128 new tokens, greedy, EOS ignored. In one run:

* ``kvcache.engine.LLM`` per kv_dtype (auto = bf16, fp8, int8, int4): continuous batching, paged cache, decode
  steps in CUDA graphs; generated tokens / wall time of ``generate`` (after a warm-up that captures the graphs;
  the median of three timed runs, all three reported);
* transformers ``generate`` on the same 64 x 512 batch with its DynamicCache, and with ``cache_implementation=
  "static"`` (StaticCache);
* peak GPU memory of each (``torch.cuda.max_memory_allocated``, weights included);
* each engine row's greedy tokens against the DynamicCache run's (identical requests, agreeing first tokens:
  bf16 with random weights, so reported, not required: a sanity check of the GPU path, CUDA graphs included);
* a long-context row (8 requests x 16k prompt tokens, ``--long``), and the largest number of concurrent 4k-token
  sequences whose KV fits in 60 GiB per kv_dtype (from ``cache_block_bytes``: arithmetic, not a run).

``--capacity``: what a stored format buys when memory limits the batch. A random-weight Llama-3.1-8B-shaped model
(hidden 4096, 32 layers, 32 / 8 heads, head_dim 128, bf16), a fixed 4 GiB KV budget, 192 requests x (512 prompt +
512 new) tokens, one timed run per kv_dtype after a warm-up run of the same workload: generated tokens/s and its
ratio to bf16 KV, decode tokens per step (the batch the budget held), preemptions, and the bytes per token the
format stores. ``--decode-reserves default,0`` runs every kv_dtype under each admission policy
(``EngineConfig.decode_reserve``: the default, learned, never preempts requests that run to ``max_tokens``; 0 admits
while the next chunk fits and preempts). ``--varied-lengths``: each request's max_tokens drawn from 64..960 (mean
525, seeded), so requests finish at different steps.

Writes JSON (``--out``). ``--quick``: 16 requests x 128 + 32 tokens, for a smoke test.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from typing import Any

import torch

from ..ops.paged.format import KV_FORMATS
from ..paged import cache_block_bytes

__all__ = ["main"]

REPEATS = 5
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, vocab_size=128256)


class _IdsOnlyTokenizer:
    """The bench feeds token ids and reads token ids: decoding is not part of what is measured."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def _model(device: torch.device, shape: dict | None = None) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(shape or SHAPE), max_position_embeddings=131072, tie_word_embeddings=True,
                         rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         bos_token_id=128000, eos_token_id=128001, pad_token_id=128001)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256)
CAPACITY = dict(requests=192, prompt_tokens=512, new_tokens=512, kv_gib=4)


def _prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _engine_row(model: Any, prompts: list[list[int]], new: int, kv_dtype: str, kv_bytes: int,
                max_num_seqs: int) -> dict:
    from ..engine import LLM, SamplingParams

    _free()
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm = LLM(model, tokenizer=_IdsOnlyTokenizer(), kv_dtype=kv_dtype, max_num_seqs=max_num_seqs,
              kv_cache_memory=kv_bytes, max_model_len=max(len(p) for p in prompts) + new,
              enable_prefix_caching=False)
    # warm-up: the same workload once, so every kernel is compiled and every decode bucket the run passes
    # through (requests finish in waves as their prefills were chunked) is captured before the timed run
    llm.generate(prompts, sp)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # REPEATS timed runs (a run takes well under a second, so single runs are noisy); the row reports the median
    runs = []
    for _ in range(REPEATS):
        outs = llm.generate(prompts, sp)
        runs.append(llm.stats.elapsed_s)
    st = llm.stats
    elapsed = sorted(runs)[len(runs) // 2]
    row = {"kind": "kvcache.engine", "kv_dtype": kv_dtype, "generated_tokens": st.generated_tokens,
           "elapsed_s": elapsed, "generated_tok_s": st.generated_tokens / elapsed,
           "runs_tok_s": [round(st.generated_tokens / e) for e in runs],
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "cache_gib": st.cache_bytes / 2**30,
           "steps": st.steps, "graph_steps": st.graph_steps, "attention": st.attention,
           "preemptions": st.preemptions, "blocks_used": st.blocks_used}
    if any(len(o.token_ids) != new for o in outs):
        row["error"] = "a request generated fewer tokens than asked"
    row["_tokens"] = [o.token_ids for o in outs]
    del llm, outs
    return row


def _hf_row(model: Any, prompts: list[list[int]], new: int, static: bool) -> dict:
    _free()
    ids = torch.tensor(prompts, device=model.device)
    kw: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              attention_mask=torch.ones_like(ids), pad_token_id=model.config.pad_token_id)
    if static:
        kw["cache_implementation"] = "static"
    with torch.inference_mode():
        model.generate(ids[:, :16], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4,
                                       "attention_mask": torch.ones_like(ids[:, :16])})
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"kind": "transformers generate", "cache": "StaticCache" if static else "DynamicCache",
            "generated_tokens": n, "elapsed_s": dt, "generated_tok_s": n / dt,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "_tokens": out[:, ids.shape[1]:].tolist()}


def _public(row: dict) -> dict:
    """The row without its private fields (the generated token ids kept for :func:`_agreement`)."""
    return {k: v for k, v in row.items() if not k.startswith("_")}


def _agreement(rows: list[dict]) -> None:
    """Each engine row's greedy tokens against transformers' DynamicCache run (bf16: reported, not required):
    requests whose tokens are identical, and requests whose first token agrees (it comes from the prefill)."""
    ref = next((r["_tokens"] for r in rows if r.get("cache") == "DynamicCache" and "_tokens" in r), None)
    for r in rows:
        toks = r.pop("_tokens", None)
        if ref is None or toks is None or r.get("kind") != "kvcache.engine" or len(toks) != len(ref):
            continue
        r["identical_to_hf_dynamic"] = f"{sum(a == b for a, b in zip(toks, ref))}/{len(ref)}"
        r["first_token_agrees_with_hf_dynamic"] = f"{sum(a[:1] == b[:1] for a, b in zip(toks, ref))}/{len(ref)}"


def _capacity_lengths(n: int, varied: bool) -> list[int]:
    """Each request's max_tokens: :data:`CAPACITY`'s ``new_tokens``, or (``varied``) drawn uniformly from 64..960
    (seeded: a mean of 525 over 192 requests), so that requests finish at different steps."""
    if not varied:
        return [CAPACITY["new_tokens"]] * n
    return torch.randint(64, 961, (n,), generator=torch.Generator().manual_seed(5)).tolist()


def _capacity_row(model: Any, prompts: list[list[int]], kv_dtype: str, varied: bool = False, **engine: Any) -> dict:
    """One timed run of the capacity workload (:data:`CAPACITY`; ``varied``: max_tokens per request from
    :func:`_capacity_lengths`) with ``kv_dtype``, after a warm-up run of the same workload; ``engine``: more
    :class:`~kvcache.engine.EngineConfig` fields."""
    from ..engine import LLM, SamplingParams

    _free()
    lengths = _capacity_lengths(len(prompts), varied)
    new = max(lengths)
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    llm = LLM(model, tokenizer=_IdsOnlyTokenizer(), kv_dtype=kv_dtype, max_num_seqs=len(prompts),
              kv_cache_memory=CAPACITY["kv_gib"] * 2**30, max_model_len=len(prompts[0]) + new,
              enable_prefix_caching=False, **engine)
    # warm-up: the whole workload once, so every kernel is compiled and every decode bucket the run passes through
    # is captured before the timed run (a shorter warm-up leaves compilation and capture inside the timed run)
    llm.generate(prompts, sp)
    torch.cuda.synchronize()
    outs = llm.generate(prompts, sp)
    st = llm.stats
    row = {"kind": "kvcache.engine capacity", "kv_dtype": kv_dtype, "generated_tokens": st.generated_tokens,
           "elapsed_s": st.elapsed_s, "generated_tok_s": st.generated_tokens / st.elapsed_s,
           "tokens_per_step": st.generated_tokens / max(st.steps, 1), "steps": st.steps,
           "preemptions": st.preemptions, "cache_gib": st.cache_bytes / 2**30,
           "kv_bytes_per_token": cache_block_bytes(SHAPE_8B["num_hidden_layers"], SHAPE_8B["num_key_value_heads"],
                                                   SHAPE_8B["head_dim"], 16, torch.bfloat16, kv_dtype) // 16}
    if [len(o.token_ids) for o in outs] != lengths:
        row["error"] = "a request generated fewer tokens than asked"
    del llm, outs
    return row


def _fits_60gib(block_size: int = 16, seq_len: int = 4096) -> list[dict]:
    rows = []
    for kv in KV_FORMATS:
        bb = cache_block_bytes(SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"], SHAPE["head_dim"], block_size,
                               torch.bfloat16, kv)
        per_seq = -(-seq_len // block_size) * bb
        rows.append({"kv_dtype": kv, "block_bytes": bb, "bytes_per_4k_seq": per_seq,
                     "max_concurrent_4k_seqs_in_60GiB": (60 * 2**30) // per_seq})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the engine benchmark; returns the exit code (0 ok, 1 a row failed).

    Parameters
    ----------
    argv : list of str, optional
        ``--out FILE`` (JSON, default ``engine_bench.json``), ``--quick``, ``--long`` (add the 8 x 16k row),
        ``--kv-dtypes auto,int8,int4``, ``--no-hf``, ``--capacity`` (the fixed-budget workload alone),
        ``--decode-reserves default,0`` (with ``--capacity``: each kv_dtype under each admission policy, see
        ``EngineConfig.decode_reserve``), ``--varied-lengths`` (with ``--capacity``: max_tokens from 64 to 960).

    Example
    -------
    >>> main(["--quick", "--out", "/tmp/engine.json"])   # doctest: +SKIP
    0
    """
    p = argparse.ArgumentParser(prog="python -m kvcache.bench.engine", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="engine_bench.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--long", action="store_true", help="add 8 requests x 16k prompt tokens")
    p.add_argument("--kv-dtypes", default=",".join(KV_FORMATS), help="comma-separated, of " + ", ".join(KV_FORMATS))
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--capacity", action="store_true",
                   help="only the fixed-budget workload: 8B shape, 4 GiB of KV, 192 x (512 + 512), per kv_dtype")
    p.add_argument("--decode-reserves", default="default",
                   help="with --capacity: comma-separated decode_reserve values ('default' or a float in [0, 1])")
    p.add_argument("--varied-lengths", action="store_true",
                   help="with --capacity: each request's max_tokens drawn from 64..960 (seeded), not 512")
    args = p.parse_args(argv)
    reserves = _reserves(p, args.decode_reserves)
    kv_dtypes = [k for k in args.kv_dtypes.split(",") if k]
    bad = [k for k in kv_dtypes if k not in KV_FORMATS]
    if bad:
        p.error(f"--kv-dtypes: expected values of {KV_FORMATS}, got {bad[0]!r}")
    if not torch.cuda.is_available():
        print("kvcache.bench.engine: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if args.capacity:
        return _capacity_main(args.out, kv_dtypes, dev, reserves, args.varied_lengths)
    n_req, plen, new = (16, 128, 32) if args.quick else (64, 512, 128)
    model = _model(dev)
    prompts = _prompts(n_req, plen, SHAPE["vocab_size"])
    result: dict[str, Any] = {
        "benchmark": "kvcache.bench.engine", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "workload": {"requests": n_req, "prompt_tokens": plen, "new_tokens": new, "model": SHAPE, "dtype": "bf16"},
        "rows": [], "fits_60GiB": _fits_60gib(),
    }
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    code = 0
    kv_bytes = 8 * 2**30

    def run(label: str, fn: Any) -> None:
        nonlocal code
        t0 = time.perf_counter()
        try:
            row = fn()
        except Exception as e:  # one failed row must not lose the others
            row = {"kind": label, "error": f"{type(e).__name__}: {e}"}
            code = 1
        row["wall_s"] = time.perf_counter() - t0
        result["rows"].append(row)
        print(json.dumps(_public(row)), flush=True)
        dump()

    def dump() -> None:
        with open(args.out, "w") as f:
            json.dump({**result, "rows": [_public(r) for r in result["rows"]]}, f, indent=2)

    for kv in kv_dtypes:
        run(f"engine {kv}", lambda kv=kv: _engine_row(model, prompts, new, kv, kv_bytes, n_req))
    if not args.no_hf:
        run("hf dynamic", lambda: _hf_row(model, prompts, new, static=False))
        run("hf static", lambda: _hf_row(model, prompts, new, static=True))
    if args.long:
        long_prompts = _prompts(8, 16384, SHAPE["vocab_size"], seed=2)
        for kv in kv_dtypes:
            run(f"engine long {kv}", lambda kv=kv: {**_engine_row(model, long_prompts, new, kv, 16 * 2**30, 8),
                                                     "long_context": "8 x 16384"})
    _agreement(result["rows"])
    dump()
    print(f"wrote {args.out}")
    return code


def _reserves(p: argparse.ArgumentParser, spec: str) -> list[float | None]:
    out: list[float | None] = []
    for v in spec.split(","):
        try:
            r = None if v == "default" else float(v)
        except ValueError:
            r = -1.0
        if r is not None and not 0 <= r <= 1:
            p.error(f"--decode-reserves: expected 'default' or floats in [0, 1], got {v!r}")
        out.append(r)
    return out


def _capacity_main(out: str, kv_dtypes: list[str], dev: torch.device, reserves: list[float | None],
                   varied: bool = False) -> int:
    """``--capacity``: one row per (decode_reserve, kv_dtype), each with its tokens/s relative to bf16 KV (``auto``)
    under the same decode_reserve when it ran."""
    model = _model(dev, SHAPE_8B)
    prompts = _prompts(CAPACITY["requests"], CAPACITY["prompt_tokens"], SHAPE_8B["vocab_size"], seed=3)
    rows, code = [], 0
    for reserve, kv in [(r, kv) for r in reserves for kv in kv_dtypes]:
        label = "default" if reserve is None else reserve
        try:
            row = _capacity_row(model, prompts, kv, varied, decode_reserve=reserve)
        except Exception as e:  # one failed row must not lose the others
            row, code = {"kind": "kvcache.engine capacity", "kv_dtype": kv, "error": f"{type(e).__name__}: {e}"}, 1
        row["decode_reserve"] = label
        rows.append(row)
        base = next((r for r in rows if r["kv_dtype"] == "auto" and r["decode_reserve"] == label and
                     "error" not in r), None)
        if base is not None and "error" not in row:
            row["vs_auto"] = row["generated_tok_s"] / base["generated_tok_s"]
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump({"benchmark": "kvcache.bench.engine --capacity", "device": torch.cuda.get_device_name(dev),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__,
                   "workload": {**CAPACITY, "varied_lengths": varied, "model": SHAPE_8B, "dtype": "bf16"},
                   "rows": rows}, f, indent=2)
    print(f"wrote {out}")
    return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
