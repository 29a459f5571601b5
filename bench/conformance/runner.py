"""One node test through pulsar: onnxruntime on the original, build, the optimized float graph, both run modes."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bench.conformance.cases import Case

MODES = ("NPUBackend", "Reference")
FLOOR = 0.99  # cosine floor against the expected output (non-constant outputs)
REL_FLOOR = 0.01  # largest relative error of a constant (or one-element) output


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two tensors as flat float64 vectors (1.0 for two equal ones, also all-zero)."""
    x, y = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if x.shape != y.shape:
        return float("nan")
    if np.array_equal(x, y, equal_nan=True):
        return 1.0
    finite = np.isfinite(x) & np.isfinite(y)
    if not np.array_equal(np.isfinite(x), np.isfinite(y)) or not np.array_equal(x[~finite], y[~finite]):
        return float("nan")  # inf / nan in different places
    x, y = x[finite], y[finite]
    nx, ny = np.linalg.norm(x), np.linalg.norm(y)
    if nx == 0 or ny == 0:
        return 1.0 if nx == ny else 0.0
    return float(np.dot(x, y) / (nx * ny))


def is_constant(t: Any) -> bool:
    """An output with fewer than two distinct values (cosine says nothing about it)."""
    if not isinstance(t, np.ndarray) or t.dtype.kind not in "fc":
        return True
    return t.size < 2 or np.unique(t[np.isfinite(t)]).size < 2


def _ort_run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[Any]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    src = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _close(got: Any, want: Any) -> bool:
    if not isinstance(want, np.ndarray) or not isinstance(got, np.ndarray):
        return False
    if got.shape != want.shape:
        return False
    if want.dtype.kind not in "fc":
        return np.array_equal(got, want)
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3, atol=1e-4, equal_nan=True))


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over max |want| (what a constant or one-element output is judged by)."""
    if want.dtype.kind not in "fc":
        return 0.0 if np.array_equal(got, want) else 1.0
    g, w = got.astype(np.float64), want.astype(np.float64)
    same = (np.isnan(g) & np.isnan(w)) | (g == w)
    diff = np.where(same, 0.0, np.abs(g - w))
    if not np.isfinite(diff).all():
        return float("inf")
    return float(diff.max(initial=0.0) / max(float(np.abs(w[np.isfinite(w)]).max(initial=0.0)), 1e-6))


def _compare(outs: list[Any], expected: list[Any]) -> dict[str, Any]:
    """Per output: cosine (non-constant outputs) or relative error (constant ones), and shapes."""
    rows = []
    for got, want in zip(outs, expected, strict=False):
        got_a = np.asarray(got) if isinstance(got, np.ndarray | np.generic) else got
        want_a = np.asarray(want) if isinstance(want, np.ndarray | np.generic) else want
        shape_ok = isinstance(got_a, np.ndarray) and isinstance(want_a, np.ndarray) and got_a.shape == want_a.shape
        rows.append({"cos": cosine(got_a, want_a) if shape_ok else float("nan"), "close": _close(got_a, want_a),
                     "rel": rel_error(got_a, want_a) if shape_ok else float("inf"),
                     "constant": is_constant(want_a), "shape_ok": shape_ok,
                     "shape": list(getattr(got_a, "shape", ())), "want_shape": list(getattr(want_a, "shape", ()))})
    return {"outputs": rows}


def _reference(case: Case, res: dict[str, Any]) -> list[Any]:
    """What the compiled model is compared with: the test's expected outputs, or onnxruntime's own
    outputs where onnxruntime (which runs pulsar's CPU subgraphs) disagrees with them; random ops
    (onnxruntime differs from itself) are marked and not judged."""
    if res["ort"] != "ok":
        return case.expected
    first, second = _ort_run(case.model, case.inputs), _ort_run(case.model, case.inputs)
    if not all(_close(np.asarray(a), np.asarray(b)) for a, b in zip(first, second, strict=False)):
        res["random"] = True
        return case.expected
    agree = [_close(np.asarray(a), np.asarray(b)) for a, b in zip(first, case.expected, strict=False)]
    if all(agree):
        return case.expected
    res["ort_vs_expected"] = [round(cosine(np.asarray(a), np.asarray(b)), 4)
                              for a, b in zip(first, case.expected, strict=False)]
    return first


def _placement(out_dir: Path) -> list[tuple[str, str, str]]:
    path = out_dir / "quant" / "quant_config.json"
    if not path.exists():
        return []
    nodes = json.loads(path.read_text())["nodes"]
    return [(v["op_type"], v["placement"], v["placement_reason"]) for v in nodes.values()]


def finite(x: np.ndarray) -> np.ndarray:
    """Calibration data must be finite (pulsar refuses NaN / inf there): the tests that feed such
    values calibrate on them replaced as a user would (NaN by 0, +-inf by the dtype's extremes, as
    HF's finfo.min masks), and run on the real inputs."""
    if x.dtype.kind != "f" or np.isfinite(x).all():
        return x
    return np.nan_to_num(x, nan=0.0)


def _config(case: Case, root: Path) -> dict[str, Any]:
    inputs = []
    for name, value in case.inputs.items():
        folder = root / "calib" / f"in{len(inputs)}"
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "0.npy", finite(value))
        inputs.append({"tensor_name": name, "calibration_dataset": str(folder), "calibration_format": "Numpy",
                       "calibration_size": 1})
    return {"quant": {"input_configs": inputs}}


def run_case(case: Case, root: Path) -> dict[str, Any]:
    """Everything measured for one test; ``status`` is refused / crash / built (paths in messages are
    relative to the test's folder)."""
    res = _run_case(case, root)
    for key in ("reason", "frontend_error"):
        if key in res:
            res[key] = res[key].replace(f"{root}/", "")
    for mode in MODES:
        if isinstance(res.get(mode), dict) and "error" in res[mode]:
            res[mode]["error"] = res[mode]["error"].replace(f"{root}/", "")
    return res


def _run_case(case: Case, root: Path) -> dict[str, Any]:
    import pulsar
    from pulsar.core.tensor_io import tensor_file_stem
    from pulsar.errors import PulsarError
    from pulsar.runtime.runner import run_model

    res: dict[str, Any] = {"name": case.name, "ops": case.ops, "opset": case.opset}
    try:
        _ort_run(case.model, case.inputs)
        res["ort"] = "ok"
    except Exception as e:  # noqa: BLE001 - any failure of onnxruntime itself is the finding
        res["ort"] = _first_line(e)
    root.mkdir(parents=True, exist_ok=True)
    src = root / "model.onnx"
    onnx.save(case.model, src)
    out = root / "out"
    try:
        built = pulsar.build(src, out, _config(case, root), quiet=True)
    except PulsarError as e:
        res.update(status="refused", reason=_first_line(e))
        return res
    except Exception as e:  # noqa: BLE001
        res.update(status="crash", stage="build", reason=f"{type(e).__name__}: {_first_line(e)}",
                   trace=traceback.format_exc()[-2000:])
        return res
    res.update(status="built", placement=_placement(out))
    try:
        ref = _ort_run(case.model, case.inputs) if res["ort"] == "ok" else case.expected
        opt = _ort_run(str(built.optimized_model), case.inputs)
        res["frontend_ok"] = all(_close(np.asarray(a), np.asarray(b)) if isinstance(b, np.ndarray) else True
                                 for a, b in zip(opt, ref, strict=False)) and len(opt) == len(ref)
    except Exception as e:  # noqa: BLE001
        res["frontend_ok"] = False
        res["frontend_error"] = _first_line(e)
    reference = _reference(case, res)
    feeds = root / "inputs"
    feeds.mkdir(exist_ok=True)
    for name, value in case.inputs.items():
        np.save(feeds / f"{tensor_file_stem(name)}.npy", value)
    for mode in MODES:  # as `pulsar run --input_dir inputs --mode MODE` does it: files in, files out
        dest = root / f"run_{mode}"
        try:
            ran = run_model(built.compiled_model, dest, input_dir=feeds, mode=mode, workers=1)
            outs = [np.load(dest / f"{tensor_file_stem(name)}.npy") for name, _, _ in ran.outputs]
            res[mode] = _compare(outs, reference)
        except PulsarError as e:
            res[mode] = {"error": _first_line(e)}
        except Exception as e:  # noqa: BLE001
            res[mode] = {"error": f"{type(e).__name__}: {_first_line(e)}", "trace": traceback.format_exc()[-2000:]}
    return res
