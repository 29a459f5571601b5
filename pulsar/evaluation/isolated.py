"""Metric plugins run in a child process: their import (the check before a build writes) and their calls.

A plugin is user code. In the build's own process, ``os._exit`` or a kill for memory would end the build
without a word and leave its staging folder and lock behind, and an ``os.chdir`` would move where the
build writes. In a child process of its own (a fresh ``python -c``, which imports nothing of the build's
``__main__``), its death is one PulsarError naming the plugin and what it was doing, and the build
cleans up as after any error; the child gets its working directory back after each call.

Only the plugin runs there: its sessions are proxies whose ``run(feeds)`` is answered by the build's
process, which holds the three models (and has onnxruntime and the simulator loaded). So the cost is
one interpreter start and the plugin's own imports, about 0.1-0.3 s per check (cached per plugin file
version: a sweep checks once) and per evaluation, plus pickling each call's feeds and outputs.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pulsar.errors import PulsarError

_CHECKED: set[tuple[str, str, tuple[int, int] | None]] = set()  # plugins whose import passed, by file version


def check_plugin(spec: str, field: str = "evaluation.metric") -> None:
    """Import the plugin and check its signature, in a child; a plugin file checked before (same size
    and mtime) is not imported again in this process."""
    target = spec.rpartition(":")[0]
    key = (spec, os.getcwd(), _stamp(Path(target)) if target.endswith(".py") else None)
    if key in _CHECKED:
        return
    _in_child("import", (spec, field), spec, field, {})
    _CHECKED.add(key)


def score_plugin(spec: str, sessions: dict[str, Any], field: str = "evaluation.metric") -> dict[str, float]:
    """``{model: fn(session)}`` for each of ``sessions`` (scored in that order), ``fn`` running in a child
    that reaches each session through this process."""
    inputs = {what: list(s.inputs) for what, s in sessions.items()}
    values: dict[str, float] = _in_child("score", (spec, field, inputs), spec, field, sessions)
    return values


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


# -- the build's side -----------------------------------------------------------------------------------
def _in_child(fn: str, args: tuple[Any, ...], spec: str, field: str, sessions: dict[str, Any]) -> Any:
    """``_STEPS[fn](conn, *args)`` in a fresh interpreter: its result, its PulsarError, or one saying how it
    died. The child says what it is doing (``doing``) and asks for model runs (``run``), answered here.

    A plain ``python -c`` child rather than multiprocessing's spawn, which would import this process's
    ``__main__`` again there (a Ray worker's, or a user script that calls pulsar.build unguarded)."""
    ours, theirs = socket.socketpair()
    package_root = str(Path(__file__).resolve().parents[2])  # pulsar importable however this process found it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    with ours, theirs:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno()), str(os.getpid())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        conn = Connection(os.dup(ours.fileno()))
    doing = "while it was imported"
    try:
        conn.send((list(sys.path), fn, args))
        while True:
            try:
                kind, payload = conn.recv()
                if kind == "run":
                    conn.send(_serve(sessions, *payload))
                    continue
            except (EOFError, OSError):
                proc.wait()
                raise PulsarError(_died(spec, field, proc.returncode, doing)) from None
            if kind == "doing":
                doing = payload
            elif kind == "error":
                raise PulsarError(payload)
            else:
                return payload
    finally:
        conn.close()  # a child still waiting for an answer sees the end and exits
        _stop(proc)


def _serve(sessions: dict[str, Any], what: str, feeds: Any) -> tuple[str, Any]:
    """One ``session.run`` for the child: its outputs, or the exception to raise there."""
    try:
        return "outputs", sessions[what].run(feeds)
    except PulsarError as exc:
        return "raise", ("PulsarError", str(exc))
    except Exception as exc:  # noqa: BLE001 - bad feeds are the plugin's error, raised in the plugin
        return "raise", (type(exc).__name__, str(exc))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The child gone: it exits by itself after its answer; after an error or Ctrl-C it is ended."""
    for end in (None, proc.terminate, proc.kill):
        if end is not None:
            end()
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _died(spec: str, field: str, code: int | None, doing: str) -> str:
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        hint = " (e.g. for memory)" if code == -signal.SIGKILL else ""
        return (f"{field}: the plugin {spec} {how}{hint} {doing}; a metric must return a float (the build is "
                "unchanged)")
    return (f"{field}: the plugin {spec} ended its process (exit code {code}, e.g. os._exit) {doing}; a metric "
            "must return a float, not end the process (the build is unchanged)")


# -- the plugin's side ----------------------------------------------------------------------------------
class RemoteSession:
    """What a plugin gets: ``inputs`` and ``run(feeds)`` (:class:`pulsar.evaluation.sessions.MetricSession`),
    the model running in the build's process."""

    def __init__(self, conn: Connection, what: str, inputs: list[Any]) -> None:
        self._conn, self._what, self.inputs = conn, what, inputs

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        self._conn.send(("run", (self._what, feeds)))
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the build is gone (ended or interrupted): nothing is left to score for
        if kind == "raise":
            name, text = payload
            if name == "PulsarError":
                raise PulsarError(text)
            kind_of = getattr(builtins, name, None)
            raise (kind_of(text) if isinstance(kind_of, type) and issubclass(kind_of, Exception)
                   else RuntimeError(f"{name}: {text}"))
        outputs: dict[str, Any] = payload
        return outputs


def _die_with_parent() -> None:
    """On Linux, this process is killed when the build's process dies (a sweep worker killed for memory
    leaves no plugin running)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_CHILD = "import sys; from pulsar.evaluation.isolated import child_main; child_main(int(sys.argv[1]), int(sys.argv[2]))"


def child_main(fd: int, parent: int) -> None:
    """The plugin's process: one request (the build's ``sys.path``, a step, its arguments), one answer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends this process
    _die_with_parent()
    if os.getppid() != parent:  # the build died before this process could follow it
        os._exit(0)
    conn = Connection(fd)
    try:
        path, step, args = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    sys.path[:] = path  # a plugin module imports as it would in the build's process
    try:
        answer: tuple[str, Any] = ("result", _STEPS[step](conn, *args))
    except PulsarError as exc:
        answer = ("error", str(exc))
    except BaseException as exc:  # noqa: BLE001 - a pulsar bug in the child is still one line in the parent
        answer = ("error", f"evaluation: {type(exc).__name__}: {exc} (in the metric plugin's process)")
    with contextlib.suppress(OSError):  # the parent may be gone: say nothing then
        conn.send(answer)
        conn.close()


@contextlib.contextmanager
def _home() -> Iterator[None]:
    """The working directory as it was, whatever the plugin did to it."""
    home = os.getcwd()
    try:
        yield
    finally:
        os.chdir(home)


def _import_plugin(conn: Connection, spec: str, field: str) -> None:
    from pulsar.evaluation.plugins import load_metric

    with _home():
        load_metric(spec, field)


def _score(conn: Connection, spec: str, field: str, inputs: dict[str, list[Any]]) -> dict[str, float]:
    from pulsar.evaluation.plugins import call_metric, load_metric

    with _home():
        fn = load_metric(spec, field)
    values = {}
    for what, infos in inputs.items():
        conn.send(("doing", f"while it scored the {what} model"))
        with _home():
            values[what] = call_metric(fn, RemoteSession(conn, what, infos), what, field)
    return values


_STEPS: dict[str, Callable[..., Any]] = {"import": _import_plugin, "score": _score}
