"""State shared by the build stages: the config, output paths, console/timing, and the model as it
moves from stage to stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from pulsar.ui import Stages


@dataclass
class BuildContext:
    cfg: Any                       # typed BuildConfig
    data: dict[str, Any]           # effective config as written to build_config.json
    config_hash: str
    output_dir: Path
    work_dir: Path
    stages: Stages
    quiet: bool = False
    model: onnx.ModelProto | None = None        # the float model (optimized after the frontend)
    calibration: Any = None                     # pulsar.quant.datasets.CalibrationData
    artifacts: dict[str, Path] = field(default_factory=dict)
    check_samples: list[dict[str, Any]] = field(default_factory=list)
    analysis_samples: list[dict[str, Any]] = field(default_factory=list)  # NPUBackend precision analysis
    # (model, sha256 of its serialized bytes): the frontend hashes optimized.onnx as it writes it
    float_digest: tuple[onnx.ModelProto, Any] | None = None
    float_reference: Any = None                 # pulsar.quant.calibrate.Reference: float outputs the pass kept
    frontend_check: Any = None                  # pulsar.frontend.pass_manager.PendingCheck: settled by the quant stage
    quant_check: Any = None                     # pulsar.quant.model_check.QuantCheck: runs while the compiler works
    quant_graph: Any = None                     # pulsar.quant.graph.QuantGraph, once the quant stage built it
    imported: dict[str, Any] = field(default_factory=dict)  # QuantONNX: tensor -> TensorQuant kept from the input
    # QuantONNX: model -> (float model, imported params); set by the orchestrator so the frontend
    # does not import from the quant stage
    import_quant: Callable[[onnx.ModelProto], tuple[onnx.ModelProto, dict[str, Any]]] | None = None

    # where the artifacts go when the build succeeds (output_dir is then the staging folder)
    final_output_dir: Path | None = None
    # the float model's file name for the compiled model's metadata (a recompile's input is a build dir)
    source_model: str | None = None

    @property
    def float_model(self) -> onnx.ModelProto:
        """The float model the stages after the frontend work on (the frontend sets ``model``)."""
        if self.model is None:
            raise RuntimeError("no float model yet: the frontend stage has not run")
        return self.model

    def path(self, *parts: str) -> Path:
        return self.output_dir.joinpath(*parts)

    def shown(self, path: Path) -> Path:
        """``path`` as the user will find it: inside the output dir, not the staging folder."""
        if self.final_output_dir is None:
            return path
        try:
            return self.final_output_dir / Path(path).relative_to(self.output_dir)
        except ValueError:
            return Path(path)
