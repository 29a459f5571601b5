"""CalibrationData: resolve the per-input configs, match samples by name, stream them one by one.

Opening is cheap (validation, archive listings, name matching; no file contents are read), so the
sample count, the Quant Config Table and the cache fingerprint are known before calibration runs.
Iteration then reads and decodes one sample at a time from archives that stay open.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

import numpy as np

from pulsar.errors import PulsarError, did_you_mean
from pulsar.quant.datasets.formats import FORMATS, Reader
from pulsar.quant.datasets.plugin import PluginFeed, is_plugin
from pulsar.quant.datasets.sources import Member, Source, open_source
from pulsar.quant.datasets.spec import DEFAULT_TENSOR, DatasetConfig, InputSpec

log = logging.getLogger(__name__)

_FINGERPRINT_VERSION = 1  # bump when decoding changes, so cached statistics are not reused
_LIST_LIMIT = 5
_FAR_BEYOND = 100  # calibration_size above this many times the samples found is an error, not a warning


@dataclass
class _Feed:
    """One dataset read with one format, feeding one or more inputs per sample."""

    configs: list[DatasetConfig]
    reader: Reader
    specs: list[InputSpec]
    source: Source
    samples: dict[str, Member] = field(default_factory=dict)

    @property
    def config(self) -> DatasetConfig:
        return self.configs[0]

    @property
    def field(self) -> str:
        return f"{self.config.field_path}.calibration_dataset"


def _short(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    return shown + (f" ... ({len(names)} in all)" if len(names) > _LIST_LIMIT else "")


def _sample_names(members: list[Member]) -> dict[str, Member]:
    """Key each file by its path without extension, minus the folder prefix all files share.

    Flat datasets are keyed by file stem (``a/1.bin`` and ``b/1.bin`` both give ``1``), while
    class sub-folders keep their names apart (``cat/1.jpg`` vs ``dog/1.jpg``).
    """
    dirs = [PurePosixPath(m.name).parts[:-1] for m in members]
    common = 0
    while dirs and all(len(d) > common and d[common] == dirs[0][common] for d in dirs):
        common += 1
    keyed: dict[str, Member] = {}
    for member in members:
        path = PurePosixPath(member.name)
        key = "/".join((*path.parts[common:-1], path.stem))
        if key in keyed:
            raise PulsarError(
                f"files '{keyed[key].name}' and '{member.name}' both give sample name '{key}'; "
                f"rename one so each sample has one file"
            )
        keyed[key] = member
    return keyed


def _require_finite(arr: np.ndarray, origin: str, tensor: str) -> None:
    """NaN / inf in calibration data would turn every range it reaches into nonsense (a scale of
    1e-12 or inf): refuse the sample, naming the file."""
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        nan, inf = int(np.isnan(arr).sum()), int(np.isinf(arr).sum())
        raise PulsarError(f"{origin}: input '{tensor}' holds {nan} NaN and {inf} infinite value(s); calibration "
                          "data must be finite numbers (fix or remove the file)")


class CalibrationData:
    """Calibration samples for all model inputs, streamed as ``{input_name: array}``."""

    def __init__(self, inputs: list[InputSpec], configs: list[DatasetConfig]) -> None:
        if not inputs:
            raise PulsarError("the model has no inputs to calibrate")
        self._inputs = list(inputs)
        self._configs = list(configs)
        self._per_input = self._resolve(self._inputs, self._configs)
        self._sources: dict[str, Source] = {}
        self._closed = False
        self._plugin: PluginFeed | None = None
        try:
            self._plugin = self._open_plugin()
            self._feeds = [] if self._plugin else self._make_feeds()
            self._names = [str(i) for i in range(self._plugin.count)] if self._plugin else self._match()
        except BaseException:
            self.close()
            raise

    # -- resolution and validation ---------------------------------------------------------------
    @staticmethod
    def _resolve(inputs: list[InputSpec], configs: list[DatasetConfig]) -> dict[str, DatasetConfig]:
        names = [spec.name for spec in inputs]
        explicit: dict[str, DatasetConfig] = {}
        default: DatasetConfig | None = None
        for cfg in configs:
            if cfg.calibration_format not in FORMATS and not is_plugin(cfg):
                raise PulsarError(
                    f"{cfg.field_path}.calibration_format: '{cfg.calibration_format}' is not a calibration "
                    f"format{did_you_mean(cfg.calibration_format, FORMATS)}; use one of {', '.join(FORMATS)}"
                )
            if (
                isinstance(cfg.calibration_size, bool)
                or cfg.calibration_size == 0
                or cfg.calibration_size < -1
            ):
                raise PulsarError(
                    f"{cfg.field_path}.calibration_size: {cfg.calibration_size} is not allowed; "
                    f"use a positive count or -1 for all files"
                )
            if cfg.tensor_name == DEFAULT_TENSOR:
                if default is not None:
                    raise PulsarError(
                        f"{cfg.field_path}.tensor_name: DEFAULT is already used by {default.field_path}; "
                        f"keep one DEFAULT entry"
                    )
                default = cfg
            elif cfg.tensor_name not in names:
                raise PulsarError(
                    f"{cfg.field_path}.tensor_name: '{cfg.tensor_name}' is not a model input"
                    f"{did_you_mean(cfg.tensor_name, names)}; inputs are {', '.join(names)}"
                )
            elif cfg.tensor_name in explicit:
                raise PulsarError(
                    f"{cfg.field_path}.tensor_name: input '{cfg.tensor_name}' already configured by "
                    f"{explicit[cfg.tensor_name].field_path}; keep one entry per input"
                )
            else:
                explicit[cfg.tensor_name] = cfg
        resolved: dict[str, DatasetConfig] = {}
        for spec in inputs:
            cfg = explicit.get(spec.name, default)
            if cfg is None:
                raise PulsarError(
                    f"model input '{spec.name}' has no calibration data; add a quant.input_configs entry with "
                    f"tensor_name '{spec.name}' or 'DEFAULT'"
                )
            if not is_plugin(cfg):  # a plugin's arrays are checked as they come (plugin.py)
                FORMATS[cfg.calibration_format].validate(spec, cfg)
            resolved[spec.name] = cfg
        return resolved

    def _open_plugin(self) -> PluginFeed | None:
        """A dataset plugin feeds every input (samples have no names to pair with files); None without one."""
        plugins = {c.calibration_dataset for c in self._per_input.values() if is_plugin(c)}
        if not plugins:
            return None
        first = next(c for c in self._configs if c in self._per_input.values() and is_plugin(c))
        for spec in self._inputs:
            cfg = self._per_input[spec.name]
            if cfg.calibration_dataset != first.calibration_dataset:
                raise PulsarError(
                    f"{cfg.field_path}.calibration_dataset: input '{spec.name}' reads '{cfg.calibration_dataset}' but "
                    f"{first.field_path} names the plugin {first.calibration_dataset}; a plugin feeds every input "
                    f"(tensor_name DEFAULT), so yield '{spec.name}' from it too and drop this entry")
        configs = list(dict.fromkeys(self._per_input.values()))
        return PluginFeed(configs, self._inputs)

    def _open(self, cfg: DatasetConfig) -> Source:
        key = str(Path(cfg.calibration_dataset).expanduser().resolve())
        if key not in self._sources:
            self._sources[key] = open_source(cfg.calibration_dataset, cfg.field_path)
        return self._sources[key]

    def _make_feeds(self) -> list[_Feed]:
        """Group inputs that read the same files the same way, so each file is read once a sample."""
        feeds: dict[tuple[Any, ...], _Feed] = {}
        for spec in self._inputs:
            cfg = self._per_input[spec.name]
            source = self._open(cfg)
            key = (id(source), cfg.calibration_format, cfg.calibration_mean, cfg.calibration_std)
            feed = feeds.get(key)
            if feed is None:
                feed = feeds[key] = _Feed([cfg], FORMATS[cfg.calibration_format], [spec], source)
            else:
                feed.specs.append(spec)
                if cfg not in feed.configs:
                    feed.configs.append(cfg)
        for feed in feeds.values():
            self._list_samples(feed)
        return list(feeds.values())

    @staticmethod
    def _list_samples(feed: _Feed) -> None:
        usable, ignored = [], []
        for member in feed.source.members():
            fits = PurePosixPath(member.name).suffix.lower() in feed.reader.extensions
            (usable if fits else ignored).append(member)
        if ignored:
            log.debug(
                "%s: ignoring %d file(s) that are not %s data: %s",
                feed.source.path, len(ignored), feed.reader.name, _short([m.name for m in ignored]),
            )  # fmt: skip
        if not usable:
            found = sorted({PurePosixPath(m.name).suffix.lower() or "(none)" for m in ignored})
            raise PulsarError(
                f"{feed.field}: no {feed.reader.name} files ({', '.join(feed.reader.extensions)}) in "
                f"'{feed.config.calibration_dataset}'"
                + (f"; found only {', '.join(found)} files, is calibration_format right?" if found else "")
            )
        try:
            feed.samples = _sample_names(usable)
        except PulsarError as exc:
            raise PulsarError(f"{feed.field} '{feed.config.calibration_dataset}': {exc}") from None

    def _match(self) -> list[str]:
        """Samples are the names every feed has; a name missing anywhere is a user error."""
        all_names = set().union(*(feed.samples for feed in self._feeds))
        problems = []
        for feed in self._feeds:
            missing = sorted(all_names - set(feed.samples))
            if missing:
                inputs = ", ".join(spec.name for spec in feed.specs)
                problems.append(
                    f"input {inputs} ('{feed.config.calibration_dataset}') lacks {_short(missing)}"
                )
        if problems:
            raise PulsarError(
                "calibration samples are matched by file name across inputs, but "
                + "; ".join(problems)
                + "; give every input a file for each sample"
            )
        names = sorted(all_names)
        sizes = [c.calibration_size for f in self._feeds for c in f.configs if c.calibration_size != -1]
        wanted = min(sizes) if sizes else len(names)
        if wanted > _FAR_BEYOND * len(names):  # a typo (extra zeros), not a wish for "all of them"
            c = min((c for f in self._feeds for c in f.configs if c.calibration_size != -1),
                    key=lambda c: c.calibration_size)
            raise PulsarError(
                f"{c.field_path}.calibration_size: {c.calibration_size:,} samples asked for, but "
                f"'{c.calibration_dataset}' has {len(names):,}; set it to {len(names)} or -1 for all of them")
        if wanted > len(names):
            log.warning(
                "calibration_size is %d but only %d sample(s) were found in %s; using %d",
                wanted, len(names), ", ".join(f"'{f.config.calibration_dataset}'" for f in self._feeds), len(names),
            )  # fmt: skip
        names = names[:wanted]
        for feed in self._feeds:
            feed.source.check_order([feed.samples[n] for n in names])
        return names

    # -- public API -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._names)

    def sample_names(self) -> list[str]:
        return list(self._names)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        if self._closed:
            raise RuntimeError("CalibrationData is closed")
        return self._stream()

    def _stream(self) -> Iterator[dict[str, np.ndarray]]:
        if self._plugin is not None:
            yield from self._plugin.stream()
            return
        for name in self._names:
            arrays: dict[str, np.ndarray] = {}
            for feed in self._feeds:
                member = feed.samples[name]
                data = feed.source.read(member)
                origin = feed.source.origin(member)
                decoded = feed.reader.decode(data, origin, feed.specs, feed.config)
                for tensor, arr in decoded.items():
                    _require_finite(arr, origin, tensor)
                arrays.update(decoded)
            yield {spec.name: arrays[spec.name] for spec in self._inputs}

    def describe(self) -> list[dict[str, Any]]:
        """One row per input for the Quant Config Table."""
        rows = []
        for spec in self._inputs:
            cfg = self._per_input[spec.name]
            rows.append(
                {
                    "input": spec.name,
                    "shape": list(spec.shape),
                    "dataset": cfg.calibration_dataset,
                    "format": "Plugin" if self._plugin else cfg.calibration_format,
                    "tensor_format": spec.tensor_format if cfg.calibration_format == "Image" and not self._plugin
                    else None,
                    "mean": list(cfg.calibration_mean),
                    "std": list(cfg.calibration_std),
                    "samples": len(self),
                }
            )
        return rows

    def fingerprint(self) -> str:
        """A cache key for calibration statistics: configs, inputs and the files used (names, sizes, stamps).

        Stamps are modification times for directories and tar members and CRCs for zip members, so
        the key changes when data changes without any file contents being read.
        """
        if self._plugin is not None:  # the arrays' hash: what the plugin yields, wherever it reads it from
            inputs = [[s.name, list(s.shape), s.dtype.str] for s in self._inputs]
            payload: dict[str, Any] = {"version": _FINGERPRINT_VERSION, "plugin": self._plugin.digest,
                                       "count": self._plugin.count, "inputs": inputs}
            return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        feeds = []
        for feed in self._feeds:
            feeds.append(
                {
                    "source": [type(feed.source).__name__, str(feed.source.path.resolve())],
                    "format": feed.reader.name,
                    "configs": [
                        [c.tensor_name, c.calibration_size, list(c.calibration_mean), list(c.calibration_std)]
                        for c in feed.configs
                    ],
                    "inputs": [
                        [s.name, list(s.shape), s.dtype.str, s.tensor_format, s.tensor_layout]
                        for s in feed.specs
                    ],
                    "members": [
                        [feed.samples[n].name, feed.samples[n].size, feed.samples[n].stamp]
                        for n in self._names
                    ],
                }
            )
        payload = {"version": _FINGERPRINT_VERSION, "samples": self._names, "feeds": feeds}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def close(self) -> None:
        for source in self._sources.values():
            source.close()
        self._closed = True

    def __enter__(self) -> CalibrationData:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
