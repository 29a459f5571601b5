"""onnxruntime's ``MatMulInteger`` on uint8 x uint8 operands: exact int32 sums on CPUs without VNNI.

Why it is exact: MLAS runs uint8 x uint8 products on its U8U8 kernels, which widen both operands to
16 bits and multiply-add pairs into 32-bit lanes (``vpmaddwd`` on AVX2): a pair sums to at most
``2 * 255 * 255 < 2**31``, and every later addition is an int32 addition, exact while the result
fits in int32 (the zero points are applied as integer row / column-sum corrections, exact modulo
2**32 and hence exact for a result that fits). Signed weights would take MLAS's uint8 x int8 kernels
instead, which on AVX2 add pairs in saturating 16-bit lanes (``vpmaddubsw``) and are not exact: so
the weights enter as ``w + 128`` (uint8) with a weight zero point of 128. :func:`u8u8_exact` checks
the whole path on extreme operands before any kernel uses it.

One onnxruntime session per constant weight matrix (and activation zero point and thread count):
the session prepacks the weights once, and each call pays only the run overhead.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

INT32_LIMIT = 1 << 31
# the raw products sum_k a*b (before the zero-point corrections) stay in int32 below this depth
MAX_DEPTH = (INT32_LIMIT - 1) // (255 * 255)


def _model(k: int, n: int, w_u8: np.ndarray, a_zp: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "a_zp", "w_zp"], ["y"])], "u8u8",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["M", n])],
        [numpy_helper.from_array(w_u8, "w"), numpy_helper.from_array(np.array(a_zp, np.uint8), "a_zp"),
         numpy_helper.from_array(np.array(128, np.uint8), "w_zp")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return bytes(model.SerializeToString())


class U8U8Matmul:
    """``y[M, N] = sum_k (a[m, k] - a_zp) * w[k, n]`` in int32, for uint8 ``a`` and a constant int8
    (or within-int8) weight matrix ``w[K, N]``."""

    def __init__(self, w: np.ndarray, a_zp: int) -> None:
        if w.ndim != 2 or not 0 <= a_zp <= 255:
            raise ValueError(f"U8U8Matmul: weight {w.shape} must be 2-D and a_zp {a_zp} a uint8")
        self.k, self.n = (int(d) for d in w.shape)
        self._model = _model(self.k, self.n, (np.asarray(w, np.int16) + 128).astype(np.uint8), a_zp)
        self._sessions: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _session(self) -> Any:
        import onnxruntime as ort
        import torch

        threads = torch.get_num_threads()  # the simulator's thread budget (1 inside Session.run_many)
        sess = self._sessions.get(threads)
        if sess is None:
            with self._lock:
                sess = self._sessions.get(threads)
                if sess is None:
                    opts = ort.SessionOptions()
                    opts.intra_op_num_threads = threads
                    opts.inter_op_num_threads = 1
                    opts.log_severity_level = 3
                    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
                    sess = ort.InferenceSession(self._model, opts, providers=["CPUExecutionProvider"])
                    self._sessions[threads] = sess
        return sess

    def __call__(self, a: np.ndarray) -> np.ndarray:
        """The int32 sums for the uint8 rows ``a[M, K]`` (copied when not C-contiguous)."""
        return self._session().run(None, {"a": np.ascontiguousarray(a)})[0]  # type: ignore[no-any-return]


def byte_split(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(hi, lo), both within int8, with ``w = 256 * hi + lo`` (``lo`` in [-128, 127]): weights past
    int8 (16-bit ones) as two int8 matrices, so one ``MatMulInteger`` of double width gives both
    halves' exact sums. None when ``hi`` leaves int8 (|w| above about 2**15)."""
    w = np.asarray(w, dtype=np.int64)
    lo = ((w + 128) & 0xFF) - 128
    hi = (w - lo) >> 8  # exact: w - lo is a multiple of 256
    if hi.size and (int(hi.min()) < -128 or int(hi.max()) > 127):
        return None
    return hi, lo


@functools.lru_cache(maxsize=1)
def split_exact() -> bool:
    """Whether 16-bit weights split by :func:`byte_split` into one double-width :class:`U8U8Matmul`
    give the exact sums here: :func:`u8u8_exact`, and ``256 * hi_sums + lo_sums`` equal to the exact
    products on extreme operands (codes 0 / 255, weights -32768 / 32639 and around each byte edge)."""
    if not u8u8_exact():
        return False
    a = np.full((9, 300), 255, np.uint8)
    a[1::2, ::3] = 0
    w = np.full((300, 8), 32639, np.int64)
    w[:, 1::2] = -32768
    w[::2, 2] = 127
    w[1::2, 3] = -129
    w[:, 4] = np.arange(300) * 211 - 31000
    split = byte_split(w)
    if split is None:
        return False
    hi, lo = split
    try:
        for zp in (0, 255):
            sums = U8U8Matmul(np.concatenate([hi, lo], axis=1), zp)(a).astype(np.int64)
            if not np.array_equal(256 * sums[:, :8] + sums[:, 8:], (a.astype(np.int64) - zp) @ w):
                return False
    except Exception:  # noqa: BLE001 - any failure disables the path
        return False
    return True


@functools.lru_cache(maxsize=1)
def u8u8_exact() -> bool:
    """Whether :class:`U8U8Matmul` returns the exact sums here: onnxruntime present, and equal to the
    exact products on extreme operands (codes 0 / 255 against weights -128 / 127, activation zero
    points 0 / 255, a depth of 1,000 where every raw product is 255 * 255)."""
    try:
        rng = np.random.default_rng(0)
        a = np.full((67, 1000), 255, np.uint8)
        a[1::3] = 0
        a[2::3, ::2] = 0
        a[-8:] = rng.integers(0, 256, size=(8, 1000))
        w = np.full((1000, 19), 127, np.int8)
        w[:, 1::2] = -128
        w[::3, 2] = -128
        w[:, -4:] = rng.integers(-128, 128, size=(1000, 4))
        for zp in (0, 255, 37):
            want = (a.astype(np.int64) - zp) @ w.astype(np.int64)
            got = U8U8Matmul(w, zp)(a)
            if got.dtype != np.int32 or not np.array_equal(got.astype(np.int64), want):
                return False
    except Exception:  # noqa: BLE001 - any failure (no onnxruntime, an op refused) disables the path
        return False
    return True
