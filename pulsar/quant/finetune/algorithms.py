"""AdaRound, BRECQ and LSQ as block-reconstruction objectives over the torch executor.

Each algorithm says which parameters of a block it trains and what loss it minimises; the loop
(:mod:`.reconstruct`) is shared. Losses are normalised by the block's loss before training, so one
learning rate suits every block and model.

- AdaRound (Nagel et al. 2020): weights = scale x (floor(W / scale) + h(V)), V learned, loss = the
  weighted layers' outputs against float (layer-wise reconstruction, inputs from the quantized
  preceding layers) + an annealed regulariser that drives every h(V) to 0 or 1.
- BRECQ (Li et al. 2021): the same learned rounding, loss = the block's output against float.
- LSQ (Esser et al. 2020): weights, their per-channel scales and the block's activation scales are
  learned, straight-through rounding to nearest, step-size gradients scaled by 1 / sqrt(N x Q_P).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pulsar.quant.finetune.blocks import Block
from pulsar.quant.torch_exec import QuantExecutor
from pulsar.quant.torch_exec.fake_quant import rounding_regularizer

Tensor = torch.Tensor

WARMUP = 0.2            # share of steps without the rounding regulariser
BETA = (20.0, 2.0)      # regulariser exponent, annealed from the first to the second
# learning rate of each kind of parameter, in units of finetune_lr: AdaRound's V is unitless (about
# -3 ... 3), LSQ's weight changes are in grid steps (10x: up to about one step in 100 steps), its
# scale factors start at 1
LR_FACTORS = {"rounding": 100.0, "weights": 10.0, "scales": 1.0}
REG_WEIGHT = 0.1        # weight of the mean rounding term against the normalised reconstruction loss


@dataclass
class Objective:
    name: str
    targets: Callable[[Block], list[str]]       # tensors compared with float
    learned_rounding: bool                      # AdaRound-style V (else LSQ)

    def prepare(self, exe: QuantExecutor, block: Block, acts: list[str], lr: float) -> list[dict[str, object]]:
        """Make the block trainable; Adam parameter groups with their learning rates."""
        if self.learned_rounding:
            for w in block.weights:
                exe.weights[w].start_adaround()
        else:
            exe.start_lsq(block.weights, acts)
        groups = exe.parameter_groups([*block.weights, *acts])
        return [{"params": ps, "lr": lr * LR_FACTORS[kind]} for kind, ps in groups.items() if ps]

    def regularizer(self, exe: QuantExecutor, block: Block, step: int, steps: int) -> Tensor | None:
        """AdaRound's rounding term after the warm-up, its exponent annealed from 20 to 2."""
        start = int(WARMUP * steps)
        if not self.learned_rounding or step < start:
            return None
        t = (step - start) / max(1, steps - start)
        beta = BETA[1] + (BETA[0] - BETA[1]) * (1 - t)
        vs = [v for w in block.weights if (v := exe.weights[w].v) is not None]
        terms = [rounding_regularizer(v, beta) for v in vs]
        n = sum(exe.weights[w].w.numel() for w in block.weights)
        return REG_WEIGHT * torch.stack(terms).sum() / max(1, n) if terms else None

    def harden(self, exe: QuantExecutor, block: Block) -> None:
        if self.learned_rounding:
            for w in block.weights:
                exe.weights[w].hard = True


OBJECTIVES: dict[str, Objective] = {
    "adaround": Objective("AdaRound", lambda b: b.weighted_nodes, True),
    "brecq": Objective("BRECQ", lambda b: b.outputs, True),
    "lsq": Objective("LSQ", lambda b: b.outputs, False),
}
