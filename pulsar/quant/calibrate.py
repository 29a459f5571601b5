"""Calibration: run the float model once over the calibration data, collecting statistics for every
tensor that will be quantized, then turn them into ranges with any calibration method.

The pass is the expensive part (the real models expose 500-1500 tensors), so it is done once and
its statistics are enough for all methods (see :mod:`pulsar.quant.observers.histogram`). They are
cached under a key the caller derives from model + data + config, so trying another calibration
method or precision only re-runs :func:`compute_ranges`, which takes seconds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from pulsar.core import custom_ops
from pulsar.core.opdefs import order_keeping_ops, same_value_ops
from pulsar.core.ort_weights import session_with_lifted_weights
from pulsar.core.plugin_session import inference_session
from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.shapes import serialized_over
from pulsar.quant.observers import DEFAULT_NUM_BINS, TensorStats, compute_range, get_method
from pulsar.quant.observers.histogram import DEFAULT_MOMENTUM
from pulsar.utils.atomic import atomic_path
from pulsar.utils.scratch import scratch_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = [
    "Reference",
    "TensorStats",
    "collect_statistics",
    "compute_ranges",
    "load_statistics",
    "save_statistics",
    "stats_from_arrays",
    "stats_to_arrays",
]

_CACHE_VERSION = 3  # 2: running extremes (batches, momentum, run_min, run_max); 3: histograms of a sample
_ORT_ERRORS = (
    ort_state.Fail,
    ort_state.InvalidArgument,
    ort_state.InvalidGraph,
    ort_state.InvalidProtobuf,
    ort_state.NoSuchFile,
    ort_state.NotImplemented,
    ort_state.RuntimeException,
)
_HIST_THREADS = 2  # threads that count one sample's activations (the float pass's own threads are onnxruntime's)
# one sample's activations (from the model's static shapes) up to which the next sample's float pass
# overlaps their counting, two samples' activations alive at once; larger or unknown ones run one at a time
_OVERLAP_BYTES = 64 << 20
_KEY_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_PROTO_LIMIT = 2**31 - 2**26  # protobuf's 2 GiB cap, with room for the graph around the weights


# ------------------------------------------------------------------------------------ statistics
class Reference:
    """The first ``count`` calibration samples (the model's feeds) and the float model's outputs
    ``names`` on them, kept from the calibration pass for the build's check of its quantized model,
    which then neither reads the data again nor runs a float session of its own (and cannot pair an
    output with another sample, whatever a data set plugin streams). Stays empty when the pass does
    not run (statistics from the cache or a file), and drops what it has kept when the samples would
    hold more than ``budget`` bytes: the check then reads and runs one sample at a time."""

    def __init__(self, names: Iterable[str], count: int, budget: int = 64 << 20) -> None:
        self.names, self.count, self.budget = list(names), count, budget
        self.inputs: list[dict[str, np.ndarray]] = []
        self.outputs: list[dict[str, np.ndarray]] = []
        self.complete = False  # the pass ran to the end: fewer samples than ``count`` are then all there are
        self.dropped = False  # the samples would have held more than ``budget`` bytes: none are kept
        self._bytes = 0

    @property
    def wants(self) -> bool:
        return not self.dropped and len(self.outputs) < self.count

    @property
    def usable(self) -> bool:
        return self.complete and not self.dropped

    def keep(self, feed: dict[str, np.ndarray], fetch: list[str], values: list[Any]) -> None:
        if not self.wants:
            return
        got = dict(zip(fetch, values, strict=True))
        outputs = {n: got[n] for n in self.names if n in got}
        self._bytes += sum(int(getattr(a, "nbytes", 0)) for a in [*feed.values(), *outputs.values()])
        if self._bytes > self.budget:  # large inputs or outputs (a segmentation map): the check streams
            self.inputs, self.outputs, self.dropped = [], [], True
            return
        # copies: a data set plugin may hand out one buffer it refills for every sample
        self.inputs.append({k: np.array(v, copy=True) for k, v in feed.items()})
        self.outputs.append(outputs)


def collect_statistics(
    model: onnx.ModelProto,
    tensor_names: list[str],
    samples: Iterable[dict[str, np.ndarray]],
    *,
    progress: Callable[[int], None] | None = None,
    cache_dir: str | Path | None = None,
    cache_key: str | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
    momentum: float = DEFAULT_MOMENTUM,
    sample_cap: int = 0,
    device: str = "cpu",
    backend: str = "auto",
    reference: Reference | None = None,
) -> dict[str, TensorStats]:
    """Statistics of ``tensor_names`` over all ``samples`` (dicts input name -> array).

    Graph inputs are read from the feed; intermediate tensors are exposed as extra outputs of a
    copy of the model run in onnxruntime on CPU. Initializers are skipped (weights are ranged by
    the exporter), so they are absent from the result. ``progress(n)`` is called after each
    sample with the number of samples done. With ``cache_dir`` and ``cache_key`` the statistics
    are loaded from / saved to ``<cache_dir>/calib_stats_<key>.npz``.

    ``device`` (``quant.device``): ``cpu`` runs onnxruntime as above; ``cuda`` / ``cuda:N`` runs the
    float model in torch on that GPU with the statistics reduced there
    (:mod:`pulsar.quant.calibration_torch`). ``backend="torch"`` forces the torch pass on any
    device (tests compare it with onnxruntime on CPU). The torch pass's statistics differ slightly,
    so its cache key names the device kind. ``reference`` keeps float outputs of the onnxruntime
    pass (:class:`Reference`). ``sample_cap``: the histograms bin a sample of larger batches
    (:meth:`TensorStats.binned`; 0: every value).
    """
    names = list(dict.fromkeys(tensor_names))
    torch_device = _torch_device(device, backend)
    if torch_device is not None and cache_key is not None:
        cache_key = f"{cache_key}-torch{torch_device.type}"
    cache_path = _cache_path(cache_dir, cache_key)
    graph = model.graph
    initializers = {t.name for t in graph.initializer} | {t.name for t in graph.sparse_initializer}
    inputs = {i.name: i for i in graph.input if i.name not in initializers}
    produced = {out for node in graph.node for out in node.output if out}
    unknown = [n for n in names if n not in inputs and n not in produced and n not in initializers]
    if unknown:
        candidates = [*inputs, *produced]
        raise PulsarError(
            f"calibration: tensor {unknown[0]!r} is not in the model{did_you_mean(unknown[0], candidates)}"
            + (f" ({len(unknown) - 1} more unknown)" if len(unknown) > 1 else "")
            + "; use tensor names that exist in the (simplified) float model"
        )
    skipped = [n for n in names if n in initializers and n not in produced]
    if skipped:
        log.debug("calibration: %d initializers skipped (weights): %s", len(skipped), skipped[:5])
    collected = [n for n in names if n in inputs or n in produced]
    earlier: dict[str, TensorStats] = {}
    if cache_path is not None:
        earlier = _load_cache(cache_path)
        if all(n in earlier for n in collected):
            log.info("calibration statistics: cache hit, %s (model not run)", cache_path)
            return {n: earlier[n] for n in collected}
        have = sum(1 for n in collected if n in earlier)
        log.info("calibration statistics: cache %s, running the float model (%s)",
                 f"holds {have} of the {len(collected)} tensors" if have else "miss", cache_path.name)
    # the cache's tensors (same model, data and settings) are not collected again
    from_feed = [n for n in names if n in inputs and n not in earlier]
    # permutations of another collected tensor (Reshape, Transpose ...) take a copy of its statistics
    aliases = _permutations(model, [n for n in names if n in produced and n not in earlier],
                            set(collected) | set(earlier), sample_cap)
    fetch = [n for n in names if n in produced and n not in earlier and n not in aliases]
    stats = {n: TensorStats.empty(num_bins, momentum, sample_cap) for n in collected
             if n not in earlier and n not in aliases}

    start = time.perf_counter()
    if torch_device is None:
        done, where = _ort_pass(model, inputs, from_feed, fetch, stats, samples, progress, reference), "cpu"
        if reference is not None:
            reference.complete = True
    else:
        from pulsar.quant.calibration_torch import device_name, torch_pass

        feeds = _feeds(samples, inputs, _input_dtypes(inputs))
        done = torch_pass(model, feeds, from_feed, fetch, stats, torch_device, progress)
        where = device_name(torch_device) + ("" if torch_device.type == "cuda" else " (torch)")
    if done == 0:
        raise PulsarError(
            "calibration: the calibration data yielded no samples; check "
            "quant.input_configs[].calibration_dataset and calibration_size"
        )
    for name, source in aliases.items():
        stats[name] = TensorStats.from_arrays((stats[source] if source in stats else earlier[source]).to_arrays())
    if aliases:
        log.debug("calibration: %d tensors copy the statistics of the tensor they permute (%s ...)", len(aliases),
                  ", ".join(f"{n} <- {r}" for n, r in list(aliases.items())[:3]))
    log.info(
        "calibration statistics: %d tensors over %d sample%s in %.1f s on %s",
        len(stats),
        done,
        "" if done == 1 else "s",
        time.perf_counter() - start,
        where,
    )
    if cache_path is not None:
        save_statistics(cache_path, {**earlier, **stats})  # what the cache held stays in it
    return {n: stats[n] if n in stats else earlier[n] for n in collected}


def _permutations(model: onnx.ModelProto, wanted: list[str], measured: set[str], sample_cap: int) -> dict[str, str]:
    """``{tensor: source}`` for each wanted tensor whose values are a permutation of a measured tensor
    (output 0 of Reshape, Transpose, DepthToSpace ... :func:`same_value_ops`, through chains of them;
    the source is the chain's earliest measured tensor): its statistics equal the source's (extremes,
    zeros, histogram: every value once), so it is neither exposed nor binned. A histogram of a sample
    (more than ``sample_cap`` values a batch) takes every k-th value in flat order, so a chain that
    reorders (Transpose, DepthToSpace, SpaceToDepth) counts only for tensors known to be binned whole.
    Graph outputs stay measured (:class:`Reference` reads them)."""
    graph = model.graph
    ops, ordered = same_value_ops(), order_keeping_ops()
    source_of = {node.output[0]: (node.input[0], node.op_type in ordered) for node in graph.node
                 if node.op_type in ops and node.domain in ("", "ai.onnx") and node.output and node.output[0]
                 and node.input and node.input[0]}
    outputs = {o.name for o in graph.output}
    whole = _binned_whole(model, sample_cap)
    aliases: dict[str, str] = {}
    for name in wanted:
        if name in outputs:
            continue
        root, here, keeps = None, source_of.get(name), True
        for _ in range(len(source_of)):  # a bound: a malformed graph may loop
            if here is None:
                break
            keeps = keeps and here[1]
            if here[0] in measured and (keeps or whole(name)):
                root = here[0]
            here = source_of.get(here[0])
        if root is not None:
            aliases[name] = root
    return aliases


def _binned_whole(model: onnx.ModelProto, sample_cap: int) -> Callable[[str], bool]:
    """Whether a tensor's histogram bins every value of a batch: no cap, or a static size within it."""
    if not sample_cap:
        return lambda name: True
    sizes: dict[str, int] = {}
    for vi in model.graph.value_info:
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.HasField("shape") and all(d > 0 for d in dims):
            sizes[vi.name] = math.prod(dims)
    return lambda name: 0 < sizes.get(name, 0) <= sample_cap


def _torch_device(device: str, backend: str) -> torch.device | None:
    """The torch device of the float pass, None for onnxruntime on CPU."""
    if backend not in ("auto", "onnxruntime", "torch"):
        raise ValueError(f"calibration backend must be auto, onnxruntime or torch, got {backend!r}")
    if backend == "onnxruntime" or (backend == "auto" and device == "cpu"):
        if device != "cpu":
            raise ValueError(f"the onnxruntime calibration pass runs on cpu only, got device {device!r}")
        return None
    from pulsar.quant.finetune import resolve_device

    return resolve_device(device)


def _input_dtypes(inputs: dict[str, onnx.ValueInfoProto]) -> dict[str, np.dtype]:
    return {n: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for n, i in inputs.items()}


def _feeds(
    samples: Iterable[dict[str, np.ndarray]], inputs: dict[str, onnx.ValueInfoProto], dtypes: dict[str, np.dtype]
) -> Iterator[dict[str, np.ndarray]]:
    """The checked feed of each sample; one sample's data alive at a time (the consumer drops its feed)."""
    done = 0
    for sample in samples:  # not enumerate(): its reused result tuple would keep the last sample alive
        done += 1  # noqa: SIM113
        feed = _make_feed(sample, inputs, dtypes, done)
        del sample
        yield feed
        del feed


def _ort_pass(
    model: onnx.ModelProto,
    inputs: dict[str, onnx.ValueInfoProto],
    from_feed: list[str],
    fetch: list[str],
    stats: dict[str, TensorStats],
    samples: Iterable[dict[str, np.ndarray]],
    progress: Callable[[int], None] | None,
    reference: Reference | None = None,
) -> int:
    """The float pass in onnxruntime on CPU, the activations exposed as extra outputs; returns the sample count.

    When one sample's activations are small (:data:`_OVERLAP_BYTES`), onnxruntime runs sample k on one
    core less, in a helper thread (it releases the GIL), while the activations of sample k - 1 are
    counted: the two halves of the pass overlap on a 2-core machine. Otherwise each sample runs on
    every core, then its activations are counted on every core.
    """
    done = 0
    workers = min(_HIST_THREADS, os.cpu_count() or 1)
    size = _activation_bytes(model, fetch)
    overlap = size is not None and size <= _OVERLAP_BYTES
    # one pool thread less than workers: a helper counting sample k - 1 queues behind the float run of
    # sample k and takes its share of the tensors once that run has ended (work sharing, no idle core)
    with _session(model, fetch, overlap) as session, ThreadPoolExecutor(max(1, workers - 1)) as pool:
        dtypes = _input_dtypes(inputs)
        counting: list[Any] | None = None  # the previous sample's activations, not yet counted
        for sample in samples:  # not enumerate(): its reused result tuple would keep the last sample alive
            done += 1
            feed = _make_feed(sample, inputs, dtypes, done)
            del sample
            for name in from_feed:
                stats[name].update(feed[name])
            running = pool.submit(_run_float, session, fetch, feed, done) if fetch else None
            kept = feed if reference is not None and reference.wants else None
            del feed  # the run holds it until it ends: one sample's data alive at a time
            if counting is not None:
                _count(pool, workers, fetch, counting, stats)
                counting = None
                if progress is not None:
                    progress(done - 1)
            outputs = running.result() if running is not None else []
            if kept is not None and reference is not None:
                reference.keep(kept, fetch, outputs)
                del kept
            if not overlap:
                _count(pool, workers, fetch, outputs, stats)
                if progress is not None:
                    progress(done)
            else:
                counting = outputs
            del outputs
        if counting is not None:
            _count(pool, workers, fetch, counting, stats)
            del counting
            if progress is not None:
                progress(done)
    return done


def _run_float(session: ort.InferenceSession, fetch: list[str], feed: dict[str, np.ndarray], index: int) -> list[Any]:
    try:
        return list(session.run(fetch, feed))
    except _ORT_ERRORS as exc:
        raise PulsarError(
            f"calibration sample {index}: onnxruntime failed on the float model ({_first_line(exc)}); "
            "check that the calibration data matches the model inputs"
        ) from exc


def _activation_bytes(model: onnx.ModelProto, fetch: list[str]) -> int | None:
    """Bytes of one sample's ``fetch`` from the model's static shapes; None when one is unknown."""
    infos = {v.name: v for v in [*model.graph.value_info, *model.graph.output]}
    total = 0
    for name in fetch:
        info = infos.get(name)
        tt = info.type.tensor_type if info is not None else None
        if tt is None or not tt.HasField("shape") or not tt.elem_type:
            return None
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim]
        if any(d <= 0 for d in dims):
            return None
        total += math.prod(dims) * onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize
    return total


def _count(pool: ThreadPoolExecutor, workers: int, fetch: list[str], outputs: list[Any], stats: dict[str, TensorStats]) -> None:
    """Every fetched activation of one sample into its statistics. Each tensor's statistics are its
    own, so the calling thread and ``workers - 1`` pool threads take the tensors one at a time
    (numpy's kernels release the GIL: the histograms, most of the pass's CPU time, then use both
    cores of a 2-core machine); each activation is let go as soon as it is counted."""
    order = iter(range(len(fetch)))
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                k = next(order, None)
            if k is None:
                return
            if outputs[k] is not None:
                stats[fetch[k]].update(outputs[k])
            outputs[k] = None

    helpers = [pool.submit(run) for _ in range(min(workers, len(fetch)) - 1)]
    run()
    for helper in helpers:
        helper.result()  # a failure in a helper thread surfaces here


def compute_ranges(
    stats: dict[str, TensorStats],
    method: str,
    *,
    num_bits: int = 8,
    signed: bool = False,
    symmetric: bool = False,
    percentile: float = 99.99,
    std_n: float = 3.0,
    kl_top_n: int = 1,
    weighted_alpha: float | None = None,
) -> dict[str, tuple[float, float]]:
    """Clipping range ``(lo, hi)``, ``lo <= 0 <= hi``, of every tensor with one method and grid."""
    get_method(method)  # a bad method name fails even when there is nothing to calibrate
    start = time.perf_counter()
    ranges = {
        name: compute_range(
            s, method, num_bits=num_bits, signed=signed, symmetric=symmetric, percentile=percentile, std_n=std_n,
            kl_top_n=kl_top_n, weighted_alpha=weighted_alpha,
        )
        for name, s in stats.items()
    }
    empty = [name for name, s in stats.items() if s.count == 0]
    if empty:
        log.warning(
            "calibration: %d tensors never had a finite value, range (0, 0): %s", len(empty), empty[:5]
        )
    log.debug("%s ranges of %d tensors in %.2f s", method, len(ranges), time.perf_counter() - start)
    return ranges


# --------------------------------------------------------------------------------- onnxruntime
@contextlib.contextmanager
def _session(model: onnx.ModelProto, fetch: list[str], overlap: bool = False) -> Iterator[Any]:
    """An onnxruntime session on a copy of ``model`` that also outputs ``fetch``; with ``overlap`` on one
    core less (:func:`_ort_pass`)."""
    if not fetch:
        yield None
        return
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # overlapped, the float pass leaves one core to the counting of the previous sample; its threads do
    # not spin while they wait, which leaves the cores to the counting threads (spinning cost 30-50 %
    # more CPU time for the same pass)
    if overlap:
        opts.intra_op_num_threads = max(1, (os.cpu_count() or 1) - 1)
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    with contextlib.ExitStack() as stack:
        try:
            if custom_ops.CUSTOM_OPS or serialized_over(model, _PROTO_LIMIT - 1):
                session = inference_session(_through_file(model, fetch, stack), opts, ["CPUExecutionProvider"])
            else:  # the weights reach onnxruntime without a copy; name-only outputs: onnxruntime infers their types
                session = session_with_lifted_weights(model, opts, ["CPUExecutionProvider"], fetch)
        except _ORT_ERRORS as exc:
            raise PulsarError(
                f"calibration: onnxruntime cannot load the float model ({_first_line(exc)}); "
                "the model must run in onnxruntime on CPU for calibration"
            ) from exc
        yield session


def _through_file(model: onnx.ModelProto, fetch: list[str], stack: contextlib.ExitStack) -> bytes | str:
    """``model`` with ``fetch`` as more outputs (name only: no stale value_info can contradict
    onnxruntime's types): its bytes, or a file with external weights for a model over protobuf's 2 GB
    (operator plugins run their forward through :func:`inference_session`, which needs the whole model)."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    outputs = {o.name for o in exposed.graph.output}
    exposed.graph.output.extend(onnx.ValueInfoProto(name=n) for n in fetch if n not in outputs)
    if not serialized_over(exposed, _PROTO_LIMIT - 1):  # ByteSize() < the limit, the weights not serialized
        return bytes(exposed.SerializeToString())
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pulsar_calib_", dir=scratch_dir())))
    onnx.save_model(exposed, tmp / "model.onnx", save_as_external_data=True, location="weights.bin")
    return str(tmp / "model.onnx")


def _first_line(exc: Exception, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def _make_feed(
    sample: dict[str, np.ndarray],
    inputs: dict[str, onnx.ValueInfoProto],
    dtypes: dict[str, np.dtype],
    index: int,
) -> dict[str, np.ndarray]:
    missing = [n for n in inputs if n not in sample]
    if missing:
        extra = [k for k in sample if k not in inputs]
        raise PulsarError(
            f"calibration sample {index}: model input {missing[0]!r} has no data"
            + (f" (the sample has {extra[0]!r}{did_you_mean(missing[0], extra)})" if extra else "")
            + "; set quant.input_configs[].tensor_name to the model's input names"
        )
    feed = {}
    for name, vi in inputs.items():
        arr = np.asarray(sample[name])
        dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.HasField("shape") and (
            len(dims) != arr.ndim
            or any(d is not None and d != s for d, s in zip(dims, arr.shape, strict=True))
        ):
            want = "x".join("?" if d is None else str(d) for d in dims)
            raise PulsarError(
                f"calibration sample {index}: input {name!r} has shape {'x'.join(map(str, arr.shape))}, "
                f"the model expects {want}; fix the calibration data or the input shape"
            )
        feed[name] = arr.astype(dtypes[name], copy=False)
    return feed


# -------------------------------------------------------------------------------------- cache
def stats_to_arrays(stats: dict[str, TensorStats]) -> dict[str, np.ndarray]:
    """Stack the statistics into plain arrays (tensor ``names`` as a unicode array, no pickles)."""
    names = list(stats)
    per = [stats[n].to_arrays() for n in names]
    fields = per[0].keys() if per else TensorStats.empty(16).to_arrays().keys()
    arrays = {f: np.stack([p[f] for p in per]) if per else np.zeros(0) for f in fields}
    arrays["names"] = np.array(names, dtype=np.str_)
    arrays["version"] = np.array(_CACHE_VERSION)
    return arrays


def stats_from_arrays(arrays: dict[str, np.ndarray]) -> dict[str, TensorStats]:
    if int(arrays["version"]) != _CACHE_VERSION:
        raise ValueError(f"statistics format version {int(arrays['version'])}, expected {_CACHE_VERSION}")
    fields = [k for k in arrays if k not in ("names", "version")]
    return {
        str(name): TensorStats.from_arrays({f: arrays[f][k] for f in fields})
        for k, name in enumerate(arrays["names"])
    }


def save_statistics(path: str | Path, stats: dict[str, TensorStats]) -> Path:
    """Write statistics to an ``.npz`` file atomically."""
    # an .npz as numpy writes it, deflated at level 1: the histograms are mostly zeros, and level 1
    # is 5x faster than savez_compressed's default for 10 % more bytes
    with atomic_path(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, value in stats_to_arrays(stats).items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)
    log.debug("calibration statistics saved to %s", path)
    return Path(path)


def load_statistics(path: str | Path) -> dict[str, TensorStats]:
    with np.load(path, allow_pickle=False) as data:
        return stats_from_arrays({k: data[k] for k in data.files})


def _cache_path(cache_dir: str | Path | None, cache_key: str | None) -> Path | None:
    if cache_dir is None or cache_key is None:
        return None
    if not _KEY_RE.match(cache_key):
        raise ValueError(f"calibration cache key must match {_KEY_RE.pattern}, got {cache_key!r}")
    return Path(cache_dir) / f"calib_stats_{cache_key}.npz"


def _load_cache(path: Path) -> dict[str, TensorStats]:
    """Every tensor the cache file holds ({} when there is none, or it is unreadable)."""
    if not path.is_file():
        return {}
    try:
        return load_statistics(path)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # corrupt: recompute
        log.warning("calibration statistics cache %s unreadable (%s); recomputing", path, exc)
        return {}
