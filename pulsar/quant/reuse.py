"""``model_type: QuantModel`` (pulsar2: ``QuantAxModel``): an earlier build's quant output as input.

The quant stage exports what it hands the compiler (:class:`pulsar.core.handoff.QuantResult`) as two
files: ``quant/quantized.onnx`` (the QDQ model: every scale, zero point and layer data type) and
``quant/quant_config.json`` (per node its placement, NPU or CPU, and why). Reading both back gives the
same QuantResult, so a recompile for another target or batch sizes needs neither the float model nor
calibration data. A compiled model is not accepted: its subgraphs hold the integer programs with the
input processors merged in, not the QDQ graph the compiler lowers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
from google.protobuf.message import DecodeError

from pulsar.core.handoff import QuantResult
from pulsar.errors import PulsarError
from pulsar.quant.graph import QUANT_JSON_VERSION

MODEL_NAME = "quantized.onnx"
CONFIG_NAME = "quant_config.json"
BUILD_CONFIG = "build_config.json"
_NAMES = ("QuantModel", "QuantAxModel")


@dataclass(frozen=True)
class QuantSource:
    """Where a recompile reads from: the quant folder, and the build output dir around it when there
    is one (its ``build_config.json`` is the recompile's base config, its ``frontend/`` is copied)."""

    quant_dir: Path
    build_dir: Path | None
    base_config: dict[str, Any] | None

    @property
    def model_path(self) -> Path:
        return self.quant_dir / MODEL_NAME

    @property
    def config_path(self) -> Path:
        return self.quant_dir / CONFIG_NAME


def _is_quant_dir(path: Path) -> bool:
    return (path / MODEL_NAME).is_file() and (path / CONFIG_NAME).is_file()


def _quant_dir_of(path: Path, field: str) -> Path:
    """The quant folder ``path`` names: a build output dir, a quant dir, or a file inside one."""
    if not path.exists():
        raise PulsarError(f"{field}: '{path}' does not exist; give an earlier build's output dir, its quant dir "
                          f"or quant/{MODEL_NAME}")
    if path.is_dir():
        for cand in (path / "quant", path):
            if _is_quant_dir(cand):
                return cand
        raise PulsarError(f"{field}: '{path}' holds no quant/{MODEL_NAME} and quant/{CONFIG_NAME}; give the "
                          "output dir of a finished pulsar build (or its quant dir)")
    if path.name == CONFIG_NAME or ((path.parent / CONFIG_NAME).is_file() and path.suffix == ".onnx"):
        if not _is_quant_dir(path.parent):
            raise PulsarError(f"{field}: '{path.parent}' lacks {MODEL_NAME}; give a complete quant dir")
        return path.parent
    if _is_quant_dir(path.parent / "quant"):  # e.g. the compiled model of a build
        raise PulsarError(f"{field}: '{path}' is not a quant output (a compiled model keeps integer programs, not "
                          f"the quantized graph the compiler lowers); give its build's output dir '{path.parent}'")
    raise PulsarError(f"{field}: '{path}' has no {CONFIG_NAME} beside it, so it is not a pulsar quant output; "
                      "for a QDQ model from another tool use model_type QuantONNX")


def find_source(path: str | Path, field: str = "input") -> QuantSource:
    """Locate the quant artifacts (and the build around them) that ``path`` names."""
    quant_dir = _quant_dir_of(Path(path), field)
    build_dir = quant_dir.parent if quant_dir.name == "quant" and (quant_dir.parent / BUILD_CONFIG).is_file() \
        else None
    base = None
    if build_dir is not None:
        try:
            base = json.loads((build_dir / BUILD_CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise PulsarError(f"{field}: {build_dir / BUILD_CONFIG} cannot be read ({exc}); restore it or give the "
                              "quant dir alone") from None
        if not isinstance(base, dict):
            raise PulsarError(f"{field}: {build_dir / BUILD_CONFIG} is not a config mapping; restore it")
        if base.get("model_type") in _NAMES and not base.get("quant"):
            raise PulsarError(f"{field}: {build_dir / BUILD_CONFIG} has no quant section; restore it")
    return QuantSource(quant_dir, build_dir, base)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PulsarError(f"{path}: cannot be read as JSON ({exc}); rebuild the quantized model") from None
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
        raise PulsarError(f"{path}: not a pulsar quant config (no 'nodes' mapping); rebuild the quantized model")
    if data.get("version") != QUANT_JSON_VERSION:
        raise PulsarError(f"{path}: quant config version {data.get('version')!r}, this pulsar reads version "
                          f"{QUANT_JSON_VERSION}; rebuild the quantized model with this pulsar")
    return data


def load_quant_result(source: QuantSource) -> QuantResult:
    """The QuantResult the earlier build's compiler received: its QDQ model and its placement."""
    try:
        model = onnx.load(str(source.model_path))
    except (OSError, DecodeError, ValueError, RuntimeError) as exc:
        raise PulsarError(f"{source.model_path}: not a readable ONNX model ({exc}); rebuild the quantized "
                          "model") from None
    qjson = _read_json(source.config_path)
    names = {n.name for n in model.graph.node}
    placement: dict[str, tuple[str, str]] = {}
    for name, node in qjson["nodes"].items():
        device = node.get("placement") if isinstance(node, dict) else None
        if device not in ("NPU", "CPU"):
            raise PulsarError(f"{source.config_path}: node {name!r} has no placement NPU or CPU; rebuild the "
                              "quantized model")
        if name not in names and not (isinstance(node, dict) and node.get("fused_into")):
            raise PulsarError(f"{source.config_path}: node {name!r} is not in {source.model_path}: the two files "
                              "come from different builds; use the quant dir of one build")
        placement[name] = (device, str(node.get("placement_reason", "")))
    if not any(n.op_type == "QuantizeLinear" for n in model.graph.node) and not any(
            d == "NPU" for d, _ in placement.values()):
        raise PulsarError(f"{source.model_path}: holds no quantized op; rebuild the quantized model")
    return QuantResult(model, placement)
