"""Checks that need the model: every name the config mentions must exist in it.

Collected all at once (like schema errors) so a user fixes a config in one round trip.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from pulsar.config.validate import ConfigError
from pulsar.errors import did_you_mean
from pulsar.utils.user_code import is_spec

if TYPE_CHECKING:
    from pulsar.config.generated import BuildConfig

DEFAULT = "DEFAULT"


def _names_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_against_model(cfg: BuildConfig, model: onnx.ModelProto, source: str = "config") -> None:
    g = model.graph
    inits = {t.name for t in g.initializer}
    inputs = [i.name for i in g.input if i.name not in inits]
    outputs = [o.name for o in g.output]
    nodes = [n.name for n in g.node]
    tensors = set(inputs) | {o for n in g.node for o in n.output} | inits
    constants = inits | {n.output[0] for n in g.node if n.op_type == "Constant"}
    problems: list[str] = []

    def need(path: str, name: str, pool: list[str] | set[str], what: str, default_ok: bool = False) -> None:
        if (default_ok and name == DEFAULT) or name in pool:
            return
        problems.append(f"{path}: '{name}' is not {what} of the model{did_you_mean(name, pool)}")

    for i, ic in enumerate(cfg.quant.input_configs):
        need(f"quant.input_configs[{i}].tensor_name", ic.tensor_name, inputs, "an input", True)
        if is_spec(ic.calibration_dataset):  # a dataset plugin file.py:callable, imported when the data opens
            plugin_file = ic.calibration_dataset.rpartition(":")[0]
            if not Path(plugin_file).is_file():
                problems.append(f"quant.input_configs[{i}].calibration_dataset: plugin {ic.calibration_dataset}: file "
                                f"'{plugin_file}' does not exist; check the path (relative paths start at the current "
                                "directory)")
        elif not Path(ic.calibration_dataset).exists():
            problems.append(f"quant.input_configs[{i}].calibration_dataset: '{ic.calibration_dataset}' does not "
                            "exist (a directory, .tar, .tar.gz or .zip; relative paths start at the current "
                            "directory)")
    for i, p in enumerate(cfg.input_processors):
        need(f"input_processors[{i}].tensor_name", p.tensor_name, inputs, "an input", True)
    for i, p in enumerate(cfg.output_processors):
        need(f"output_processors[{i}].tensor_name", p.tensor_name, outputs, "an output", True)
    for i, p in enumerate(cfg.op_processors):
        need(f"op_processors[{i}].op_name", p.op_name, nodes, "a layer (node name)")
    frozen = {}
    for i, p in enumerate(cfg.const_processors):
        need(f"const_processors[{i}].name", p.name, constants | set(inputs), "a constant or an input")
        if p.name in inputs:
            frozen[p.name] = i
    for i, ic in enumerate(cfg.quant.input_configs):
        if ic.tensor_name in frozen:
            problems.append(f"quant.input_configs[{i}].tensor_name: input '{ic.tensor_name}' is fixed by "
                            f"const_processors[{frozen[ic.tensor_name]}] and no longer read from data; remove "
                            "this entry")
    for i, sc in enumerate(cfg.compiler.sub_configs):
        for key in ("start_tensor_names", "end_tensor_names"):
            for t in _names_list(getattr(sc, key)):
                need(f"compiler.sub_configs[{i}].{key}", t, tensors, "a tensor")
    if not cfg.quant.input_configs:
        problems.append("quant.input_configs: empty; give calibration data for each input, e.g. "
                        '[{"tensor_name": "DEFAULT", "calibration_dataset": "calib/", "calibration_format": "Numpy"}]')
    if problems:
        raise ConfigError(problems, source)


def check_layer_configs(cfg: BuildConfig, model: onnx.ModelProto, source: str = "config") -> None:
    """quant.layer_configs name layers, op types and tensors of the OPTIMIZED graph (the one that is
    quantized: fusions rename and remove nodes), so they are checked after the frontend; an entry
    that matches nothing is an error."""
    g = model.graph
    nodes = [n.name for n in g.node]
    op_types = sorted({n.op_type for n in g.node})
    tensors = {i.name for i in g.input} | {o for n in g.node for o in n.output} | {t.name for t in g.initializer}
    problems = []
    where = "of the optimized model (names as in frontend/optimized.onnx)"
    for i, lc in enumerate(cfg.quant.layer_configs):
        base = f"quant.layer_configs[{i}]"
        checks = [("layer_name", n, nodes, "a layer") for n in _names_list(lc.layer_name) + _names_list(lc.layer_names)]
        checks += [("op_type", t, op_types, "an op type") for t in _names_list(lc.op_type) + _names_list(lc.op_types)]
        checks += [(key, t, tensors, "a tensor") for key in ("start_tensor_names", "end_tensor_names")
                   for t in _names_list(getattr(lc, key)) if t != DEFAULT]
        for key, name, pool, what in checks:
            if name not in pool:
                problems.append(f"{base}.{key}: '{name}' is not {what} {where}{did_you_mean(name, pool)}")
    if problems:
        raise ConfigError(problems, source)
