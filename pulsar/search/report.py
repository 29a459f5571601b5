"""The sweep's report: the Pareto front of metric against estimated latency, as JSON, PNG and HTML.

A trial is on the front when no other finished trial is at least as accurate and at least as fast
and better in one of the two. The HTML page is self-contained (the plot embedded as a data URI)."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from pulsar.utils.atomic import atomic_write_bytes, atomic_write_text


def _placed(r: dict[str, Any]) -> bool:
    """A trial that has a point in the plot: it finished with a finite metric and a latency estimate."""
    return (r["status"] == "ok" and isinstance(r.get("metric"), int | float) and math.isfinite(r["metric"])
            and isinstance(r.get("latency_ms"), int | float))


def pareto(rows: list[dict[str, Any]]) -> None:
    """Set ``pareto`` on every row: metric higher is better, ``latency_ms`` lower is better."""
    ok = [r for r in rows if _placed(r)]
    for r in rows:
        r["pareto"] = _placed(r) and not any(
            q["metric"] >= r["metric"] and q["latency_ms"] <= r["latency_ms"]
            and (q["metric"] > r["metric"] or q["latency_ms"] < r["latency_ms"]) for q in ok)


def _short(metric: str) -> str:
    """A plugin by its function name (the axis label and table header), a built-in as is."""
    return metric.rpartition(":")[2] if ":" in metric else metric


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _plot(rows: list[dict[str, Any]], metric: str) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ok = [r for r in rows if _placed(r)]
    front = sorted((r for r in ok if r["pareto"]), key=lambda r: r["latency_ms"])
    ax.scatter([r["latency_ms"] for r in ok], [r["metric"] for r in ok], color="#8aa", label="trial")
    ax.plot([r["latency_ms"] for r in front], [r["metric"] for r in front], "o-", color="#c33", label="Pareto front")
    points: dict[tuple[float, float], list[str]] = {}
    for r in ok:  # trials that land on the same point share one label
        points.setdefault((r["latency_ms"], r["metric"]), []).append(str(r["trial"]))
    for xy, names in points.items():
        ax.annotate(",".join(names), xy, fontsize=7, xytext=(3, 3), textcoords="offset points")
    floats = {float(r["metric_float"]) for r in ok if r.get("metric_float") is not None}
    if len(floats) == 1:  # every trial scores the same float model: the bar quantization is measured against
        ax.axhline(floats.pop(), color="#555", linestyle="--", linewidth=1, label="float model")
    ax.set_xlabel("estimated latency (ms)")
    ax.set_ylabel(_short(metric))
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _html(rows: list[dict[str, Any]], metric: str, png: bytes, best: int | None) -> str:
    fields = sorted({f for r in rows for f in r["settings"]})
    name = _short(metric)
    head = "".join(f"<th>{html.escape(h).replace('.', '.<wbr>')}</th>" for h in ["trial", *fields, "status", name, f"{name} (float)",
                                                           f"{name} (QDQ)", "latency ms", "size bytes", "build s",
                                                           "pareto"])
    body = []
    for r in rows:
        cells = [str(r["trial"]), *(_cell(r["settings"][f]) if f in r["settings"] else "" for f in fields), r["status"],
                 *("" if r.get(k) is None else f"{r[k]:.6g}" for k in ("metric", "metric_float", "metric_qdq")),
                 "" if r.get("latency_ms") is None else f"{r['latency_ms']:.4g}",
                 str(r.get("size_bytes") or ""), f"{r.get('build_s') or 0:.1f}", "yes" if r.get("pareto") else ""]
        style = ' class="front"' if r.get("pareto") else ""
        title = f' title="{html.escape(r["error"])}"' if r.get("error") else ""
        body.append(f"<tr{style}{title}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    picked = f"<p>Fastest trial meeting the target: <b>{best}</b></p>" if best is not None else ""
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>pulsar sweep</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:3px 8px;font-size:13px}tr.front{background:#fde}</style></head><body>"
            f"<h1>pulsar sweep: {html.escape(metric)} vs estimated latency</h1>{picked}"
            f"<img alt='Pareto plot' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            f"<table><tr>{head}</tr>{''.join(body)}</table></body></html>\n")


def write_report(out: Path, rows: list[dict[str, Any]], metric: str, best: int | None) -> None:
    """``sweep.json``, ``sweep.png`` and ``sweep.html`` in ``out`` (each written atomically)."""
    pareto(rows)
    atomic_write_text(out / "sweep.json", json.dumps({"metric": metric, "best": best, "trials": rows}, indent=2)
                      + "\n")
    png = _plot(rows, metric)
    atomic_write_bytes(out / "sweep.png", png)
    atomic_write_text(out / "sweep.html", _html(rows, metric, png, best))
