"""Fine-tuning (``quant.enable_adaround`` / ``enable_brecq`` / ``enable_lsq``) of the quantized graph.

What combining the switches does: ``enable_adaround`` alone reconstructs each weighted layer's
output; ``enable_brecq`` (with or without ``enable_adaround``, whose learned rounding BRECQ already
is) reconstructs each block's output; ``enable_lsq`` learns weights and scales and is rejected next
to the other two (config/support.py). One *epoch* in ``finetune_epochs`` is one optimizer step on one
batch of ``finetune_batch_size`` samples, per block (as pulsar2 counts "Steps" per block).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch

from pulsar.context import BuildContext
from pulsar.errors import PulsarError
from pulsar.quant.finetune.algorithms import OBJECTIVES
from pulsar.quant.finetune.blocks import Block, make_blocks
from pulsar.quant.finetune.gradient import reach
from pulsar.quant.finetune.guard import WholeModelCheck
from pulsar.quant.finetune.loss_mask import check_mask_input, sample_mask
from pulsar.quant.finetune.reconstruct import BlockReport, Reconstruction, Settings, block_activations
from pulsar.quant.finetune.store import SampleStore
from pulsar.quant.graph import QuantGraph
from pulsar.quant.plan import make_plan
from pulsar.quant.torch_exec import QuantExecutor
from pulsar.ui import literal, show, table
from pulsar.utils.atomic import atomic_write_bytes
from pulsar.utils.progress import progress_task
from pulsar.utils.scratch import scratch_dir

if TYPE_CHECKING:
    from pulsar.config.generated import QuantConfig

log = logging.getLogger(__name__)

CACHE_VERSION = 2
# QDrop's probability per algorithm; measured on MobileNetV2 (top-1 agreement with float on 200 crops,
# the calibration photos' other halves / other photos): BRECQ 0.815 / 0.655 plain, 0.850 / 0.710 with
# QDrop and the held-out rollback; AdaRound 0.825 / 0.685 held-out only, 0.810 / 0.655 with QDrop too;
# LSQ 0.855 / 0.735 plain, 0.860 / 0.720 with both: no gain for 40% more time (a random mask and a
# select per activation, forward and backward), so LSQ trains without it
QDROP = {"brecq": 0.5}


def finetune_enabled(q: QuantConfig) -> bool:
    return bool(q.enable_adaround or q.enable_brecq or q.enable_lsq)


def algorithm(q: QuantConfig) -> str:
    return "lsq" if q.enable_lsq else "brecq" if q.enable_brecq else "adaround"


def resolve_device(value: str, field: str = "quant.device") -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; a CUDA device this machine does not have is a config error."""
    if value == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PulsarError(f'{field}: "{value}" needs a CUDA GPU, and torch finds none on this machine '
                          f"(torch {torch.__version__}); set {field} to cpu")
    dev = torch.device(value)
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise PulsarError(f'{field}: "{value}" does not exist: this machine has {count} CUDA device(s) '
                          f"(cuda:0 ... cuda:{count - 1})")
    return dev


def _cache_key(ctx: BuildContext, qg: QuantGraph, settings: Settings, device: torch.device) -> str:
    assert ctx.model is not None
    h = hashlib.sha256(ctx.model.SerializeToString())
    h.update(ctx.calibration.fingerprint().encode())
    h.update(json.dumps({"v": CACHE_VERSION, "settings": vars(settings), "device": device.type,
                         "block_size": ctx.cfg.quant.finetune_block_size,
                         "params": {k: v.to_json() for k, v in qg.params.items()}}, sort_keys=True).encode())
    return h.hexdigest()[:24]


def _save(path: Path, qg: QuantGraph, changed: list[str]) -> None:
    arrays: dict[str, np.ndarray] = {}
    for i, name in enumerate(changed):
        if name in qg.weights:
            arrays[f"w{i}"] = qg.weights[name]
        arrays[f"s{i}"] = np.asarray(qg.params[name].scale, np.float32)
    arrays["names"] = np.array(json.dumps(changed))
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    atomic_write_bytes(path, buf.getvalue())


def _load(path: Path, qg: QuantGraph) -> int:
    with np.load(path, allow_pickle=False) as data:
        names = json.loads(str(data["names"]))
        for i, name in enumerate(names):
            if f"w{i}" in data:
                qg.set_weight(name, data[f"w{i}"])
            qg.set_scale(name, data[f"s{i}"])
    return len(names)


def _show_parameters(ctx: BuildContext, settings: Settings, device: torch.device, blocks: list[Block],
                     samples: int) -> None:
    rows = [("algorithm", {"adaround": "AdaRound", "brecq": "BRECQ", "lsq": "LSQ"}[settings.algorithm]),
            ("device", str(device)), ("blocks", str(len(blocks))),
            ("block size (weighted layers)", str(ctx.cfg.quant.finetune_block_size)),
            ("steps per block (finetune_epochs)", str(settings.steps)),
            ("batch size", str(settings.batch_size)), ("learning rate", f"{settings.lr:g}"),
            ("samples", str(samples)), ("seed", str(settings.seed)),
            ("CPU threads", str(torch.get_num_threads()))]
    show(table("Fine-tuning", ["parameter", "value"], rows), quiet=ctx.quiet)


def _block_line(r: BlockReport, n: int) -> str:
    ins, outs = ", ".join(r.inputs), ", ".join(r.outputs)
    worse = "the hard-rounded loss was worse" if r.hard_rounding else "the loss after training was worse"
    state = f" (rolled back: {worse})" if r.rolled_back else ""
    state = f" (stays calibrated: {r.reason or 'nothing to train'})" if not r.trained else state
    return (f"block {r.index}/{n}: [{ins}] -> [{outs}]  {r.layers} layer(s)  loss {r.loss_before:.6g} -> "
            f"{r.loss_after:.6g} (SQNR {r.sqnr(r.loss_before):.1f} -> {r.sqnr(r.loss_after):.1f} dB){state}  "
            f"{r.seconds:.1f} s")


def _option(q: QuantConfig) -> str:
    return "quant.enable_lsq" if q.enable_lsq else "quant.enable_brecq" if q.enable_brecq else "quant.enable_adaround"


def trainable_blocks(model: onnx.ModelProto, weights: dict[str, str], q: QuantConfig) -> tuple[list[Block], list[str]]:
    """The blocks with every weight a gradient reaches (``Block.weights`` cut to those), and one line
    per block that cannot train or trains only some of its weights."""
    blocks = make_blocks(model, weights, q.finetune_block_size)
    targets = OBJECTIVES[algorithm(q)].targets
    notes = []
    for i, b in enumerate(blocks, 1):
        r = reach(model, b, targets(b), weights)
        if r.stopped:
            through = ", ".join(r.blocked_by[:4]) or "no path to the block's outputs"
            if not r.trainable:
                b.reason = f"no gradient reaches its weights (through {through})"
            what = "stays calibrated" if not r.trainable else f"{len(r.stopped)} of {len(b.weights)} weights stay calibrated"
            notes.append(f"block {i}/{len(blocks)}: {what}: no gradient reaches {', '.join(r.stopped[:3])}"
                         f"{' ...' if len(r.stopped) > 3 else ''} (through {through})")
        pairs = list(zip(b.weights, b.weighted_nodes, strict=True))
        b.weights = [w for w, _ in pairs if w in r.trainable]
        b.weighted_nodes = [o for w, o in pairs if w in r.trainable]
    return blocks, notes


def check_finetune(model: onnx.ModelProto, q: QuantConfig) -> None:
    """Before calibration: fine-tuning can train at least one block of the (optimized) model; the
    blocks that cannot train are logged and will stay calibrated."""
    if not finetune_enabled(q):
        return
    plan = make_plan(model)
    weights = {w.tensor: w.node for w in plan.weights}
    if not weights:
        raise PulsarError(f"{_option(q)}: this model has no weighted layer (Conv, Gemm, MatMul with a constant "
                          f"weight ...) for fine-tuning to train; turn {_option(q)} off")
    check_mask_input(model, q.finetune_loss_mask)
    blocks, notes = trainable_blocks(model, weights, q)
    for line in notes:
        log.info("fine-tuning: %s", line)
    if not any(b.weights for b in blocks):
        raise PulsarError(f"{_option(q)}: no block of this model can be trained: {notes[0] if notes else ''}; "
                          f"turn {_option(q)} off")


def run_finetune(ctx: BuildContext, qg: QuantGraph) -> None:
    """Train the quantized graph block by block and write what it learned into ``qg``."""
    q = ctx.cfg.quant
    device = resolve_device(q.device)
    algo = algorithm(q)
    settings = Settings(algo, q.finetune_epochs, q.finetune_batch_size, q.finetune_lr,
                        qdrop=QDROP.get(algo, 0.0), held_out=True, loss_mask=q.finetune_loss_mask)
    weights = {w.tensor: w.node for w in qg.plan.weights if w.tensor in qg.params}
    blocks, notes = trainable_blocks(qg.model, weights, q)
    for line in notes:
        log.info("fine-tuning: %s", line)
    _show_parameters(ctx, settings, device, blocks, len(ctx.calibration))
    cache = ctx.work_dir / "cache" / f"finetune-{_cache_key(ctx, qg, settings, device)}.npz"
    if cache.is_file():
        n = _load(cache, qg)
        qg.rederive_biases(q.refine_weight_threshold)
        log.info("fine-tuning: %d learned parameters from the cache (%s); not retrained", n, literal(str(cache)))
        return
    _train(ctx, qg, settings, device, blocks, cache)


def _train(ctx: BuildContext, qg: QuantGraph, settings: Settings, device: torch.device, blocks: list[Block],
           cache: Path) -> None:
    q = ctx.cfg.quant
    torch.manual_seed(settings.seed)
    exe = QuantExecutor(qg, device)
    spill = Path(scratch_dir() or ctx.work_dir / "cache")
    fp, qs = SampleStore(spill), SampleStore(spill)
    mask_name = q.finetune_loss_mask
    masks = SampleStore(spill) if mask_name else None
    rec = Reconstruction(exe, settings, masks)
    train, held = rec.split(len(ctx.calibration))
    kept: list[dict[str, np.ndarray]] = []
    for i, sample in enumerate(ctx.calibration):
        fp.append(sample)
        qs.append(sample)
        if masks is not None:
            masks.append({"m": sample_mask(sample, mask_name)})
        if i in held:
            kept.append(sample)
    check = WholeModelCheck(exe, kept, [sample_mask(s, mask_name) for s in kept] if mask_name else None)
    reports: list[BlockReport] = []
    start = time.perf_counter()
    spilled = 0
    try:
        for i, block in enumerate(blocks, 1):
            acts = block_activations(exe, block) if settings.algorithm == "lsq" else []
            tgt = SampleStore(spill)
            rec.float_outputs(block, fp, tgt)
            with progress_task(ctx.stages, f"{settings.algorithm} block {i}/{len(blocks)}", settings.steps) as task:
                r = rec.block(i, block, fp, tgt, qs, acts, progress=task)
            reports.append(r)
            log.info("%s", _block_line(r, len(blocks)))
            spilled = max(spilled, fp.spilled + tgt.spilled + qs.spilled)
            fp.close()
            fp = tgt  # the float block's outputs: the next block's float inputs
            if i < len(blocks):
                qs_next = SampleStore(spill)
                rec.advance(block, qs, qs_next)
                qs.close()
                qs = qs_next
    finally:
        fp.close()
        qs.close()
        if masks is not None:
            masks.close()
    changed: list[str] = []
    trained = {w for b, r in zip(blocks, reports, strict=True) if r.trained and not r.rolled_back for w in b.weights}
    learned = bool(trained) or any(not np.array_equal(aq.scale0.detach().cpu().numpy().astype(np.float32),
                                                      np.asarray(qg.params[a].scale, np.float32))
                                   for a, aq in exe.acts.items())
    undone = False
    if learned:
        verdict = check.verdict()
        what = verdict.line() if held != train else verdict.line().replace("held-out", "calibration")
        undone = not verdict.keep
        if undone:
            log.warning("fine-tuning (%s): %s: no better than calibrated, so every block keeps its calibrated "
                        "parameters", settings.algorithm, what)
        else:
            log.info("fine-tuning (%s): %s", settings.algorithm, what)
    if not undone:
        for w in sorted(trained):
            value, scale = exe.weight_values(w)
            qg.set_weight(w, value)
            qg.params[w].scale = scale.reshape(np.shape(qg.params[w].scale))
            changed.append(w)
        for a, aq in exe.acts.items():
            scale = aq.scale0.detach().cpu().numpy()
            if not np.array_equal(scale.astype(np.float32), np.asarray(qg.params[a].scale, np.float32)):
                qg.set_scale(a, scale)
                changed.append(a)
    qg.rederive_biases(q.refine_weight_threshold)
    _save(cache, qg, changed)
    log.info("fine-tuning (%s): %d blocks in %.1f s, %d rolled back%s, %d parameters learned%s", settings.algorithm,
             len(blocks), time.perf_counter() - start, sum(r.rolled_back for r in reports),
             " (all undone by the whole-model check)" if undone else "", len(changed),
             f"; block inputs of {spilled} sample{'s' if spilled != 1 else ''} spilled to disk" if spilled else "")
