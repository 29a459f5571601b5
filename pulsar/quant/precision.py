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
    weight_granularity: str | None = None     # None: per_channel; per_tensor: one weight scale
    activation_symmetric: bool | None = None  # None: U* affine, S* symmetric; True / False: forced
    weight_group_size: int | None = None      # weight-only layers: a scale per group along the input axis

    @property
    def output(self) -> str:
        return self.output_data_type or self.data_type

    @property
    def weights(self) -> str:
        return self.weight_data_type or "S8"

    @property
    def per_tensor_weights(self) -> bool:
        return self.weight_granularity == "per_tensor"

    def widened(self, data_type: str, why: str) -> NodePrecision:
        """This precision with wider activations (a preset's), its weight choices kept."""
        return NodePrecision(data_type, weight_data_type=self.weight_data_type, why=why,
                             weight_granularity=self.weight_granularity, activation_symmetric=self.activation_symmetric,
                             weight_group_size=self.weight_group_size)
