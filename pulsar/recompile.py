"""Recompile without re-quantizing: ``model_type: QuantModel`` (pulsar2's ``QuantAxModel``).

The input is an earlier build's output dir (or its quant dir, or ``quant/quantized.onnx``). Its
``build_config.json`` is the base config: the config file and flags given now are merged over it, so
a recompile with no other setting compiles exactly as that build did (the same compiled model, byte
for byte). Only what the compiler reads can change (``target_hardware``, ``npu_mode``, ``compiler.*``,
``input_processors`` / ``output_processors``, ``output_name``); what the quantized model already
embodies (``input_shapes``, ``onnx_opt``, ``const_processors``, ``op_processors``, ``quant``,
``quant_op_processors``) is kept as that build ran it, and a value given for it is named in a warning,
never silently dropped. The frontend and the quant stage do not run: no float model, no calibration.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from pulsar.compiler.targets import cores_for, load_profile
from pulsar.config import EffectiveConfig, load_build_config
from pulsar.config.loader import read_config_file
from pulsar.config.model import to_typed
from pulsar.config.schema import default_config, fill_defaults
from pulsar.context import BuildContext
from pulsar.core.handoff import QuantResult
from pulsar.errors import PulsarError, did_you_mean
from pulsar.preflight import check_extra_shapes, check_input_memory, check_processors
from pulsar.quant.reuse import QuantSource, find_source, load_quant_result
from pulsar.quant.samples import InputConverter, SampleDir

log = logging.getLogger(__name__)

RECOMPILED = ("QuantModel", "QuantAxModel")  # pulsar's name, pulsar2's name
# what the quantized model embodies: set by the build that quantized it, kept by a recompile
FROZEN = ("input_shapes", "onnx_opt", "const_processors", "op_processors", "quant", "quant_op_processors")
_NOT_INHERITED = ("input", "output_dir", "work_dir", "model_type")


@dataclass(frozen=True)
class RecompilePlan:
    """The effective config of a recompile and where its quantized model comes from.

    ``config_hash``: the hash of the equivalent build from the float model (the base build's
    ``model_type``), so the same settings give the same compiled model, metadata included;
    ``source_model``: the float model's file name, as the base build recorded it."""

    eff: EffectiveConfig
    source: QuantSource
    config_hash: str
    source_model: str


def requested_input(config: str | Path | dict[str, Any] | None, overrides: dict[str, Any]) -> str | None:
    """``input`` when the config and flags ask for a recompile, else None (a config that does not
    parse is left to the config loader to report)."""
    data: Any = config if isinstance(config, dict) else {}
    if config and not isinstance(config, dict):
        try:
            data = read_config_file(config)
        except PulsarError:
            return None
    model_type = overrides.get("model_type", data.get("model_type"))
    value = overrides.get("input", data.get("input"))
    return value if model_type in RECOMPILED and isinstance(value, str) and value else None


def _differences(path: str, mine: Any, theirs: Any) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in dict.fromkeys([*theirs, *mine]):
            yield from _differences(f"{path}.{key}", mine.get(key), theirs.get(key))
    elif mine != theirs:
        yield path, mine, theirs


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _freeze(data: dict[str, Any], source: QuantSource) -> list[str]:
    """Reset (in place) every field the quantized model embodies to the base build's value; one
    warning per field that was set otherwise. Without a base config the fields cannot act either:
    each one set away from its default is named (``quant.input_configs`` still gives the default
    mean / std of input_processors, as in a build)."""
    base = fill_defaults(source.base_config) if source.base_config is not None else None  # fields added since
    reference = base if base is not None else default_config()
    lines = []
    for key in FROZEN:
        for path, mine, theirs in _differences(key, data.get(key), reference.get(key)):
            if base is not None:
                lines.append(f"{path}: {_shown(mine)} has no effect when recompiling: the quantized model in "
                             f"{source.quant_dir} was built with {_shown(theirs)}, which is kept (build from the "
                             "float model, model_type ONNX, to change it)")
            elif not path.startswith("quant.input_configs"):
                lines.append(f"{path}: {_shown(mine)} has no effect when recompiling {source.quant_dir}: its "
                             "quantized graph and scales are fixed (build from the float model to change it)")
        if base is not None and key in base:
            data[key] = copy.deepcopy(base[key])
    defaults = default_config()
    if data.get("evaluation") != defaults["evaluation"]:
        lines.append("evaluation: not run when recompiling (it needs the float model and runs it); turned off, "
                     "build from the float model to evaluate")
        data["evaluation"] = defaults["evaluation"]
    q = data.get("quant") or {}
    if q.get("precision_analysis") and q.get("precision_analysis_mode") == "NPUBackend":
        lines.append("quant.precision_analysis_mode: NPUBackend analysis is not rerun when recompiling (it runs "
                     "calibration samples through the float model); quant/debug keeps the earlier build's tables")
    return lines


def _source_model(source: QuantSource) -> str:
    """The float model's file name as the base build recorded it (a recompiled base: its compiled
    model's metadata)."""
    base = source.base_config or {}
    if base.get("model_type") not in RECOMPILED and base.get("input"):
        return Path(str(base["input"])).name
    compiled = source.build_dir / str(base.get("output_name", "")) if source.build_dir else None
    if compiled is not None and compiled.is_file():
        from pulsar.core.container import load_compiled

        with_name = load_compiled(compiled).metadata.get("source_model")
        if isinstance(with_name, str):
            return with_name
    return source.model_path.name


def _unset_dropped(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its null fields (an effective config writes an unset optional field as null,
    which a config may not say)."""
    return {k: _unset_dropped(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}


def plan_recompile(config: str | Path | dict[str, Any] | None, overrides: dict[str, Any] | None
                   ) -> RecompilePlan | None:
    """The recompile's effective config (base build < config < flags, frozen fields reset, each
    reset named in a warning), or None when the config does not ask for a recompile."""
    overrides = overrides or {}
    wanted = requested_input(config, overrides)
    if wanted is None:
        return None
    source = find_source(wanted)
    base = source.base_config
    inherited = _unset_dropped({k: v for k, v in base.items() if k not in _NOT_INHERITED}) if base else None
    eff = load_build_config(config, overrides, base=inherited)
    data = copy.deepcopy(eff.data)
    lines = _freeze(data, source)
    for line in lines:
        log.warning("%s", line)
    eff = EffectiveConfig(data, to_typed(data), (*eff.warnings, *lines))
    origin = str(base.get("model_type", "ONNX")) if base else "ONNX"
    equivalent = EffectiveConfig({**data, "model_type": "ONNX" if origin in RECOMPILED else origin}, eff.cfg)
    return RecompilePlan(eff, source, equivalent.hash, _source_model(source))


def _check_names(ctx: BuildContext, model: onnx.ModelProto) -> None:
    """The names the compiler settings use, against the quantized model (config errors, all at once)."""
    from pulsar.config.validate import ConfigError

    cfg = ctx.cfg
    g = model.graph
    inputs = [i.name for i in g.input]
    outputs = [o.name for o in g.output]
    tensors = set(inputs) | {o for n in g.node for o in n.output} | {t.name for t in g.initializer}
    problems = []
    for field, entries, pool, what in (("input_processors", cfg.input_processors, inputs, "an input"),
                                       ("output_processors", cfg.output_processors, outputs, "an output")):
        for i, p in enumerate(entries):
            if p.tensor_name != "DEFAULT" and p.tensor_name not in pool:
                problems.append(f"{field}[{i}].tensor_name: '{p.tensor_name}' is not {what} of the quantized "
                                f"model{did_you_mean(p.tensor_name, pool)}")
    for i, sc in enumerate(cfg.compiler.sub_configs):
        for key in ("start_tensor_names", "end_tensor_names"):
            value = getattr(sc, key)
            for t in [value] if isinstance(value, str) else list(value or []):
                if t not in tensors:
                    problems.append(f"compiler.sub_configs[{i}].{key}: '{t}' is not a tensor of the quantized "
                                    f"model{did_you_mean(t, tensors)}")
    if problems:
        raise ConfigError(problems, "config")


def recompile_preflight(ctx: BuildContext, source: QuantSource) -> QuantResult:
    """Every check a recompile can make before it writes anything; the QuantResult to compile."""
    cfg = ctx.cfg
    with ctx.stages.stage("load quantized model"):
        quantized = load_quant_result(source)
        qmodel = quantized.qdq_model
        ctx.model = qmodel  # same inputs as the float model: compiler.check reads them
        log.info("recompiling %s: frontend and quantization skipped, every scale kept (%s)", source.quant_dir,
                 "base config " + str(source.build_dir / "build_config.json") if source.build_dir
                 else "no base config: the config given now is the whole config")
        _check_names(ctx, qmodel)
        check_input_memory(qmodel, "input", "recompile a model quantized with smaller input_shapes")
        c = cfg.compiler
        if c.input_sample_dir and not Path(c.input_sample_dir).is_dir():  # quant.input_sample_dir is not read
            raise PulsarError(f"compiler.input_sample_dir: '{c.input_sample_dir}' is not a directory; give a "
                              "directory of samples (one file per input tensor, or one sub-directory per sample)")
        cores_for(load_profile(cfg.target_hardware), cfg.npu_mode)
        check_extra_shapes(cfg, qmodel)
        check_processors(ctx, qmodel)
        if c.check and c.input_sample_dir:
            converter = InputConverter(cfg, qmodel)
            for _ in SampleDir("compiler.input_sample_dir", c.input_sample_dir, converter.deployed_infos, None,
                               converter.model_infos):
                pass
    return quantized


def copy_quant_artifacts(ctx: BuildContext, source: QuantSource) -> None:
    """The earlier build's quant/ (and frontend/) folders into this output dir, so that it is complete
    and can itself be recompiled."""
    shutil.copytree(source.quant_dir, ctx.path("quant"), dirs_exist_ok=True)
    ctx.artifacts["quantized model (QDQ ONNX, copied)"] = ctx.path("quant", "quantized.onnx")
    ctx.artifacts["quant config (per tensor, copied)"] = ctx.path("quant", "quant_config.json")
    if source.build_dir is not None and (source.build_dir / "frontend").is_dir():
        shutil.copytree(source.build_dir / "frontend", ctx.path("frontend"), dirs_exist_ok=True)
