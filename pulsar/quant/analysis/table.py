"""The "Quant Precision Table": one row per layer, as plain text (written to a file) and as a rich table."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from pulsar.quant.analysis.metrics import COSINE_OK, grade
from pulsar.quant.analysis.perlayer import LayerPrecision
from pulsar.ui import table
from pulsar.utils.atomic import atomic_write_text

TITLE = "Quant Precision Table"
COLUMNS = ("Operator", "Type", "Output Tensor", "Shape", "DType", "QDType", "Cosine", "MSE", "SQNR (dB)")
_STYLE = {"good": "green", "ok": "yellow", "bad": "bold red"}


def fmt_shape(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if len(shape) else "scalar"


def fmt_float(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else str(x)


def cells(r: LayerPrecision) -> list[str]:
    return [r.node, r.op_type, r.tensor, fmt_shape(r.shape), r.dtype, r.qdtype, fmt_float(r.cosine, ".6f"),
            fmt_float(r.mse, ".3e"), fmt_float(r.sqnr_db, ".2f")]


def fixed_width(title: str, columns: Sequence[str], body: Sequence[Sequence[str]], numeric: set[int]) -> str:
    """Title, header, dashes, one line per row, every column as wide as its widest cell (``numeric``
    columns right-aligned)."""
    widths = [max([len(c), *(len(b[i]) for b in body)]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if i in numeric else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths,
                                                                                           strict=True))]
        return "  ".join(parts).rstrip()

    out = [title, line(columns), "  ".join("-" * w for w in widths)]
    out += [line(b) for b in body]
    return "\n".join(out) + "\n"


def table_text(rows: Sequence[LayerPrecision], title: str = TITLE) -> str:
    """Fixed-width text: title, header, dashes, one line per layer (numbers right-aligned)."""
    return fixed_width(title, COLUMNS, [cells(r) for r in rows], {6, 7, 8})


def write_table(rows: Sequence[LayerPrecision], path: str | os.PathLike, *, title: str = TITLE) -> str:
    """Write the precision table atomically to ``path``; return its text."""
    text = table_text(rows, title)
    atomic_write_text(path, text)
    return text


def graded_table(title: str, columns: Sequence[str], body: Sequence[Sequence[str]], cosines: Sequence[float],
                 graded: int, numeric: Sequence[int]) -> Table:
    """A console table whose column ``graded`` is coloured green / yellow / red by ``cosines`` (see
    metrics.grade); cells are shown literally by ui.table (names may hold '[' or escapes)."""
    rows = []
    for cell_row, cos in zip(body, cosines, strict=True):
        c: list[str | Text] = list(cell_row)
        c[graded] = Text(str(c[graded]), style=_STYLE[grade(cos)])
        rows.append(c)
    t = table(title, columns, rows)
    for i in numeric:
        t.columns[i].justify = "right"
    return t


def precision_table(rows: Sequence[LayerPrecision], title: str = TITLE) -> Table:
    """The same table for the console, cosine coloured green / yellow / red (see metrics.grade)."""
    return graded_table(title, COLUMNS, [cells(r) for r in rows], [r.cosine for r in rows], 6, (6, 7, 8))


SLICE_TITLE = "Quant Precision Table: slices"
SLICE_COLUMNS = ("Operator", "Output Tensor", "QDType", "Cosine", "Worst Slice", "Slice Cosine", "Slice SQNR (dB)",
                 "Fix (layer_configs)")


def slice_rows(rows: Sequence[LayerPrecision]) -> list[LayerPrecision]:
    """The layers whose worst slice (channel / last-axis index) grades below 'ok' while the whole tensor
    may still read well: what a per-tensor cosine hides."""
    return [r for r in rows if r.worst_slice is not None and grade(r.slice_cosine) == "bad"]


def _slice_cells(r: LayerPrecision) -> list[str]:
    ws = r.worst_slice
    assert ws is not None
    return [r.node, r.tensor, r.qdtype, fmt_float(r.cosine, ".6f"), str(ws), fmt_float(ws.cosine, ".6f"),
            fmt_float(ws.sqnr_db, ".2f"), r.fix() or "-"]


def slice_table_text(rows: Sequence[LayerPrecision], title: str = SLICE_TITLE) -> str:
    """Fixed-width text of :func:`slice_rows` (a line saying there are none otherwise)."""
    body = [_slice_cells(r) for r in slice_rows(rows)]
    if not body:
        return f"{title}\nevery slice of every layer grades ok (cosine >= {COSINE_OK})\n"
    return fixed_width(title, SLICE_COLUMNS, body, {3, 5, 6})


def slice_table(rows: Sequence[LayerPrecision], title: str = SLICE_TITLE) -> Table | None:
    """The console form of :func:`slice_table_text`; None when every slice grades ok."""
    chosen = slice_rows(rows)
    if not chosen:
        return None
    return graded_table(title, SLICE_COLUMNS, [_slice_cells(r) for r in chosen], [r.slice_cosine for r in chosen],
                        5, (3, 5, 6))


def publish_slices(rows: Sequence[LayerPrecision], path: str | os.PathLike, title: str, quiet: bool) -> None:
    """Show the slice table (when a slice grades bad) and write it to ``path``, for either analysis mode."""
    from pulsar.ui import show

    t = slice_table(rows, f"{title}: slices")
    if t is not None:
        show(t, quiet=quiet)
    atomic_write_text(path, slice_table_text(rows, f"{title}: slices"))
