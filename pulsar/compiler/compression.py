"""Data soft compression (``compiler.enable_data_soft_compression``): how many DDR bytes each weight
tensor of an NPU program takes when stored compressed.

Why: the NPU reads every layer's weights (and its other constants: biases, multipliers, tables)
from DDR each time the layer runs. Quantized weights often hold many zero codes (pruned or small
weights round to the zero point) or long runs of one value; storing them compressed and expanding
them on the way in cuts that traffic, and only that traffic: the decompressed codes are exactly the
stored ones, so results never change.

Encodings are a registry (``ENCODINGS``): each returns the compressed size of a tensor's integer
codes. A tensor is stored in the smallest encoding, and raw when none is smaller. The decision is
made from the actual codes, never from a model or layer name.

- ``bitmap``: one bit per element marking the tensor's most frequent code (the zero point of a
  sparse weight), then the other elements' codes, plus the common code itself.
- ``runs``: (code, run length) pairs, a run at most 256 elements (an 8-bit length).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

_PACKED = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)
MAX_RUN = 256

# encoding name -> compressed bytes of a flat code array of ``bits`` bits per element
Encoding = Callable[[np.ndarray, int], int]
ENCODINGS: dict[str, Encoding] = {}


def encoding(name: str) -> Callable[[Encoding], Encoding]:
    """Register a compressed encoding under ``name``."""

    def register(fn: Encoding) -> Encoding:
        if name in ENCODINGS:
            raise ValueError(f"encoding {name!r} registered twice")
        ENCODINGS[name] = fn
        return fn

    return register


def _bytes(bits: int) -> int:
    return (bits + 7) // 8


@encoding("bitmap")
def _bitmap(codes: np.ndarray, bits: int) -> int:
    _, counts = np.unique(codes, return_counts=True)
    others = codes.size - int(counts.max())
    return _bytes(codes.size) + _bytes(others * bits) + _bytes(bits)


@encoding("runs")
def _runs(codes: np.ndarray, bits: int) -> int:
    starts = np.flatnonzero(np.diff(codes)) + 1
    lengths = np.diff(np.concatenate(([0], starts, [codes.size])))
    pairs = int(np.sum((lengths + MAX_RUN - 1) // MAX_RUN))
    return _bytes(pairs * (bits + 8))


@dataclass(frozen=True)
class Packed:
    """One weight tensor in DDR: ``raw`` bytes uncompressed, ``stored`` bytes as kept, ``encoding``
    (``raw`` when no encoding is smaller)."""

    raw: int
    stored: int
    encoding: str


def raw_bytes(tensor: onnx.TensorProto) -> int:
    """Uncompressed bytes, as the cost model counts them (4-bit codes two per byte)."""
    n = int(np.prod(tensor.dims, dtype=np.int64))
    if tensor.data_type in _PACKED:
        return (n + 1) // 2
    return n * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def pack(tensor: onnx.TensorProto) -> Packed:
    """The smallest encoding of ``tensor``'s codes (raw when none is smaller or it is not integer)."""
    raw = raw_bytes(tensor)
    codes = numpy_helper.to_array(tensor).reshape(-1)
    if codes.size < 2 or codes.dtype.kind not in "iu":
        return Packed(raw, raw, "raw")
    bits = 4 if tensor.data_type in _PACKED else 8 * codes.dtype.itemsize
    sizes = {name: fn(codes, bits) for name, fn in ENCODINGS.items()}
    best = min(sizes, key=lambda k: (sizes[k], k))
    return Packed(raw, sizes[best], best) if sizes[best] < raw else Packed(raw, raw, "raw")


def graph_constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The constant tensors of an NPU program (initializers and Constant values): what it reads from DDR."""
    out = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    out[node.output[0]] = a.t
    return out


def weight_packing(graph: onnx.GraphProto) -> dict[str, Packed]:
    """Constant tensor name -> how it is stored with soft compression on."""
    return {name: pack(t) for name, t in graph_constants(graph).items()}


@dataclass(frozen=True)
class LayerWeights:
    """One layer's constants in DDR: ``raw`` bytes, ``stored`` as kept, the encodings used (``raw``
    when nothing was compressed) and the cycles to expand them (the profile's decompression rate)."""

    raw: int
    stored: int
    encoding: str = "raw"
    decompress_cycles: int = 0

    @property
    def compressed(self) -> bool:
        return self.stored < self.raw


def layer_weights(inputs: list[str], packing: dict[str, Packed], bytes_per_cycle: int) -> LayerWeights:
    """The constants among ``inputs`` as compressed (each tensor in its smallest encoding); expanding the
    compressed ones costs raw bytes / ``bytes_per_cycle`` cycles (0: expanded in the DMA at line rate)."""
    parts = [packing[i] for i in inputs if i in packing]
    raw = sum(p.raw for p in parts)
    stored = sum(p.stored for p in parts)
    used = sorted({p.encoding for p in parts if p.encoding != "raw"})
    expanded = sum(p.raw for p in parts if p.encoding != "raw")
    cycles = -(-expanded // bytes_per_cycle) if bytes_per_cycle and expanded else 0
    return LayerWeights(raw, stored, "+".join(used) or "raw", cycles)
