"""Streaming histogram statistics and the four calibration methods, checked against numpy."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pulsar.errors import PulsarError
from pulsar.quant.observers import (
    CALIBRATION_METHODS,
    DEFAULT_NUM_BINS,
    TensorStats,
    compute_range,
    side_histograms,
)
from pulsar.quant.observers.kl import kl_divergences

METHODS = ["MinMax", "Percentile", "MSE", "KL"]


def _stats(x: np.ndarray, batches: int = 16, num_bins: int = DEFAULT_NUM_BINS) -> TensorStats:
    s = TensorStats.empty(num_bins)
    for b in np.array_split(x, batches):
        s.update(b)
    return s


def _quant_mse(x: np.ndarray, lo: float, hi: float, num_bits: int = 8, symmetric: bool = False) -> float:
    """Mean squared error of actually quantizing x to the grid of [lo, hi] (zero exactly on the grid)."""
    x = x.astype(np.float64)
    if symmetric:
        qmax = 2 ** (num_bits - 1) - 1
        scale = hi / qmax
        q = np.clip(np.round(x / scale), -qmax, qmax)
        return float(np.mean((q * scale - x) ** 2))
    qmax = 2**num_bits - 1
    scale = (hi - lo) / qmax
    zp = np.round(-lo / scale)
    q = np.clip(np.round(x / scale) + zp, 0, qmax)
    return float(np.mean(((q - zp) * scale - x) ** 2))


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def gauss_outliers(rng: np.random.Generator) -> np.ndarray:
    x = np.concatenate([rng.standard_normal(1_000_000), rng.uniform(15, 40, 30), -rng.uniform(15, 40, 20)])
    return rng.permutation(x).astype(np.float32)


# ------------------------------------------------------------------------------------ histogram
def test_histogram_widening_keeps_counts_and_matches_numpy(rng: np.random.Generator) -> None:
    # batches that keep growing on both sides force several re-binnings
    batches = [rng.normal(0, 0.1 * (k + 1), 20_000).astype(np.float32) + 0.05 * k for k in range(12)]
    s = TensorStats.empty(2048)
    s.update(batches[0])
    first_span = s.hist_hi - s.hist_lo
    for b in batches[1:]:
        s.update(b)
    data = np.concatenate(batches)
    assert s.hist_hi - s.hist_lo > 2 * first_span  # it did widen
    assert s.count == data.size == int(s.hist.sum())
    assert (s.min, s.max) == (float(data.min()), float(data.max()))
    assert s.hist_lo <= s.min and s.max <= s.hist_hi
    ref, _ = np.histogram(data, bins=s.num_bins, range=(s.hist_lo, s.hist_hi))
    # bins are merged exactly: only values sitting on an edge (float rounding) may differ
    assert np.abs(ref - s.hist).sum() <= 1e-3 * data.size
    assert s.hist.shape == (2048,)


def test_widening_from_constant_first_batch(rng: np.random.Generator) -> None:
    s = TensorStats.empty(512)
    s.update(np.zeros(1000, np.float32))
    s.update(np.full(10, 3.0, np.float32))
    data = rng.uniform(-2, 5, 5000).astype(np.float32)
    s.update(data)
    assert s.count == 6010 == int(s.hist.sum())
    assert s.zeros == 1000 + int(np.sum(data == 0))
    assert s.min == float(data.min()) and s.max == float(data.max())
    edges = s.edges()
    zero_bin = np.searchsorted(edges, 0.0, side="right") - 1
    assert s.hist[zero_bin] >= 1000  # the zeros are still at zero


def test_nonfinite_values_are_skipped() -> None:
    s = TensorStats.empty()
    s.update(np.array([1.0, np.nan, -np.inf, 2.0, np.inf], np.float32))
    assert (s.count, s.nonfinite, s.min, s.max) == (2, 3, 1.0, 2.0)
    s.update(np.array([np.nan], np.float32))
    assert s.count == 2 and s.nonfinite == 4


def test_fast_binning_and_zero_count_match_the_plain_formulas(rng: np.random.Generator) -> None:
    """update() counts zeros through a bool mask and casts bin positions through int32, in chunks:
    the same counts as count_nonzero and an int64 cast over the whole tensor (-0.0 is a zero too)."""
    from pulsar.quant.observers import histogram

    x = (rng.standard_normal(3 * histogram._CHUNK + 17) * 5).astype(np.float32)
    x[::7], x[::11] = 0.0, -0.0
    x[5], x[9] = x.min() - 1, x.max() + 1  # the extremes land on the outer bins
    s = TensorStats.empty()
    s.update(x)
    lo, hi, n = s.hist_lo, s.hist_hi, s.num_bins
    t = np.clip((x - np.float32(lo)) * np.float32(n / (hi - lo)), 0.0, n - 0.5)
    assert np.array_equal(s.hist, np.bincount(t.astype(np.int64), minlength=n)[:n])
    assert s.zeros == x.size - np.count_nonzero(x) and s.zeros > x.size // 7


def test_stats_memory_is_independent_of_sample_count(rng: np.random.Generator) -> None:
    few, many = TensorStats.empty(), TensorStats.empty()
    few.update(rng.standard_normal(100).astype(np.float32))
    for _ in range(300):
        many.update(rng.standard_normal(5000).astype(np.float32))
    size = sum(a.nbytes for a in few.to_arrays().values())
    assert size == sum(a.nbytes for a in many.to_arrays().values())
    assert many.count == 1_500_000


def test_a_sampled_histogram_covers_every_value_over_stride_batches(rng: np.random.Generator) -> None:
    """Past ``sample_cap`` a batch is binned every k-th value (k prime), each counting k times, from an
    offset that moves with each batch: k batches of the same tensor bin each value once (k times the
    histogram of the whole tensor), while the extremes see every value of every batch."""
    x = (rng.standard_normal(10_000) * 3).astype(np.float32)
    x[::9] = 0.0
    x[4321] = 50.0  # not in the first batch's sample (offset 0, stride 11)
    whole = TensorStats.empty()
    whole.update(x)
    sampled = TensorStats.empty(sample_cap=1000)
    assert sampled.binned(x.size)[1] == 11  # 10, the ratio, is not prime
    sampled.update(x)
    assert sampled.max == 50.0 and sampled.count == 11 * len(range(0, x.size, 11)) == int(sampled.hist.sum())
    for _ in range(10):
        sampled.update(x)
    assert np.array_equal(sampled.hist, 11 * whole.hist) and (sampled.hist_lo, sampled.hist_hi) == (whole.hist_lo,
                                                                                                     whole.hist_hi)
    assert (sampled.count, sampled.zeros, sampled.min) == (11 * whole.count, 11 * whole.zeros, whole.min)
    assert sampled.batches == 11 and sampled.sample_cap == 1000


def test_a_sample_reaches_every_row_and_column_of_a_feature_map() -> None:
    """With fewer batches than the stride (a large map, few samples), the binned positions still spread
    over every channel, row and column of an NCHW map with power-of-two sides (a stride of 256 would
    bin only 64 of 512 columns, in two blocks)."""
    c, h, w = 16, 128, 512
    s = TensorStats.empty(sample_cap=4096)
    seen = np.zeros(c * h * w, bool)
    for _ in range(32):
        part, weight = s.binned(seen.size)
        seen[part] = True
        s.batches += 1
    assert weight == 257  # the smallest prime >= 256
    grid = seen.reshape(c, h, w)
    assert grid.any(axis=(0, 1)).all() and grid.any(axis=(0, 2)).all() and grid.any(axis=(1, 2)).all()
    assert grid.sum() == sum(len(range(k * 159 % 257, seen.size, 257)) for k in range(32))


def test_batches_of_different_sizes_keep_their_weight(rng: np.random.Generator) -> None:
    """A sampled batch counts as many values as it has: small batches (binned whole) next to large
    sampled ones do not take over the histogram (unweighted, the 2,000-value batches of N(0, 1) would
    be a fifth of it instead of 1 %), and MSE's range quantizes all the data as well as the range from
    every value does (measured: 1-3 % more error)."""
    full, capped = TensorStats.empty(), TensorStats.empty(sample_cap=10_000)
    data = []
    for _ in range(8):
        for b in (rng.normal(0, 1, 2000).astype(np.float32), rng.normal(0, 10, 200_000).astype(np.float32)):
            data.append(b)
            full.update(b)
            capped.update(b)
    assert capped.binned(200_000)[1] == 23 and abs(capped.count - full.count) <= 8 * 23
    x = np.concatenate(data)
    a, b = compute_range(full, "MSE"), compute_range(capped, "MSE")
    assert _quant_mse(x, *b) <= 1.05 * _quant_mse(x, *a), (a, b)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_histograms_give_the_ranges_of_all_values(seed: int) -> None:
    """A cap of 64 Ki values a batch (``quant.calibration_histogram_values: 65536``) on 32 batches of
    0.5 M values with 50 outliers each (1 in 10,000: the hardest case, as the sample sees a binomial
    share of them): the extremes are exact, and each method's range quantizes the data with an error
    within 5 % of the error at the range from every value (the ranges move where the error is flat in
    them)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.standard_normal(500_000 - 50), rng.uniform(15, 40, 30), -rng.uniform(15, 40, 20)])
    x = x.astype(np.float32)
    full, capped = TensorStats.empty(), TensorStats.empty(sample_cap=1 << 16)
    for _ in range(32):
        b = rng.permutation(x)
        full.update(b)
        capped.update(b)
    assert capped.binned(x.size)[1] == 11 and abs(capped.count - full.count) <= 32 * 11
    assert (capped.min, capped.max) == (full.min, full.max)
    for method in ("Percentile", "MSE", "KL"):
        a, b = compute_range(full, method), compute_range(capped, method)
        assert _quant_mse(x, *b) <= 1.05 * _quant_mse(x, *a), (method, a, b)


def test_to_from_arrays_roundtrip(gauss_outliers: np.ndarray) -> None:
    s = _stats(gauss_outliers[:10_000])
    back = TensorStats.from_arrays(s.to_arrays())
    assert back == s and back is not s
    back.update(np.ones(3, np.float32))
    assert back != s
    assert all(v.dtype.kind != "O" for v in s.to_arrays().values())


def test_merge_equals_stats_of_union(rng: np.random.Generator) -> None:
    a_data = rng.normal(0, 1, 50_000).astype(np.float32)
    b_data = rng.normal(3, 2, 50_000).astype(np.float32)
    a, b = _stats(a_data, 4), _stats(b_data, 4)
    a.merge(b)
    both = np.concatenate([a_data, b_data])
    assert a.count == both.size == int(a.hist.sum())
    assert (a.min, a.max) == (float(both.min()), float(both.max()))
    p = compute_range(a, "Percentile", percentile=99.9)
    assert p[1] == pytest.approx(np.percentile(both, 99.9), abs=2 * a.bin_width + 2 * b.bin_width)


def test_side_histograms_keep_all_counts(rng: np.random.Generator) -> None:
    for x in (
        rng.standard_t(2, 100_000),  # extremes far out, alone in their bins
        np.abs(rng.normal(size=10_000)),
        -np.abs(rng.normal(size=10_000)),
        rng.uniform(3, 5, 10_000),
    ):
        s = _stats(x.astype(np.float32))
        sides = side_histograms(s)
        assert sides.pos.sum() + sides.neg.sum() == pytest.approx(s.count, rel=1e-9)
        # only the raw bin straddling zero is split between the sides (in proportion)
        straddling = (
            s.hist[int(np.clip(-s.hist_lo / s.bin_width, 0, s.num_bins - 1))] if s.min < 0 < s.max else 0
        )
        assert sides.pos.sum() == pytest.approx(np.sum(x > 0), abs=straddling + 1e-6)
        assert sides.pos.size * sides.width >= s.max and sides.neg.size * sides.width >= -s.min


# -------------------------------------------------------------------------------------- methods
def test_registry_and_unknown_method() -> None:
    assert set(METHODS) <= set(CALIBRATION_METHODS)
    s = _stats(np.linspace(-1, 1, 101, dtype=np.float32), 1)
    assert compute_range(s, "kl") == compute_range(s, "KL")  # case does not matter
    with pytest.raises(PulsarError, match=r'quant\.calibration_method.*did you mean "Percentile"'):
        compute_range(s, "Percentil")


def test_minmax_is_exact(rng: np.random.Generator) -> None:
    x = rng.uniform(-3, 7, 10_000).astype(np.float32)
    s = _stats(x)
    assert compute_range(s, "MinMax") == (float(x.min()), float(x.max()))
    t = float(max(-x.min(), x.max()))
    assert compute_range(s, "MinMax", symmetric=True) == (-t, t)
    pos = _stats(np.abs(x) + 2.0)
    assert compute_range(pos, "MinMax") == (0.0, float(np.max(np.abs(x) + 2.0)))


@pytest.mark.parametrize("p", [99.99, 99.9, 99.0])
def test_percentile_matches_numpy(gauss_outliers: np.ndarray, p: float) -> None:
    s = _stats(gauss_outliers)
    lo, hi = compute_range(s, "Percentile", percentile=p)
    ref_lo, ref_hi = np.percentile(gauss_outliers, [100 - p, p])
    assert abs(lo - ref_lo) <= s.bin_width and abs(hi - ref_hi) <= s.bin_width
    assert hi < 0.2 * s.max  # the outliers are clipped
    lo_s, hi_s = compute_range(s, "Percentile", percentile=p, symmetric=True)
    assert lo_s == -hi_s
    assert abs(hi_s - np.percentile(np.abs(gauss_outliers), p)) <= s.bin_width


def test_percentile_one_sided_keeps_lower_end(rng: np.random.Generator) -> None:
    x = (np.abs(rng.standard_normal(200_000)) + 1.0).astype(np.float32)
    s = _stats(x)
    lo, hi = compute_range(s, "Percentile", percentile=99.9)
    assert lo == 0.0  # min (1.0) kept, then extended to zero
    assert abs(hi - np.percentile(x, 99.9)) <= s.bin_width


def test_mse_beats_minmax_on_outliers(gauss_outliers: np.ndarray) -> None:
    s = _stats(gauss_outliers)
    for symmetric in (False, True):
        mse = compute_range(s, "MSE", symmetric=symmetric, signed=symmetric)
        mm = compute_range(s, "MinMax", symmetric=symmetric, signed=symmetric)
        err_mse = _quant_mse(gauss_outliers, *mse, symmetric=symmetric)
        err_mm = _quant_mse(gauss_outliers, *mm, symmetric=symmetric)
        assert err_mse < 0.7 * err_mm
        assert mse[1] < mm[1]


@pytest.mark.parametrize("kind", ["laplace", "relu_t3", "t2"])
def test_mse_is_near_the_brute_force_optimum(rng: np.random.Generator, kind: str) -> None:
    x = {
        "laplace": lambda: rng.laplace(size=200_000),
        "relu_t3": lambda: np.maximum(rng.standard_t(3, 200_000), 0),
        "t2": lambda: rng.standard_t(2, 200_000),  # bulk far narrower than the range
    }[kind]().astype(np.float32)
    s = _stats(x)
    lo, hi = compute_range(s, "MSE")
    scales = np.geomspace(0.02, 1.0, 30)
    lows = [0.0] if x.min() >= 0 else x.min() * scales
    best = min(_quant_mse(x, a, b) for a in lows for b in x.max() * scales)
    assert _quant_mse(x, lo, hi) <= 1.02 * best


def test_mse_keeps_uniform_data_nearly_unclipped(rng: np.random.Generator) -> None:
    x = rng.uniform(-1, 3, 500_000).astype(np.float32)
    s = _stats(x)
    lo, hi = compute_range(s, "MSE")
    assert lo == pytest.approx(x.min(), rel=0.01) and hi == pytest.approx(x.max(), rel=0.01)
    assert _quant_mse(x, lo, hi) <= 1.01 * _quant_mse(x, float(x.min()), float(x.max()))


def test_kl_clips_heavy_tails_and_keeps_uniform(rng: np.random.Generator) -> None:
    heavy = np.maximum(rng.standard_t(3, 500_000), 0).astype(np.float32)
    s = _stats(heavy)
    lo, hi = compute_range(s, "KL")
    assert lo == 0.0 and hi < 0.5 * s.max
    assert hi > np.percentile(heavy, 99)  # clips the tail, not the bulk
    sym = compute_range(_stats(rng.laplace(size=500_000).astype(np.float32)), "KL", symmetric=True)
    assert sym[0] == -sym[1]

    uniform = rng.uniform(0, 1, 500_000).astype(np.float32)
    lo, hi = compute_range(_stats(uniform), "KL")
    assert lo == 0.0 and hi >= 0.98 * uniform.max()
    two_sided = rng.uniform(-1, 1, 500_000).astype(np.float32)
    for symmetric in (False, True):
        lo, hi = compute_range(_stats(two_sided), "KL", symmetric=symmetric)
        assert lo <= 0.98 * two_sided.min() and hi >= 0.98 * two_sided.max()


def test_kl_threshold_does_not_depend_on_bin_alignment(rng: np.random.Generator) -> None:
    """A steep head (most values in the first bins) must not make the choice erratic: merging native
    bins directly, as TensorRT does, let the grouping of those first bins decide (and clip ~1%)."""
    x = rng.exponential(1.0, 1_000_000).astype(np.float32)
    his = [compute_range(_stats(x, num_bins=bins), "KL")[1] for bins in (4096, 3000, 2048)]
    assert max(his) / min(his) < 1.05
    assert all(np.mean(x > hi) < 1e-4 for hi in his)


def test_kl_leaves_small_tensors_unclipped(rng: np.random.Generator) -> None:
    """A few thousand values (e.g. after global pooling) spread over thousands of bins look like a
    tail everywhere; there is no distribution to fit, so nothing is clipped."""
    x = rng.normal(0, 1, 3840).astype(np.float32)
    assert compute_range(_stats(x, 4), "KL") == (float(x.min()), float(x.max()))


def test_kl_vectorised_matches_reference_loop(rng: np.random.Generator) -> None:
    """The vectorised divergence equals the textbook per-threshold computation."""
    sub, levels = 2, 32

    def reference(h: np.ndarray, t: float) -> float:
        cum = np.concatenate([[0.0], np.cumsum(h)])
        cdf = np.interp(np.linspace(0.0, t, sub * levels + 1), np.arange(h.size + 1.0), cum)
        p = np.diff(cdf)
        p[-1] += cum[-1] - cdf[-1]  # clipped mass into the last bin
        q = np.zeros_like(p)
        for g in range(levels):
            part = slice(g * sub, (g + 1) * sub)
            support = p[part] > 0
            if support.any():  # the level's mass (without the clipped part) over its non-empty bins
                q[part] = np.where(support, (cdf[(g + 1) * sub] - cdf[g * sub]) / support.sum(), 0.0)
        p, q = p / p.sum(), q / q.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(np.where(p > 0, p * np.log(p / q), 0.0).sum())

    h = rng.integers(0, 40, 400).astype(np.float64)
    h[rng.random(400) < 0.3] = 0
    thresholds = np.linspace(levels, 400, 157)
    got = kl_divergences(h, thresholds, levels, sub)
    want = np.array([reference(h, t) for t in thresholds])
    ok = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), ok)
    np.testing.assert_allclose(got[ok], want[ok], atol=1e-5)
    dense = h + 1.0  # the fast path for histograms without empty bins
    np.testing.assert_allclose(
        kl_divergences(dense, thresholds, levels, sub),
        [reference(dense, t) for t in thresholds],
        atol=1e-5,
    )


@pytest.mark.parametrize("method", METHODS)
def test_every_range_contains_zero_and_stays_within_data(rng: np.random.Generator, method: str) -> None:
    for data in (rng.uniform(3, 5, 50_000), rng.uniform(-5, -3, 50_000), rng.normal(1, 2, 50_000)):
        x = data.astype(np.float32)
        s = _stats(x)
        for symmetric in (False, True):
            lo, hi = compute_range(s, method, symmetric=symmetric)
            assert lo <= 0.0 <= hi and hi > lo
            if symmetric:
                assert lo == -hi
            else:
                assert lo >= min(float(x.min()), 0.0) and hi <= max(float(x.max()), 0.0)


@pytest.mark.parametrize("method", METHODS)
def test_degenerate_statistics(method: str) -> None:
    assert compute_range(TensorStats.empty(), method) == (0.0, 0.0)
    zeros = _stats(np.zeros(100, np.float32), 2)
    assert compute_range(zeros, method) == (0.0, 0.0)
    const = _stats(np.full(100, 2.5, np.float32), 2)
    assert compute_range(const, method)[1] == pytest.approx(2.5, rel=1e-3)


def test_sixteen_bits_barely_clip(gauss_outliers: np.ndarray) -> None:
    s = _stats(gauss_outliers)
    assert compute_range(s, "KL", num_bits=16) == compute_range(s, "MinMax", num_bits=16)
    lo, hi = compute_range(s, "MSE", num_bits=16)
    lo8, hi8 = compute_range(s, "MSE", num_bits=8)
    assert hi >= hi8 and lo <= lo8  # finer grid: rounding is cheap, clipping less attractive


def test_ranges_for_many_tensors_are_fast(rng: np.random.Generator) -> None:
    stats = []
    for k in range(60):
        x = rng.standard_t(3 + k % 5, 20_000).astype(np.float32)
        stats.append(_stats(np.maximum(x, 0) if k % 2 else x, 2))
    start = time.process_time()
    for s in stats:
        for method in ("MSE", "KL"):
            compute_range(s, method)
            compute_range(s, method, symmetric=True)
    per_tensor = (time.process_time() - start) / len(stats)
    assert per_tensor < 0.05  # ~5 ms expected for both methods, both grids: 1500 tensors in seconds


def _clipped_counts(x: np.ndarray, lo: float, hi: float, n: int) -> np.ndarray:
    """The bin counts with every position clipped into [0, n - 0.5] before truncation (the reference)."""
    x = x.astype(np.float64) if x.dtype == np.float32 and (n / (hi - lo) > 1e30 or abs(lo) > 1e30) else x
    t = (x - x.dtype.type(lo)) * x.dtype.type(n / (hi - lo))
    return np.bincount(np.clip(t, 0.0, n - 0.5).astype(np.int64), minlength=n)[:n]


@pytest.mark.parametrize("case", ["edges", "rounding", "below_lo", "chunks"])
def test_bin_counts_put_edge_values_where_clipping_would(case: str) -> None:
    """Positions rounding puts at n or past it join the top bin, and values below the grid (a caller's
    mistake) the bottom one, exactly as clipping every position did."""
    from pulsar.quant.observers.histogram import _CHUNK, _bin_counts

    rng = np.random.default_rng(5)
    lo, hi, n = -1.0000001, 3.0000002, 4096
    if case == "edges":
        x = np.array([lo, hi, np.nextafter(np.float32(hi), np.float32(0)), 0.0] * 50, np.float32)
    elif case == "rounding":  # a grid edge between float32 neighbours: hi rounds past it
        x = np.float32(hi) - rng.random(10_000, dtype=np.float32) * np.float32(1e-6)
    elif case == "below_lo":
        x = np.concatenate([rng.uniform(lo, hi, 1000), [lo - 0.5, lo - 1e-7]]).astype(np.float32)
    else:
        x = rng.uniform(lo, hi, 2 * _CHUNK + 17).astype(np.float32)
        x[::997] = np.float32(hi)
    counts, zeros = _bin_counts(x, lo, hi, n, count_zeros=True)
    assert counts.shape == (n,) and counts.dtype == np.int64
    np.testing.assert_array_equal(counts, _clipped_counts(x, lo, hi, n))
    assert zeros == int(np.sum(x == 0))
