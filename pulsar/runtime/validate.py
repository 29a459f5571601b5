"""The last step of every build: each subgraph of the compiled model loads in the runtime that runs it.

The compiler writes CPU subgraphs for onnxruntime and NPU subgraphs as integer programs with float
reference bodies. A body the installed onnxruntime cannot load (an op at an opset it lacks, a Q/DQ
pair of a type it has no kernel for) would otherwise surface only at ``pulsar run``, after a build
that reported success; here it fails the build, and nothing is written."""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort

from pulsar.core.container import load_compiled
from pulsar.errors import PulsarError
from pulsar.runtime.session import _CUSTOM_DOMAINS, RUNNER_FACTORIES

log = logging.getLogger(__name__)


def check_loadable(path: Path, shown: str | Path | None = None) -> int:
    """Prepare every subgraph of the compiled model at ``path`` (every variant) in every run mode;
    returns how many bodies were prepared. Raises a PulsarError naming the subgraph, mode and cause."""
    compiled = load_compiled(path)
    opsets = [op for op in compiled.model.opset_import if op.domain not in _CUSTOM_DOMAINS]
    count = 0
    for k, (mode, factory) in enumerate(RUNNER_FACTORIES.items()):
        for sg in compiled.subgraphs:
            if sg.kind != "npu" and k > 0:
                continue  # a CPU body is the same onnxruntime graph in every mode
            for variant in sg.variant_ids:
                try:
                    factory(sg.at(variant), opsets, compiled.model.ir_version)
                except PulsarError as exc:
                    cause = str(exc).removesuffix("; rebuild the model")
                    simulated = sg.kind == "npu" and mode == "NPUBackend"
                    fix = ("the integer program does not match the simulator of this pulsar: rebuild with the "
                           "pulsar that runs it" if simulated else
                           f"onnxruntime {ort.__version__} lacks it: re-export the model at an opset this onnxruntime "
                           "supports, or place the op on the other device with quant.layer_configs")
                    raise PulsarError(f"the compiled model {shown or path} does not run in {mode} mode: {cause}; "
                                      f"{fix}") from None
                count += 1
    log.info("every subgraph loads in its runtime (%d bodies in %d modes)", count, len(RUNNER_FACTORIES))
    return count
