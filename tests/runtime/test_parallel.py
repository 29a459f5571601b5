"""Samples in parallel threads: same results in the same order, torch's thread count restored."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from pulsar.api import run_model
from pulsar.compiler.package import package_qdq_model
from pulsar.errors import PulsarError
from pulsar.runtime.parallel import map_samples
from pulsar.runtime.session import Session
from tests.runtime.test_session import qdq_conv_model


@pytest.fixture(autouse=True)
def _two_threads():
    """Two torch threads before each test (pytest -n sets one per worker), so "restored" is checked
    against a count that map_samples changes."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_map_samples_runs_items_concurrently_in_order():
    barrier = threading.Barrier(2, timeout=10)  # only passes if two items run at the same time

    def fn(i: int) -> tuple[int, int]:
        if i < 2:
            barrier.wait()
        return i, torch.get_num_threads()

    before = torch.get_num_threads()
    got = map_samples(fn, list(range(6)), workers=2)
    assert [i for i, _ in got] == list(range(6))
    assert {n for _, n in got} == {1}  # one torch thread per worker while they run
    assert torch.get_num_threads() == before


def test_map_samples_propagates_errors_and_checks_workers():
    def fn(i: int) -> int:
        if i == 3:
            raise RuntimeError("sample 3 failed")
        return i

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="sample 3"):
        map_samples(fn, list(range(5)), workers=2)
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="workers"):
        map_samples(fn, [1, 2], workers=0)
    assert map_samples(fn, [0, 1, 2], workers=1) == [0, 1, 2]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return package_qdq_model(qdq_conv_model(), tmp_path_factory.mktemp("par") / "model.axmodel", {})


def _samples(n: int) -> list[dict[str, np.ndarray]]:
    return [{"images": np.random.default_rng(i).standard_normal((2, 3, 16, 16)).astype(np.float32)}
            for i in range(n)]


@pytest.mark.parametrize("mode", ["NPUBackend", "Reference"])
def test_run_many_equals_sequential_runs(compiled, mode):
    sess = Session(compiled, mode=mode)
    samples = _samples(7)
    want = [sess.run(s) for s in samples]
    got = sess.run_many(samples, workers=3)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g) == ["out"]
        np.testing.assert_array_equal(g["out"], w["out"])
    assert len({g["out"].tobytes() for g in got}) == 7  # the samples really differ


def test_run_batches_in_parallel_equals_one_by_one(compiled):
    sess = Session(compiled)
    samples = _samples(4)
    stacked = {"images": np.concatenate([s["images"] for s in samples])}
    got = sess.run_batches(stacked, 4, workers=2)["out"]
    np.testing.assert_array_equal(got, np.concatenate([sess.run(s)["out"] for s in samples]))


def test_run_model_rejects_zero_workers(compiled, tmp_path):
    with pytest.raises(PulsarError, match="--workers must be at least 1"):
        run_model(compiled, tmp_path / "o", random_input=True, workers=0)
