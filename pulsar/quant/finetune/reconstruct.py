"""The block-wise training loop shared by AdaRound, BRECQ and LSQ.

Block by block, in graph order: the block is fed the *quantized* output of the blocks before it
(with what they learned) and trained to reproduce the *float* block's output on the float input.
After training the rounding is made hard and the loss measured again on held-out samples that no
training batch draws (a quarter of the samples, 4 to 16, where there are at least 16): a block that
ends worse there than it started, having fitted its training batches but not generalized, is
rolled back to its calibrated parameters. BRECQ trains with QDrop (Wei et al. 2022): each
element of the block's input and of its quantized activations keeps its float value with
probability 0.5, which flattens the loss around the learned parameters. The block inputs
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
from pulsar.quant.finetune.loss_mask import mean_square, per_sample_error, squared_error
from pulsar.quant.finetune.store import SampleStore
from pulsar.quant.torch_exec import QuantExecutor

log = logging.getLogger(__name__)

EVAL_SAMPLES = 16  # at most this many samples judge a block's loss before / after training
MIN_HELD = 4  # held-out samples needed to judge on samples kept out of training
HELD_FROM = 16  # samples from which some are held out (fewer: training needs them all)
CHECKS, PATIENCE = 5, 2  # LSQ: held-out checks per block; checks without a gain before it stops
CHUNK = 8  # samples per forward pass outside training (targets, next inputs, losses)


@dataclass
class Settings:
    algorithm: str           # adaround | brecq | lsq
    steps: int               # optimizer steps per block (finetune_epochs)
    batch_size: int
    lr: float
    seed: int = 0
    qdrop: float = 0.0       # QDrop probability (0: off)
    held_out: bool = False   # judge the rollback on samples kept out of training
    loss_mask: str = ""      # quant.finetune_loss_mask: the model input that weighs the losses


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
    reason: str = ""             # why a block did not train
    signal: float = 0.0          # mean square of the float targets on the held-out samples

    def sqnr(self, loss: float) -> float:
        """Signal-to-quantization-noise ratio in dB of a loss on the held-out samples."""
        if loss <= 0 or not np.isfinite(loss):
            return float("inf") if loss == 0 else float("nan")
        return float(10 * np.log10(max(self.signal, 1e-30) / loss))


def _batch(store: SampleStore, idx: Iterable[int], names: Sequence[str], device: torch.device) -> dict[str, torch.Tensor]:
    samples = [store[int(i)] for i in idx]
    return {n: torch.from_numpy(np.concatenate([s[n] for s in samples])).to(device) for n in names}


def _mse(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
    return torch.stack([squared_error(a[k], b[k], mask) for k in a]).mean()


class Reconstruction:
    def __init__(self, exe: QuantExecutor, settings: Settings, masks: SampleStore | None = None) -> None:
        self.exe, self.settings = exe, settings
        self.masks = masks  # quant.finetune_loss_mask of every sample (key "m"), or None
        self.objective: Objective = OBJECTIVES[settings.algorithm]
        self.device = exe.device
        self.rng = np.random.default_rng(settings.seed)
        self.batched: dict[int, bool] = {}  # block (first node) -> samples may be stacked on axis 0

    def _run(self, block: Block, feeds: dict[str, torch.Tensor], names: Sequence[str], quant: bool,
             n: int) -> dict[str, torch.Tensor]:
        """The block on ``n`` samples concatenated along axis 0 (as :func:`_batch` makes them); the
        outputs likewise. Where the block cannot take them stacked (a graph written for one sample:
        a Squeeze of axis 0, a Reshape to [1, ...]), it runs once per sample, as the graph says, and
        the outputs are concatenated (torch.func.vmap was measured slower: torch's fake-quantize
        kernels have no batching rule and fall back to a loop per sample, recurrent ops loop anyway)."""
        if n == 1 or self.batched.get(block.nodes[0], False):
            return self.exe.run(block.nodes, feeds, names, quant=quant)
        parts = [self.exe.run(block.nodes, {k: v.reshape(n, v.shape[0] // n, *v.shape[1:])[i] for k, v in feeds.items()},
                              names, quant=quant) for i in range(n)]
        return {k: torch.cat([p[k] for p in parts]) for k in names}

    def _mask(self, idx: Iterable[int]) -> torch.Tensor | None:
        """The loss mask of the samples ``idx``, stacked along axis 0 as :func:`_batch` stacks them."""
        return None if self.masks is None else _batch(self.masks, idx, ["m"], self.device)["m"]

    def split(self, n: int) -> tuple[list[int], list[int]]:
        """(training samples, held-out samples the rollback judges on). With enough samples the
        held-out ones are never drawn for training, so a block that fits its training batches but
        generalizes worse is rolled back; with few, both are all samples."""
        if not self.settings.held_out or n < HELD_FROM:
            every = list(range(n))
            return every, every[:EVAL_SAMPLES]
        k = min(EVAL_SAMPLES, max(MIN_HELD, n // 4))
        order = np.random.default_rng(self.settings.seed + 1).permutation(n)
        return sorted(int(i) for i in order[k:]), sorted(int(i) for i in order[:k])

    def _chunks(self, n: int) -> list[list[int]]:
        """Sample indices in groups run as one batch outside training."""
        return [list(range(i, min(n, i + CHUNK))) for i in range(0, n, CHUNK)]

    def _loss(self, block: Block, tgt: SampleStore, q: SampleStore, held: list[int], targets: list[str]) -> float:
        """Mean over the samples ``held`` of the per-sample loss (the quantized block against its target)."""
        total = 0.0
        with torch.no_grad():
            for idx in [held[i:i + CHUNK] for i in range(0, len(held), CHUNK)]:
                o = self._run(block, _batch(q, idx, block.inputs, self.device), targets, True, len(idx))
                t = _batch(tgt, idx, targets, self.device)
                m = self._mask(idx)
                per = torch.stack([per_sample_error(o[k], t[k], m, len(idx)) for k in targets]).mean(0)
                total += float(per.sum())
        return total / max(1, len(held))

    def _signal(self, tgt: SampleStore, held: list[int], targets: list[str]) -> float:
        """Mean square of the float targets on ``held``, the loss's scale (its SQNR's signal)."""
        total = 0.0
        for i in held:
            sample = tgt[i]
            m = None if self.masks is None else self.masks[i]["m"]
            total += float(np.mean([mean_square(sample[k], m) for k in targets]))
        return total / max(1, len(held))

    def _check_batching(self, block: Block, fp: SampleStore) -> bool:
        """Whether samples can simply be concatenated along axis 0 in this block: the float block on
        two samples, together and apart (vmap, one per sample), gives the same."""
        if len(fp) < 2:
            return False
        feeds = _batch(fp, [0, 1], block.inputs, self.device)
        with torch.no_grad():
            apart = self._run(block, feeds, block.outputs, False, 2)
            try:
                together = self.exe.run(block.nodes, feeds, block.outputs, quant=False)
            except RuntimeError:
                return False
        return all(together[k].shape == apart[k].shape and torch.allclose(together[k], apart[k], atol=1e-5,
                                                                           rtol=1e-4) for k in apart)

    def float_outputs(self, block: Block, fp: SampleStore, out: SampleStore) -> None:
        """The float block on every float input: the training targets (the objective's tensors) and
        the next block's float inputs (the block outputs), computed once, not at every step."""
        self.batched[block.nodes[0]] = self._check_batching(block, fp)
        names = list(dict.fromkeys([*self.objective.targets(block), *block.outputs]))
        self._each(block, fp, names, False, out)

    def _each(self, block: Block, src: SampleStore, names: list[str], quant: bool, out: SampleStore) -> None:
        with torch.no_grad():
            for idx in self._chunks(len(src)):
                res = self._run(block, _batch(src, idx, block.inputs, self.device), names, quant, len(idx))
                arrays = {k: v.cpu().numpy() for k, v in res.items()}
                for j in range(len(idx)):
                    out.append({k: np.split(a, len(idx))[j] for k, a in arrays.items()})

    def block(self, index: int, block: Block, fp: SampleStore, tgt: SampleStore, q: SampleStore, acts: list[str],
              progress: Callable[[int], None] | None = None) -> BlockReport:
        """Train one block: ``fp`` its float inputs, ``tgt`` the float block's outputs on them
        (:meth:`float_outputs`), ``q`` its quantized inputs."""
        start = time.perf_counter()
        exe, s, obj = self.exe, self.settings, self.objective
        targets = obj.targets(block)
        train, held = self.split(len(q))
        before = self._loss(block, tgt, q, held, targets)
        signal = self._signal(tgt, held, targets)
        saved_w = {w: exe.weight_values(w) for w in block.weights}
        saved_a = {a: exe.act_values(a) for a in acts}
        params = obj.prepare(exe, block, acts, s.lr)
        if not params:
            return BlockReport(index, block.inputs, block.outputs, len(block.weights), before, before, False,
                               time.perf_counter() - start, trained=False, reason=block.reason, signal=signal)
        opt = torch.optim.Adam(params)
        norm = max(before, 1e-12)
        # LSQ's parameters are usable at any step: checked on the held-out samples every ``every``
        # steps, the best kept, training stopped after PATIENCE checks without a gain (learned
        # rounding is only meaningful once its regulariser has annealed: judged at the end only)
        every = max(1, s.steps // CHECKS) if s.held_out and held != train and not obj.learned_rounding else 0
        best, best_state, stale = before, None, 0
        exe.drop = s.qdrop
        for step in range(s.steps):
            idx = self.rng.choice(train, size=s.batch_size)
            target = _batch(tgt, idx, targets, self.device)
            feeds = _batch(q, idx, block.inputs, self.device)
            if s.qdrop:  # QDrop on the block input too: elements of the float input in place of the quantized
                fp_feeds = _batch(fp, idx, block.inputs, self.device)
                feeds = {k: torch.where(exe.drop_mask(v), fp_feeds[k], v) if v.is_floating_point()
                         else v for k, v in feeds.items()}
            out = self._run(block, feeds, targets, True, len(idx))
            loss = _mse(out, target, self._mask(idx)) / norm
            reg = obj.regularizer(exe, block, step, s.steps)
            if reg is not None:
                loss = loss + reg
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            for group in opt.param_groups:  # a non-finite gradient (0 / 0 somewhere) moves nothing
                for p in group["params"]:
                    if p.grad is not None:
                        torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
            opt.step()
            if progress is not None:
                progress(step + 1)
            if every and (step + 1) % every == 0 and step + 1 < s.steps:
                exe.drop = 0.0
                now = self._loss(block, tgt, q, held, targets)
                exe.drop = s.qdrop
                if now < best:
                    best, stale = now, 0
                    best_state = ({w: exe.weight_values(w) for w in block.weights}, {a: exe.act_values(a) for a in acts})
                else:
                    stale += 1
                    if stale >= PATIENCE:
                        if progress is not None:
                            progress(s.steps)
                        break
        exe.drop = 0.0
        obj.harden(exe, block)
        after = self._loss(block, tgt, q, held, targets)
        if best_state is not None and best < after:  # an earlier checkpoint generalized better
            for w, (value, scale) in best_state[0].items():
                exe.freeze_weight(w, value, scale)
            for a, scale in best_state[1].items():
                exe.set_act_scale(a, scale)
            after = best
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
                           hard_rounding=obj.learned_rounding, signal=signal)

    def advance(self, block: Block, q: SampleStore, q_next: SampleStore) -> None:
        """The next block's quantized inputs: this block's quantized output (with what it learned)
        on its quantized input."""
        self._each(block, q, list(block.outputs), True, q_next)


def block_activations(exe: QuantExecutor, block: Block) -> list[str]:
    """Activation grids an LSQ block trains: those whose dominator is produced inside the block."""
    produced = {o for i in block.nodes for o in exe.nodes[i].output}
    return [a for a in exe.acts if a in produced]


def summary(reports: list[BlockReport]) -> dict[str, Any]:
    return {"blocks": len(reports), "rolled_back": sum(r.rolled_back for r in reports),
            "seconds": sum(r.seconds for r in reports)}
