"""A search space: dotted config fields -> lists of values (a small yaml / json file), checked whole.

Every field must be a config field (``did you mean``), every value list non-empty, and every trial's
full config must pass the same validation a build does, so a wrong type or an unsupported
combination is found before the first trial runs."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from pulsar.config import load_build_config
from pulsar.config.loader import read_config_file
from pulsar.config.overrides import leaf_map
from pulsar.errors import PulsarError, did_you_mean

# set per trial by the sweep itself; a space may not vary them
RESERVED = ("input", "output_dir", "work_dir", "evaluation.metric")


def load_space(path: str | Path) -> dict[str, list[Any]]:
    """``{dotted field: [values]}`` from a .json / .yaml / .toml file, fields and lists checked."""
    raw = read_config_file(path)
    if not isinstance(raw, dict) or not raw:
        raise PulsarError(f"search space {path}: expected a mapping of dotted config fields to lists of values, "
                          "e.g. {\"quant.calibration_method\": [\"MinMax\", \"KL\"]}")
    known = {flag.removeprefix("--"): leaf for flag, leaf in leaf_map().items()}
    space: dict[str, list[Any]] = {}
    for field, values in raw.items():
        name = field.removeprefix("--")
        if name not in known:
            raise PulsarError(f"search space {path}: {field!r} is not a config field{did_you_mean(name, list(known))}")
        if name in RESERVED:
            raise PulsarError(f"search space {path}: {field!r} is set by the sweep itself; remove it")
        if not isinstance(values, list) or not values:
            raise PulsarError(f"search space {path}: {field!r} must be a non-empty list of values, got {values!r}")
        space[name] = values
    return space


def trials(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination, the first field varying slowest (the order trials are numbered and run)."""
    keys = list(space)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(space[k] for k in keys))]


def check_trials(base: str | Path | dict[str, Any] | None, settings: list[dict[str, Any]],
                 fixed: dict[str, Any], path: str | Path) -> None:
    """Validate every trial's config as a build would (types, enums, combinations)."""
    for k, s in enumerate(settings):
        try:
            load_build_config(base, {**fixed, **s})
        except PulsarError as exc:
            shown = ", ".join(f"{f}={v!r}" for f, v in s.items())
            raise PulsarError(f"search space {path}: trial {k} ({shown}): {exc}") from None
