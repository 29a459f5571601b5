"""Independent samples in parallel threads: how the simulator uses several cores.

One sample of a small network gives torch's intra-op threads little to share (a 7x7 convolution
splits badly, numpy casts run on one core), so running each sample on one core and several samples
at once scales much better. The kernels release the GIL in torch / numpy / onnxruntime and keep
their temporaries per thread (``kernels.common.scratch``), so the threads share a Session safely;
results are the same integers in the same order as a sequential run.

While samples run in parallel, torch's intra-op pool is set to one thread (it is process-wide) and
restored afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_LOCK = threading.Lock()


def default_workers() -> int:
    """One worker per torch intra-op thread (torch's default: one per core)."""
    import torch

    return max(1, torch.get_num_threads())


@contextmanager
def single_threaded_torch() -> Iterator[None]:
    """torch's intra-op pool at one thread for the duration (the workers are the parallelism)."""
    import torch

    with _LOCK:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        yield
    finally:
        with _LOCK:
            torch.set_num_threads(before)


def map_samples(fn: Callable[[T], R], items: Sequence[T], workers: int | None = None) -> list[R]:
    """``[fn(x) for x in items]``, with up to ``workers`` items at a time (default: one per core).

    The first exception raised by ``fn`` propagates (the remaining items may still have run)."""
    n = default_workers() if workers is None else workers
    if n < 1:
        raise ValueError(f"workers must be at least 1, got {n}")
    if n == 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with single_threaded_torch(), ThreadPoolExecutor(max_workers=min(n, len(items))) as pool:
        return list(pool.map(fn, items))
