"""An interrupt can land anywhere in a write: atomic_path leaves no temp file behind either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from pulsar.utils import atomic


def test_an_interrupt_right_after_the_temp_file_exists_removes_it(tmp_path: Path, monkeypatch) -> None:
    real_close = atomic.os.close
    fired = []

    def interrupted(fd: int) -> None:  # the signal lands after the file is created, before the block runs
        real_close(fd)
        if not fired:
            fired.append(fd)
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "close", interrupted)
    with pytest.raises(KeyboardInterrupt), atomic.atomic_path(tmp_path / "out.npy") as tmp:
        tmp.write_bytes(b"never")
    monkeypatch.undo()
    assert fired
    assert list(tmp_path.iterdir()) == [] and not atomic._LIVE


def test_a_write_whose_cleanup_never_ran_is_removed_by_remove_unfinished(tmp_path: Path) -> None:
    ctx = atomic.atomic_path(tmp_path / "logits.npy")
    tmp = ctx.__enter__()  # the block started; its exit never runs (the interrupt cut it short)
    tmp.write_bytes(b"half")
    assert [p.name for p in tmp_path.iterdir()] == [tmp.name] and tmp.name.endswith(".tmp")
    assert atomic.remove_unfinished() == 1
    assert list(tmp_path.iterdir()) == [] and not atomic._LIVE


def test_a_finished_write_is_not_listed(tmp_path: Path) -> None:
    atomic.atomic_write_bytes(tmp_path / "a.bin", b"x")
    assert (tmp_path / "a.bin").read_bytes() == b"x" and not atomic._LIVE and atomic.remove_unfinished() == 0
