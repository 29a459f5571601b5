"""Serialize a config as json, yaml or toml (for `pulsar config defaults`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import tomli_w
import yaml

from pulsar.errors import PulsarError, did_you_mean


def _toml(cfg: dict[str, Any]) -> str:
    # TOML has no null; unset optional fields are simply absent.
    return tomli_w.dumps(cfg)


DUMPERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "json": lambda c: json.dumps(c, indent=2) + "\n",
    "yaml": lambda c: yaml.safe_dump(c, sort_keys=False),
    "toml": _toml,
}


def dump_config(cfg: dict[str, Any], fmt: str) -> str:
    if fmt not in DUMPERS:
        raise PulsarError(f"--format: '{fmt}' is not one of {', '.join(DUMPERS)}{did_you_mean(fmt, DUMPERS)}")
    return DUMPERS[fmt](cfg)
