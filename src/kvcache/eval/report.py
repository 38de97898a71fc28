"""What ``kvcache eval`` measures, per stored format, and how it is written: a table (rich or plain) and JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

__all__ = ["FormatResult", "EvalReport", "format_table"]


@dataclasses.dataclass
class FormatResult:
    """One ``kv_dtype`` against the full-precision reference (transformers' DynamicCache) on the same inputs.

    Attributes
    ----------
    kv_dtype : str
        The stored format.
    bytes_per_token : float
        Bytes one token takes in one layer (K and V, quantization parameters included), from the paged cache's
        own allocation.
    perplexity : float
        exp(mean negative log-likelihood) of the scored tokens, attention reading the stored K / V.
    kl : float
        Mean over scored tokens of KL(reference || format) of the next-token distributions, in nats.
    top1 : float
        Fraction of scored positions whose most likely next token equals the reference's.
    greedy_identical : int
        Prompts whose greedy answer (to its end of sequence or ``max_new_tokens``) equals the reference's.
    first_divergence : list of int or None
        Per prompt: index of the first new token that differs from the reference's (None: identical).
    """

    kv_dtype: str
    bytes_per_token: float
    perplexity: float
    kl: float
    top1: float
    greedy_identical: int = 0
    first_divergence: list[int | None] = dataclasses.field(default_factory=list)

    def perplexity_delta(self, reference: float) -> float:
        """Perplexity change against ``reference`` in percent."""
        return (self.perplexity / reference - 1.0) * 100.0

    @property
    def mean_first_divergence(self) -> float | None:
        """Mean first differing token over the prompts that differ (None when all are identical or no prompts)."""
        d = [x for x in self.first_divergence if x is not None]
        return sum(d) / len(d) if d else None


@dataclasses.dataclass
class EvalReport:
    """Result of :func:`kvcache.eval.evaluate`: the setup, the reference's figures and one row per format.

    Attributes
    ----------
    model : str
        Name of the model (its config's ``_name_or_path`` or architecture).
    dtype, device : str
        The model's dtype and device.
    text : str
        Name of the text (a shipped text's name, a file name or ``"custom"``).
    text_tokens, scored_tokens : int
        Tokens of the text, and tokens scored (after ``max_tokens``).
    window, chunk, block_size : int
        Tokens per sequence, tokens per forward, tokens per paged block.
    reference_perplexity : float
        Perplexity of the full-precision reference.
    prompts, max_new_tokens : int
        Greedy prompts and new tokens per prompt (0 prompts: no greedy check).
    reference_bytes_per_token : float
        Bytes per token and layer of the reference's cache (K and V in the model dtype).
    formats : list of FormatResult
    seconds : float
        Wall time of the evaluation.
    """

    model: str
    dtype: str
    device: str
    text: str
    text_tokens: int
    scored_tokens: int
    window: int
    chunk: int
    block_size: int
    reference_perplexity: float
    prompts: int
    max_new_tokens: int
    reference_bytes_per_token: float
    formats: list[FormatResult]
    seconds: float = 0.0

    def result(self, kv_dtype: str) -> FormatResult:
        """The row of ``kv_dtype`` (KeyError naming the formats measured otherwise)."""
        for r in self.formats:
            if r.kv_dtype == kv_dtype:
                return r
        raise KeyError(f"kv_dtype: expected one of {[r.kv_dtype for r in self.formats]}, got {kv_dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): the fields, and per format also its perplexity delta in percent and mean first
        divergence."""
        d = dataclasses.asdict(self)
        for row, r in zip(d["formats"], self.formats):
            row["perplexity_delta_pct"] = r.perplexity_delta(self.reference_perplexity)
            row["mean_first_divergence"] = r.mean_first_divergence
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    def rows(self) -> list[list[str]]:
        """The table's cells: one list of strings per format, in the order of :data:`COLUMNS`."""
        out = []
        for r in self.formats:
            d = r.mean_first_divergence
            greedy = f"{r.greedy_identical}/{self.prompts}" if self.prompts else "-"
            out.append([
                r.kv_dtype, f"{r.bytes_per_token:,.0f}", f"{r.perplexity:.3f}",
                _pct(r.perplexity_delta(self.reference_perplexity)), f"{r.kl:.5f}", f"{r.top1:.1%}", greedy,
                "-" if d is None else f"token {d:.0f}",
            ])
        return out

    def summary(self) -> str:
        """One line: model, text, tokens, window, chunk and the reference's perplexity."""
        return (f"{self.model} ({self.dtype}, {self.device}), text {self.text!r}: {self.scored_tokens:,} scored tokens "
                f"of {self.text_tokens:,}, windows of {self.window} fed {self.chunk} per forward; full-precision "
                f"perplexity {self.reference_perplexity:.3f}; greedy: {self.prompts} prompts x {self.max_new_tokens} "
                f"tokens; {self.seconds:.0f} s")


def _pct(x: float) -> str:
    """A signed percentage with two decimals; a rounding-level change prints as +0.00% (never -0.00%)."""
    return f"{x + 0.0 if abs(x) >= 0.005 else 0.0:+.2f}%"


COLUMNS = ("kv_dtype", "bytes/token/layer", "perplexity", "delta", "KL", "top-1 = full", "greedy identical",
           "mean first divergence")


def format_table(report: EvalReport, *, markdown: bool = True) -> str:
    """The report as a Markdown table (``markdown=False``: aligned plain text), preceded by its summary line.

    Example
    -------
    >>> r = EvalReport("m", "float32", "cpu", "t", 10, 9, 10, 4, 16, 2.0, 0, 0, 64.0,
    ...                [FormatResult("int8", 18.0, 2.002, 0.0001, 0.99)])
    >>> print(format_table(r).splitlines()[-1])
    | int8 | 18 | 2.002 | +0.10% | 0.00010 | 99.0% | - | - |
    """
    rows = report.rows()
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(" --- " for _ in COLUMNS) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
        lines += ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    return report.summary() + "\n\n" + "\n".join(lines)
