"""The torch executor (fine-tuning's interpreter) against onnxruntime on the torch CI subset of the ONNX
node tests (bench/conformance/subset.py: TORCH_SUBSET): every test pulsar builds runs in torch with
no op missing, float outputs equal onnxruntime's (1e-5 of the range, integers exact) and
fake-quantized outputs equal the QDQ model's, except the tests whose difference is onnxruntime's
own (bench/conformance/torch_exec.py: KNOWN, each with its reason)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from bench.conformance.cases import collect
from bench.conformance.pool import run_all
from bench.conformance.subset import TORCH_SUBSET
from bench.conformance.torch_exec import KNOWN

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    cases, skipped = collect(TORCH_SUBSET)
    assert not skipped, skipped
    assert sorted(c.name for c in cases) == sorted(set(TORCH_SUBSET))
    work = Path(tmp_path_factory.mktemp("torch_conformance"))
    return {r["name"]: r for r in run_all(cases, work, jobs=2, timeout=240,
                                          runner="bench.conformance.torch_exec:run_torch_case")}


def test_every_built_test_runs_in_torch_as_in_onnxruntime(results: dict[str, dict]) -> None:
    built = {n: r for n, r in results.items() if r["status"] != "refused"}
    assert len(built) >= 80, len(built)
    bad = {n: (r["status"], r.get("reason") or r.get("why")) for n, r in built.items()
           if r["status"] != "ok" and not any(fnmatch.fnmatch(n, p) for p in KNOWN)}
    assert not bad, bad


def test_the_executor_is_compared_in_both_modes(results: dict[str, dict]) -> None:
    """Not vacuous: outputs are compared, and in many tests quantization moves them (a fake-quantized
    output equal to the float one would say nothing about the quantizers)."""
    ok = [r for r in results.values() if r["status"] == "ok"]
    assert all(r["outputs"] for r in ok)
    moved = [r["name"] for r in ok if any(0 < o["quant_effect"] < float("inf") for o in r["outputs"])]
    assert len(moved) >= 20, moved
