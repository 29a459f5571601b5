"""Dataset plugins: ``calibration_dataset: my_data.py:samples`` names a Python callable that makes the data.

The callable is called with no arguments and returns an iterable of samples: a generator, a list, a
``torch.utils.data.Dataset`` (``__len__`` + ``__getitem__``, read by index) or anything with ``__iter__``.
A sample is ``{input_name: array}`` (numpy arrays or torch tensors), or a bare array when the plugin feeds
exactly one input. The arrays are the model inputs as they are: the plugin does all preprocessing
(pulsar2 / Compass dataset plugins work the same way), so calibration_mean / calibration_std are refused
and calibration_format is not read.

Memory stays bounded: samples are drawn one at a time and dropped after use. Opening the data makes one
checking pass over the samples to be used (at most calibration_size): every sample is validated before the
build writes anything, the exact count is known for progress and splits, and a hash of the arrays keys the
calibration cache (a plugin reading changed files gives a new key). Each later pass calls the callable
again, so it must return a fresh iterable every call (a generator function does).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pulsar.errors import PulsarError, did_you_mean
from pulsar.quant.datasets.spec import DatasetConfig, InputSpec
from pulsar.utils.user_code import describe, is_spec, load_callable

__all__ = ["PluginFeed", "is_plugin"]

log = logging.getLogger(__name__)


def is_plugin(config: DatasetConfig) -> bool:
    """A ``file.py:callable`` dataset rather than a directory or archive."""
    return is_spec(config.calibration_dataset)


class PluginFeed:
    """All model inputs fed by one dataset plugin, streamed one sample at a time."""

    def __init__(self, configs: list[DatasetConfig], specs: list[InputSpec], base_dir: Path | None = None) -> None:
        self.configs = configs
        self.specs = specs
        cfg = configs[0]
        self.plugin = cfg.calibration_dataset
        self.field = f"{cfg.field_path}.calibration_dataset"
        self.where = f"{self.field}: plugin {self.plugin}"
        for c in configs:
            for name in ("calibration_mean", "calibration_std"):
                if getattr(c, name):
                    raise PulsarError(f"{c.field_path}.{name}: a dataset plugin's arrays are fed to the model as they "
                                      "are; normalize inside the plugin and remove this field")
        sizes = [c.calibration_size for c in configs if c.calibration_size != -1]
        self.limit: int | None = min(sizes) if sizes else None
        self.fn: Callable[..., Any] = load_callable(self.plugin, base_dir or Path.cwd(), self.field)
        self.count, self.digest = self._check_pass()

    # -- drawing samples ---------------------------------------------------------------------------
    def _items(self) -> Iterator[Any]:
        """Call the plugin and walk what it returns, up to the limit."""
        try:
            data = self.fn()
        except PulsarError:
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the plugin's own error on one line
            raise PulsarError(f"{self.where} raised {describe(exc)} when called; fix the plugin") from None
        if isinstance(data, Mapping | str | bytes) or data is None or not (
                hasattr(data, "__iter__") or (hasattr(data, "__len__") and hasattr(data, "__getitem__"))):
            raise PulsarError(f"{self.where} returned {_kind(data)}, not an iterable of samples; return a list, a "
                              "generator (yield {input_name: array}) or a torch Dataset")
        if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not hasattr(data, "__iter__"):
            return self._indexed(data)  # a map-style torch Dataset: read by index, never past its length
        return self._iterated(data)

    def _indexed(self, data: Any) -> Iterator[Any]:
        total = self._length(data)
        stop = total if self.limit is None else min(total, self.limit)
        for i in range(stop):
            try:
                item = data[i]
            except PulsarError:
                raise
            except (Exception, SystemExit) as exc:  # noqa: BLE001
                raise PulsarError(f"{self.where}: sample {i}: __getitem__({i}) raised {describe(exc)}; fix the "
                                  "plugin") from None
            yield item

    def _iterated(self, data: Any) -> Iterator[Any]:
        try:
            it = iter(data)
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            raise PulsarError(f"{self.where}: iterating its result raised {describe(exc)}; fix the plugin") from None
        i = 0
        while self.limit is None or i < self.limit:
            try:
                item = next(it)
            except StopIteration:
                return
            except PulsarError:
                raise
            except (Exception, SystemExit) as exc:  # noqa: BLE001
                raise PulsarError(f"{self.where}: sample {i}: the plugin raised {describe(exc)}; fix the "
                                  "plugin") from None
            yield item
            i += 1
        close = getattr(it, "close", None)  # a generator's `finally` runs now, not at garbage collection
        if callable(close):
            close()

    def _length(self, data: Any) -> int:
        try:
            return int(len(data))
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            raise PulsarError(f"{self.where}: len() of its result raised {describe(exc)}; fix __len__") from None

    def _samples(self) -> Iterator[dict[str, np.ndarray]]:
        for i, item in enumerate(self._items()):
            yield self._convert(item, i)

    def _check_pass(self) -> tuple[int, str]:
        """Validate every sample to be used, count them and hash them; nothing is kept."""
        h = hashlib.sha256(self.plugin.encode())
        count = 0
        for sample in self._samples():
            for name in sorted(sample):
                arr = sample[name]
                h.update(f"{name}|{arr.dtype.str}|{arr.shape}".encode())
                h.update(np.ascontiguousarray(arr).data)
            count += 1
        if count == 0:
            raise PulsarError(f"{self.where} yielded no samples; make it return at least one "
                              "{input_name: array} sample")
        if self.limit is not None and count < self.limit:
            log.warning("calibration_size is %d but %s gave only %d sample(s); using %d",
                        self.limit, self.plugin, count, count)
        return count, h.hexdigest()

    def stream(self) -> Iterator[dict[str, np.ndarray]]:
        """The ``count`` samples again, drawn afresh from a new call of the plugin."""
        n = 0
        for sample in self._samples():
            if n == self.count:
                break
            yield sample
            n += 1
        if n < self.count:
            raise PulsarError(f"{self.where} gave {n} sample(s) on a later pass but {self.count} on the first; "
                              "return a fresh iterable on every call (a generator function, a list), not a shared "
                              "iterator")

    # -- one sample ----------------------------------------------------------------------------------
    def _convert(self, item: Any, i: int) -> dict[str, np.ndarray]:
        names = [s.name for s in self.specs]
        if isinstance(item, Mapping):
            raw = dict(item)
            missing = [n for n in names if n not in raw]
            extra = [str(k) for k in raw if k not in names]
            if extra:
                hint = did_you_mean(extra[0], names)
                raise PulsarError(f"{self.where}: sample {i} has key {extra[0]!r}, not an input it feeds{hint}; "
                                  f"use the input names {', '.join(names)}")
            if missing:
                raise PulsarError(f"{self.where}: sample {i} lacks input {missing[0]!r}; give every sample the keys "
                                  f"{', '.join(names)}")
        elif _is_array(item):
            if len(names) != 1:
                raise PulsarError(f"{self.where}: sample {i} is a bare array, but the plugin feeds inputs "
                                  f"{', '.join(names)}; yield a dict {{input_name: array}}")
            raw = {names[0]: item}
        else:
            raise PulsarError(f"{self.where}: sample {i} is {_kind(item)}; yield a dict {{input_name: array}} of "
                              "numpy arrays or torch tensors" + (" (or a bare array for a one-input model)"
                                                                 if len(names) == 1 else ""))
        return {spec.name: self._fit(raw[spec.name], spec, i) for spec in self.specs}

    def _fit(self, value: Any, spec: InputSpec, i: int) -> np.ndarray:
        where = f"{self.where}: sample {i}: input '{spec.name}'"
        if not _is_array(value):
            raise PulsarError(f"{where} is {_kind(value)}; give a numpy array or a torch tensor")
        arr = _to_numpy(value)
        if arr.dtype != spec.dtype:
            if arr.dtype == np.float64 and spec.dtype == np.float32:
                arr = arr.astype(np.float32)
            else:
                raise PulsarError(f"{where} is {arr.dtype}, the model expects {spec.dtype}; convert it with "
                                  f".astype(np.{spec.dtype.name}) in the plugin")
        if not _matches(arr.shape, spec.shape):
            if spec.shape and spec.shape[0] in (1, 0, -1) and _matches(arr.shape, spec.shape[1:]):
                arr = arr[np.newaxis]
            else:
                raise PulsarError(f"{where} has shape {list(arr.shape)}, the model expects {list(spec.shape)}; "
                                  "reshape it in the plugin")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise PulsarError(f"{where} holds {int(np.isnan(arr).sum())} NaN and {int(np.isinf(arr).sum())} "
                              "infinite value(s); calibration data must be finite numbers")
        return np.ascontiguousarray(arr)


def _matches(shape: Sequence[int], want: Sequence[int]) -> bool:
    return len(shape) == len(want) and all(w <= 0 or s == w for s, w in zip(shape, want, strict=True))


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray | np.generic) or _is_tensor(value)


def _is_tensor(value: Any) -> bool:
    """A torch tensor, recognised without importing torch (plugins that never use it do not pay for it)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "detach") and hasattr(value, "numpy")


def _to_numpy(value: Any) -> np.ndarray:
    if _is_tensor(value):
        return np.asarray(value.detach().cpu().numpy())
    return np.asarray(value)


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    name = type(value).__name__
    return f"a {name}" + (f" {value!r}" if isinstance(value, str | bytes | int | float) and len(repr(value)) < 40
                          else "")
