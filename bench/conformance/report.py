"""Verdicts, the summary and the support table (docs/onnx_support.md) from the conformance results."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from bench.conformance.runner import FLOOR, MODES, REL_FLOOR

BAD = ("crash", "hang", "run-fail", "frontend", "floor")


def _min_cos(res: dict[str, Any], mode: str) -> float:
    """The lowest cosine of the non-constant outputs (NaN when there are none); an output whose
    non-finite values sit elsewhere than expected counts as 0."""
    vals = [0.0 if math.isnan(o["cos"]) else o["cos"] for o in res[mode]["outputs"] if not o["constant"]]
    return min(vals) if vals else math.nan


def _max_rel(res: dict[str, Any], mode: str) -> float:
    return max((o["rel"] for o in res[mode]["outputs"] if o["constant"]), default=0.0)


def where(res: dict[str, Any]) -> tuple[str, str]:
    """("NPU" | "CPU" | "NPU+CPU", the CPU reasons) of a built test."""
    places = res.get("placement") or []
    devices = {d for _, d, _ in places}
    why = sorted({f"{op}: {r}" for op, d, r in places if d == "CPU" and r})
    label = "+".join(sorted(devices, key=lambda d: d != "NPU")) or "-"
    return label, "; ".join(why)


def outcome(res: dict[str, Any]) -> tuple[str, str]:
    """(verdict, detail): ok / constant / refused / crash / hang / run-fail / frontend / floor."""
    status = res["status"]
    if status != "built":
        ort = "" if res.get("ort") == "ok" else " [onnxruntime fails too]"
        return status, res.get("reason", "") + ort
    for mode in MODES:
        if "error" in res[mode]:
            return "run-fail", f"{mode}: {res[mode]['error']}"
        for o in res[mode]["outputs"]:
            if not o["shape_ok"]:
                return "run-fail", f"{mode}: shape {o['shape']} expected {o['want_shape']}"
    if not res.get("frontend_ok", True):
        return "frontend", res.get("frontend_error", "optimized float graph differs from the original")
    label, _ = where(res)
    if res.get("random"):
        return "random", f"{label}, random op: onnxruntime's own outputs differ run to run (not judged)"
    note = f" (vs onnxruntime: its output differs from the test's, cos {res['ort_vs_expected']})" \
        if "ort_vs_expected" in res else ""
    cos = {m: _min_cos(res, m) for m in MODES}
    rel = {m: _max_rel(res, m) for m in MODES}
    text = f"{label}, " + ("cos " + " / ".join(f"{cos[m]:.4f}" for m in MODES) if not math.isnan(cos[MODES[0]])
                           else "constant output, rel. error " + " / ".join(f"{rel[m]:.2g}" for m in MODES))
    if any(c < FLOOR for c in cos.values()) or any(r > REL_FLOOR for r in rel.values()):
        return "floor", text + note
    return "ok", text + note


def summary(results: list[dict[str, Any]], skipped: dict[str, str], seconds: float) -> str:
    counts = Counter(outcome(r)[0] for r in results)
    places = Counter(where(r)[0] for r in results if r["status"] == "built")
    lines = [f"\n{len(results)} eligible tests in {seconds:.0f} s: "
             + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
             "built: " + ", ".join(f"{k} {v}" for k, v in sorted(places.items())),
             f"skipped (input types): {len(skipped)} - "
             + ", ".join(f"{k} {v}" for k, v in Counter(skipped.values()).most_common(6))]
    refused = Counter(r["reason"] for r in results if r["status"] == "refused")
    if refused:
        lines.append("refusals:")
        lines += [f"  {n:3d}  {why}" for why, n in refused.most_common()]
    bad = [r for r in results if outcome(r)[0] in BAD]
    if bad:
        lines.append("failures:")
        lines += [f"  {r['name']}: {outcome(r)[0]} {outcome(r)[1]}" for r in bad]
    return "\n".join(lines)


def _cell(res: dict[str, Any], mode: str) -> str:
    if res["status"] != "built" or "error" in res.get(mode, {}):
        return ""
    c = _min_cos(res, mode)
    return f"const ({_max_rel(res, mode):.2g})" if math.isnan(c) else f"{c:.4f}"


def _short(reason: str) -> str:
    """A placement reason's first clause (the table's note; quant_config.json has the whole text)."""
    return re.split(r"[:;(]", reason, maxsplit=1)[0].strip()


def _refusal(reason: str) -> str:
    """A refusal's reason without the file it names, to its first clause."""
    text = re.sub(r"^(model file )?\S*\.(onnx|npy)\S*:? ", "", reason)
    return text.split(";")[0].strip()[:140]


def _reasons(res: dict[str, Any]) -> str:
    places = res.get("placement") or []
    return "; ".join(sorted({f"{op}: {_short(r)}" for op, d, r in places if d == "CPU" and r}))


def torch_cell(rs: list[dict[str, Any]], torch: dict[str, dict[str, Any]] | None) -> str:
    """The torch executor's verdicts over these tests (``bench.conformance.torch_exec``): ok / mismatch
    / error counts, ``-`` where pulsar does not build them."""
    if torch is None:
        return "-"
    counts = Counter(torch[r["name"]]["status"] for r in rs if r["name"] in torch
                     and torch[r["name"]]["status"] not in ("refused",))
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def _op_rows(groups: dict[str, list[dict[str, Any]]], torch: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """One row per operator (the ops of its tests): opsets, verdicts, where it runs, worst cosine, the
    torch executor's verdicts."""
    rows = []
    for key in sorted(groups):
        rs = groups[key]
        verdicts = Counter(outcome(r)[0] for r in rs)
        places = Counter(where(r)[0] if r["status"] == "built" else "refused" for r in rs)
        cos = {m: [_min_cos(r, m) for r in rs if r["status"] == "built" and "error" not in r[m]] for m in MODES}
        worst = {m: min((c for c in v if not math.isnan(c)), default=math.nan) for m, v in cos.items()}
        why = sorted({_short(rr) for r in rs for _, d, rr in (r.get("placement") or []) if d == "CPU" and rr}
                     | {_refusal(r.get("reason", "")) for r in rs if r["status"] == "refused"})
        rows.append(f"| {key} | {', '.join(map(str, sorted({r['opset'] for r in rs})))} | "
                    + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())) + " | "
                    + ", ".join(f"{k} {v}" for k, v in sorted(places.items())) + " | "
                    + " / ".join("-" if math.isnan(worst[m]) else f"{worst[m]:.4f}" for m in MODES) + " | "
                    + torch_cell(rs, torch) + " | "
                    + "; ".join(why).replace("|", "\\|") + " |")
    return rows


TORCH_LEGEND = [
    "- **torch**: fine-tuning's torch executor on the built graph (`python -m bench.conformance.torch_exec",
    "  --docs docs/onnx_support.md`): `ok` when its float outputs equal onnxruntime's (max abs error <= 1e-5",
    "  of the output's range, integer outputs exact) and its fake-quantized outputs equal the QDQ model's in",
    "  onnxruntime with `session.disable_quant_qdq`; `missing` when an op has no torch function (it then runs",
    "  in onnxruntime, without a gradient); the per-test note says why a test is not ok.",
]


def write_docs(path: Path, results: list[dict[str, Any]], skipped: dict[str, str], types: str,
               torch: dict[str, dict[str, Any]] | None = None) -> None:
    """The support table: per operator, then per test, where it runs and how accurately, and whether
    fine-tuning's torch executor runs it as onnxruntime does (``torch``: its results by test name)."""
    groups = _groups_of(results)
    counts = Counter(outcome(r)[0] for r in results)
    out = [
        "# ONNX operator support",
        "",
        "Generated by `python -m bench.conformance --docs docs/onnx_support.md` from the ONNX backend node",
        "tests of the installed onnx package: each test model is built with the default config, calibrated",
        "on the test's own inputs, and its compiled model run with `pulsar run` in both modes (NPUBackend: the",
        "bit-exact integer simulator; Reference: the float QDQ graph in onnxruntime) and compared with the",
        "test's expected outputs.",
        "",
        "- **where**: NPU (integer), CPU (float, in onnxruntime, with the reason), or refused (why).",
        f"- **cos**: the lowest cosine over the test's non-constant outputs (floor {FLOOR}); `const (e)` when",
        f"  every expected output is constant or one element: `e` is the largest relative error (floor {REL_FLOOR}).",
        "- The reference is the test's expected output, or onnxruntime's output where onnxruntime itself",
        "  disagrees with it (noted); random ops (Dropout in training mode) are run but not judged.",
        "- Calibration data must be finite: tests whose inputs hold NaN / inf calibrate on them with NaN as 0",
        "  and infinities as the float32 extremes, and run on the real inputs.",
        *TORCH_LEGEND,
        "",
        f"Eligible tests (every graph input {types}): {len(results)}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f". Skipped for their input types: {len(skipped)}.",
        "",
        "## Per operator",
        "",
        "| ops | opsets | tests | where | worst cos NPUBackend / Reference | torch | CPU placement or refusal reasons |",
        "|---|---|---|---|---|---|---|",
        *_op_rows(groups, torch),
        "",
        "## Per test",
        "",
        "| ops | test | opset | where | cos NPUBackend | cos Reference | torch | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(groups):
        for r in groups[key]:
            verdict, detail = outcome(r)
            if r["status"] == "built":
                label, note = where(r)[0], _reasons(r) if verdict == "ok" else f"{verdict}: {detail}"
            else:
                label, note = "refused", detail
            t = (torch or {}).get(r["name"], {})
            tcell = "-" if not t or t["status"] == "refused" else t["status"]
            if t.get("status") not in (None, "ok", "refused") and t.get("why"):
                note = f"{note}; torch: {t['why']}".lstrip("; ")
            note = note.replace("|", "\\|")
            out.append(f"| {key} | {r['name']} | {r['opset']} | {label} | {_cell(r, 'NPUBackend')} | "
                       f"{_cell(r, 'Reference')} | {tcell} | {note} |")
    out += ["", "## Not built: input types", "", "| test | why |", "|---|---|"]
    out += [f"| {name} | {why} |" for name, why in sorted(skipped.items())]
    path.write_text("\n".join(out) + "\n")


def _groups_of(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Test results by the support table's row key (its ops; an expanded test under its function's op)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    plain = {r["name"]: "+".join(r["ops"]) for r in results if "_expanded" not in r["name"]}
    for r in results:
        if "_expanded" not in r["name"]:
            groups[plain[r["name"]]].append(r)
            continue
        base = r["name"].split("_expanded")[0]  # the function's own test: its op names the expansion
        groups[f"{plain[base]} (expanded)" if base in plain else "(function, expanded)"].append(r)
    return groups


def add_torch_column(path: Path, torch: dict[str, dict[str, Any]]) -> None:
    """Put the torch executor's verdicts into an existing support table (both tables gain a ``torch``
    column after the cosines), so the torch conformance can refresh the docs without rebuilding the
    whole ONNX suite in both run modes."""
    groups = _groups_of(list(torch.values()))
    out: list[str] = []
    section = ""
    text = path.read_text()
    if "- **torch**:" not in text:  # the column's legend, after the list that explains the others
        text = text.replace("\n\nEligible tests", "\n" + "\n".join(TORCH_LEGEND) + "\n\nEligible tests", 1)
    done: set[str] = set()  # tables that have the column already: its cells are replaced
    for line in text.splitlines():
        if line.startswith("## "):
            section = line
        tables = {"## Per operator": 5, "## Per test": 6}  # the torch column goes before this cell
        at = tables.get(section)
        if line.startswith("| ops |") and "| torch |" in line:
            done.add(section)
        if at is None or not line.startswith("|") or (section in done and line.startswith("| ops |")):
            out.append(line)
            continue
        if line.startswith("|---"):
            out.append(line if section in done else line + "---|")
            continue
        cells = line[2:-2].split(" | ")
        if section in done:  # drop the old torch cell and note
            del cells[at]
            cells[-1] = cells[-1].split("; torch: ")[0] if not cells[-1].startswith("torch: ") else ""
        if cells[0] == "ops":
            value = "torch"
        elif section == "## Per operator":
            value = torch_cell(groups.get(cells[0], []), torch)
        else:
            t = torch.get(cells[1], {})
            value = "-" if not t or t["status"] == "refused" else t["status"]
            if t.get("status") not in (None, "ok", "refused") and t.get("why"):
                why = t["why"].replace("|", "\\|")
                cells[-1] = f"{cells[-1]}; torch: {why}" if cells[-1].strip() else f"torch: {why}"
        out.append("| " + " | ".join([*cells[:at], value, *cells[at:]]) + " |")
    path.write_text("\n".join(out) + "\n")
