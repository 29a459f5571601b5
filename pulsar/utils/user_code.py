"""Importing a user's own Python file (dataset plugins, operator plugins).

Running the file IS the feature (as in pulsar2): the user names a ``.py`` file in the config and pulsar
executes it. What this module guarantees is hygiene, not sandboxing: the file is imported under a unique
module name (two plugins both called ``data.py`` never collide, nor shadow a real package), its folder is
on ``sys.path`` only while it is being imported (so it can import its own helper files), no bytecode is
written beside the user's file, and every failure is ONE :class:`PulsarError` line naming ``what``, the
file and the fix. A file is executed once per content version: loading it again returns the same module
unless the file changed (so preflight and the build do not run import side effects twice).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from pulsar.errors import PulsarError

_LOADED: dict[tuple[str, int, int], ModuleType] = {}  # (resolved path, size, mtime_ns) -> module
_COUNTER = itertools.count()


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text, for one-line error messages."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def describe(exc: BaseException) -> str:
    """``TypeName: first line`` of an exception (the plugin's own words, on one line)."""
    text = first_line(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_module(path: Path, what: str) -> ModuleType:
    """Import the Python file ``path`` as a fresh module; errors name ``what`` (e.g. a config field)."""
    path = Path(path)
    if not path.is_file():
        hint = ("it is a folder; name a .py file" if path.is_dir()
                else "check the path (relative paths start at the config file's folder)")
        raise PulsarError(f"{what}: plugin file {path} does not exist; {hint}")
    if path.suffix != ".py":
        raise PulsarError(f"{what}: plugin file {path} is not a .py file; name a Python file such as my_data.py")
    resolved = path.resolve()
    st = resolved.stat()
    key = (str(resolved), st.st_size, st.st_mtime_ns)
    cached = _LOADED.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"pulsar_user_{_identifier(resolved.stem)}_{digest}_{next(_COUNTER)}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise PulsarError(f"{what}: {path} cannot be loaded as a Python module; name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses, pickling and typing look the module up while it runs
    folder = str(resolved.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except PulsarError:
        sys.modules.pop(name, None)
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the plugin's error (even sys.exit) on one line
        sys.modules.pop(name, None)
        raise PulsarError(f"{what}: importing {path} raised {describe(exc)}; fix the plugin file") from None
    finally:
        sys.dont_write_bytecode = before
        if added and folder in sys.path:
            sys.path.remove(folder)
    _LOADED[key] = module
    return module


def split_spec(spec: str, what: str) -> tuple[str, str]:
    """``'path/to/file.py:name'`` -> ``('path/to/file.py', 'name')``, or a PulsarError saying the form."""
    target, sep, name = str(spec).rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise PulsarError(f"{what}: {spec!r} is not 'path/to/file.py:function'; write the file, a colon and the "
                          "callable's name, e.g. my_data.py:samples")
    return target, name


def is_spec(value: object) -> bool:
    """True for strings of the form ``something.py:name`` (a plugin), false for plain paths."""
    if not isinstance(value, str):
        return False
    target, sep, name = value.rpartition(":")
    return bool(sep) and target.endswith(".py") and name.isidentifier()


def load_callable(spec: str, base_dir: Path, what: str) -> Callable[..., Any]:
    """The callable ``spec`` (``file.py:name``) names; a relative file resolves against ``base_dir``."""
    target, name = split_spec(spec, what)
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = Path(base_dir) / path
    module = load_module(path, what)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        hint = f" (it defines: {', '.join(found)})" if found else ""
        raise PulsarError(f"{what}: plugin {spec}: {target} has no {name!r}{hint}; define `def {name}(): ...` in it "
                          "or fix the name")
    if not callable(fn):
        raise PulsarError(f"{what}: plugin {spec} is a {type(fn).__name__}, not callable; make it a function")
    result: Callable[..., Any] = fn
    return result


def _identifier(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c == "_" else "_" for c in text)
    return cleaned[:40] or "plugin"
