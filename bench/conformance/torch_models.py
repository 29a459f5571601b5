"""The torch executor against onnxruntime on the real models: every bench_quant spec and zoo model.

``python -m bench.conformance.torch_models [--models mbv2,zoo:magika,...] [--samples 4]``

Each model is built with its bench config (calibration data from its own module); then on its first
calibration samples the executor runs the built graph in float (against onnxruntime on the same
graph) and fake-quantized (against the QDQ model in onnxruntime with ``session.disable_quant_qdq``),
with the tolerances of :mod:`bench.conformance.torch_exec`; and node by node on onnxruntime's own
values of each node's inputs (:func:`teacher_forced`), where deep models' end-to-end outputs drift
apart from rounding ties. Prints one row per model output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.conformance.torch_exec import FLOAT_TOL, QUANT_TOL, _session, compare


def _spec(name: str, work: Path, n: int) -> tuple[Path, dict, list[dict[str, np.ndarray]]]:
    from bench import bench_quant as bq
    from examples import assets

    paths = assets.make_example_assets(work / "assets", n_calib=bq.N_CALIB)
    if name == "cls":
        paths.update(assets.make_cls_assets(work / "assets", n_calib=bq.N_CALIB))
    spec = bq.SPECS[name]
    model, config = spec.prepare(paths)
    import onnx

    first = onnx.load(str(model)).graph.input[0].name
    return model, config, [{first: x} for x in spec.calib(paths, model)[:n]]


def _zoo(name: str, work: Path, n: int) -> tuple[Path, dict, list[dict[str, np.ndarray]]]:
    from bench import bench_zoo as bz
    from bench import zoo
    from bench.zoo._data import CACHE

    mod = zoo.load(name)
    model = mod.float_model(CACHE)
    calib = mod.calib_feeds(min(32, getattr(mod, "N_CALIB", 32)), model)
    extra = getattr(mod, "CONFIG", {})
    fixed = {c["name"] for c in extra.get("const_processors", [])}
    config: dict[str, Any] = {"quant": {"input_configs": bz.write_calibration(calib, work / "calib", fixed)}}
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return model, config, [{k: v for k, v in f.items() if k not in fixed} for f in calib[:n]]


def teacher_forced(exe: Any, qmodel_path: Path, feed: dict[str, np.ndarray]) -> tuple[float, float]:
    """Every node of the fake-quantized graph run in torch on onnxruntime's own values of its inputs
    (the QDQ model in onnxruntime, every tensor an output): (worst difference of a quantized output in
    steps of its grid (or of float32's noise, where that is coarser), share of its elements that differ). A deep network's end-to-end outputs drift
    apart from a few rounding ties where float32 noise (torch's conv against onnxruntime's) lands a
    value on the other side of a half step; this judges each node on the same inputs instead."""
    import onnx
    import torch

    from bench.conformance.torch_exec import _session
    from pulsar.quant.torch_exec.executor import to_torch

    qm = onnx.load(str(qmodel_path))
    names = [o for n in exe.nodes for o in n.output if o]
    have = {o for n in qm.graph.node for o in n.output}
    names = [o for o in names if o in have]
    del qm.graph.output[:]
    qm.graph.output.extend([onnx.helper.make_empty_tensor_value_info(o) for o in names])
    values = dict(zip(names, _session(qm, qdq=True).run(names, feed), strict=True))
    worst, off, total = 0.0, 0, 0
    for idx, node in enumerate(exe.nodes):
        if node.op_type == "Constant" or not any(o in exe.qg.params for o in node.output):
            continue
        feeds = {i: to_torch(values[i] if i in values else feed[i]) for i in node.input
                 if i and i not in exe.consts and (i in values or i in feed)}
        with torch.no_grad():
            got = exe.run([idx], feeds, [o for o in node.output if o in exe.qg.params], quant=True)
        for o, g in got.items():
            # one step of the grid, or float32's noise where a 16-bit grid is finer than it (a sum computed
            # in another order differs by ~1e-6 of its magnitude: several steps of a fine grid)
            want = values[o].astype(np.float64)
            step = max(float(np.max(exe.qg.params[o].scale)), 4e-6 * float(np.abs(want).max(initial=0.0)))
            d = np.abs(g.detach().cpu().numpy().astype(np.float64) - want) / step
            worst = max(worst, float(d.max(initial=0.0)))
            off += int((d > 0.5).sum())
            total += d.size
    return worst, off / max(1, total)


def check_model(key: str, work: Path, n: int) -> list[dict[str, Any]]:
    import pulsar
    from pulsar.quant.torch_exec import QuantExecutor, unsupported_ops
    from pulsar.quant.torch_exec.executor import to_numpy, to_torch

    model, config, feeds = (_zoo(key.removeprefix("zoo:"), work, n) if key.startswith("zoo:")
                            else _spec(key, work, n))
    built = pulsar.build(model, work / "out", config, {"compiler.check": 0}, quiet=True)
    qg = built.quant_graph
    names = [o.name for o in qg.model.graph.output]
    inputs = {i.name for i in qg.model.graph.input}
    exe = QuantExecutor(qg)
    sf, sq = _session(qg.model), _session(str(built.quantized_model), qdq=True)
    worst: dict[str, list[float]] = {o: [0.0, 0.0, 0.0] for o in names}
    ok = {o: [True, True] for o in names}
    for feed in feeds:
        feed = {k: v for k, v in feed.items() if k in inputs}
        want_f, want_q = sf.run(names, feed), sq.run(names, feed)
        t = {k: to_torch(v) for k, v in feed.items()}
        got_f = exe.run(range(len(exe.nodes)), t, names, quant=False)
        got_q = exe.run(range(len(exe.nodes)), t, names, quant=True)
        for o, wf, wq in zip(names, want_f, want_q, strict=True):
            okf, ef = compare(to_numpy(got_f[o], np.asarray(wf).dtype), wf, FLOAT_TOL)
            okq, eq = compare(to_numpy(got_q[o], np.asarray(wq).dtype), wq, QUANT_TOL)
            _, effect = compare(np.asarray(wq), np.asarray(wf), 0.0)
            worst[o] = [max(worst[o][0], ef), max(worst[o][1], eq), max(worst[o][2], effect)]
            ok[o] = [ok[o][0] and okf, ok[o][1] and okq]
    missing = sorted({m.split(" (")[0] for m in unsupported_ops(qg.model)})
    tf_worst, tf_share = teacher_forced(exe, Path(built.quantized_model),
                                        {k: v for k, v in feeds[0].items() if k in inputs})
    return [{"teacher_forced_steps": tf_worst, "teacher_forced_share": tf_share, "model": key, "output": o, "float_ok": ok[o][0], "float_err": worst[o][0], "quant_ok": ok[o][1],
             "quant_err": worst[o][1], "quant_effect": worst[o][2], "samples": len(feeds), "nodes": len(exe.nodes),
             "missing": missing} for o in names]


def main(argv: list[str] | None = None) -> int:
    from bench import bench_quant as bq
    from bench import zoo

    ap = argparse.ArgumentParser(prog="python -m bench.conformance.torch_models", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join([*bq.SPECS, *(f"zoo:{m}" for m in zoo.MODELS)]))
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args(argv)
    print(f"{'model':<20} {'output':<28} {'nodes':>5} {'float err':>10} {'quant err':>10} {'q effect':>9} "
          f"{'per node (steps, share off)':>28}  verdict")
    bad = 0
    for key in args.models.split(","):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="pulsar_tmodels_") as tmp:
            try:
                rows = check_model(key, Path(tmp), args.samples)
            except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end of the run
                print(f"{key:<20} error: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
                bad += 1
                continue
        for r in rows:
            # end to end within the rule, or every node exact on onnxruntime's inputs but for ties (one step)
            per_node = r["teacher_forced_steps"] <= 1.01 and r["teacher_forced_share"] < 1e-3
            verdict = "ok" if r["float_ok"] and r["quant_ok"] else ("ok per node" if r["float_ok"] and per_node
                                                                    else "MISMATCH")
            bad += verdict == "MISMATCH"
            miss = f" (onnxruntime runs: {', '.join(r['missing'])})" if r["missing"] else ""
            print(f"{r['model']:<20} {r['output'][:28]:<28} {r['nodes']:>5} {r['float_err']:>10.2e} "
                  f"{r['quant_err']:>10.2e} {r['quant_effect']:>9.2e} {r['teacher_forced_steps']:>11.1f} "
                  f"{r['teacher_forced_share']:>16.1e}  {verdict}{miss}", flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
