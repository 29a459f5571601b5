"""Background artifact writes: in place (0644 under umask 022) when the block ends, readable while in
flight, a refused write reported once, and nothing written after a failed block has cleaned up."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from pulsar.errors import PulsarError
from pulsar.utils import atomic


def _hold_writes(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Every write waits at its start for ``gate``; ``started`` is set when one is under way."""
    started, gate = threading.Event(), threading.Event()
    real = atomic.atomic_path

    def held(path):
        started.set()
        gate.wait(10)
        return real(path)

    monkeypatch.setattr(atomic, "atomic_path", held)
    return started, gate


def test_writes_are_in_place_with_the_umask_mode_when_the_block_ends(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    with atomic.background_writes():
        returned = atomic.atomic_write_bytes(tmp_path / "sub" / "model.onnx", data, background=True)
        atomic.atomic_write_bytes(tmp_path / "small.json", b"{}", background=True)
    assert returned == tmp_path / "sub" / "model.onnx"
    assert returned.read_bytes() == data and (tmp_path / "small.json").read_bytes() == b"{}"
    assert stat.S_IMODE(returned.stat().st_mode) == 0o666 & ~atomic.current_umask()
    assert not [p for p in tmp_path.rglob("*.tmp")] and not atomic._LIVE


def test_without_a_block_background_writes_happen_at_once(tmp_path: Path) -> None:
    atomic.atomic_write_bytes(tmp_path / "a.bin", b"now", background=True)
    assert (tmp_path / "a.bin").read_bytes() == b"now"
    assert atomic.pending_bytes(tmp_path / "a.bin") is None


def test_bytes_in_flight_are_readable_and_settle_waits(tmp_path: Path, monkeypatch) -> None:
    gate = threading.Event()
    real = atomic.atomic_path

    def slow(path):  # the writer thread waits here until the test has looked
        gate.wait(10)
        return real(path)

    monkeypatch.setattr(atomic, "atomic_path", slow)
    target = tmp_path / "compiled.pulsar"
    with atomic.background_writes():
        atomic.atomic_write_bytes(target, b"payload", background=True)
        assert not target.exists()
        assert atomic.pending_bytes(target) == b"payload"
        assert atomic.pending_bytes(tmp_path / "other") is None
        gate.set()
        atomic.settle_writes()
        assert target.read_bytes() == b"payload" and atomic.pending_bytes(target) is None


def test_a_refused_write_is_raised_when_the_block_ends(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_bytes(b"")
    with pytest.raises(PulsarError, match="cannot write .*not_a_dir"), atomic.background_writes():
        atomic.atomic_write_bytes(blocker / "model.onnx", b"x", background=True)
    assert not atomic._LIVE


def test_a_refused_write_is_raised_by_settle(tmp_path: Path) -> None:
    blocker = tmp_path / "f"
    blocker.write_bytes(b"")
    with atomic.background_writes():
        atomic.atomic_write_bytes(blocker / "a.onnx", b"x", background=True)
        with pytest.raises(PulsarError, match="cannot write"):
            atomic.settle_writes()
        atomic.atomic_write_bytes(tmp_path / "b.onnx", b"y", background=True)  # the block goes on
    assert (tmp_path / "b.onnx").read_bytes() == b"y"


def test_a_failing_block_keeps_its_error_and_every_write_has_ended(tmp_path: Path, monkeypatch) -> None:
    started = threading.Event()
    real = atomic.atomic_path

    def slow(path):
        started.set()
        threading.Event().wait(0.2)  # still writing when the block fails
        return real(path)

    monkeypatch.setattr(atomic, "atomic_path", slow)
    blocker = tmp_path / "f"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match="the stage failed"), atomic.background_writes():
        atomic.atomic_write_bytes(tmp_path / "late.onnx", b"z", background=True)
        atomic.atomic_write_bytes(blocker / "refused.onnx", b"x", background=True)  # its error is not the one
        started.wait(10)
        raise ValueError("the stage failed")
    # the block waited: the write is complete before the caller removes the staging folder
    assert (tmp_path / "late.onnx").read_bytes() == b"z"
    assert [t.name for t in threading.enumerate() if t.name.startswith("pulsar-write")] == []


def test_a_failed_write_is_raised_to_its_reader(tmp_path: Path) -> None:
    blocker = tmp_path / "f"
    blocker.write_bytes(b"")
    with atomic.background_writes():
        atomic.atomic_write_bytes(blocker / "compiled.pulsar", b"x", background=True)
        writer = atomic._WRITER.get()
        assert writer is not None and writer._futures[0].exception(timeout=10) is not None  # it has failed
        with pytest.raises(PulsarError, match="cannot write"):  # not "does not exist"
            atomic.pending_bytes(blocker / "compiled.pulsar")


def test_after_an_interrupt_writes_not_begun_never_run(tmp_path: Path, monkeypatch) -> None:
    started, gate = _hold_writes(monkeypatch)
    with pytest.raises(KeyboardInterrupt), atomic.background_writes():
        atomic.atomic_write_bytes(tmp_path / "first.onnx", b"1", background=True)
        atomic.atomic_write_bytes(tmp_path / "second.onnx", b"2", background=True)
        started.wait(10)
        threading.Timer(0.2, gate.set).start()
        raise KeyboardInterrupt
    assert (tmp_path / "first.onnx").read_bytes() == b"1"  # under way: finished before the block left
    assert not (tmp_path / "second.onnx").exists()  # queued: dropped


def test_a_second_interrupt_while_closing_still_waits_for_the_write(tmp_path: Path, monkeypatch) -> None:
    started, gate = _hold_writes(monkeypatch)
    real_shutdown = atomic.ThreadPoolExecutor.shutdown
    interrupted = []

    def shutdown(self, wait=True, *, cancel_futures=False):
        if not interrupted:  # the second Ctrl-C lands while the first one's cleanup waits
            interrupted.append(True)
            threading.Timer(0.2, gate.set).start()
            raise KeyboardInterrupt
        return real_shutdown(self, wait=wait, cancel_futures=cancel_futures)

    monkeypatch.setattr(atomic.ThreadPoolExecutor, "shutdown", shutdown)
    with pytest.raises(ValueError), atomic.background_writes():
        atomic.atomic_write_bytes(tmp_path / "sub" / "a.onnx", b"a", background=True)
        started.wait(10)  # under way when the block fails
        raise ValueError("stage failed")
    assert interrupted and (tmp_path / "sub" / "a.onnx").read_bytes() == b"a"
    assert [t.name for t in threading.enumerate() if t.name.startswith("pulsar-write")] == []
