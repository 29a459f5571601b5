"""The ONNX conformance subset (bench/conformance/subset.py) built and run in both modes: no crash, hang,
run failure, frontend mismatch or accuracy below the floor; refusals only where onnxruntime itself
cannot run the model or for interfaces pulsar documents as unsupported, each with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.conformance.cases import collect
from bench.conformance.pool import run_all
from bench.conformance.report import outcome
from bench.conformance.subset import SUBSET

pytestmark = pytest.mark.slow

# refused on purpose: the reason names what is unsupported
REFUSED = {
    "test_split_to_sequence_nokeepdims": "sequence",
    "test_if_seq": "output 'res'",
    "test_reduce_sum_empty_axes_input_noop": "size 0",
    "test_simple_rnn_batchwise": "onnxruntime cannot run the input model",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    cases, skipped = collect(SUBSET)
    assert not skipped, skipped
    assert sorted(c.name for c in cases) == sorted(SUBSET)  # every name still exists in this onnx version
    work = Path(tmp_path_factory.mktemp("conformance"))
    return {r["name"]: r for r in run_all(cases, work, jobs=2, timeout=240)}


def test_no_failure_class_remains(results: dict[str, dict]) -> None:
    bad = {name: outcome(r) for name, r in results.items()
           if outcome(r)[0] not in ("ok", "refused") or (outcome(r)[0] == "refused") != (name in REFUSED)}
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusals_name_their_reason(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert r["status"] == "refused" and REFUSED[name] in r["reason"], r


def test_scalar_and_large_number_cases_are_accurate_in_both_modes(results: dict[str, dict]) -> None:
    for name in ("test_clip", "test_gemm_default_scalar_bias", "test_dynamicquantizelinear_expanded",
                 "test_logsoftmax_large_number_expanded", "test_attention_4d_softcap_neginf_mask_poison_expanded"):
        r = results[name]
        for mode in ("NPUBackend", "Reference"):
            outs = r[mode]["outputs"]
            assert all(o["shape_ok"] for o in outs), (name, mode, outs)
            assert all(o["cos"] >= 0.99 or (o["constant"] and o["rel"] <= 0.01) for o in outs), (name, mode, outs)
