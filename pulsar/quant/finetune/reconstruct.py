"""The block-wise training loop shared by AdaRound, BRECQ and LSQ.

Block by block, in graph order: the block is fed the *quantized* output of the blocks before it
(with what they learned) and trained to reproduce the *float* block's output on the float input.
After training the rounding is made hard and the loss measured again on the same held samples; a
block that ends worse than it started is rolled back to its calibrated parameters. The block inputs
of every sample (float and quantized) live in two bounded :class:`SampleStore` objects and are
advanced through each block once it is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pulsar.quant.finetune.algorithms import OBJECTIVES, Objective
from pulsar.quant.finetune.blocks import Block
from pulsar.quant.finetune.store import SampleStore
from pulsar.quant.torch_exec import QuantExecutor

log = logging.getLogger(__name__)

EVAL_SAMPLES = 16  # samples the before / after loss of a block is measured on (the same ones)


@dataclass
class Settings:
    algorithm: str           # adaround | brecq | lsq
    steps: int               # optimizer steps per block (finetune_epochs)
    batch_size: int
    lr: float
    seed: int = 0


@dataclass
class BlockReport:
    index: int
    inputs: list[str]
    outputs: list[str]
    layers: int
    loss_before: float
    loss_after: float
    rolled_back: bool
    seconds: float
    trained: bool = True
    hard_rounding: bool = True   # the after-loss is that of the hard (integer) rounding


def _batch(store: SampleStore, idx: Iterable[int], names: Sequence[str], device: torch.device) -> dict[str, torch.Tensor]:
    samples = [store[int(i)] for i in idx]
    return {n: torch.from_numpy(np.concatenate([s[n] for s in samples])).to(device) for n in names}


def _mse(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.mean((a[k] - b[k]) ** 2) for k in a]).mean()


class Reconstruction:
    def __init__(self, exe: QuantExecutor, settings: Settings) -> None:
        self.exe, self.settings = exe, settings
        self.objective: Objective = OBJECTIVES[settings.algorithm]
        self.device = exe.device
        self.rng = np.random.default_rng(settings.seed)

    def _run(self, block: Block, feeds: dict[str, torch.Tensor], names: Sequence[str], quant: bool,
             batched: bool) -> dict[str, torch.Tensor]:
        if batched:
            return self.exe.run(block.nodes, feeds, names, quant=quant)
        n = next(iter(feeds.values())).shape[0]
        parts = [self.exe.run(block.nodes, {k: v[i:i + 1] for k, v in feeds.items()}, names, quant=quant)
                 for i in range(n)]
        return {k: torch.cat([p[k] for p in parts]) for k in names}

    def _loss(self, block: Block, tgt: SampleStore, q: SampleStore, idx: Sequence[int], targets: list[str],
              batched: bool) -> float:
        with torch.no_grad():
            total = 0.0
            for i in idx:
                o = self._run(block, _batch(q, [i], block.inputs, self.device), targets, True, batched)
                total += float(_mse(o, _batch(tgt, [i], targets, self.device)))
        return total / max(1, len(idx))

    def _check_batching(self, block: Block, fp: SampleStore) -> bool:
        """Whether samples can be concatenated along axis 0 in this block (a Reshape that holds the
        batch size 1 would mix them): the float block on two samples, together and apart."""
        if len(fp) < 2 or self.settings.batch_size < 2:
            return False
        feeds = _batch(fp, [0, 1], block.inputs, self.device)
        with torch.no_grad():
            try:
                together = self.exe.run(block.nodes, feeds, block.outputs, quant=False)
            except RuntimeError:
                return False
            apart = self._run(block, feeds, block.outputs, False, False)
        return all(together[k].shape == apart[k].shape and torch.allclose(together[k], apart[k], atol=1e-5,
                                                                           rtol=1e-4) for k in apart)

    def float_outputs(self, block: Block, fp: SampleStore, out: SampleStore) -> None:
        """The float block on every float input: the training targets (the objective's tensors) and
        the next block's float inputs (the block outputs), computed once, not at every step."""
        names = list(dict.fromkeys([*self.objective.targets(block), *block.outputs]))
        with torch.no_grad():
            for i in range(len(fp)):
                f = self.exe.run(block.nodes, _batch(fp, [i], block.inputs, self.device), names, quant=False)
                out.append({k: v.cpu().numpy() for k, v in f.items()})

    def block(self, index: int, block: Block, fp: SampleStore, tgt: SampleStore, q: SampleStore, acts: list[str],
              progress: Callable[[int], None] | None = None) -> BlockReport:
        """Train one block: ``fp`` its float inputs, ``tgt`` the float block's outputs on them
        (:meth:`float_outputs`), ``q`` its quantized inputs."""
        start = time.perf_counter()
        exe, s, obj = self.exe, self.settings, self.objective
        targets = obj.targets(block)
        batched = self._check_batching(block, fp)
        held = list(range(min(EVAL_SAMPLES, len(q))))
        before = self._loss(block, tgt, q, held, targets, batched)
        saved_w = {w: exe.weight_values(w) for w in block.weights}
        saved_a = {a: exe.act_values(a) for a in acts}
        params = obj.prepare(exe, block, acts, s.lr)
        if not params:
            return BlockReport(index, block.inputs, block.outputs, len(block.weights), before, before, False,
                               time.perf_counter() - start, trained=False)
        opt = torch.optim.Adam(params)
        norm = max(before, 1e-12)
        for step in range(s.steps):
            idx = self.rng.integers(0, len(q), size=s.batch_size)
            target = _batch(tgt, idx, targets, self.device)
            out = self._run(block, _batch(q, idx, block.inputs, self.device), targets, True, batched)
            loss = _mse(out, target) / norm
            reg = obj.regularizer(exe, block, step, s.steps)
            if reg is not None:
                loss = loss + reg
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            if progress is not None:
                progress(step + 1)
        obj.harden(exe, block)
        after = self._loss(block, tgt, q, held, targets, batched)
        rolled_back = not (after <= before) or not np.isfinite(after)
        if rolled_back:
            for w, (value, scale) in saved_w.items():
                exe.freeze_weight(w, value, scale)
            for a, scale in saved_a.items():
                exe.set_act_scale(a, scale)
        else:
            for w in block.weights:
                exe.freeze_weight(w, *exe.weight_values(w))
            for a in acts:
                exe.set_act_scale(a, exe.act_values(a))
        return BlockReport(index, block.inputs, block.outputs, len(block.weights), before,
                           after, rolled_back, time.perf_counter() - start,
                           hard_rounding=obj.learned_rounding)

    def advance(self, block: Block, q: SampleStore, q_next: SampleStore) -> None:
        """The next block's quantized inputs: this block's quantized output (with what it learned)
        on its quantized input."""
        with torch.no_grad():
            for i in range(len(q)):
                o = self.exe.run(block.nodes, _batch(q, [i], block.inputs, self.device), block.outputs, quant=True)
                q_next.append({k: v.cpu().numpy() for k, v in o.items()})


def block_activations(exe: QuantExecutor, block: Block) -> list[str]:
    """Activation grids an LSQ block trains: those whose dominator is produced inside the block."""
    produced = {o for i in block.nodes for o in exe.nodes[i].output}
    return [a for a in exe.acts if a in produced]


def summary(reports: list[BlockReport]) -> dict[str, Any]:
    return {"blocks": len(reports), "rolled_back": sum(r.rolled_back for r in reports),
            "seconds": sum(r.seconds for r in reports)}
