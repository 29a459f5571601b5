"""``compiler.sub_configs``: which compiler options act per range, and the effective per-range options.

A sub-config entry leaves unset what it inherits from the compiler section (the schema marks it
``x-inherit``, so no defaults are filled into it). Once the config is validated, every entry is
completed with the inherited value of each option that acts per range (:data:`PER_RANGE`), so that
build_config.json shows what each range ran with, and a re-run of that file builds the same.

Options that act on the whole model (:data:`WHOLE_MODEL`) cannot differ per range: set in an entry
away from the top level's value they are reset, with a warning naming the field (``disable_ir_fix``
is refused outright in :mod:`pulsar.config.support`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

# options whose per-range value acts on the range's subgraphs (lowering, batches, estimate, check)
PER_RANGE: tuple[str, ...] = (
    "lut_items_in_bits",        # lowering of the range's lookup tables
    "static_batch_sizes",       # the range's compiled batches (compiler/variants.py)
    "max_dynamic_batch_size",
    "ddr_bw_limit",             # the range's subgraphs in the performance estimate (compiler/cost.py)
    "enable_tile_mode", "enable_slice_mode",  # the range's ops split to fit on chip (compiler/tiling.py)
    "enable_data_soft_compression",  # the range's weights stored compressed (compiler/compression.py)
    "check", "check_mode", "check_rtol", "check_atol", "check_cosine_simularity",
    "check_tensor_black_list",  # the range's tensors in compiler.check (runtime/check_scopes.py)
)

# options of the whole model, and why a range cannot have its own
WHOLE_MODEL: dict[str, str] = {
    "input_sample_dir": "the check's samples feed the model's inputs",
    "npu_perf": "the performance trace covers the whole model",
}

_RANGE_KEYS = ("start_tensor_names", "end_tensor_names")


def _entries(config: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    compiler = config.get("compiler")
    if not isinstance(compiler, dict):
        return {}, []
    return compiler, [e for e in compiler.get("sub_configs") or [] if isinstance(e, dict)]


def whole_model_options(config: dict[str, Any]) -> list[str]:
    """Remove (in place) every whole-model option a sub-config sets away from the top level's value; one
    warning line each, naming the field and where to set it."""
    compiler, entries = _entries(config)
    warnings = []
    for i, entry in enumerate(entries):
        for key, why in WHOLE_MODEL.items():
            if key in entry and entry[key] != compiler.get(key):
                warnings.append(f"compiler.sub_configs[{i}].{key} is set ({json.dumps(entry[key])}) but {why}, so a "
                                f"range cannot have its own; ignored (set compiler.{key} instead)")
                del entry[key]
    return warnings


def complete_sub_configs(config: dict[str, Any]) -> None:
    """Fill (in place) every sub-config entry's unset :data:`PER_RANGE` options with the compiler section's
    values: the effective options each range runs with."""
    compiler, entries = _entries(config)
    for entry in entries:
        for key in PER_RANGE:
            if entry.get(key) is None and key in compiler:
                entry[key] = copy.deepcopy(compiler[key])


def effective_options(compiler: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """The options a range runs with: the compiler section's, overridden by the entry's own."""
    top = {k: v for k, v in compiler.items() if k != "sub_configs"}
    return {**top, **{k: v for k, v in entry.items() if v is not None and k not in _RANGE_KEYS}}
