"""A search space: dotted config fields -> lists of values (a small yaml / json file), checked whole.

Every field must be a config field (``did you mean``), every value list non-empty, and every trial's
full config must pass the same validation a build does, so a wrong type or an unsupported
combination is found before the first trial runs.

A key that is not a config field names a *group*: its list holds mappings of dotted fields that are
set together in one trial (``{"quant.enable_lsq": true, "quant.finetune_epochs": 40}``). Groups are
how fields that only act with a switch (fine-tuning steps with LSQ) vary with it, since a build
rejects such a field when its switch is off."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from pulsar.config import load_build_config
from pulsar.config.loader import read_config_file
from pulsar.config.overrides import leaf_map
from pulsar.config.sanity import check_raw
from pulsar.errors import PulsarError, did_you_mean

# set per trial by the sweep itself; a space may not vary them
RESERVED = ("input", "output_dir", "work_dir", "evaluation.metric")
SWEEP_FILES = ("trial.json",)  # what the sweep itself writes into a trial's folder, beside the build's artifacts
MAX_TRIALS = 1000

Space = dict[str, list[dict[str, Any]]]  # a key -> its alternatives, each {dotted field: value}


def _field(known: dict[str, Any], field: str, where: str) -> str:
    name = field.removeprefix("--")
    if name not in known:
        raise PulsarError(f"{where}: {field!r} is not a config field{did_you_mean(name, list(known))}")
    if name in RESERVED:
        raise PulsarError(f"{where}: {field!r} is set by the sweep itself; remove it")
    return name


def _group(known: dict[str, Any], key: str, values: list[Any], path: str | Path) -> list[dict[str, Any]]:
    where = f"search space {path}: group {key!r}"
    options: list[dict[str, Any]] = []
    for i, option in enumerate(values):
        if not isinstance(option, dict) or not option:
            raise PulsarError(f"{where}: item {i} must be a mapping of dotted config fields to values, got {option!r}")
        fields = [_field(known, f, f"{where}, item {i}") for f in option]
        if len(set(fields)) < len(fields):
            raise PulsarError(f"{where}, item {i}: a field is given twice (with and without '--'); give it once")
        options.append(dict(zip(fields, option.values(), strict=True)))
    return options


def load_space(path: str | Path) -> Space:
    """Each key's alternatives from a .json / .yaml / .toml file, fields and lists checked.

    A config field's list becomes one-field alternatives; a group key's list of mappings is kept as is."""
    raw = read_config_file(path)
    if not isinstance(raw, dict) or not raw:
        raise PulsarError(f"search space {path}: expected a mapping of dotted config fields to lists of values, "
                          "e.g. {\"quant.calibration_method\": [\"MinMax\", \"KL\"]}")
    problems = check_raw(raw)  # keys that are not strings, duplicate keys, absurd numbers
    if problems:
        raise PulsarError(f"search space {path}: {problems[0]}")
    known = {flag.removeprefix("--"): leaf for flag, leaf in leaf_map().items()}
    space: Space = {}
    for key, values in raw.items():
        if key.removeprefix("--") in space:
            raise PulsarError(f"search space {path}: {key!r} is given twice (with and without '--'); give it once")
        if not isinstance(values, list) or not values:
            raise PulsarError(f"search space {path}: {key!r} must be a non-empty list of values, got {values!r}")
        name = key.removeprefix("--")
        if name not in known and any(isinstance(v, dict) for v in values):
            space[key] = _group(known, key, values, path)
            continue
        name = _field(known, key, f"search space {path}")
        space[name] = [{name: v} for v in values]
    seen: dict[str, str] = {}
    for key, options in space.items():
        for field in {f for o in options for f in o}:
            if seen.setdefault(field, key) != key:
                raise PulsarError(f"search space {path}: {field!r} is set by both {seen[field]!r} and {key!r}; "
                                  "vary each field in one place")
    return space


def trials(space: Space, path: str | Path) -> list[dict[str, Any]]:
    """Every combination as ``{dotted field: value}``, the first key varying slowest (the order trials
    are numbered and run). Counted first: a space of more than MAX_TRIALS is refused before one is made
    (each trial is a build, and every one is validated before the first runs)."""
    sizes = [len(options) for options in space.values()]
    count = math.prod(sizes)
    if count > MAX_TRIALS:
        shown = " x ".join(f"{n} {k}" for k, n in zip(space, sizes, strict=True))
        raise PulsarError(f"search space {path}: {count:,} trials ({shown}), more than the limit of {MAX_TRIALS:,} "
                          "(each trial is a build); vary fewer fields or fewer values per field, or split the space "
                          "into several sweeps")
    return [{f: v for option in combo for f, v in option.items()} for combo in itertools.product(*space.values())]


def check_trials(base: str | Path | dict[str, Any] | None, settings: list[dict[str, Any]],
                 fixed: dict[str, Any], path: str | Path) -> None:
    """Validate every trial's config as a build would (types, enums, combinations), and that no trial's
    compiled model would take the name of the sweep's own record in its folder."""
    for k, s in enumerate(settings):
        shown = ", ".join(f"{f}={v!r}" for f, v in s.items())
        try:
            cfg = load_build_config(base, {**fixed, **s}).cfg
        except PulsarError as exc:
            raise PulsarError(f"search space {path}: trial {k} ({shown}): {exc}") from None
        if cfg.output_name in SWEEP_FILES:
            where = (f"search space {path}: trial {k} ({shown})" if "output_name" in s else
                     f"--config {base}" if isinstance(base, str | Path) else "the base config")
            raise PulsarError(f"{where}: output_name {cfg.output_name!r} is the sweep's own record of each trial "
                              "(trials/<k>/trial.json); choose another output_name")
