"""What the quant stage hands the compiler in memory: the typed boundary between the two stages.

The files (quant/quantized.onnx, quant/quant_config.json) are exports of the same result for people
and for later builds; within one build the compiler reads this object, never the files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx


@dataclass(frozen=True)
class QuantResult:
    """The quantized model and where the quant stage placed each op."""

    qdq_model: onnx.ModelProto                      # the QDQ model (what quant/quantized.onnx holds)
    placement: Mapping[str, tuple[str, str]]        # node -> (NPU | CPU, why): decided once, by the quant plan

    def cpu_nodes(self) -> dict[str, str]:
        """The nodes the quant stage keeps on the CPU, with why (the compiler keeps them there)."""
        return {name: why for name, (device, why) in self.placement.items() if device == "CPU"}
