"""``quant/statistics.json``: the calibration statistics as a documented, versioned, editable file.

Written with ``quant.save_statistics``, read with ``quant.statistics_file`` instead of running the
float model (on this or another machine). Layout (version 1)::

    {"format": "pulsar-calibration-statistics", "version": 1,
     "collection": {"bins": 4096, "momentum": 0.9, "binned_per_batch": 65536},
     "tensors": {"<tensor>": {
         "count": ..., "min": ..., "max": ..., "zeros": ..., "nonfinite": ...,
         "batches": ..., "run_min": ..., "run_max": ...,           # running extremes (Mean)
         "histogram": {"lo": ..., "hi": ..., "counts": [...]},     # equal bins over [lo, hi]
         "range": [lo, hi] | null,                                 # the range the method chose
         "range_by": {"method": ..., "num_bits": ..., "signed": ..., "symmetric": ..., ...}}}}

``binned_per_batch``: about the most values of one batch the histogram bins (0: all). Past it the
histogram holds an even sample, each value counted as many times as the sampling stride (see
:mod:`pulsar.quant.observers.histogram`): ``count`` and ``zeros`` are the histogram's, within a stride
a batch of the values seen, while ``min`` / ``max`` hold every value.

``range`` is the calibration method's own range (before pulsar's refinements), and ``range_by``
says how it was computed. A ``range`` that no longer equals what ``range_by`` computes from the
statistics was edited by hand: that tensor then takes it as its final range, whatever the method;
every other tensor is ranged from its statistics by this build's settings. JSON floats round-trip
exactly, so a loaded file reproduces the build that wrote it bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from pulsar.errors import PulsarError, did_you_mean
from pulsar.quant.observers import TensorStats, compute_range
from pulsar.utils.atomic import atomic_write_text

log = logging.getLogger(__name__)

FORMAT = "pulsar-calibration-statistics"
VERSION = 1
_SCALARS = ("count", "min", "max", "zeros", "nonfinite", "batches", "run_min", "run_max")
_INTS = {"count", "zeros", "nonfinite", "batches"}
_RANGE_BY = ("method", "num_bits", "signed", "symmetric", "percentile", "std_n", "kl_top_n", "weighted_alpha")


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None  # an empty tensor's +-inf extremes: JSON has no infinity


def write_statistics(path: Path, stats: dict[str, TensorStats], ranges: dict[str, tuple[float, float]],
                     range_by: dict[str, dict[str, Any]]) -> Path:
    tensors: dict[str, Any] = {}
    bins, momentum, cap = 0, 0.0, 0
    for name, s in stats.items():
        bins, momentum, cap = s.num_bins, s.momentum, s.sample_cap
        entry: dict[str, Any] = {k: getattr(s, k) if k in _INTS else _finite(float(getattr(s, k))) for k in _SCALARS}
        entry["histogram"] = {"lo": s.hist_lo, "hi": s.hist_hi, "counts": s.hist.tolist()}
        entry["range"] = list(ranges[name]) if name in ranges else None
        entry["range_by"] = range_by.get(name)
        tensors[name] = entry
    doc = {"format": FORMAT, "version": VERSION, "collection": {"bins": bins, "momentum": momentum,
                                                                     "binned_per_batch": cap},
           "tensors": tensors}
    return atomic_write_text(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def _reject_constant(token: str) -> float:
    raise ValueError(f"{token} is not a number JSON allows")


def read_statistics(path: Path) -> tuple[dict[str, TensorStats], dict[str, tuple[float, float]]]:
    """The statistics and the hand-edited ranges of a statistics file; any problem is one error line
    naming the file and the tensor."""
    where = f"quant.statistics_file '{path}'"
    try:
        doc = json.loads(Path(path).read_text(), parse_constant=_reject_constant)
    except FileNotFoundError:
        raise PulsarError(f"{where}: no such file; write one with quant.save_statistics (quant/statistics.json)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PulsarError(f"{where}: not a readable statistics file ({e}); write one with quant.save_statistics") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PulsarError(f"{where}: not a pulsar statistics file (its \"format\" must be \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise PulsarError(f"{where}: version {doc.get('version')!r}, this pulsar reads version {VERSION}; "
                          "write it again with quant.save_statistics")
    col = doc.get("collection") or {}
    cap = col.get("binned_per_batch", 0) if isinstance(col, dict) else 0
    if not isinstance(col, dict) or isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise PulsarError(f"{where}: \"collection\" must be an object whose \"binned_per_batch\" is an integer >= 0; "
                          "write the file again with quant.save_statistics")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise PulsarError(f"{where}: \"tensors\" must be an object of tensor name -> statistics")
    stats: dict[str, TensorStats] = {}
    edited: dict[str, tuple[float, float]] = {}
    for name, entry in tensors.items():
        try:
            s = _stats(entry, col)
            rng = _edited_range(s, entry)
        except (KeyError, TypeError, ValueError) as exc:
            raise PulsarError(f"{where}: tensor '{name}': {exc}; fix the entry or write the file again") from None
        stats[name] = s
        if rng is not None:
            edited[name] = rng
    return stats, edited


def _stats(e: dict[str, Any], col: dict[str, Any]) -> TensorStats:
    if not isinstance(e, dict):
        raise TypeError("each tensor's entry must be an object")
    h = e["histogram"]
    counts = np.asarray(h["counts"])
    if counts.ndim != 1 or counts.size < 16 or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ValueError("histogram.counts must be a list of at least 16 counts >= 0")
    vals = {k: e[k] for k in _SCALARS}
    count = int(vals["count"])
    if count and (vals["min"] is None or vals["max"] is None):
        raise ValueError("min and max must be numbers")
    if count and vals["min"] > vals["max"]:
        raise ValueError(f"min {vals['min']} > max {vals['max']}")
    if count and int(counts.sum()) != count:
        raise ValueError(f"the histogram holds {int(counts.sum())} values, count says {count}")
    return TensorStats(
        count=count, min=float(vals["min"]) if count else math.inf, max=float(vals["max"]) if count else -math.inf,
        hist=counts.astype(np.int64), hist_lo=float(h["lo"]), hist_hi=float(h["hi"]), zeros=int(vals["zeros"]),
        nonfinite=int(vals["nonfinite"]), batches=int(vals["batches"]), momentum=float(col.get("momentum", 0.9)),
        run_min=float(vals["run_min"] or 0.0), run_max=float(vals["run_max"] or 0.0),
        sample_cap=int(col.get("binned_per_batch", 0)))


def _edited_range(s: TensorStats, e: dict[str, Any]) -> tuple[float, float] | None:
    """The entry's range when it is not what its ``range_by`` computes from the statistics."""
    rng, by = e.get("range"), e.get("range_by")
    if rng is None:
        return None
    if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(v, int | float) for v in rng)):
        raise ValueError("range must be [lo, hi] (two numbers) or null")
    lo, hi = float(rng[0]), float(rng[1])
    if lo > hi:
        raise ValueError(f"range [{lo}, {hi}] has lo > hi")
    if not lo <= 0.0 <= hi:
        raise ValueError(f"range [{lo}, {hi}] must contain 0 (zero is exact on every grid)")
    if isinstance(by, dict) and set(by) <= set(_RANGE_BY) and "method" in by:
        computed = compute_range(s, by["method"], **{k: v for k, v in by.items() if k != "method" and v is not None})
        if computed == (lo, hi):
            return None
    return lo, hi


def load_statistics_file(path: Path, needed: list[str],
                         collection: tuple[int, float]) -> tuple[dict[str, TensorStats], dict[str, tuple[float, float]]]:
    """quant.statistics_file instead of the float pass: it must hold every tensor the model calibrates
    (``needed``) and no tensor it lacks (a file of another model, or of this one optimized otherwise).
    ``collection``: the config's (calibration_bins, calibration_momentum), which loaded statistics
    keep from their own collection (a warning says so when they differ)."""
    stats, edited = read_statistics(path)
    known = set(needed)
    unknown = [t for t in stats if t not in known]
    if unknown:
        raise PulsarError(f"quant.statistics_file '{path}': tensor '{unknown[0]}' is not in the optimized model"
                          f"{did_you_mean(unknown[0], needed)} ({len(unknown)} unknown); the file belongs to another "
                          "model or another optimization: write it again with quant.save_statistics")
    missing = [t for t in needed if t not in stats]
    if missing:
        raise PulsarError(f"quant.statistics_file '{path}': no statistics for '{missing[0]}' ({len(missing)} tensors "
                          "missing); write the file again with quant.save_statistics for this model")
    first = next(iter(stats.values()), None)
    if first is not None and (first.num_bins, first.momentum) != collection:
        log.warning("quant.statistics_file: collected with %d bins and momentum %g; quant.calibration_bins %d and "
                    "calibration_momentum %g do not act on loaded statistics", first.num_bins, first.momentum,
                    *collection)
    log.info("calibration statistics: %d tensors loaded from %s (model not run)%s", len(stats), path,
             f", {len(edited)} hand-edited range(s)" if edited else "")
    return stats, edited
