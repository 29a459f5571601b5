"""Tile / slice schedules for layers whose activations do not fit the target's on-chip memory.

Why: an NPU computes out of its SRAM. A layer whose activation inputs + outputs exceed it cannot be
double-buffered; without a scheduler for it the layer runs in one pass staged through DDR (load,
compute, store, nothing overlapped: a *spill*). ``compiler.enable_tile_mode`` /
``enable_slice_mode`` let the compiler cut such a layer into N pieces whose working set fits half of
the SRAM (the other half receives the next piece), so one piece's DMA overlaps the last one's compute.

- tile mode: pieces along the output rows (H of NCHW, the sequence axis of [B, S, C], the rows of a
  matrix). A convolution / pool piece reads the input rows its window needs, so neighbouring pieces
  re-read a halo of (kernel - stride) rows; inputs that do not follow the rows (a MatMul's B, a
  broadcast operand) stay resident, read once. Weights stay resident when they fit beside two
  pieces, otherwise every piece reads them again.
- slice mode: pieces along the output channels (C of NCHW, the last axis of a MatMul). Each piece
  reads its share of the weights once; the input stays resident (read once), except for
  element-wise, pooling and depthwise layers, whose input slices with the output.

Which layers split how is a registry (``SPLITS``): one entry per integer op type. A plan only
changes the schedule (the estimate and the trace); it never changes what a layer computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import onnx
from onnx import helper

from pulsar.compiler.workload import Tensors, Workload


@dataclass(frozen=True)
class Tile:
    """One piece of a split layer: output positions ``start:stop`` along the plan's axis."""

    index: int
    start: int
    stop: int
    shape: tuple[int, ...]          # the piece's output shape
    reads: tuple[tuple[str, int], ...]  # (activation input, bytes this piece reads of it)
    out_bytes: int
    weight_bytes: int               # weight bytes this piece loads (0: resident since an earlier piece)

    @property
    def in_bytes(self) -> int:
        return sum(b for _, b in self.reads)


@dataclass(frozen=True)
class TilePlan:
    mode: str                 # "tile" (rows) or "slice" (channels)
    axis: int                 # the output axis that is split
    tiles: tuple[Tile, ...]
    working_set: int          # bytes on chip at the peak (two pieces in flight + resident data)
    weights_resident: bool

    @property
    def n(self) -> int:
        return len(self.tiles)

    def read_bytes(self, names: set[str]) -> int:
        """Bytes the pieces read of the inputs in ``names`` (halo re-reads included)."""
        return sum(b for tile in self.tiles for name, b in tile.reads if name in names)

    @property
    def weight_bytes(self) -> int:
        return sum(tile.weight_bytes for tile in self.tiles)


def _attr(node: onnx.NodeProto, name: str, default: list[int]) -> list[int]:
    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return list(value) if isinstance(value, (list, tuple)) else [int(value)]
    return default


# ---------------------------------------------------------------------- how each op splits

InputRange = Callable[[onnx.NodeProto, int, int, int], tuple[int, int]]


def _same(node: onnx.NodeProto, dim: int, start: int, stop: int) -> tuple[int, int]:
    return start, stop


def _window(node: onnx.NodeProto, dim: int, start: int, stop: int) -> tuple[int, int]:
    """Input rows (along H, the first spatial axis) that output rows start:stop read: stride,
    dilation, kernel and the top pad of the window, clipped to the input."""
    kh = (_attr(node, "kernel_shape", []) or [1])[0]
    sh = _attr(node, "strides", [1])[0]
    dh = _attr(node, "dilations", [1])[0]
    top = _attr(node, "pads", [0])[0]
    lo = start * sh - top
    hi = (stop - 1) * sh - top + (kh - 1) * dh + 1
    return max(lo, 0), min(hi, dim)


@dataclass(frozen=True)
class Split:
    """How one op type splits. ``rows`` / ``channels``: how input 0's range follows the output's
    (None: the mode does not apply); ``window``: input 0 is read through a kernel window."""

    rows: InputRange | None = _same
    channels: InputRange | None = _same
    channels_resident: bool = False   # slice mode keeps input 0 whole (a conv / matmul reads every channel)


SPLITS: dict[str, Split] = {
    "QConv": Split(rows=_window, channels_resident=True),
    "QAvgPool": Split(rows=_window),
    "MaxPool": Split(rows=_window),
    "QMatMul": Split(channels_resident=True),
    "QAdd": Split(), "QMul": Split(), "Requantize": Split(), "QLut": Split(),
    "Dequantize": Split(), "Quantize": Split(),
    "QLayerNorm": Split(channels=None),   # normalizes the channel axis: rows only
    "QSoftmax": Split(channels=None),     # rows only, and only when its axis is not the row axis
}


def row_axis(rank: int) -> int | None:
    """The axis tile mode splits: H of NCHW, S of [B, S, C], the rows of a matrix."""
    return {4: 2, 3: 1, 2: 0}.get(rank)


def channel_axis(op_type: str, rank: int) -> int | None:
    """The axis slice mode splits: C of NCHW, else the last axis (a MatMul's output columns)."""
    if rank == 4 and op_type != "QMatMul":
        return 1
    return rank - 1 if rank >= 2 else None


def _kernel_rows(node: onnx.NodeProto, t: Tensors) -> onnx.NodeProto:
    """QConv carries no kernel_shape: give the window rule one from the weight's shape."""
    if node.op_type != "QConv" or _attr(node, "kernel_shape", []):
        return node
    w = t.dims(node.input[1])
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.attribute.append(helper.make_attribute("kernel_shape", list(w[2:]) or [1]))
    return copy


def _follows(op_type: str, mode: str, k: int, split: Split, depthwise: bool, window: bool, same: bool) -> bool:
    """Whether activation input ``k`` is split with the output (else it stays resident, read once)."""
    if op_type == "QMatMul" and k == 1:
        return mode == "slice"  # an activation B: its columns are the output's, its rows the K axis
    if k == 0 and mode == "slice" and split.channels_resident and not depthwise:
        return False  # every output channel reads every input channel
    return same or (k == 0 and window)


def _pieces(node: onnx.NodeProto, w: Workload, t: Tensors, mode: str, n: int
            ) -> tuple[int, list[Tile], int, int] | None:
    """The n pieces of ``node`` (None when it does not split that way): (axis, tiles, bytes of one
    piece's sliced data at the peak, bytes resident for the whole layer)."""
    split = SPLITS.get(node.op_type)
    out = node.output[0]
    oshape = t.dims(out)
    rank = len(oshape)
    if split is None or len([o for o in node.output if o]) != 1:
        return None
    rule = split.rows if mode == "tile" else split.channels
    axis = row_axis(rank) if mode == "tile" else channel_axis(node.op_type, rank)
    if rule is None or axis is None or oshape[axis] < n:
        return None
    if node.op_type == "QSoftmax":
        sm = next((int(a.i) for a in node.attribute if a.name == "axis"), -1)
        if sm % rank == axis:
            return None
    node = _kernel_rows(node, t)
    extent = oshape[axis]
    step = math.ceil(extent / n)
    acts = t.activations(node)
    tiles: list[Tile] = []
    peak = 0
    resident: dict[str, int] = {}
    depthwise = node.op_type == "QConv" and _attr(node, "group", [1])[0] > 1
    for i, start in enumerate(range(0, extent, step)):
        stop = min(start + step, extent)
        reads: list[tuple[str, int]] = []
        sliced = 0
        for k, name in enumerate(acts):
            shape = t.dims(name)
            full = t.nbytes(name)
            if not _follows(node.op_type, mode, k, split, depthwise, rule is _window,
                            len(shape) == rank and shape[axis] == extent):
                resident[name] = full
                reads.append((name, full if i == 0 else 0))
                continue
            dim = shape[axis] if len(shape) == rank else shape[-1]  # a MatMul's B of another rank: its columns
            lo, hi = rule(node, dim, start, stop) if k == 0 else (start, stop)
            part = full * (hi - lo) // max(dim, 1)
            reads.append((name, part))
            sliced += part
        oshape_i = tuple(stop - start if d == axis else s for d, s in enumerate(oshape))
        obytes = w.bytes_written * (stop - start) // extent
        wbytes = w.weight_bytes * (stop - start) // extent if mode == "slice" else w.weight_bytes
        tiles.append(Tile(i, start, stop, oshape_i, tuple(reads), obytes, wbytes))
        peak = max(peak, sliced + obytes)
    return axis, tiles, peak, sum(resident.values())


def plan(node: onnx.NodeProto, w: Workload, t: Tensors, onchip_bytes: int, mode: str) -> TilePlan | None:
    """The fewest pieces of ``mode`` whose working set fits ``onchip_bytes`` (two pieces in flight,
    the resident inputs and, when they fit, the weights once); None when no split fits."""
    oshape = t.dims(node.output[0]) if node.output else ()
    if not oshape:
        return None
    most = max(oshape)
    for resident_weights in (True, False):
        n = 2
        while n <= most:
            got = _pieces(node, w, t, mode, n)
            if got is None:
                break
            axis, tiles, peak, resident = got
            wslice = max(tile.weight_bytes for tile in tiles)
            if mode == "slice":
                need, keep = resident + 2 * (peak + wslice), True
            elif resident_weights:
                need, keep = resident + 2 * peak + w.weight_bytes, True
            else:
                need, keep = resident + 2 * (peak + w.weight_bytes), False
            if need <= onchip_bytes:
                if mode == "tile" and keep:  # resident weights: loaded with the first piece only
                    tiles = [tile if tile.index == 0 else _no_weights(tile) for tile in tiles]
                return TilePlan(mode, axis, tuple(tiles), need, keep)
            # next n: at least one more piece; jump ahead geometrically on big layers
            n = n + 1 if n < 16 else n * 2
        if mode == "slice":
            break
    return None


def _no_weights(tile: Tile) -> Tile:
    return Tile(tile.index, tile.start, tile.stop, tile.shape, tile.reads, tile.out_bytes, 0)
