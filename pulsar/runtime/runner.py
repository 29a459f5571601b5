"""``pulsar run``: read inputs per tensor (or a list of sample directories), run a compiled model,
write one file per output."""

from __future__ import annotations

import logging
from pathlib import Path

from pulsar.errors import PulsarError
from pulsar.ui import setup_logging

log = logging.getLogger(__name__)


def run_model(model: str | Path, output_dir: str | Path, *, input_dir: str | Path | None = None,
              list_file: str | Path | None = None, random_input: bool = False,
              mode: str = "NPUBackend", batch_size: int = 1, perlayer: bool = False,
              workers: int | None = None) -> list[Path]:
    """``pulsar run``: inputs from files (or random), one .npy per output tensor.

    ``batch_size`` samples are stacked on axis 0 of each input file and run one compiled batch at a
    time; ``perlayer`` also writes every tensor the model computes to ``<output>/perlayer/``.
    Independent samples (the batches of a file, the directories of a list) run ``workers`` at a time,
    one core each (default: one per core)."""
    from pulsar.runtime.io import random_inputs, read_inputs, read_list_file, write_outputs
    from pulsar.runtime.parallel import default_workers
    from pulsar.runtime.session import Session

    setup_logging()
    if workers is not None and workers < 1:
        raise PulsarError(f"--workers must be at least 1, got {workers}")
    session = Session(model, mode=mode)
    infos = session.batched_inputs(batch_size)
    out = Path(output_dir)
    written: list[Path] = []

    def one(feeds: dict, dest: Path) -> None:
        nonlocal written
        written += write_outputs(dest, session.run_batches(feeds, batch_size, workers))
        if perlayer:
            for k in range(batch_size):
                b = [i.shape[0] for i in session.inputs]
                part = {i.name: feeds[i.name][k * n:(k + 1) * n] for i, n in zip(session.inputs, b, strict=True)}
                sub = dest / "perlayer" / (f"batch_{k}" if batch_size > 1 else "")
                written += write_outputs(sub, session.run_all(part))

    if list_file is not None:
        if input_dir is None:
            raise PulsarError("--list needs --input_dir (the list's relative paths start there)")
        dirs = read_list_file(list_file, input_dir)
        # a few samples in memory at a time; batches and per-layer dumps go one directory at a time
        step = 1 if batch_size > 1 or perlayer else (workers or default_workers())
        for start in range(0, len(dirs), step):
            chunk = dirs[start:start + step]
            if step == 1:
                one(read_inputs(chunk[0], infos), out / chunk[0].name)
                continue
            results = session.run_many([read_inputs(d, infos) for d in chunk], workers=workers)
            for sample_dir, result in zip(chunk, results, strict=True):
                written += write_outputs(out / sample_dir.name, result)
    elif random_input:
        one(random_inputs(infos), out)
    elif input_dir is not None:
        one(read_inputs(input_dir, infos), out)
    else:
        raise PulsarError("give --input_dir (files named after the input tensors), --list, or --random_input")
    log.info("wrote %d output file(s) to %s", len(written), out)
    return written
