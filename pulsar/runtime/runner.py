"""``pulsar run``: read inputs per tensor (or a list of sample directories), run a compiled model,
write one file per output.

Everything a user can get wrong (paths, ``--output_dir``, the list file, ``--batch_size``, every
input file of every listed sample) is checked before the first sample runs, so a failed run leaves
nothing behind; outputs never land outside ``--output_dir`` (see :mod:`pulsar.runtime.paths`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pulsar.errors import PulsarError
from pulsar.ui import setup_logging

if TYPE_CHECKING:  # numpy is imported only once the flags are checked
    import numpy as np

    from pulsar.core.container import CompiledModel

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What ``pulsar run`` did: per output (name, shape, dtype) of one sample's result, the number of
    samples (compiled-model runs), the compute time (after one untimed warm-up run, timed apart: the
    first run pays for one-off setup, which is not the model's speed) and the files written."""

    output_dir: Path
    outputs: list[tuple[str, tuple[int, ...], np.dtype]] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0
    warmup_seconds: float | None = None  # the untimed first run; None before it ran
    written: list[Path] = field(default_factory=list)
    sample_dirs: list[Path] = field(default_factory=list)  # --list: one output directory per entry

    @property
    def ms_per_sample(self) -> float:
        return 1000.0 * self.seconds / max(1, self.samples)


def _check_batch_memory(tensors: list, batch_size: int) -> None:
    """An error before allocating when ``batch_size`` samples' inputs and outputs cannot fit in memory."""
    from pulsar.runtime.paths import available_memory, human_bytes

    per_run = sum(math.prod(max(d, 1) for d in t.shape) * t.dtype.itemsize for t in tensors)
    needed = per_run * batch_size
    available = available_memory()
    if available is not None and needed > available:
        raise PulsarError(f"--batch_size {batch_size} needs {human_bytes(needed)} for the inputs and outputs alone "
                          f"({human_bytes(per_run)} per sample), {human_bytes(available)} of memory is available "
                          "(MemAvailable in /proc/meminfo); use a smaller --batch_size")


def _check_flags(model, output_dir, input_dir, list_file, batch_size: int, workers: int | None):
    from pulsar.runtime.paths import check_path_text

    if batch_size < 1:
        raise PulsarError(f"--batch_size must be at least 1, got {batch_size}")
    if workers is not None and workers < 1:
        raise PulsarError(f"--workers must be at least 1, got {workers}")
    if list_file is not None and input_dir is None:
        raise PulsarError("--list needs --input_dir (the list's relative paths start there)")
    paths = {"--model": model, "--output_dir": output_dir, "--input_dir": input_dir, "--list": list_file}
    return {flag: None if p is None else check_path_text(flag, p) for flag, p in paths.items()}


def run_model(model: str | Path, output_dir: str | Path, *, input_dir: str | Path | None = None,
              list_file: str | Path | None = None, random_input: bool = False,
              mode: str = "NPUBackend", batch_size: int = 1, perlayer: bool = False,
              workers: int | None = None, group: int = 0) -> RunResult:
    """``pulsar run``: inputs from files (or random), one .npy per output tensor.

    ``batch_size`` samples are stacked on axis 0 of each input file and run one compiled batch at a
    time (a multi-batch model runs them as its compiled batches, largest first); ``group`` picks the
    shape group (``--group_index``); ``perlayer`` also writes every tensor the model computes to
    ``<output>/perlayer/``.
    Independent samples (the batches of a file, the directories of a list) run ``workers`` at a time,
    one core each (default: one per core)."""
    from pulsar.runtime.paths import discard_created, prepare_output_dir, read_sample_list

    setup_logging()
    paths = _check_flags(model, output_dir, input_dir, list_file, batch_size, workers)
    out, input_dir, list_file = paths["--output_dir"], paths["--input_dir"], paths["--list"]
    if list_file is None and input_dir is None and not random_input:
        raise PulsarError("give --input_dir (files named after the input tensors), --list, or --random_input")
    created = prepare_output_dir(out)  # removed again if the run fails
    try:
        # imported only now: flag mistakes above are reported without loading onnx / onnxruntime
        from pulsar.core.container import load_compiled
        from pulsar.core.tensor_io import random_inputs, read_inputs
        from pulsar.runtime.batching import GroupView
        from pulsar.runtime.session import Session, batched_inputs, check_mode

        check_mode(mode)
        compiled = load_compiled(paths["--model"])
        view = GroupView.of(compiled, group)
        inputs = view.inputs
        infos = batched_inputs(inputs, batch_size)
        if view.multi_batch:  # a batch the compiled ones cannot make fails before anything is read
            for i, sg in enumerate(compiled.subgraphs):
                view.plan(i, batch_size, sg.name)
        _check_batch_memory(inputs + view.outputs, batch_size)
        entries = read_sample_list(list_file, input_dir) if list_file is not None else []
        # every input is read (and checked) before the model is prepared, anything runs or is written
        float_only = nonfinite_allowed(compiled)
        for e in entries:
            read_inputs(e.sample_dir, inputs, batch_size=batch_size, allow_nonfinite=float_only)
        first = None
        if not entries:
            first = random_inputs(infos) if random_input else read_inputs(input_dir, inputs, batch_size=batch_size,
                                                                         allow_nonfinite=float_only)
        _warn_unread(None if random_input else input_dir, entries, inputs)
        session = Session(compiled, mode=mode, group=group)
        if view.multi_batch:
            log.info("%d sample(s) per run as compiled batches: %s", batch_size, session.batch_plan(batch_size))
        return _execute(session, out, entries, first, batch_size, perlayer, workers, float_only)
    except BaseException:
        discard_created(created)
        raise


def _warn_unread(input_dir: Path | None, entries: list, inputs: list) -> None:
    """A warning per file in the input directory (each listed sample directory with --list; none with
    --random_input) that no input reads: ``images.npy`` beside ``image.npy`` is a typo, not data."""
    from pulsar.runtime.input_files import unread_files

    folders = list(dict.fromkeys(e.sample_dir for e in entries)) if entries else [input_dir] if input_dir else []
    for line in unread_files(folders, inputs):
        log.warning("%s", line)


def _per_sample(shape: tuple[int, ...], axis: int, batch_size: int) -> tuple[int, ...]:
    """The shape of one sample's part of an output of ``batch_size`` stacked samples."""
    if batch_size == 1 or len(shape) <= axis or shape[axis] % batch_size:
        return shape
    return (*shape[:axis], shape[axis] // batch_size, *shape[axis + 1:])


def nonfinite_allowed(compiled: CompiledModel) -> dict[str, str]:
    """Which model inputs may hold NaN / infinity: "all" where nothing quantizes the input or anything
    the CPU computes from it (isnan), "inf" where only what float ops make from it is quantized (a -inf
    attention mask the Softmax absorbs). NaN reaching a quantized tensor has no integer code, and an
    input quantized as it comes in takes neither (those are left out)."""
    npu_inputs = {i.name for sg in compiled.subgraphs if sg.kind == "npu" for i in sg.graph.input}
    readers: dict[str, list] = {}
    for sg in compiled.subgraphs:
        if sg.kind != "npu":
            for n in sg.graph.node:
                for i in n.input:
                    readers.setdefault(i, []).append(n)

    def quantized(name: str, direct: bool) -> bool:
        stack, seen = [name], {name}
        while stack:
            t = stack.pop()
            if t in npu_inputs:
                return True
            for n in readers.get(t, []):
                if n.op_type == "QuantizeLinear":
                    return True
                if not direct:
                    new = [o for o in n.output if o and o not in seen]
                    seen.update(new)
                    stack.extend(new)
        return False

    out = {}
    for i in compiled.model.graph.input:
        if not quantized(i.name, direct=True):
            out[i.name] = "inf" if quantized(i.name, direct=False) else "all"
    return out


def _execute(session, out: Path, entries: list, first: dict | None, batch_size: int, perlayer: bool,
             workers: int | None, float_only: dict[str, str] | None = None) -> RunResult:
    from pulsar.core.tensor_io import read_inputs, write_outputs
    from pulsar.runtime.parallel import default_workers
    from pulsar.runtime.paths import inside

    result = RunResult(output_dir=out)

    def timed(fn, *args, **kwargs):
        t0 = time.perf_counter()
        value = fn(*args, **kwargs)
        result.seconds += time.perf_counter() - t0
        return value

    def warm_up(feeds: dict) -> None:
        if result.warmup_seconds is not None:
            return
        t0 = time.perf_counter()
        session.warm_up(feeds, batch_size)
        result.warmup_seconds = time.perf_counter() - t0
        log.debug("warm-up run: %.1f ms (not counted in the time per sample)", 1000 * result.warmup_seconds)

    def record(outputs: dict[str, np.ndarray], dest: Path, samples: int) -> None:
        if not result.outputs:  # one sample's part: a file of --batch_size samples stacks them on axis 0
            axes = session.view.batch_axes if session.view.multi_batch else {}
            result.outputs = [(name, _per_sample(tuple(v.shape), axes.get(name, 0), samples), v.dtype)
                              for name, v in outputs.items()]
        result.samples += samples
        result.written.extend(write_outputs(inside(out, dest), outputs))

    def one(feeds: dict, dest: Path) -> None:
        warm_up(feeds)
        record(timed(session.run_batches, feeds, batch_size, workers), dest, batch_size)
        if perlayer and session.view.multi_batch:  # every tensor of the batch as it ran (samples on axis 0)
            result.written.extend(write_outputs(inside(out, dest / "perlayer"), session.run_all(feeds)))
        elif perlayer:
            for k in range(batch_size):
                b = [i.shape[0] for i in session.inputs]
                part = {i.name: feeds[i.name][k * n:(k + 1) * n] for i, n in zip(session.inputs, b, strict=True)}
                sub = dest / "perlayer" / (f"batch_{k}" if batch_size > 1 else "")
                result.written.extend(write_outputs(inside(out, sub), session.run_all(part)))

    if first is not None:
        one(first, out)
    else:
        # a few samples in memory at a time; batches and per-layer dumps go one directory at a time
        step = 1 if batch_size > 1 or perlayer else (workers or default_workers())
        for start in range(0, len(entries), step):
            chunk = entries[start:start + step]
            feeds = [read_inputs(e.sample_dir, session.inputs, batch_size=batch_size, allow_nonfinite=float_only)
                     for e in chunk]
            dests = [out / e.output_name for e in chunk]
            result.sample_dirs.extend(dests)
            warm_up(feeds[0])
            if step == 1:
                one(feeds[0], dests[0])
                continue
            for dest, outputs in zip(dests, timed(session.run_many, feeds, workers=workers), strict=True):
                record(outputs, dest, 1)
    for e, dest in zip(entries, result.sample_dirs, strict=True):
        log.debug("list line %d: %s -> %s", e.line, e.sample_dir, dest)
    log.info("wrote %d output file(s) to %s", len(result.written), out)
    return result
