"""``python -m pulsar ARGS`` in a fresh process forked from a warm interpreter (a fork server).

The CLI tests run the real command in a process of its own (exit code, stdout, stderr, files). A new
interpreter spends most of a failing command's time importing numpy, onnx, onnxruntime, torch ...
(about 1-2 s of CPU each, hundreds of times in the suite), so the server imports those third-party
libraries once and forks a child per command. ``pulsar`` itself is imported fresh in every child
(the server never imports it), with the argv, working directory, environment and stdin of the
command, ``sys.path[0]`` set to the working directory as ``python -m`` does, atexit handlers run and
the exit status, or the killing signal, reported like ``subprocess.run`` reports them.

``PULSAR_TEST_FORK=0`` runs every command as a plain subprocess instead (same results, slower).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import locale
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Third-party modules a pulsar command imports that read no environment at import time; never pulsar or
# typer (their import-time state is made per command, from its own environment).
PRELOAD = ("numpy", "onnx", "onnxruntime", "torch", "jsonschema", "pydantic", "rich.console", "yaml",
           "json5", "PIL.Image", "ml_dtypes")
_REPO = Path(__file__).resolve().parents[1]


def enabled() -> bool:
    return os.environ.get("PULSAR_TEST_FORK", "1") != "0" and hasattr(os, "fork")


# ---------------------------------------------------------------------------------------- client


class _Server:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="pulsar-fork-")
        self.path = os.path.join(self.dir, "s")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_fork", self.path], cwd=_REPO,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the test fork server did not start")
        atexit.register(self.close)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_server: _Server | None = None
cpu_s = 0.0  # CPU seconds the forked commands used (with the children they waited for): for timing the suite
_lock = threading.Lock()


def _get_server() -> _Server:
    global _server
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        return _server


def _decode(data: bytes, errors: str) -> str:
    """As ``subprocess.run(text=True)`` decodes: locale encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False), errors=errors).read()


def run_pulsar(args: list[str], cwd: Path | str | None = None, *, env: dict[str, str] | None = None,
               timeout: float | None = None, stdin: str | None = None,
               errors: str = "strict") -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([python, "-m", "pulsar", *args], capture_output=True, text=True, ...)`` returns."""
    argv = [sys.executable, "-m", "pulsar", *args]
    if not enabled():
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
                              input=stdin, errors=errors)
    server = _get_server()
    with tempfile.TemporaryDirectory(dir=server.dir) as t:
        files = {k: os.path.join(t, k) for k in ("in", "out", "err")}
        if stdin is not None:
            Path(files["in"]).write_bytes(stdin.encode(locale.getpreferredencoding(False)))
        request = {"args": args, "cwd": os.path.abspath(cwd or os.getcwd()), "env": dict(env or os.environ),
                   "stdin": files["in"] if stdin is not None else None, "stdout": files["out"],
                   "stderr": files["err"], "timeout": timeout}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(server.path)
            s.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(s.makefile("rb").readline())
        out = _decode(Path(files["out"]).read_bytes(), errors)
        err = _decode(Path(files["err"]).read_bytes(), errors)
    global cpu_s
    cpu_s += reply["cpu_s"]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(argv, timeout or 0, out, err)
    return subprocess.CompletedProcess(argv, reply["rc"], out, err)


# ---------------------------------------------------------------------------------------- server


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _command(req: dict[str, Any]) -> None:
    """The forked child: become ``python -m pulsar ARGS`` in ``cwd``; never returns."""
    code = 1
    try:
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path, flags in ((0, req["stdin"] or os.devnull, os.O_RDONLY),
                                (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = ["-m", *req["args"]]
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *_BASE_PATH]  # as `python -m` in cwd with this PYTHONPATH
        import runpy

        try:
            runpy.run_module("pulsar", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()  # join non-daemon threads, as interpreter exit does
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        if code < 0:  # ended by a signal, as the interpreter does after an uncaught KeyboardInterrupt
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def _handle(conn: socket.socket) -> None:
    """A forked handler: fork the command, wait for it (killing it at the timeout), reply; never returns."""
    try:
        req = json.loads(conn.makefile("rb").readline())
        pid = os.fork()
        if pid == 0:
            conn.close()
            _command(req)
        deadline = None if req["timeout"] is None else time.monotonic() + req["timeout"]
        timed_out, nap = False, 0.002
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if deadline is not None and time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                timed_out = True
                break
            time.sleep(nap)
            nap = min(nap * 1.5, 0.02)
        reply = {"rc": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
                 "cpu_s": usage.ru_utime + usage.ru_stime}
        conn.sendall(json.dumps(reply).encode() + b"\n")
    finally:
        os._exit(0)


_BASE_PATH: list[str] = []  # the server's sys.path less its cwd and its own PYTHONPATH


def serve(path: str) -> None:
    import importlib

    own = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in own]

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # The children share one bytecode cache outside the source tree (PYTHONDONTWRITEBYTECODE would make
    # every command compile pulsar's sources again); a changed source is compiled again as usual.
    sys.pycache_prefix = os.path.join(os.path.dirname(path), "pycache")
    sys.dont_write_bytecode = False
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    srv.settimeout(2.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    print("ready", flush=True)
    while os.getppid() == parent:  # the test process is gone: stop
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        if os.fork() == 0:
            srv.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            conn.settimeout(None)
            _handle(conn)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
