"""onnxruntime's refusals as user errors: one line naming the model, the node and the cause.

onnxruntime raises its own exception types (``Fail``, ``InvalidArgument``, ``RuntimeException`` ...)
with multi-line messages that name the node in one of two forms (``Node (name)`` when a model is
loaded, ``Name:'name'`` when a node fails while running). Every place that loads or runs a model in
onnxruntime goes through :func:`ort_guard`, so ``pulsar build``, ``pulsar run``, ``compiler.check``
and evaluation end in one ``error:`` line and exit code 2 instead of a traceback."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from pulsar.errors import PulsarError

_NODE = (re.compile(r"Name:\s*'([^']*)'"), re.compile(r"[Nn]ode \(([^)]*)\)"), re.compile(r"node '([^']+)'"))
_PREFIX = re.compile(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*")


def failed_node(message: str) -> str | None:
    """The node an onnxruntime error message names, if any."""
    for pattern in _NODE:
        m = pattern.search(message)
        if m and m.group(1):
            return m.group(1)
    return None


def cause(message: str) -> str:
    """The message without onnxruntime's status prefix, on one line."""
    text = " ".join(line.strip() for line in str(message).strip().splitlines() if line.strip())
    text = _PREFIX.sub("", text)
    m = re.search(r"Status Message:\s*(.*)", text)
    return (m.group(1) if m else text).strip() or "no message"


def ort_failure(exc: BaseException, what: str, fix: str) -> PulsarError:
    """A PulsarError for an onnxruntime exception raised while ``what`` (e.g. "running the QDQ model
    out/quant/quantized.onnx") happened: names the node when onnxruntime did, then the cause and ``fix``."""
    message = str(exc)
    node = failed_node(message)
    where = f" at node '{node}'" if node else ""
    return PulsarError(f"onnxruntime failed {what}{where}: {cause(message)}; {fix}")


def is_ort_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from onnxruntime (its exception classes live in its C++ bindings)."""
    module = type(exc).__module__ or ""
    return module.startswith("onnxruntime") or "[ONNXRuntimeError]" in str(exc)


@contextmanager
def ort_guard(what: str, fix: str) -> Iterator[None]:
    """Turn an onnxruntime exception raised inside the block into :func:`ort_failure`."""
    try:
        yield
    except PulsarError:
        raise
    except Exception as exc:  # onnxruntime raises its own exception types
        if not is_ort_error(exc):
            raise
        raise ort_failure(exc, what, fix) from exc
