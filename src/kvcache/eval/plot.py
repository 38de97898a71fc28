"""The eval's plot (matplotlib, optional: the ``bench`` extra): per format, perplexity change and top-1 /
greedy agreement against bytes per token."""

from __future__ import annotations

import os

from .report import EvalReport

__all__ = ["plot_report"]


def plot_report(report: EvalReport, path: str | os.PathLike) -> str:
    """Write a PNG: left, perplexity change (%) against bytes per token and layer; right, top-1 agreement and
    greedy answers identical to the reference, per format.

    Parameters
    ----------
    report : EvalReport
    path : str or os.PathLike
        The PNG to write.

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    ImportError
        matplotlib is not installed (``pip install 'kvcache[bench]'``).

    Example
    -------
    >>> plot_report(report, "eval.png")  # doctest: +SKIP
    'eval.png'
    """
    if not isinstance(report, EvalReport):
        raise TypeError(f"report: expected an EvalReport, got {type(report).__name__}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.kv_dtype for r in report.formats]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in report.formats:
        delta = r.perplexity_delta(report.reference_perplexity)
        a.scatter(r.bytes_per_token, delta, s=40)
        a.annotate(r.kv_dtype, (r.bytes_per_token, delta), textcoords="offset points", xytext=(5, 4))
    a.axhline(0.0, color="grey", lw=0.8)
    a.set_xlabel("bytes per token per layer")
    a.set_ylabel("perplexity vs full precision (%)")
    a.set_title(f"{report.text}: {report.scored_tokens:,} tokens, windows of {report.window}", fontsize=10)
    x = range(len(names))
    w = 0.38
    b.bar([i - w / 2 for i in x], [100 * r.top1 for r in report.formats], w, label="top-1 = full precision")
    if report.prompts:
        b.bar([i + w / 2 for i in x], [100 * r.greedy_identical / report.prompts for r in report.formats], w,
              label=f"greedy answers identical ({report.prompts} x {report.max_new_tokens} tokens)")
    b.set_xticks(list(x), names)
    b.set_ylim(0, 125)
    b.set_ylabel("%")
    b.legend(loc="upper center", fontsize=8, ncol=1)
    fig.suptitle(f"kvcache eval: {report.model} ({report.dtype}, {report.device})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.fspath(path)
