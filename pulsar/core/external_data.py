"""Write an ONNX model with its large tensors in a side file (ONNX external data), atomically.

Why: ``onnx_opt.save_tensors_data`` keeps the weights of the optimized model out of its protobuf.
A protobuf cannot exceed 2 GiB, and serializing a model copies every weight once more in memory;
with the tensors in ``<model>.data`` the graph file stays small and the serialized copy holds only
the graph. ``onnx.load`` and onnxruntime read the pair back from the model's folder.

Both files are written through :func:`pulsar.utils.atomic.atomic_path` (the data file first, so a
model file never names data that is not there yet).
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx.external_data_helper import set_external_data

from pulsar.utils.atomic import atomic_path, write_error

ALIGN = 4096      # tensor offsets in the data file (lets readers memory-map each tensor)
MIN_BYTES = 1024  # smaller tensors stay inside the model file


def save_with_external_data(model: onnx.ModelProto, path: str | Path, *, min_bytes: int = MIN_BYTES) -> list[Path]:
    """Write ``model`` to ``path`` with every initializer of at least ``min_bytes`` raw bytes in
    ``<path>.data``; returns the files written (the data file only when some tensor went there).
    ``model`` itself is not changed."""
    path = Path(path)
    data_name = f"{path.name}.data"
    out = onnx.ModelProto()
    out.CopyFrom(model)
    big = [t for t in out.graph.initializer if t.HasField("raw_data") and len(t.raw_data) >= min_bytes]
    written = []
    if big:
        with atomic_path(path.parent / data_name) as tmp:
            try:
                with open(tmp, "wb") as fh:
                    for t in big:
                        offset = -(-fh.tell() // ALIGN) * ALIGN
                        fh.write(b"\0" * (offset - fh.tell()))
                        fh.write(t.raw_data)
                        set_external_data(t, data_name, offset=offset, length=len(t.raw_data))
                        t.ClearField("raw_data")
                        t.data_location = onnx.TensorProto.EXTERNAL
            except OSError as exc:
                raise write_error(path.parent / data_name, exc) from None
        written.append(path.parent / data_name)
    with atomic_path(path) as tmp:
        try:
            tmp.write_bytes(out.SerializeToString())
        except OSError as exc:
            raise write_error(path, exc) from None
    return [path, *written]
