"""Target profiles: the handful of hardware numbers the cost model needs, kept as data files.

A profile is a flat YAML or JSON mapping (see docs/targets.md). The built-in ones (VNPU-S / -M / -L)
ship next to this module; users point ``target_hardware`` at their own file to describe another
device. Loading is strict: a typo'd or missing field would silently skew every estimate, so each
problem is a PulsarError naming the file and the field.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulsar.errors import PulsarError, did_you_mean

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_SUFFIXES = (".yaml", ".yml", ".json")
NPU_MODES = {"NPU1": 1, "NPU2": 2, "NPU3": 3, "NPU4": 4}


@dataclass(frozen=True)
class TargetProfile:
    """One NPU class. Rates are per core; memory and DDR are shared by all cores."""

    name: str
    description: str
    cores: int
    int8_macs_per_cycle_per_core: int
    int16_macs_per_cycle_per_core: int
    clock_mhz: float
    onchip_memory_kib: float
    ddr_bandwidth_gbps: float
    vector_ops_per_cycle_per_core: int
    op_overhead_cycles: int = 0
    fp16_macs_per_cycle_per_core: int = 0   # 0: the NPU has no FP16 (FP16 layers are refused)
    bf16_macs_per_cycle_per_core: int = 0
    # soft-compressed weights expanded per cycle of one core; 0: expanded by the DMA at line rate (free)
    decompress_bytes_per_cycle_per_core: int = 0
    source: str = ""

    def float_macs_per_cycle(self, fmt: str) -> int:
        """Per-core MAC rate of float format ``fmt`` (FP16 / BF16); 0 when the NPU lacks it."""
        return {"FP16": self.fp16_macs_per_cycle_per_core, "BF16": self.bf16_macs_per_cycle_per_core}.get(fmt, 0)

    def macs_per_cycle(self, bits: int) -> int:
        """Per-core MAC rate for operands of ``bits`` (<= 8: int8 array, wider: int16 rate)."""
        return self.int8_macs_per_cycle_per_core if bits <= 8 else self.int16_macs_per_cycle_per_core

    def peak_tops(self, bits: int = 8, cores: int | None = None) -> float:
        """Peak tera-operations per second (1 MAC = 2 ops)."""
        n = self.cores if cores is None else cores
        return 2.0 * self.macs_per_cycle(bits) * n * self.clock_mhz * 1e6 / 1e12

    @property
    def onchip_bytes(self) -> int:
        return int(self.onchip_memory_kib * 1024)

    def ddr_bytes_per_cycle(self, ddr_bw_limit_gbps: float = 0.0) -> float:
        """DDR bytes per NPU clock cycle, capped by ``ddr_bw_limit_gbps`` when it is > 0 (1 GB = 1e9 B)."""
        bw = self.ddr_bandwidth_gbps
        if ddr_bw_limit_gbps > 0:
            bw = min(bw, ddr_bw_limit_gbps)
        return bw * 1e9 / (self.clock_mhz * 1e6)


# field -> (must be an integer, must be > 0 (else >= 0), meaning for error messages)
_NUMERIC: dict[str, tuple[bool, bool, str]] = {
    "cores": (True, True, "number of NPU cores"),
    "int8_macs_per_cycle_per_core": (True, True, "int8 multiply-accumulates per cycle of one core"),
    "int16_macs_per_cycle_per_core": (True, True, "multiply-accumulates per cycle of one core for 16-bit operands"),
    "clock_mhz": (False, True, "NPU clock in MHz"),
    "onchip_memory_kib": (False, True, "on-chip SRAM in KiB (shared by the cores)"),
    "ddr_bandwidth_gbps": (False, True, "DDR bandwidth in GB/s"),
    "vector_ops_per_cycle_per_core": (True, True, "8-bit elementwise operations per cycle of one core"),
    "op_overhead_cycles": (True, False, "fixed cycles each op costs (launch, DMA setup)"),
    "fp16_macs_per_cycle_per_core": (True, False, "FP16 multiply-accumulates per cycle of one core (0: no FP16)"),
    "bf16_macs_per_cycle_per_core": (True, False, "BF16 multiply-accumulates per cycle of one core (0: no BF16)"),
    "decompress_bytes_per_cycle_per_core": (True, False, "bytes of soft-compressed weights one core expands per "
                                            "cycle (0: free, done by the DMA)"),
}
_TEXT = ("name", "description")
_OPTIONAL = {"name", "description", "op_overhead_cycles", "fp16_macs_per_cycle_per_core",
             "bf16_macs_per_cycle_per_core", "decompress_bytes_per_cycle_per_core"}
_ALLOWED = set(_NUMERIC) | set(_TEXT)


def builtin_profiles() -> dict[str, Path]:
    """Built-in profile name -> its data file inside the installed package."""
    return {p.stem: p for p in sorted(_HERE.glob("*.yaml"))}


def _read_mapping(path: Path) -> dict[str, Any]:
    """The profile file as a mapping, read with a config file's limits (size, depth, duplicate keys,
    huge or non-finite numbers)."""
    from pulsar.config.loader import read_mapping_file

    if path.suffix.lower() not in _SUFFIXES:
        raise PulsarError(f"target profile {path}: use a .yaml, .yml or .json file")
    data = read_mapping_file(path, "target profile")
    if not isinstance(data, dict):
        raise PulsarError(f"target profile {path}: expected a mapping of field: value, got {type(data).__name__}; "
                          "see docs/targets.md for the format")
    return data


def _validate(path: Path, data: dict[str, Any]) -> TargetProfile:
    for key in data:
        if key not in _ALLOWED:
            raise PulsarError(f"target profile {path}: unknown field {key!r}{did_you_mean(str(key), _ALLOWED)}; "
                              f"allowed fields: {', '.join(sorted(_ALLOWED))}")
    for key in sorted(_ALLOWED - _OPTIONAL):
        if key not in data:
            raise PulsarError(f"target profile {path}: field {key!r} is missing ({_NUMERIC[key][2]}); add it")
    values: dict[str, Any] = {}
    for key in _TEXT:
        value = data.get(key, path.stem if key == "name" else "")
        if not isinstance(value, str):
            raise PulsarError(f"target profile {path}: field {key!r} must be a string, got {value!r}")
        values[key] = value
    for key, (integer, strict, meaning) in _NUMERIC.items():
        value = data.get(key, 0)
        ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type or not math.isfinite(value):
            kind = "an integer" if integer else "a number"
            raise PulsarError(f"target profile {path}: field {key!r} ({meaning}) must be {kind}, got {value!r}")
        if value <= 0 if strict else value < 0:
            bound = "positive" if strict else "zero or positive"
            raise PulsarError(f"target profile {path}: field {key!r} ({meaning}) must be {bound}, got {value!r}")
        values[key] = value
    return TargetProfile(**values, source=str(path))


def load_profile(name_or_path: str | Path, base_dir: str | Path | None = None) -> TargetProfile:
    """A built-in profile by name (``VNPU-M``) or a user's ``.yaml`` / ``.json`` profile file.

    Relative paths resolve against ``base_dir`` (the config file's folder) when given, else the
    current directory."""
    builtins = builtin_profiles()
    text = str(name_or_path)
    if text in builtins:
        return _validate(builtins[text], _read_mapping(builtins[text]))
    path = Path(text).expanduser()
    if path.suffix.lower() not in _SUFFIXES:
        raise PulsarError(f"target_hardware {text!r} is neither a built-in profile ({', '.join(builtins)})"
                          f"{did_you_mean(text, builtins)} nor a .yaml / .json profile file")
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise PulsarError(f"target profile file {path} does not exist; fix target_hardware or use a built-in "
                          f"profile ({', '.join(builtins)})")
    profile = _validate(path, _read_mapping(path))
    log.debug("loaded target profile %s from %s", profile.name, path)
    return profile


def cores_for(profile: TargetProfile, npu_mode: str) -> int:
    """Cores an ``npu_mode`` (NPU1..NPU4) uses on ``profile``; more than the profile has is an error."""
    if npu_mode not in NPU_MODES:
        raise PulsarError(f"npu_mode {npu_mode!r} is not one of {', '.join(NPU_MODES)}{did_you_mean(npu_mode, NPU_MODES)}")
    n = NPU_MODES[npu_mode]
    if n > profile.cores:
        fit = [m for m, c in NPU_MODES.items() if c <= profile.cores]
        raise PulsarError(f"npu_mode {npu_mode} needs {n} cores but target profile {profile.name} has "
                          f"{profile.cores}; use {' / '.join(fit)} or a target with more cores")
    return n

