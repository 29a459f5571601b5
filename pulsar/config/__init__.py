"""Config stage: file + command-line overrides + schema defaults -> validated effective config."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pulsar.config.loader import read_config_file
from pulsar.config.model import to_typed
from pulsar.config.overrides import apply_overrides
from pulsar.config.sanity import check_paths, check_raw, check_shapes
from pulsar.config.schema import default_config, fill_defaults, load_schema
from pulsar.config.sub_configs import complete_sub_configs, whole_model_options
from pulsar.config.support import check_supported, switched_off
from pulsar.config.validate import ConfigError, validate

if TYPE_CHECKING:
    from pulsar.config.generated import BuildConfig

__all__ = ["ConfigError", "EffectiveConfig", "default_config", "load_build_config", "load_schema", "validate"]

log = logging.getLogger("pulsar.config")


@dataclass(frozen=True)
class EffectiveConfig:
    """What a build runs with: ``data`` is written to build_config.json, ``cfg`` is the typed view;
    ``warnings``: one line per field that was set but had no effect (reset to its default in ``data``)."""

    data: dict[str, Any]
    cfg: BuildConfig
    warnings: tuple[str, ...] = ()

    @property
    def hash(self) -> str:
        """Hash of the settings that change the compiled model: not where files are read or written
        (``input``, ``output_dir``, ``work_dir``, ``output_name``) nor what is only analysed, checked
        or reported (precision analysis, compiler checks, the perf trace, the model check)."""
        keep = json.loads(json.dumps(self.data))
        for dotted in _NOT_HASHED:
            *parents, last = dotted.split(".")
            node = keep
            for part in parents:
                node = node.get(part, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict):
                node.pop(last, None)
        compiler = keep.get("compiler") if isinstance(keep.get("compiler"), dict) else {}
        for entry in compiler.get("sub_configs") or []:  # a range's own check options change no program
            for dotted in _NOT_HASHED:
                if dotted.startswith("compiler.") and isinstance(entry, dict):
                    entry.pop(dotted.split(".", 1)[1], None)
        q = keep.get("quant") or {}
        if isinstance(q, dict) and not any(q.get(f) for f in _FINETUNE_SWITCHES):
            for f in _FINETUNE_ONLY:  # read by fine-tuning only: without it they change nothing
                q.pop(f, None)
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


_FINETUNE_SWITCHES = ("enable_adaround", "enable_brecq", "enable_lsq")
_FINETUNE_ONLY = ("finetune_epochs", "finetune_block_size", "finetune_batch_size", "finetune_lr", "finetune_loss_mask")
_NOT_HASHED = ("input", "output_dir", "work_dir", "output_name", "onnx_opt.model_check",
               "quant.precision_analysis", "quant.precision_analysis_method", "quant.precision_analysis_mode",
               "quant.input_sample_dir", "compiler.check", "compiler.check_mode", "compiler.check_rtol",
               "compiler.check_atol", "compiler.check_cosine_simularity", "compiler.check_tensor_black_list",
               "compiler.input_sample_dir", "compiler.npu_perf", "quant.save_statistics")


def _flag_named(line: str, flag_paths: list[str]) -> tuple[str, bool]:
    """``line`` with ``--`` before its field when a command-line flag set it, and whether one did."""
    flag = next((k for k in flag_paths if line.startswith(k) and line[len(k):len(k) + 1] in (":", ".", "[", " ")),
                None)
    return (f"--{line}", True) if flag else (line, False)


def _from_flags(problems: list[str], flag_paths: list[str], source: str) -> ConfigError:
    """Name the command-line flag (``--quant.calibration_method``) for problems it caused, and the
    config file for the rest."""
    named = [_flag_named(line, flag_paths) for line in problems]
    from_file = any(not by_flag for _line, by_flag in named)
    return ConfigError([line for line, _by_flag in named], source if from_file else "command line")


def load_build_config(config: str | Path | dict[str, Any] | None = None,
                      overrides: dict[str, Any] | None = None, *, require_io: bool = True,
                      base: dict[str, Any] | None = None) -> EffectiveConfig:
    """Merge defaults < ``base`` < config file < overrides, validate against the schema and the support
    matrix. ``base``: an earlier build's effective config (a recompile starts from it; sections merge
    key by key, lists and values are replaced). A field that has no effect without a switch that is off
    is reset to its default, with a warning (logged on ``pulsar.config`` and kept in
    ``EffectiveConfig.warnings``)."""
    if isinstance(config, dict):
        data, source = config, "config"
    elif config:
        data, source = read_config_file(config), str(config)
    else:
        data, source = {}, "command line"
    flags = sorted(overrides or {}, key=len, reverse=True)
    problems = check_raw(data)  # before anything copies or expands it
    problems += check_raw({k: v for k, v in (overrides or {}).items()})
    if problems:
        raise _from_flags(problems, flags, source)
    merged = apply_overrides(_deep_merge(base, data) if base else data, overrides or {})
    full = fill_defaults(merged)
    try:
        validate(full, source)
    except ConfigError as e:
        raise _from_flags(e.problems, flags, source) from None
    warnings = tuple(_flag_named(line, flags)[0] for line in switched_off(full) + whole_model_options(full))
    problems = check_paths(full) + check_shapes(full)
    if require_io:
        problems += [f"{key}: required (give --{key} or set it in the config)" for key in ("input", "output_dir")
                     if not full.get(key)]
    problems += check_supported(full)
    if problems:
        raise _from_flags(problems, flags, source)
    for line in warnings:
        log.warning("%s", line)
    complete_sub_configs(full)  # build_config.json shows each range's effective options
    return EffectiveConfig(full, to_typed(full), warnings)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, anything else in ``top`` replaces."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        out[key] = _deep_merge(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return out
