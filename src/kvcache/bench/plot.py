"""PNG plots of ``kvcache bench`` results, one readable figure per case family, written beside the JSON.

Reads the JSON the bench suites write (``kvcache bench linear|paged|attention|engine --json FILE``):

* attention (``"suite": "attention"``): two figures. ``<name>.decode.png``: GB/s of every kv_dtype and of the
  PyTorch baselines per (shape, block size), the ceiling of each kv_dtype marked on its bar, and below it the
  % of that ceiling. ``<name>.prefill.png``: TFLOP/s beside the dense SDPA of the same shape, and the % of SDPA.
* linear: ``{"copy_gbs": float, "rows": [{"case", "impl", "extra": {"gbs"}}]}``: one bar per row with a
  bandwidth, the copy bandwidth of the same run as a vertical line.
* paged: ``{"rows": [{"op", "shape", "impl", "role", "gbs"}]}``: one bar per row, coloured by role
  (``kvcache``, ``baseline`` = plain PyTorch, ``ceiling`` = a plain copy of the same bytes).
* throughput, in either file or its own (``python -m kvcache.bench.engine``): rows with ``"tok_s"`` or
  ``"generated_tok_s"`` (generated tokens per second) and an ``"impl"`` / ``"name"`` label (or ``"kind"`` plus
  ``"kv_dtype"`` / ``"cache"``): a second panel.

Every figure is at most :data:`MAX_INCHES` (x 100 dpi) on a side. matplotlib runs with the Agg backend (no display
needed).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["MAX_INCHES", "attention_groups", "bandwidth_bars", "plot_bench", "throughput_bars"]

MAX_INCHES = 15.0  # 1,500 px at the 100 dpi the figures are written with
_DPI = 100
_ROLE_COLORS = {"kvcache": "#1f77b4", "baseline": "#ff7f0e", "ceiling": "#7f7f7f"}
_SERIES_COLORS = ["#1f77b4", "#2ca02c", "#9467bd", "#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"]


def bandwidth_bars(result: dict[str, Any]) -> tuple[list[tuple[str, float, str, float | None]], float | None]:
    """``([(label, GB/s, role, ceiling GB/s or None)], copy GB/s or None)`` from a bench result (linear or paged
    format). A row's ceiling is the copy bandwidth (linear), or the fastest ``ceiling`` row of the same op and
    shape (paged).

    Examples
    --------
    >>> bandwidth_bars({"copy_gbs": 3000.0, "rows": [{"case": "save", "impl": "kvcache", "extra": {"gbs": 2500.0}}]})
    ([('save | kvcache', 2500.0, 'kvcache', 3000.0)], 3000.0)
    """
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise ValueError("result: expected a bench result with a 'rows' list")
    copy = result.get("copy_gbs")
    copy = float(copy) if isinstance(copy, (int, float)) else None
    ceilings: dict[tuple, float] = {}
    for r in result["rows"]:
        if isinstance(r, dict) and r.get("role") == "ceiling" and isinstance(r.get("gbs"), (int, float)):
            key = (r.get("op"), r.get("shape"))
            ceilings[key] = max(ceilings.get(key, 0.0), float(r["gbs"]))
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


def attention_groups(result: dict[str, Any]) -> dict[str, list[tuple[str, dict[str, tuple[float, float | None,
                                                                                       float | None]]]]]:
    """The bars of ``kvcache bench attention``'s figures: ``{family: [(case label, {series: (value, % of the
    reference or None, ceiling GB/s or None)})]}``. ``decode``: GB/s against the kv_dtype's ceiling (kvcache and
    baseline rows); ``prefill``: TFLOP/s against SDPA. Copy rows are not bars (their max is the ceiling).

    Examples
    --------
    >>> attention_groups({"rows": [{"op": "decode", "shape": "64 x 16k", "block_size": 16, "role": "kvcache",
    ...     "impl": "kvcache auto", "gbs": 4000.0, "pct_ceiling": 95.0, "ceiling_gbs": 4210.0, "tflops": 1.0}]})
    {'decode': [('64 x 16k, block 16', {'kvcache auto': (4000.0, 95.0, 4210.0)})]}
    """
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise ValueError("result: expected a bench result with a 'rows' list")
    groups: dict[str, dict[str, dict[str, tuple[float, float | None, float | None]]]] = {}
    for r in result["rows"]:
        if not isinstance(r, dict) or r.get("role") == "ceiling" or r.get("op") not in ("decode", "prefill"):
            continue
        decode = r["op"] == "decode"
        value = r.get("gbs") if decode else r.get("tflops")
        if not isinstance(value, (int, float)) or value <= 0:
            continue
        pct = r.get("pct_ceiling") if decode else r.get("pct_sdpa")
        ceiling = r.get("ceiling_gbs") if decode else None
        case = f"{r.get('shape', '')}, block {r.get('block_size', '')}"
        groups.setdefault(r["op"], {}).setdefault(case, {})[str(r.get("impl", ""))] = (float(value), pct, ceiling)
    return {fam: list(cases.items()) for fam, cases in groups.items()}


def _grouped(ax: Any, cases: list, series: list[str], index: int, ylabel: str, marks: bool) -> None:
    """Grouped bars: one group per case, one bar per series; ``index`` 0 (value) or 1 (percentage, written on
    each bar); ``marks``: a black tick at each bar's ceiling."""
    width = 0.8 / len(series)
    for j, name in enumerate(series):
        xs, ys, cs = [], [], []
        for i, (_, bars) in enumerate(cases):
            v = bars.get(name)
            if v is not None and v[index] is not None:
                xs.append(i - 0.4 + (j + 0.5) * width)
                ys.append(v[index])
                cs.append(v[2])
        bars_ = ax.bar(xs, ys, width, label=name, color=_SERIES_COLORS[j % len(_SERIES_COLORS)])
        if index == 1:
            ax.bar_label(bars_, fmt="%.0f", fontsize=6)
        if marks:
            pts = [(x, c) for x, c in zip(xs, cs) if c]
            if pts:
                ax.hlines([c for _, c in pts], [x - width / 2 for x, _ in pts], [x + width / 2 for x, _ in pts],
                          colors="black", linewidth=1.5, label="ceiling (faster copy)" if j == 0 else None)
    ax.set_xticks(range(len(cases)), [c for c, _ in cases], fontsize=8, rotation=20, ha="right")
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def _attention_figure(plt: Any, family: str, cases: list, title: str, out: str) -> str:
    series: list[str] = []
    for _, bars in cases:
        series += [s for s in bars if s not in series]
    width = min(MAX_INCHES, max(9.0, 0.35 * len(cases) * len(series) + 3.0))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(width, 9.0), sharex=True)
    decode = family == "decode"
    _grouped(top, cases, series, 0, "GB/s (K / V bytes read per second)" if decode else "TFLOP/s", decode)
    _grouped(bottom, cases, series, 1, "% of the kv_dtype's copy ceiling" if decode else "% of SDPA (flash)", False)
    bottom.axhline(100.0, color="black", linestyle="--", linewidth=1)
    handles, labels = top.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, ncol=min(4, len(labels)), loc="upper center", bbox_to_anchor=(0.5, 0.96))
    fig.suptitle(f"{title}: {family} ({'memory-bound' if decode else 'compute-bound'})", fontsize=10)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.92))
    fig.savefig(out, dpi=_DPI)
    plt.close(fig)
    return out


def _bandwidth_figure(plt: Any, result: dict[str, Any], title: str, out: str) -> str:
    from matplotlib.patches import Patch

    bars, copy = bandwidth_bars(result)
    tput = throughput_bars(result)
    if not bars and not tput:
        raise ValueError("json_path: no rows with a bandwidth (gbs) or tokens/s (tok_s)")
    panels = [p for p in (bars, tput) if p]
    rows = sum(len(p) for p in panels)
    per_row = min(0.28, (MAX_INCHES - 1.2 * len(panels)) / max(rows, 1))  # the figure stays <= MAX_INCHES tall
    font = max(4.0, min(8.0, 25 * per_row))
    heights = [max(2.0, per_row * len(p) + 1.2) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, min(MAX_INCHES, sum(heights))), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    ax_i = 0
    if bars:
        ax = axes[ax_i][0]
        ax_i += 1
        ax.barh(range(len(bars)), [b[1] for b in bars][::-1],
                color=[_ROLE_COLORS.get(b[2], "#1f77b4") for b in bars][::-1])
        ax.set_yticks(range(len(bars)), [b[0] for b in bars][::-1], fontsize=font)
        ax.set_xlabel("achieved GB/s (bytes read + written per second)")
        for i, b in enumerate(bars[::-1]):
            if b[3]:
                ax.text(b[1], i, f" {100 * b[1] / b[3]:.0f}%", va="center", fontsize=font - 1)
        handles = [Patch(color=c, label=r) for r, c in _ROLE_COLORS.items() if any(b[2] == r for b in bars)]
        if copy:
            handles.append(ax.axvline(copy, color="red", linestyle="--", label=f"device copy {copy:.0f} GB/s"))
        ax.legend(handles=handles, fontsize=7, loc="lower right", title="% = of the copy ceiling", title_fontsize=6)
        ax.set_title(title, fontsize=9)
    if tput:
        ax = axes[ax_i][0]
        ax.barh(range(len(tput)), [t[1] for t in tput][::-1], color="#2ca02c")
        ax.set_yticks(range(len(tput)), [t[0] for t in tput][::-1], fontsize=8)
        ax.set_xlabel("generated tokens / s")
        if not bars:
            ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=_DPI)
    plt.close(fig)
    return out


def plot_bench(json_path: str, png_path: str | None = None) -> list[str]:
    """Write the figures of a bench JSON file; returns their paths.

    An attention result gives one figure per case family present (``<stem>.decode.png``,
    ``<stem>.prefill.png``); any other result one figure (``<stem>.png``). ``<stem>`` is ``png_path`` without its
    ``.png``, or by default the JSON's path without ``.json`` (the figures land beside it).

    Parameters
    ----------
    json_path : str
        A file written by ``kvcache bench ... --json``.
    png_path : str, optional
        Where to write the figure (attention: the stem of its figures).

    Raises
    ------
    ValueError
        The file holds no bandwidth, TFLOP/s or tokens/s rows.

    Examples
    --------
    >>> import json, tempfile, os
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "b.json")
    >>> json.dump({"copy_gbs": 100.0, "rows": [{"case": "c", "impl": "kvcache", "extra": {"gbs": 80.0}}]}, open(p, "w"))
    >>> [os.path.basename(f) for f in plot_bench(p)]
    ['b.png']
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        result = json.load(f)
    if not isinstance(result, dict):
        raise ValueError(f"json_path: expected a bench result (a JSON object) in {json_path}")
    stem = os.path.splitext(png_path or json_path)[0]
    title = " ".join(str(result[k]) for k in ("command", "device", "date") if result.get(k)) or "kvcache bench"
    if result.get("suite") == "attention":
        groups = attention_groups(result)
        if not groups:
            raise ValueError(f"json_path: no decode or prefill rows with a figure in {json_path}")
        return [_attention_figure(plt, fam, cases, title, f"{stem}.{fam}.png") for fam, cases in groups.items()]
    try:
        return [_bandwidth_figure(plt, result, title, f"{stem}.png")]
    except ValueError as e:
        raise ValueError(f"{e} in {json_path}") from None
