"""The shared requantization: folded form == literal form == the Python-int reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pulsar.errors import PulsarError
from pulsar.runtime.kernels.common import OutSpec, requant, round_div
from pulsar.runtime.kernels.requant import Requant
from tests.runtime.kernels import intref

RNG = np.random.default_rng(3)


def reference(acc, m, n, bias, attrs):
    out = np.zeros(acc.shape, dtype=np.int64)
    for idx in np.ndindex(acc.shape):
        c = idx[1]
        out[idx] = intref.finish(int(acc[idx]) + int(bias[c]), int(m[c]), int(n[c]), attrs)
    return out


@pytest.mark.parametrize("odt,zp", [(np.uint8, 0), (np.int8, -128), (np.uint16, 65535), (np.int16, 1234)])
def test_folded_requant_equals_literal_and_reference(odt, zp):
    channels, bound = 5, (1 << 24) - 1
    m = RNG.integers(1 << 29, (1 << 31) - 1, size=channels) * RNG.choice([-1, 1], size=channels)
    n = np.array([37, 38, 41, 39, 36])  # per-channel shifts a few bits apart, as quantize_multiplier gives
    bias = RNG.integers(-(1 << 20), 1 << 20, size=channels)
    attrs = intref.out_attrs(odt, zp)
    spec = OutSpec.from_attrs(attrs)
    acc = RNG.integers(-bound, bound, size=(2, channels, 6), endpoint=True)
    acc[0, :, 0] = bound
    acc[0, :, 1] = -bound
    shape = (channels, 1)
    folded = Requant(m.reshape(shape), n.reshape(shape), spec, bias.reshape(shape), bound)
    literal = Requant(m.reshape(shape), n.reshape(shape), spec, bias.reshape(shape))
    assert folded.fast is not None and literal.fast is None
    want = reference(acc, m, n, bias, attrs)
    np.testing.assert_array_equal(literal(acc.copy()), want)
    np.testing.assert_array_equal(folded(acc.copy()), want)
    np.testing.assert_array_equal(folded.torch(torch.from_numpy(acc.astype(np.float64))), want)
    assert folded.torch(torch.from_numpy(acc.copy())).dtype == np.dtype(odt)


def test_fold_refused_when_it_could_overflow():
    spec = OutSpec.from_attrs(intref.out_attrs(np.int8))
    m, n = np.array([[(1 << 31) - 1], [5]]), np.array([[0], [62]])  # S - N = 62 for channel 0
    assert Requant(m, n, spec, bound=1 << 20).fast is None
    acc = np.array([[3, -3], [1 << 59, -(1 << 59)]])
    got = Requant(m, n, spec, bound=1 << 20)(acc)
    np.testing.assert_array_equal(got, [[127, -128], [1, -1]])


def test_ties_round_toward_plus_infinity():
    spec = OutSpec.from_attrs(intref.out_attrs(np.int16))
    acc = np.array([-7, -5, -3, -1, 1, 3, 5, 7])
    np.testing.assert_array_equal(requant(acc, 1, 1, spec), [-3, -2, -1, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(requant(np.array([-6, -2, 2, 6]), 1, 2, spec), [-1, 0, 1, 2])
    np.testing.assert_array_equal(requant(acc, 3, 2, spec), [-5, -4, -2, -1, 1, 2, 4, 5])  # -0.75 -> -1
    np.testing.assert_array_equal(round_div(np.array([-3, -1, 1, 3, 5]), np.array([2])), [-1, 0, 1, 2, 3])


def test_out_spec_checks():
    with pytest.raises(PulsarError, match="out_min / out_max"):
        OutSpec.from_attrs({"to": 2, "out_min": -1, "out_max": 255})
    with pytest.raises(PulsarError, match="integer element type"):
        OutSpec.from_attrs({"to": 1})
    spec = OutSpec.from_attrs({"to": 3})
    assert (spec.lo, spec.hi, spec.zp) == (-128, 127, 0)
