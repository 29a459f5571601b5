"""The build's allocator settings: freed memory kept inside the block, handed back after it, and
a user's own settings respected."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pulsar.utils import malloc

pytestmark = pytest.mark.skipif(malloc._glibc() is None, reason="glibc on Linux only")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_freed_memory_is_kept_inside_the_block_and_returned_after_it() -> None:
    with malloc.tuned_allocator() as tuned:
        assert tuned
        block = np.ones(24 << 20, np.uint8)  # under the 32 MiB threshold: from the heap, pages touched
        before = _rss_mb()
        del block
        kept = before - _rss_mb()
        assert kept < 8, f"{kept:.1f} MB went back to the kernel inside the block"
        block = np.ones(24 << 20, np.uint8)  # the same memory again
        del block
        held = _rss_mb()
    assert held - _rss_mb() > 16  # malloc_trim on leaving: the free heap memory goes back


def test_nested_blocks_restore_once(monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    libc = malloc._glibc()
    assert libc is not None

    class Spy:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return int(libc.mallopt(param, value))

        def malloc_trim(self, pad: int) -> int:
            calls.append((0, pad))
            return int(libc.malloc_trim(pad))

    monkeypatch.setattr(malloc, "_glibc", lambda: Spy())
    with malloc.tuned_allocator(), malloc.tuned_allocator():
        assert calls == list(malloc.BUILD.items())  # the inner block changes nothing
    assert calls[len(malloc.BUILD):] == [*malloc.AFTER.items(), (0, 0)]


@pytest.mark.parametrize("variable", ["MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_"])
def test_a_users_own_allocator_settings_are_left_alone(monkeypatch, variable: str) -> None:
    monkeypatch.setenv(variable, "2" if variable != "GLIBC_TUNABLES" else "glibc.malloc.arena_max=2")
    with malloc.tuned_allocator() as tuned:
        assert not tuned


def test_other_platforms_are_left_alone(monkeypatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    with malloc.tuned_allocator() as tuned:
        assert not tuned


def test_after_the_block_a_freed_block_is_reused_not_unmapped() -> None:
    """The settings left behind are glibc's warmed-up ones: a 16 MiB block freed after the build stays
    for the next (at a fixed 128 KiB mmap threshold each such block would be mapped and faulted in
    again: the simulator ran 1.5-1.8x slower after a build in the same process)."""
    with malloc.tuned_allocator():
        pass
    for _ in range(2):
        block = np.ones(16 << 20, np.uint8)
        before = _rss_mb()
        del block
        assert before - _rss_mb() < 8
