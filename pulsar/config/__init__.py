"""Config stage: file + command-line overrides + schema defaults -> validated effective config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulsar.config.loader import read_config_file
from pulsar.config.model import to_typed
from pulsar.config.overrides import apply_overrides
from pulsar.config.schema import default_config, fill_defaults, load_schema
from pulsar.config.support import check_supported
from pulsar.config.validate import ConfigError, validate

__all__ = ["ConfigError", "EffectiveConfig", "default_config", "load_build_config", "load_schema", "validate"]


@dataclass(frozen=True)
class EffectiveConfig:
    """What a build runs with: ``data`` is written to build_config.json, ``cfg`` is the typed view."""

    data: dict[str, Any]
    cfg: Any

    @property
    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()[:16]


def load_build_config(config: str | Path | dict[str, Any] | None = None,
                      overrides: dict[str, Any] | None = None, *, require_io: bool = True) -> EffectiveConfig:
    """Merge defaults < config file < overrides, validate against the schema and the support matrix."""
    if isinstance(config, dict):
        data, source = config, "config"
    elif config:
        data, source = read_config_file(config), str(config)
    else:
        data, source = {}, "command line"
    try:
        merged = apply_overrides(data, overrides or {})
    except ConfigError:
        raise
    full = fill_defaults(merged)
    validate(full, source)
    problems = []
    if require_io:
        problems += [f"{key}: required (give --{key} or set it in the config)" for key in ("input", "output_dir")
                     if not full.get(key)]
    problems += check_supported(full)
    if problems:
        raise ConfigError(problems, source)
    return EffectiveConfig(full, to_typed(full))
