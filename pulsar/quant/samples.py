"""The one reader of ``quant.input_sample_dir`` (precision analysis) and ``compiler.input_sample_dir``
(compiler check): both take the same directory of DEPLOYED inputs, what ``pulsar run`` takes.

Layout: one file per input tensor, ``<stem>.npy`` or raw ``<stem>.bin`` (the stem is the tensor name
with every character outside ``[A-Za-z0-9_-]`` replaced by ``_``), either directly in the directory
(one sample) or in one sub-directory per sample (sorted by name; hidden ones skipped). Each file holds
the compiled model's input: after ``input_processors`` (e.g. uint8 NHWC RGB for configs/mobilenetv2),
the model's own input when there are none. The precision analysis runs the float / QDQ models, so its
samples go through the input processors (the same ONNX ops the compiled model starts with) to the
model's own input; the compiler check feeds them to the compiled model as they are. A file of the
wrong shape or dtype, with NaN / inf, or unreadable is one PulsarError naming the field, file and
tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from pulsar.core.tensor_io import read_inputs, tensor_file_stem
from pulsar.core.tensors import TensorInfo, tensor_info
from pulsar.errors import PulsarError
from pulsar.frontend.processors import attach_input_processors

if TYPE_CHECKING:
    from pulsar.config.generated import BuildConfig

log = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]


class Samples(Protocol):
    """A sized stream of samples (a SampleDir, the calibration data)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Feeds]: ...


def calibration_normalization(cfg: BuildConfig, model: onnx.ModelProto) -> dict[str, tuple[list[float], list[float]]]:
    """input -> (calibration_mean, calibration_std): the defaults of input_processors' mean / std."""
    out = {}
    for vi in model.graph.input:
        entries = [c for c in cfg.quant.input_configs if c.tensor_name == vi.name]
        entries = entries or [c for c in cfg.quant.input_configs if c.tensor_name == "DEFAULT"]
        if entries:
            out[vi.name] = (list(entries[0].calibration_mean or []), list(entries[0].calibration_std or []))
    return out


def _model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


class InputConverter:
    """Deployed inputs -> the model's own inputs, through the config's input_processors (the same
    ONNX ops the compiler puts in front of the compiled model, run in onnxruntime)."""

    def __init__(self, cfg: BuildConfig, model: onnx.ModelProto):
        inputs = _model_inputs(model)
        self.model_infos = [tensor_info(vi) for vi in inputs]
        graph = helper.make_graph([helper.make_node("Identity", [vi.name], [f"{vi.name}__model_input"])
                                   for vi in inputs], "input_processors", list(inputs),
                                  [_renamed(vi, f"{vi.name}__model_input") for vi in inputs])
        opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
        chain = helper.make_model(graph, opset_imports=opsets or [helper.make_opsetid("", 17)])
        chain.ir_version = model.ir_version
        chain, _ = attach_input_processors(chain, cfg.input_processors, calibration_normalization(cfg, model))
        self.deployed_infos = [tensor_info(vi) for vi in chain.graph.input]
        self.identity = len(chain.graph.node) == len(inputs)
        self._session = None if self.identity else ort.InferenceSession(
            chain.SerializeToString(), providers=["CPUExecutionProvider"])

    def __call__(self, feeds: Feeds) -> Feeds:
        if self._session is None:
            return feeds
        names = [f"{i.name}__model_input" for i in self.model_infos]
        values = self._session.run(names, feeds)
        return {i.name: v for i, v in zip(self.model_infos, values, strict=True)}


def _renamed(vi: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    out.name = name
    return out


def _file_of(folder: Path, info: TensorInfo) -> Path:
    npy = folder / f"{tensor_file_stem(info.name)}.npy"
    return npy if npy.is_file() else npy.with_suffix(".bin")


def _peek(path: Path) -> tuple[np.dtype, tuple[int, ...]] | None:
    """dtype and shape of a .npy file without reading it (None when it cannot be read)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        return arr.dtype, tuple(arr.shape)
    except Exception:  # noqa: BLE001 - only a hint
        return None


class SampleDir:
    """Samples of one ``*.input_sample_dir``: sized, read lazily, each check naming ``field``."""

    def __init__(self, field: str, root: str | Path, infos: Sequence[TensorInfo],
                 convert: Callable[[Feeds], Feeds] | None = None,
                 model_infos: Sequence[TensorInfo] | None = None):
        self.field, self.root, self.infos, self.convert = field, Path(root), list(infos), convert
        self.model_infos = list(model_infos or [])
        if not self.root.is_dir():
            raise PulsarError(f"{field}: '{root}' is not a directory; give a directory with one file per input "
                              f"tensor ({self._expected()}), or one sub-directory per sample")
        subdirs = sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        self.dirs = subdirs or [self.root]

    def __len__(self) -> int:
        return len(self.dirs)

    def __iter__(self) -> Iterator[Feeds]:
        for d in self.dirs:
            feeds = self.read(d)
            yield self.convert(feeds) if self.convert is not None else feeds

    def _expected(self) -> str:
        return ", ".join(f"{tensor_file_stem(i.name)}.npy|.bin ({i.dtype} {list(i.shape)})" for i in self.infos)

    def read(self, folder: Path) -> Feeds:
        """One sample in the deployed format; any problem is a PulsarError naming field, file and tensor."""
        feeds = {}
        for info in self.infos:
            try:
                value = read_inputs(folder, [info])[info.name]
            except PulsarError as exc:
                text = str(exc) if f'"{info.name}"' in str(exc) else f'input "{info.name}": {exc}'
                raise PulsarError(f"{self.field}: {text}{self._hint(folder, info)}") from None
            except OSError as exc:
                raise PulsarError(f'{self.field}: {folder}: cannot read the file of input "{info.name}" '
                                  f"({exc.strerror or exc})") from None
            if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
                bad = int(np.count_nonzero(~np.isfinite(value)))
                path = _file_of(folder, info)
                raise PulsarError(f'{self.field}: {path}: input "{info.name}" holds {bad} NaN / inf value(s); '
                                  "samples must be finite")
            feeds[info.name] = value
        return feeds

    def _hint(self, folder: Path, info: TensorInfo) -> str:
        """When the file holds the model's own input format, say that the field takes the deployed one."""
        own = next((m for m in self.model_infos if m.name == info.name), None)
        found = _peek(folder / f"{tensor_file_stem(info.name)}.npy")
        if own is None or found is None or (own.dtype, own.shape) == (info.dtype, info.shape):
            return ""
        if found == (own.dtype, own.shape):
            return (f"; the file holds the model's own input format, but {self.field} takes the deployed input "
                    f"(after input_processors, as pulsar run does): {info.dtype} {list(info.shape)}")
        return ""


def open_sample_dir(field: str, root: str | Path, cfg: BuildConfig, model: onnx.ModelProto) -> SampleDir:
    """Deployed-format samples converted to ``model``'s own inputs (the precision analysis' view)."""
    converter = InputConverter(cfg, model)
    return SampleDir(field, root, converter.deployed_infos, None if converter.identity else converter,
                     converter.model_infos)


def deployed_sample_dir(field: str, root: str | Path, model: onnx.ModelProto,
                        infos: Sequence[TensorInfo]) -> SampleDir:
    """Deployed-format samples as they are (the compiled model's inputs ``infos``: the check's view)."""
    return SampleDir(field, root, infos, None, [tensor_info(vi) for vi in _model_inputs(model)])


def check_sample_dirs(cfg: BuildConfig, model: onnx.ModelProto) -> None:
    """Read every sample of both fields now, before calibration, so a bad file costs seconds rather than
    a whole build (the compiler check runs last). A field is read only when its feature is on."""
    q, c = cfg.quant, cfg.compiler
    if q.precision_analysis and q.input_sample_dir:
        for _ in open_sample_dir("quant.input_sample_dir", q.input_sample_dir, cfg, model):
            pass
    if c.check and c.input_sample_dir:
        converter = InputConverter(cfg, model)
        for _ in SampleDir("compiler.input_sample_dir", c.input_sample_dir, converter.deployed_infos, None,
                           converter.model_infos):
            pass
