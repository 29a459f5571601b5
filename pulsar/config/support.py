"""What this version of pulsar implements, as data.

Two kinds of rule:

- :class:`Rule`: a value this version cannot honour (a feature not built yet, a combination that
  contradicts itself) is an error naming the field. Features not built yet are rejected when set
  away from their default, never accepted and silently ignored; each rule goes when its feature lands.
- :class:`Needs`: a field that acts only together with a switch (``smooth_quant_strength`` without
  ``enable_smooth_quant``). pulsar2 configs set such fields freely, so the build goes on: one
  warning names the field and the switch, and the field is reset to its default, so that
  build_config.json and the config hash show what actually ran.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pulsar.config.schema import load_schema, resolve
from pulsar.config.sub_configs import effective_options

_NOT_YET = "not supported by this pulsar version yet"


@dataclass(frozen=True)
class Rule:
    path: str  # dotted, with [*] for every list item
    allowed: Callable[[Any, dict[str, Any]], bool]
    why: str
    unavailable: bool = False  # the field's feature is not built yet (marked in --help)


@dataclass(frozen=True)
class Needs:
    """``path`` acts only when ``active(section)`` holds for its enclosing section; ``switch`` says
    what turns it on, as the user would set it."""

    path: str
    active: Callable[[dict[str, Any]], bool]
    switch: str


def schema_default(path: str) -> Any:
    """The schema default of a dotted field (``[*]`` for list items); None when it has none."""
    node: dict[str, Any] = load_schema()
    for part in path.replace("[*]", "").split("."):
        node = resolve(node)
        node = node.get("properties", {}).get(part) or resolve(node.get("items", {})).get("properties", {})[part]
    return resolve(node).get("default")


def _at_default(path: str, why: str = _NOT_YET) -> Rule:
    default = schema_default(path)

    def allowed(v: Any, _c: dict[str, Any]) -> bool:
        return v is None or bool(v == default)

    return Rule(path, allowed, why, unavailable=True)


def _analysis(q: dict[str, Any]) -> bool:
    return bool(q.get("precision_analysis"))


def _finetune(q: dict[str, Any]) -> bool:
    return any(q.get(f) for f in ("enable_adaround", "enable_brecq", "enable_lsq"))


def _multi_batch(c: dict[str, Any]) -> bool:
    entries = [c, *(c.get("sub_configs") or [])]
    return any(e.get("static_batch_sizes") or e.get("max_dynamic_batch_size") for e in entries)


_MULTI = "multi-batch compilation (compiler.static_batch_sizes or max_dynamic_batch_size)"
_FINETUNE = "fine-tuning (quant.enable_adaround, enable_brecq or enable_lsq)"
_AMP = "quant.auto_mixed_precision.enable"


def _uses(method: str) -> Callable[[dict[str, Any]], bool]:
    """Whether a calibration method is used anywhere: globally, for weights, or by a layer_configs entry."""
    keys = ("calibration_method", "weight_calibration_method")
    return lambda q: any(e.get(k) == method for e in [q, *(q.get("layer_configs") or [])] for k in keys)


def _check(*levels: int, field: str = "", per_layer: bool = False) -> Callable[[dict[str, Any]], bool]:
    """Whether the check levels (and CheckPerLayer) are on: in the section itself, or (at the top level) in
    a compiler.sub_configs range that inherits ``field`` (check: 2 on one range, 0 at the top)."""
    def on(c: dict[str, Any]) -> bool:
        return c.get("check") in levels and (not per_layer or c.get("check_mode") == "CheckPerLayer")

    return lambda c: on(c) or any(e.get(field) is None and on(effective_options(c, e))
                                  for e in c.get("sub_configs") or [] if isinstance(e, dict))


RULES: list[Rule] = [
    Rule("quant.precision_analysis_mode", lambda v, q: v == "Reference" or q.get("precision_analysis_method") ==
         "EndToEnd", "NPUBackend runs the whole integer network: use it with precision_analysis_method EndToEnd"),
    Rule("quant.enable_lsq", lambda v, q: not v or not (q.get("enable_adaround") or q.get("enable_brecq")),
         "LSQ learns the weights and their scales itself, AdaRound / BRECQ learn the rounding of weights on "
         "fixed scales: enable one of them (enable_adaround with enable_brecq runs BRECQ)"),
    Rule("compiler.max_dynamic_batch_size", lambda v, c: not v or not c.get("static_batch_sizes"),
         "static (compiler.static_batch_sizes) and dynamic multi-batch exclude each other; set one of them"),
    # per sub-config, what cannot act per range (unset: inherited, accepted)
    _at_default("compiler.sub_configs[*].disable_ir_fix",
                "the IR fix acts on the whole graph before it is split; set compiler.disable_ir_fix"),
]

# fields that only act together with a switch: a warning and the default when the switch is off
SWITCHED: list[Needs] = [
    Needs("onnx_opt.simplifier", lambda o: bool(o.get("enable_onnxsim")), "onnx_opt.enable_onnxsim"),
    *(Needs(f"quant.{f}", _uses(m), f"quant.calibration_method {m} (or weight_calibration_method, or a "
            "layer_configs entry's)") for f, m in (("calibration_percentile", "Percentile"), ("calibration_std_n", "Std"),
                                                  ("calibration_momentum", "Mean"), ("calibration_kl_top_n", "KL"),
                                                  ("calibration_weighted_alpha", "WeightedScale"))),
    Needs("quant.smooth_quant_threshold", lambda q: bool(q.get("enable_smooth_quant")), "quant.enable_smooth_quant"),
    Needs("quant.smooth_quant_strength", lambda q: bool(q.get("enable_smooth_quant")), "quant.enable_smooth_quant"),
    *(Needs(f"quant.{f}", _finetune, _FINETUNE) for f in ("finetune_epochs", "finetune_block_size",
                                                          "finetune_batch_size", "finetune_lr", "finetune_loss_mask")),
    Needs("quant.precision_analysis_method", _analysis, "quant.precision_analysis"),
    Needs("quant.precision_analysis_mode", _analysis, "quant.precision_analysis"),
    Needs("quant.input_sample_dir", _analysis, "quant.precision_analysis (its samples)"),
    Needs("quant.ln_scale_data_type", lambda q: (q.get("transformer_opt_level") or 0) >= 1 or bool(
        q.get("layer_configs")), "a LayerNormalization on the NPU (quant.transformer_opt_level >= 1 or a "
        "layer_configs entry)"),
    *(Needs(f"quant.auto_mixed_precision.{f}", lambda a: bool(a.get("enable")), _AMP)
      for f in ("max_16bit_layers", "target_cosine", "data_type", "num_samples")),
    Needs("compiler.disable_ir_fix", _multi_batch, _MULTI),
    Needs("compiler.input_sample_dir", _check(1, 2, 3, field="input_sample_dir"),
          "compiler.check 1, 2 or 3 (its samples)"),
    # the check options act per sub-config range too: a range's own value needs the range's check (its own or
    # inherited), a top-level value also acts through the ranges that inherit it
    *(Needs(f"compiler{at}.{f}", _check(*levels, field=f, per_layer=per_layer), f"{where}check {switch}")
      for at, where in (("", "compiler."), (".sub_configs[*]", "this range's "))
      for f, levels, per_layer, switch in (
          ("check_mode", (1, 2, 3), False, "1, 2 or 3"),
          ("check_rtol", (1,), False, "1 (all-close)"), ("check_atol", (1,), False, "1 (all-close)"),
          ("check_cosine_simularity", (3,), False, "3 (cosine)"),
          ("check_tensor_black_list", (1, 2, 3), True, "1, 2 or 3 with check_mode CheckPerLayer"))),
    Needs("input_processors[*].padding_constant_value", lambda p: bool(p.get("padding")), "padding"),
]


def _values(data: Any, parts: list[str], prefix: str, parent: dict[str, Any]) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    if not parts:
        yield prefix, data, parent
        return
    head, rest = parts[0], parts[1:]
    star = head.endswith("[*]")
    key = head[:-3] if star else head
    if not isinstance(data, dict) or key not in data:
        if not star and not rest:
            yield f"{prefix}.{key}".lstrip("."), None, data if isinstance(data, dict) else {}
        return
    value = data[key]
    path = f"{prefix}.{key}".lstrip(".")
    if star:
        for i, item in enumerate(value or []):
            yield from _values(item, rest, f"{path}[{i}]", item)
    else:
        yield from _values(value, rest, path, data)


def unavailable_fields() -> dict[str, str]:
    """Dotted field -> why, for the fields whose feature this version does not have yet."""
    return {r.path: r.why for r in RULES if r.unavailable and "[*]" not in r.path}


def switched_off(config: dict[str, Any]) -> list[str]:
    """Reset (in place) every field set away from its default whose switch is off; one warning line
    per field, naming it and the switch. Every switch is read as the user set it (before any reset)."""
    resets: list[tuple[str, Any]] = []
    warnings = []
    for need in SWITCHED:
        default = schema_default(need.path)
        ranged = need.path.startswith(_SUB)  # a range's field: its switch may be inherited, its reset inherits
        for path, value, section in _values(config, need.path.split("."), "", config):
            if ranged:
                section = effective_options(config.get("compiler") or {}, section)
            if value is None or value == default or need.active(section):
                continue
            resets.append((path, _INHERIT if ranged or default is None else default))  # no default: unset
            warnings.append(f"{path} is set ({_shown(value)}) but has no effect without {need.switch}; ignored "
                            + ("(removed: the range inherits the compiler section's value)" if ranged else
                               f"(reset to its default {_shown(default)})"))
    for path, default in resets:
        _set(config, path, default if default is _INHERIT else copy.deepcopy(default))
    return warnings


_SUB = "compiler.sub_configs[*]."
_INHERIT = object()  # reset marker: remove the field (a sub-config entry then inherits it)


def _set(config: dict[str, Any], path: str, value: Any) -> None:
    """Set a json path (``a.b[2].c``) that exists in ``config``."""
    node: Any = config
    parts = [p for p in path.replace("[", ".[").split(".") if p]
    for part in parts[:-1]:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    if value is _INHERIT:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_supported(config: dict[str, Any]) -> list[str]:
    """One problem line per field set to a value this version cannot honour."""
    problems = []
    for rule in RULES:
        for path, value, parent in _values(config, rule.path.split("."), "", config):
            if not rule.allowed(value, parent):
                problems.append(f"{path}: {_shown(value)} is not accepted: {rule.why}; remove the field or leave it "
                                "at its default")
    return problems
