"""One node's precision: what ``layer_configs``, ``highest_mix_precision`` and the presets decide."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_DTYPE = "U8"
HIGHEST_DTYPE = "U16"


@dataclass(frozen=True)
class NodePrecision:
    data_type: str = DEFAULT_DTYPE            # activations the node reads and writes
    output_data_type: str | None = None       # its outputs, when they differ (e.g. FP32 out of a U8 Conv)
    weight_data_type: str | None = None       # None: S8
    explicit: bool = False                    # chosen by a layer_configs entry (moves manual ops)
    why: str | None = field(default=None, compare=False)  # a preset's reason, shown in the placement

    @property
    def output(self) -> str:
        return self.output_data_type or self.data_type

    @property
    def weights(self) -> str:
        return self.weight_data_type or "S8"
