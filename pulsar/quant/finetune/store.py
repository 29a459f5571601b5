"""Per-sample block inputs with bounded memory: kept in RAM up to a budget, spilled to .npy files in
the work dir beyond it, so fine-tuning memory does not grow with ``calibration_size``."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_BUDGET = 64 * 2**20  # bytes kept in memory per store


class SampleStore:
    """A list of samples (tensor name -> array); sample i is read back with ``store[i]``."""

    def __init__(self, spill_dir: Path, budget: int = DEFAULT_BUDGET) -> None:
        self.budget, self.used = budget, 0
        self.memory: list[dict[str, np.ndarray] | None] = []
        self.names: list[list[str]] = []
        self._dir: Path | None = None
        self._parent = spill_dir

    def __len__(self) -> int:
        return len(self.memory)

    def _spill_path(self, i: int, k: int) -> Path:
        if self._dir is None:
            self._parent.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="finetune-", dir=self._parent))
        return self._dir / f"{i}_{k}.npy"

    def append(self, sample: dict[str, np.ndarray]) -> None:
        size = sum(a.nbytes for a in sample.values())
        i = len(self.memory)
        self.names.append(list(sample))
        if self.used + size <= self.budget:
            self.memory.append({k: np.ascontiguousarray(v) for k, v in sample.items()})
            self.used += size
            return
        for k, v in enumerate(sample.values()):
            np.save(self._spill_path(i, k), np.ascontiguousarray(v), allow_pickle=False)
        self.memory.append(None)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        held = self.memory[i]
        if held is not None:
            return held
        return {name: np.load(self._spill_path(i, k), allow_pickle=False) for k, name in enumerate(self.names[i])}

    @property
    def spilled(self) -> int:
        return sum(1 for m in self.memory if m is None)

    def close(self) -> None:
        self.memory.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
