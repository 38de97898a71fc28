"""PNG plots of ``kvcache bench`` results: achieved bandwidth of each op against the copy bandwidth, and the
engine's generated tokens/s against Hugging Face where a result file has them.

Reads the JSON the bench suites write (``kvcache bench linear|paged --json FILE``):

* linear: ``{"copy_gbs": float, "rows": [{"case", "impl", "extra": {"gbs"}}]}``: one bar per row with a
  bandwidth, the copy bandwidth of the same run as a vertical line.
* paged: ``{"rows": [{"op", "shape", "impl", "role", "gbs"}]}``: one bar per row, coloured by role
  (``kvcache``, ``baseline`` = plain PyTorch, ``ceiling`` = a plain copy of the same bytes).
* throughput, in either file or its own (``python -m kvcache.bench.engine``): rows with ``"tok_s"`` or
  ``"generated_tok_s"`` (generated tokens per second) and an ``"impl"`` / ``"name"`` label (or ``"kind"`` plus
  ``"kv_dtype"`` / ``"cache"``): a second panel.

matplotlib runs with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["plot_bench", "bandwidth_bars", "throughput_bars"]

_ROLE_COLORS = {"kvcache": "#1f77b4", "baseline": "#ff7f0e", "ceiling": "#7f7f7f"}


def bandwidth_bars(result: dict[str, Any]) -> tuple[list[tuple[str, float, str, float | None]], float | None]:
    """``([(label, GB/s, role, ceiling GB/s or None)], copy GB/s or None)`` from a bench result (linear or paged
    format). A row's ceiling is the copy bandwidth (linear) or the ``ceiling`` row of the same op and shape
    (paged).

    Examples
    --------
    >>> bandwidth_bars({"copy_gbs": 3000.0, "rows": [{"case": "save", "impl": "kvcache", "extra": {"gbs": 2500.0}}]})
    ([('save | kvcache', 2500.0, 'kvcache', 3000.0)], 3000.0)
    """
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise ValueError("result: expected a bench result with a 'rows' list")
    copy = result.get("copy_gbs")
    copy = float(copy) if isinstance(copy, (int, float)) else None
    ceilings = {(r.get("op"), r.get("shape")): float(r["gbs"]) for r in result["rows"]
                if isinstance(r, dict) and r.get("role") == "ceiling" and isinstance(r.get("gbs"), (int, float))}
    bars: list[tuple[str, float, str, float | None]] = []
    for r in result["rows"]:
        if not isinstance(r, dict):
            continue
        gbs = r.get("gbs")
        if gbs is None and isinstance(r.get("extra"), dict):
            gbs = r["extra"].get("gbs")
        if not isinstance(gbs, (int, float)) or gbs <= 0:
            continue
        if "op" in r:
            label = f"{r['op']} {r.get('shape', '')} | {r.get('impl', '')}"
            role = str(r.get("role", "kvcache"))
            ceiling = ceilings.get((r.get("op"), r.get("shape")))
        else:
            impl = str(r.get("impl", ""))
            label = f"{r.get('case', '')} | {impl}"
            case = str(r.get("case", ""))
            # the linear suite's first row is the device copy itself: the ceiling; other torch rows are baselines
            role = "ceiling" if case.startswith("copy ") else "baseline" if impl.startswith("torch") else "kvcache"
            ceiling = copy
        bars.append((label, float(gbs), role, ceiling))
    return bars, copy


def throughput_bars(result: dict[str, Any]) -> list[tuple[str, float]]:
    """``[(label, generated tokens/s)]`` of the rows (or ``"throughput"`` rows) that carry ``tok_s``.

    Examples
    --------
    >>> throughput_bars({"rows": [{"impl": "kvcache engine", "tok_s": 21000.0}, {"impl": "x", "us": 3.0}]})
    [('kvcache engine', 21000.0)]
    >>> throughput_bars({"rows": [{"kind": "kvcache.engine", "kv_dtype": "int8", "generated_tok_s": 1e4}]})
    [('kvcache.engine int8', 10000.0)]
    """
    rows = list(result.get("rows", [])) + list(result.get("throughput", []))
    out = []
    for r in rows:
        if not isinstance(r, dict):
            continue
        tok_s = r.get("tok_s", r.get("generated_tok_s"))  # the engine bench writes generated_tok_s
        if isinstance(tok_s, (int, float)):
            label = r.get("impl", r.get("name"))
            if label is None:  # engine bench rows: kind + kv_dtype (kvcache) or + cache (transformers)
                label = " ".join(str(r[k]) for k in ("kind", "kv_dtype", "cache") if k in r) or "?"
            out.append((str(label), float(tok_s)))
    return out


def plot_bench(json_path: str, png_path: str | None = None) -> str:
    """Write the plot of a bench JSON file; returns the PNG's path (default: beside the JSON, ``.png``).

    Parameters
    ----------
    json_path : str
        A file written by ``kvcache bench ... --json``.
    png_path : str, optional
        Where to write the PNG.

    Raises
    ------
    ValueError
        The file holds no bandwidth or tokens/s rows.

    Examples
    --------
    >>> import json, tempfile, os
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "b.json")
    >>> json.dump({"copy_gbs": 100.0, "rows": [{"case": "c", "impl": "kvcache", "extra": {"gbs": 80.0}}]}, open(p, "w"))
    >>> plot_bench(p).endswith("b.png")
    True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(json_path) as f:
        result = json.load(f)
    bars, copy = bandwidth_bars(result)
    tput = throughput_bars(result)
    if not bars and not tput:
        raise ValueError(f"json_path: no rows with a bandwidth (gbs) or tokens/s (tok_s) in {json_path}")
    panels = [p for p in (bars, tput) if p]
    heights = [max(2.0, 0.28 * len(p) + 1.2) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    title = f"kvcache bench: {result.get('device', '')} {result.get('date', '')}".strip()
    ax_i = 0
    if bars:
        ax = axes[ax_i][0]
        ax_i += 1
        labels = [b[0] for b in bars][::-1]
        values = [b[1] for b in bars][::-1]
        colors = [_ROLE_COLORS.get(b[2], "#1f77b4") for b in bars][::-1]
        ax.barh(range(len(bars)), values, color=colors)
        ax.set_yticks(range(len(bars)), labels, fontsize=7)
        ax.set_xlabel("achieved GB/s (bytes read + written per second)")
        for i, b in enumerate(bars[::-1]):
            if b[3]:
                ax.text(b[1], i, f" {100 * b[1] / b[3]:.0f}%", va="center", fontsize=6)
        handles = [Patch(color=c, label=r) for r, c in _ROLE_COLORS.items() if any(b[2] == r for b in bars)]
        if copy:
            handles.append(ax.axvline(copy, color="red", linestyle="--", label=f"device copy {copy:.0f} GB/s"))
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  title="% = of the copy ceiling", title_fontsize=6)
        ax.set_title(title, fontsize=9)
    if tput:
        ax = axes[ax_i][0]
        ax.barh(range(len(tput)), [t[1] for t in tput][::-1], color="#2ca02c")
        ax.set_yticks(range(len(tput)), [t[0] for t in tput][::-1], fontsize=8)
        ax.set_xlabel("generated tokens / s")
        if not bars:
            ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out = png_path or os.path.splitext(json_path)[0] + ".png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
