"""What the quant stage hands the compiler in memory: the typed boundary between the two stages.

The files (quant/quantized.onnx, quant/quant_config.json) are exports of the same result for people
and for later builds; within one build the compiler reads this object, never the files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx

# node metadata in the QDQ model: a layer's own LUT size (quant.layer_configs lut_items_in_bits), which
# wins over compiler.lut_items_in_bits and its sub_config's; in the file, so a recompile keeps it too
LUT_BITS_KEY = "pulsar.lut_items_in_bits"


def node_lut_bits(node: onnx.NodeProto) -> int | None:
    for p in node.metadata_props:
        if p.key == LUT_BITS_KEY:
            return int(p.value)
    return None


@dataclass(frozen=True)
class QuantResult:
    """The quantized model and where the quant stage placed each op."""

    qdq_model: onnx.ModelProto                      # the QDQ model (what quant/quantized.onnx holds)
    placement: Mapping[str, tuple[str, str]]        # node -> (NPU | CPU, why): decided once, by the quant plan

    def cpu_nodes(self) -> dict[str, str]:
        """The nodes the quant stage keeps on the CPU, with why (the compiler keeps them there)."""
        return {name: why for name, (device, why) in self.placement.items() if device == "CPU"}
