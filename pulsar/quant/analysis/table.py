"""The "Quant Precision Table": one row per layer, as plain text (written to a file) and as a rich table."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from pulsar.quant.analysis.metrics import grade
from pulsar.quant.analysis.perlayer import LayerPrecision
from pulsar.ui import table
from pulsar.utils.atomic import atomic_write_text

TITLE = "Quant Precision Table"
COLUMNS = ("Operator", "Type", "Output Tensor", "Shape", "DType", "QDType", "Cosine", "MSE", "SQNR (dB)",
           "Worst Slice", "Slice Cosine", "Fix (layer_configs)")
_STYLE = {"good": "green", "ok": "yellow", "bad": "bold red"}


def fmt_shape(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if len(shape) else "scalar"


def fmt_float(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else str(x)


def cells(r: LayerPrecision) -> list[str]:
    ws = r.worst_slice
    return [r.node, r.op_type, r.tensor, fmt_shape(r.shape), r.dtype, r.qdtype, fmt_float(r.cosine, ".6f"),
            fmt_float(r.mse, ".3e"), fmt_float(r.sqnr_db, ".2f"), str(ws) if ws is not None else "-",
            fmt_float(ws.cosine, ".6f") if ws is not None else "-", r.fix()]


def table_text(rows: Sequence[LayerPrecision], title: str = TITLE) -> str:
    """Fixed-width text: title, header, dashes, one line per layer (numbers right-aligned)."""
    body = [cells(r) for r in rows]
    widths = [max([len(c), *(len(b[i]) for b in body)]) for i, c in enumerate(COLUMNS)]
    numeric = {6, 7, 8, 10}

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if i in numeric else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths,
                                                                                           strict=True))]
        return "  ".join(parts).rstrip()

    out = [title, line(COLUMNS), "  ".join("-" * w for w in widths)]
    out += [line(b) for b in body]
    return "\n".join(out) + "\n"


def write_table(rows: Sequence[LayerPrecision], path: str | os.PathLike, *, title: str = TITLE) -> str:
    """Write the precision table atomically to ``path``; return its text."""
    text = table_text(rows, title)
    atomic_write_text(path, text)
    return text


def precision_table(rows: Sequence[LayerPrecision], title: str = TITLE) -> Table:
    """The same table for the console, cosine coloured green / yellow / red (see metrics.grade)."""
    body = []
    for r in rows:
        c: list[str | Text] = list(cells(r))  # shown literally by ui.table (names may hold '[' or escapes)
        c[6] = Text(str(c[6]), style=_STYLE[grade(r.cosine)])
        c[10] = Text(str(c[10]), style=_STYLE[grade(r.slice_cosine)])
        body.append(c)
    t = table(title, COLUMNS, body)
    for i in (6, 7, 8, 10):
        t.columns[i].justify = "right"
    return t
