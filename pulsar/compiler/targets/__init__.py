"""Hardware target profiles (data files) for pulsar's performance estimates."""

from __future__ import annotations

from pulsar.compiler.targets.profile import (
    NPU_MODES,
    TargetProfile,
    builtin_profiles,
    cores_for,
    load_profile,
)

__all__ = ["NPU_MODES", "TargetProfile", "builtin_profiles", "cores_for", "load_profile"]
