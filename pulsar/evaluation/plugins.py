"""Metric plugins: ``module:function`` or ``path/to/file.py:function``, checked before the build writes.

Only the named module (or file) is imported; nothing else from the config is executed, and that in a
child process (:mod:`pulsar.evaluation.isolated`). The function takes one argument, a session
(:mod:`pulsar.evaluation.sessions`, in the deployed input format), and returns a real number, higher is
better. Every way a plugin can be wrong (missing, not callable, wrong signature, raising, returning
NaN, a string, a huge integer or a non-number) is a PulsarError naming ``field`` and the fix."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pulsar.errors import PulsarError

Metric = Callable[[Any], float]


def is_plugin(spec: str) -> bool:
    return ":" in spec


def load_metric(spec: str, field: str = "evaluation.metric") -> Metric:
    """The function ``spec`` names, after checking it can take exactly one argument."""
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise PulsarError(f"{field}: {spec!r} is not 'module:function' or 'path/to/file.py:function'")
    module = _import(target, field)
    fn = getattr(module, name, None)
    if fn is None:
        raise PulsarError(f"{field}: {target} has no function {name!r}; define `def {name}(session) -> float`")
    if not callable(fn):
        raise PulsarError(f"{field}: {target}:{name} is not a function; define `def {name}(session) -> float`")
    try:
        inspect.signature(fn).bind(object())
    except TypeError:
        raise PulsarError(f"{field}: {target}:{name}{_sig(fn)} cannot be called with one argument (the session); "
                          f"define `def {name}(session) -> float`") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    metric: Metric = fn
    return metric


def _sig(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


_FILES: dict[tuple[str, int, int], Any] = {}  # (resolved path, size, mtime) -> module: a file runs once


def _import(target: str, field: str) -> Any:
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise PulsarError(f"{field}: plugin file {target} does not exist; check the path")
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _FILES:
            _FILES[key] = _exec_file(path, target, field)
        return _FILES[key]
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise PulsarError(f"{field}: module {target!r} not found ({_first(exc)}); install it or give the file "
                          "path instead (path/to/file.py:function)") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the plugin's own error, reported on one line
        raise PulsarError(f"{field}: importing {target} raised {type(exc).__name__}: {_first(exc)}") from None


def _exec_file(path: Path, target: str, field: str) -> Any:
    """Run a plugin file as a module of its own (never written as bytecode beside the user's file)."""
    name = f"pulsar_metric_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PulsarError(f"{field}: {target} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the plugin's own error, reported on one line
        sys.modules.pop(name, None)
        raise PulsarError(f"{field}: importing {target} raised {type(exc).__name__}: {_first(exc)}") from None
    finally:
        sys.dont_write_bytecode = before
    return module


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def call_metric(fn: Metric, session: Any, what: str, field: str = "evaluation.metric") -> float:
    """``fn(session)`` as a finite float, or a PulsarError saying what the plugin did wrong."""
    label = getattr(fn, "__name__", "metric")
    try:
        value = fn(session)
    except PulsarError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - sys.exit() in a plugin must not end pulsar
        raise PulsarError(f"{field}: {label}() raised {type(exc).__name__} on the {what} model: {_first(exc)}; "
                          "fix the plugin") from None
    return as_score(value, f"{field}: {label}() returned", f"on the {what} model")


def as_score(value: Any, said: str, where: str) -> float:
    """A metric's result as a finite float. Only real numbers count: a string such as '0.75' or a bool is a
    plugin bug that ``float()`` would hide, and an integer too large for a float is one too."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's bool is not a Real either
        shown = type(value).__name__ + (f" {value!r}" if isinstance(value, str | bytes) and len(value) < 40 else "")
        raise PulsarError(f"{said} {shown} {where}, not a number; return a float (higher is better)")
    try:
        number = float(value)
    except OverflowError:
        bits = value.bit_length() if isinstance(value, int) else 0  # str() of a huge int is itself refused
        digits = int(bits * math.log10(2)) + 1
        raise PulsarError(f"{said} an integer of about {digits} digits {where}, too large for a float; return a "
                          "float (higher is better)") from None
    if not math.isfinite(number):
        raise PulsarError(f"{said} {number} {where}; return a finite float")
    return number
