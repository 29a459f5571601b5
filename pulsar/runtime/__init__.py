"""Run compiled models: the Session API and the tensor-file I/O of `pulsar run`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pulsar.runtime.session import Session, TensorInfo

__all__ = ["Session", "TensorInfo"]


def __getattr__(name: str) -> Any:
    # Lazy: `pulsar run` reports flag mistakes without paying for importing onnxruntime.
    if name in __all__:
        from pulsar.runtime import session

        return getattr(session, name)
    raise AttributeError(f"module 'pulsar.runtime' has no attribute {name!r}")
