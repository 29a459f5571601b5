"""Run compiled models: the Session API and the tensor-file I/O of `pulsar run`."""

from pulsar.runtime.session import Session, TensorInfo

__all__ = ["Session", "TensorInfo"]
