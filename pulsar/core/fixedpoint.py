"""Real-valued rescale factors as integer multiplier / shift pairs: ``r ~= M / 2**N``.

Every requantization on the NPU is ``rshift_round(acc * M, N)`` computed in int64 (see
docs/integer_semantics.md). ``M`` keeps as many bits as the accumulator bound allows (at most
``M_BITS``) so ``|acc * M| < 2**62`` can never overflow int64; ``N`` is in ``[0, MAX_SHIFT]``.
The compiler derives every (M, N) here; the simulator only ever sees the integers.
"""

from __future__ import annotations

import numpy as np

from pulsar.errors import PulsarError

M_BITS = 31
MAX_SHIFT = 62
PRODUCT_LIMIT = 2**62


FLOAT_EXACT = 2**53    # products below this are exact in float64: the simulator's fast path
MIN_FAST_M = 2**22     # ... taken only when M keeps at least 22 bits (relative error <= 2**-23)


def multiplier_limit(acc_bound: int, m_bits: int = M_BITS) -> int:
    """Largest |M| the compiler uses for accumulators up to ``acc_bound``.

    The hard limit is |acc * M| < 2**62 (int64). When it costs little precision the compiler also
    keeps |acc * M| < 2**53, so a simulator may evaluate the requantization exactly in float64; the
    integer semantics are the same either way."""
    bound = max(int(acc_bound), 1)
    limit = min(2**m_bits - 1, PRODUCT_LIMIT // bound)
    fast = FLOAT_EXACT // bound
    return int(min(limit, fast) if fast >= MIN_FAST_M else limit)


def quantize_multiplier(real: float | np.ndarray, acc_bound: int, *, m_bits: int = M_BITS,
                        what: str = "rescale") -> tuple[np.ndarray, np.ndarray]:
    """(M, N) int64 arrays of ``real``'s shape with ``M / 2**N`` the closest to ``real`` that fits.

    ``real`` may be negative (a subtraction folds its sign into M); 0 gives (0, 0). Raises when a
    factor is too large for the accumulator bound even with N = 0 (a scale ratio above ~2**31 /
    acc_bound means the quantization grids are broken)."""
    r = np.asarray(real, dtype=np.float64)
    limit = multiplier_limit(acc_bound, m_bits)
    mag = np.abs(r)
    if mag.size and not (np.all(np.isfinite(mag)) and float(np.rint(mag.max())) <= limit):  # even N = 0 fails
        raise PulsarError(f"{what}: scale ratio {float(np.nanmax(mag)):.3g} is too large for an accumulator bound "
                          f"of {acc_bound}; check the quantization ranges of this layer")
    with np.errstate(divide="ignore"):
        n = np.floor(np.log2(limit / np.where(mag > 0, mag, 1.0)))
    n = np.clip(n, 0, MAX_SHIFT).astype(np.int64)
    m = np.rint(mag * np.exp2(n.astype(np.float64))).astype(np.int64)
    over = m > limit  # log2 rounding can land one step too high
    while np.any(over & (n > 0)):
        n = np.where(over & (n > 0), n - 1, n)
        m = np.rint(mag * np.exp2(n.astype(np.float64))).astype(np.int64)
        over = m > limit
    if np.any(m > limit):
        worst = float(mag.max())
        raise PulsarError(f"{what}: scale ratio {worst:.3g} is too large for an accumulator bound of {acc_bound}; "
                          "check the quantization ranges of this layer")
    m = np.where(mag > 0, m, 0) * np.where(r < 0, -1, 1)
    n = np.where(mag > 0, n, 0)
    return m.astype(np.int64), n.astype(np.int64)


def rshift_round(v: np.ndarray, n: np.ndarray | int) -> np.ndarray:
    """``v / 2**n`` rounded to nearest, ties toward +infinity: ``(v + 2**(n-1)) >> n`` (n >= 1), ``v`` (n = 0).

    The one rounding rule of the integer semantics; int64 in, int64 out."""
    v = np.asarray(v, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    half = np.where(n > 0, np.left_shift(np.int64(1), np.maximum(n - 1, 0)), 0)
    shifted: np.ndarray = np.right_shift(v + half, n)
    return shifted
