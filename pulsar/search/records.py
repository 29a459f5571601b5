"""What a resumed sweep reads back: each trial's ``trials/<k>/trial.json``, and the fingerprint it is
matched against.

A trial is not rebuilt when its record holds the same settings and fingerprint and succeeded. The
record is the sweep's own cache, not an input: one that cannot be read, or whose figures are not what
a trial writes (a metric ``"0.9"``, a latency ``"fast"``, a NaN: edited by hand or damaged), is not
trusted and its trial runs again, with a warning naming the file and the field."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pulsar.config import EffectiveConfig

log = logging.getLogger(__name__)

# a finite number in the record of a trial that succeeded: field -> may it be missing / null
_NUMBERS = {"metric": False, "metric_float": True, "metric_qdq": True, "latency_ms": True, "build_s": True}


def _stamp(path: str | Path) -> list[int] | None:
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def fingerprint(eff: EffectiveConfig, metric: str, input: Path) -> str:
    """What a finished trial's result depends on besides its settings: the effective config, the
    metric (and its plugin file), the model file, a target profile file and constant data files.
    Any change rebuilds the trial on resume."""
    target, sep, _ = metric.rpartition(":")
    cfg = eff.cfg
    profile = Path(str(cfg.target_hardware))
    parts = {"config": eff.hash, "metric": metric, "input": _stamp(input),
             "plugin": _stamp(target) if sep and target.endswith(".py") else None,
             "profile": _stamp(profile) if profile.suffix.lower() in (".yaml", ".yml", ".json") else None,
             "consts": [_stamp(c.data_path) for c in cfg.const_processors or () if c.data_path]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def previous(path: Path, trial: int, settings: dict[str, Any], fingerprint: str) -> dict[str, Any] | None:
    """The finished row recorded in ``path`` for this trial, or None when it must run (again)."""
    try:
        row = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): trial %d runs again", path, exc, trial)
        return None
    if not isinstance(row, dict) or row.pop("fingerprint", None) != fingerprint:
        return None  # another config, metric or model: an ordinary rebuild
    if row.get("settings") != settings or row.get("status") != "ok":
        return None
    problem = _problem(row, trial)
    if problem:
        log.warning("%s: %s, not what a trial records (edited or damaged?): trial %d runs again", path, problem, trial)
        return None
    return dict(row, resumed=True)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _problem(row: dict[str, Any], trial: int) -> str | None:
    """What is wrong with a succeeded trial's record (None: it is what run_trial writes)."""
    if row.get("trial") != trial:
        return f"trial is {row.get('trial')!r}, not {trial}"
    for name, optional in _NUMBERS.items():
        value = row.get(name)
        if not (_number(value) or optional and value is None):
            return f"{name} is {value!r}"
    if row.get("latency_ms") is not None and row["latency_ms"] < 0:
        return f"latency_ms is {row['latency_ms']!r}"
    size = row.get("size_bytes")
    if not (size is None or isinstance(size, int) and not isinstance(size, bool) and size >= 0):
        return f"size_bytes is {size!r}"
    return None
