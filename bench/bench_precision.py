"""Precision analysis and automatic mixed precision on the PP-OCRv4 recognizer.

    python -m bench.bench_precision [--eval-n 200] [--k 4,8,16] [--budgets 4,8,16,32,64] [--draws 3]
                                    [--work-dir DIR] [--json FILE]

The recognizer, its config, calibration and evaluation lines and its score (exact match, character
accuracy) are bench_quant's ``SPECS["ocr"]``; quantized models run with their QDQ pairs as float math
(the contract pulsar's compiler follows). Every build shares one ``work_dir``, so the float model is
run for calibration once and every later build hits the statistics cache. Sections:

1. float vs the default config (no quantization options);
2. the default build with ``quant.precision_analysis`` (PerLayer, then EndToEnd): the table and the
   mermaid graph are read back, and the layers that lose the most are listed with their mermaid ids.
   Loss of a layer: PerLayer ``1 - cosine`` (the error the layer adds by itself); EndToEnd the drop
   from its worst input's cosine to its output's (where the network picks up its error, the rule
   of ``auto_mixed_precision.ranked_layers``). Candidates: quantized (NPU) layers of the search's
   ``COMPUTE_OPS`` that read or write an 8-bit tensor (see :func:`candidates`);
3. for each K, exact match with the K worst layers of each table at 16 bits (a ``layer_configs``
   entry: U16 activations, S16 weights, as the search writes it) against K random candidates
   (seeded, mean of ``--draws``) and the K least lossy ones;
4. ``quant.auto_mixed_precision`` at each budget (``target_cosine`` 0: the budget is the only
   limit): layers raised, the search's trials and end-to-end cosine, and the exact match; ``*``
   marks budgets within 1 point of float exact match.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from bench import bench_quant as bq
from examples import assets
from pulsar.quant.algorithms.auto_mixed_precision import COMPUTE_OPS

TABLES = ("PerLayer", "EndToEnd")
TABLE_FILE = Path("quant", "debug", "precision_analysis_table.txt")
MERMAID_FILE = Path("quant", "debug", "precision_analysis.mmd")
AMP_FILE = Path("quant", "auto_mixed_precision.json")
RAISED = {"data_type": "U16", "weight_data_type": "S16"}  # what the search writes for a raised layer
WITHIN = 0.01  # "within 1 point" of float exact match


# ---------------------------------------------------------------------------------------------------
# Pure helpers: reading the precision table / mermaid graph back, ranking layers
# ---------------------------------------------------------------------------------------------------


@dataclass
class TableRow:
    node: str
    op_type: str
    tensor: str
    qdtype: str
    cosine: float


def parse_table(text: str) -> list[TableRow]:
    """Rows of ``precision_analysis_table.txt``; columns are cut at the dash line's spans (names may
    hold any character but never run past their column)."""
    lines = text.splitlines()
    dash = next(i for i, line in enumerate(lines) if line.startswith("-") and set(line) <= {"-", " "})
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[dash])]
    header = [lines[dash - 1][a:b + 1].strip() for a, b in spans]
    col = {name: k for k, name in enumerate(header)}
    rows = []
    for line in lines[dash + 1:]:
        if not line.strip():
            continue
        cells = [line[a:b].strip() for a, b in spans[:-1]] + [line[spans[-1][0]:].strip()]
        rows.append(TableRow(cells[col["Operator"]], cells[col["Type"]], cells[col["Output Tensor"]],
                             cells[col["QDType"]], float(cells[col["Cosine"]])))
    return rows


def _unescape(text: str) -> str:
    """Mermaid entity codes (``#35;``, ``#quot;``) back to characters."""
    named = {"quot": '"', "lt": "<", "gt": ">", "amp": "&"}
    return re.sub(r"#(\d+|quot|lt|gt|amp);", lambda m: named.get(m[1]) or chr(int(m[1])), text)


def parse_mermaid(text: str) -> tuple[dict[str, str], list[tuple[int, str, str]]]:
    """(layer name -> mermaid node id, callouts as (number, layer name, id of the node they point at))."""
    ids = {_unescape(m[2]): m[1] for m in re.finditer(r'^\s+(N\d+_\w*)\["(.*?)<br/>', text, re.M)}
    notes = {m[1]: (int(m[2]), _unescape(m[3]))
             for m in re.finditer(r'^\s+(W\d+)\["#35;(\d+) (.*?)<br/>', text, re.M)}
    links = dict(re.findall(r"^\s+(W\d+) -\.-> (\w+)", text, re.M))
    callouts = sorted((num, name, links.get(w, "")) for w, (num, name) in notes.items())
    return ids, callouts


def layer_losses(rows: list[TableRow], method: str, model: onnx.ModelProto) -> dict[str, float]:
    """Loss per layer: PerLayer ``1 - cosine``; EndToEnd the drop from the worst input's cosine
    (1.0 for graph inputs and weights) to the output's. NaN cosines count as 0."""
    cos = {r.tensor: 0.0 if math.isnan(r.cosine) else r.cosine for r in rows}
    if method == "PerLayer":
        return {r.node: 1.0 - cos[r.tensor] for r in rows}
    inputs = {n.name: [i for i in n.input if i in cos] for n in model.graph.node}
    return {r.node: min((cos[i] for i in inputs.get(r.node, [])), default=1.0) - cos[r.tensor] for r in rows}


def candidates(quant_config: dict[str, Any]) -> list[str]:
    """Layers a 16-bit setting can change, in graph order: quantized (NPU) nodes of the search's op
    types that read or write an 8-bit tensor (activation or weight). The links of a lookup-table
    chain (HardSwish -> Mul -> Add fused into one op) are left out: their values are already 16-bit
    or never leave the fused op, so raising them changes nothing."""
    tensors = quant_config["tensors"]

    def eight_bit(t: str) -> bool:
        return t in tensors and tensors[t]["bit_width"] == 8

    return [name for name, n in quant_config["nodes"].items()
            if n["placement"] == "NPU" and n["op_type"] in COMPUTE_OPS
            and any(eight_bit(t) for t in [*n["inputs"], *n["outputs"]])]


def ranked(losses: dict[str, float], pool: list[str], k: int, *, worst: bool = True) -> list[str]:
    """The ``k`` most (or least) lossy layers of ``pool``; ties by name, so the pick is stable."""
    scored = [(losses[n], n) for n in pool if n in losses]
    scored.sort(key=lambda t: (-t[0], t[1]) if worst else (t[0], t[1]))
    return [n for _, n in scored[:k]]


def random_sets(pool: list[str], k: int, draws: int, seed: int) -> list[list[str]]:
    rng = random.Random(f"{seed}:{k}")
    return [sorted(rng.sample(sorted(pool), min(k, len(pool)))) for _ in range(draws)]


def raised_entry(layers: list[str], quant_config: dict[str, Any]) -> dict[str, Any]:
    """A ``layer_configs`` entry raising ``layers`` to 16 bits, with the Relu / Clip fused into them
    (they own the fused op's output), as the auto search writes it."""
    nodes = quant_config["nodes"]
    named = [n for layer in layers for n in (layer, nodes.get(layer, {}).get("fused_into")) if n]
    return {"layer_names": list(dict.fromkeys(named)), **RAISED}


def search_result(amp: dict[str, Any]) -> tuple[list[str], float, list[tuple[int, float]]]:
    """(layers raised, their end-to-end cosine, every trial as (size, cosine)) from
    ``auto_mixed_precision.json``; with target_cosine 0 the search keeps its best trial."""
    trials = amp["trials"]
    best = max(trials, key=lambda t: t["cosine"])
    return best["layers"], best["cosine"], [(len(t["layers"]), t["cosine"]) for t in trials]


# ---------------------------------------------------------------------------------------------------
# Builds and scores
# ---------------------------------------------------------------------------------------------------


class Runner:
    """Builds the recognizer with config changes (sharing one calibration cache) and scores them."""

    def __init__(self, work: Path, eval_n: int, n_calib: int) -> None:
        import pulsar

        self.build_fn = pulsar.build
        self.work = work
        paths = assets.make_example_assets(work / "assets", n_calib=n_calib)
        self.spec = bq.SPECS["ocr"]
        self.float_model, config = self.spec.prepare(paths)
        self.config = {**config, "work_dir": str(work / "shared")}  # one statistics cache for every build
        self.inputs, self.texts = self.spec.eval_data(eval_n)
        self._scores: dict[tuple[str, ...], dict[str, float]] = {}
        self.builds = 0

    def score_float(self) -> dict[str, float]:
        ref = bq._run_ort(self.float_model, self.inputs)
        return self.spec.score(ref, self.texts, ref)

    def score_model(self, qmodel: Path) -> dict[str, float]:
        outs = bq._run_ort(qmodel, self.inputs, bq._qdq_options("float"))
        return self.spec.score(outs, self.texts, outs)

    def build(self, tag: str, overrides: dict[str, Any] | None = None, layer_configs: list | None = None):
        config = json.loads(json.dumps(self.config))
        if layer_configs:
            config["quant"]["layer_configs"] = layer_configs
        self.builds += 1
        return self.build_fn(input=str(self.float_model), output_dir=str(self.work / "builds" / tag),
                             config=config, overrides=overrides or {}, quiet=True)

    def score_raised(self, tag: str, layers: list[str], quant_config: dict[str, Any]) -> dict[str, float]:
        """Exact match with ``layers`` at 16 bits (each distinct set built once)."""
        key = tuple(sorted(layers))
        if key not in self._scores:
            res = self.build(tag, layer_configs=[raised_entry(layers, quant_config)])
            self._scores[key] = self.score_model(Path(res.quantized_model))
        return self._scores[key]


def _fmt(s: dict[str, float]) -> str:
    return f"exact {s['exact']:.3f}  char {s['char_acc']:.4f}"


def _mean(scores: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(s[k] for s in scores) / len(scores) for k in scores[0]}


def section_analysis(r: Runner, default: Any, kmax: int, out: dict[str, Any]) -> tuple[dict, list[str]]:
    """Section 2: both precision tables and mermaid graphs; returns the losses per table and the pool."""
    qcfg = json.loads(Path(default.quant_config).read_text())
    model = onnx.load(str(default.optimized_model), load_external_data=False)
    pool = candidates(qcfg)
    losses: dict[str, dict[str, float]] = {}
    out["analysis"] = {"candidates": len(pool)}
    print(f"2. precision analysis (the default build + quant.precision_analysis); {len(pool)} candidate "
          "layers")
    for method in TABLES:
        res = r.build(f"analysis_{method}", {"quant.precision_analysis": True,
                                              "quant.precision_analysis_method": method})
        table, mmd = res.output_dir / TABLE_FILE, res.output_dir / MERMAID_FILE
        same = Path(res.quantized_model).read_bytes() == Path(default.quantized_model).read_bytes()
        rows = parse_table(table.read_text())
        ids, callouts = parse_mermaid(mmd.read_text())
        losses[method] = layer_losses(rows, method, model)
        worst = ranked(losses[method], pool, kmax)
        called = {name: num for num, name, _ in callouts}
        by_node = {row.node: row for row in rows}
        print(f"   {method}: {table.relative_to(r.work)} ({len(rows)} rows), {mmd.relative_to(r.work)} "
              f"({len(ids)} nodes); QDQ model identical to the default build's: {same}")
        print("     mermaid callouts: " + ", ".join(f"#{n} {name} -> {nid}" for n, name, nid in callouts))
        rule = "1 - cosine" if method == "PerLayer" else "worst input cosine - output cosine"
        print(f"     {kmax} worst candidates by loss ({rule}):")
        for i, name in enumerate(worst, 1):
            row = by_node[name]
            mark = f"  callout #{called[name]}" if name in called else ""
            print(f"     {i:3d}. {name:22s} {row.op_type:10s} {row.qdtype:4s} cos {row.cosine:.5f}  loss "
                  f"{losses[method][name]:.5f}  {ids.get(name, '?')}{mark}")
        out["analysis"][method] = {"table": str(table), "mermaid": str(mmd), "same_qdq_as_default": same,
                                   "callouts": callouts, "worst": [(n, losses[method][n]) for n in worst]}
    return losses, pool


def section_k(r: Runner, qcfg: dict[str, Any], losses: dict, pool: list[str], args: argparse.Namespace,
              out: dict[str, Any]) -> None:
    """Section 3: the K worst layers of each table at 16 bits, against K random and the K best."""
    out["k"] = {}
    for k in args.k:
        rows: list[tuple[str, dict[str, float], str]] = []
        for method in TABLES:
            layers = ranked(losses[method], pool, k)
            rows.append((f"{k} worst ({method})", r.score_raised(f"k{k}_worst_{method}", layers, qcfg), ""))
        draws = [r.score_raised(f"k{k}_random{d}", layers, qcfg)
                 for d, layers in enumerate(random_sets(pool, k, args.draws, args.seed))]
        note = "(draws " + ", ".join(f"{d['exact']:.3f}" for d in draws) + ")"
        rows.append((f"{k} random (mean of {args.draws})", _mean(draws), note))
        for method in TABLES:
            layers = ranked(losses[method], pool, k, worst=False)
            rows.append((f"{k} best ({method})", r.score_raised(f"k{k}_best_{method}", layers, qcfg), ""))
        for label, s, note in rows:
            print(f"   {label:26s} {_fmt(s)}  {note}".rstrip())
        out["k"][k] = {label: s for label, s, _ in rows} | {"random_draws": draws}


def section_auto(r: Runner, budgets: list[int], float_exact: float, out: dict[str, Any]) -> None:
    """Section 4: the automatic search at each budget (target_cosine 0: the budget is the only limit)."""
    out["auto"] = {}
    for budget in budgets:
        res = r.build(f"auto_{budget}", {"quant.auto_mixed_precision.enable": True,
                                        "quant.auto_mixed_precision.max_16bit_layers": budget,
                                        "quant.auto_mixed_precision.target_cosine": 0.0})
        layers, cosine, trials = search_result(json.loads((res.output_dir / AMP_FILE).read_text()))
        s = r.score_model(Path(res.quantized_model))
        ok = s["exact"] >= float_exact - WITHIN - 1e-9
        print(f"   budget {budget:3d}: {len(layers):3d} layers raised, end-to-end cosine "
              f"{trials[0][1]:.4f} -> {cosine:.4f}  {_fmt(s)} {'*' if ok else ''}".rstrip())
        print("      trials (layers: cosine) " + ", ".join(f"{n}: {c:.4f}" for n, c in trials))
        out["auto"][budget] = {"layers": layers, "cosine": cosine, "trials": trials, **s, "within_1pt": ok}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = Runner(work, args.eval_n, args.n_calib)
    out: dict[str, Any] = {"eval_n": args.eval_n, "n_calib": args.n_calib}

    def stamp() -> str:
        return f"   [{time.perf_counter() - t0:.0f} s]\n"

    print(f"PP-OCRv4 recognizer, {args.eval_n} evaluation lines, {args.n_calib} calibration samples\n")
    out["float"] = fl = r.score_float()
    default = r.build("default")
    out["default"] = dflt = r.score_model(Path(default.quantized_model))
    print(f"1. float vs the default config\n   float          {_fmt(fl)}\n   default (U8)   {_fmt(dflt)}")
    print(stamp())

    losses, pool = section_analysis(r, default, max(args.k), out)
    print(stamp())

    print(f"3. K layers at 16 bits (U16 activations, S16 weights); default {dflt['exact']:.3f}, "
          f"float {fl['exact']:.3f}")
    section_k(r, json.loads(Path(default.quant_config).read_text()), losses, pool, args, out)
    print(stamp())

    print(f"4. quant.auto_mixed_precision, target_cosine 0 (best trial within the budget); * = within "
          f"{WITHIN * 100:.0f} point of float exact match ({fl['exact']:.3f})")
    section_auto(r, args.budgets, fl["exact"], out)
    out["builds"], out["seconds"] = r.builds, round(time.perf_counter() - t0, 1)
    print(stamp() + f"{r.builds} builds in {out['seconds']:.0f} s")
    return out


def _ints(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a comma list of integers, e.g. 4,8,16") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="precision analysis and auto mixed precision on the OCR "
                                                 "recognizer")
    parser.add_argument("--eval-n", type=int, default=200, help="evaluation lines")
    parser.add_argument("--n-calib", type=int, default=bq.N_CALIB, help="calibration samples")
    parser.add_argument("--k", type=_ints, default=[4, 8, 16], help="layer counts for section 3, e.g. 4,8,16")
    parser.add_argument("--budgets", type=_ints, default=[4, 8, 16, 32, 64],
                        help="max_16bit_layers values for section 4")
    parser.add_argument("--draws", type=int, default=3, help="random draws per K")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws")
    parser.add_argument("--work-dir", type=Path, help="keep builds here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.eval_n < 1 or args.n_calib < 1 or args.draws < 1:
        parser.error("--eval-n, --n-calib and --draws must be at least 1")
    if not args.k or min(args.k) < 1 or not args.budgets or min(args.budgets) < 1:
        parser.error("--k and --budgets take positive integers, e.g. 4,8,16")
    ort.set_default_logger_severity(3)
    with tempfile.TemporaryDirectory(prefix="pulsar-bench-precision-") as tmp:
        results = run(args, args.work_dir or Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
