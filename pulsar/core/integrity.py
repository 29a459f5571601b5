"""The compiled model's checksum: a bit flip anywhere in the file is an error, not a wrong answer.

Scheme (see the container description in :mod:`pulsar.core.container`): the writer serializes the
model without a checksum to bytes ``B`` and appends the serialized bytes of a tiny ``ModelProto``
whose only content is one ``metadata_props`` entry ``pulsar.checksum`` = ``sha256:<hex of sha256(B)>``.
Protobuf merges concatenated messages (a repeated field appends), so ``onnx.load`` and Netron read
the file as one model with one more metadata entry. The loader re-encodes that trailer from the
parsed value, checks that the raw file ends with it and hashes the bytes before it: no
re-serialization (which need not reproduce the writer's bytes) is involved.

A re-save by ``onnx.save`` keeps the file valid (the entry is the last field written); any edit of
the content makes the digest differ. Format 2 files written before checksums existed have no entry
and load unverified; from format 3 on the entry is mandatory, so a file cut just before its
checksum, or one whose entry was removed, is refused rather than run unverified.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import onnx

from pulsar.errors import PulsarError

log = logging.getLogger(__name__)

CHECKSUM_KEY = "pulsar.checksum"
_ALGORITHM = "sha256"


def _trailer(value: str) -> bytes:
    """The serialized one-entry ModelProto appended to the file."""
    tail = onnx.ModelProto()
    entry = tail.metadata_props.add()
    entry.key, entry.value = CHECKSUM_KEY, value
    data: bytes = tail.SerializeToString()
    return data


def digest(data: bytes | memoryview) -> str:
    return f"{_ALGORITHM}:{hashlib.sha256(data).hexdigest()}"


def sealed_bytes(model: onnx.ModelProto) -> bytes:
    """``model`` serialized with its checksum trailer (an existing checksum entry is replaced)."""
    if any(p.key == CHECKSUM_KEY for p in model.metadata_props):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        kept = [p for p in copy.metadata_props if p.key != CHECKSUM_KEY]
        del copy.metadata_props[:]
        copy.metadata_props.extend(kept)
        model = copy
    body: bytes = model.SerializeToString()
    return body + _trailer(digest(body))


def verify(path: Path, raw: bytes, model: onnx.ModelProto, *, required: bool = True) -> str | None:
    """Check ``raw`` (the file ``path``, parsed as ``model``) against its checksum and drop the entry
    from ``model``; returns the checksum, or None for a file written before checksums (only where
    ``required`` is false: a format that always has one)."""
    values: list[str] = [p.value for p in model.metadata_props if p.key == CHECKSUM_KEY]
    if not values and required:
        raise PulsarError(f"compiled model {path} has no checksum (pulsar ends every file of this format with "
                          "one): the file is truncated or was edited; rebuild it")
    if not values:
        log.debug("compiled model %s has no checksum (written before pulsar stored one); not verified", path)
        return None
    kept = [p for p in model.metadata_props if p.key != CHECKSUM_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    value = values[-1]
    trailer = _trailer(value)
    if len(values) > 1 or not value.startswith(f"{_ALGORITHM}:") or not raw.endswith(trailer):
        raise PulsarError(f"compiled model {path}: checksum mismatch (the checksum entry is damaged or the file "
                          "was edited after pulsar wrote it); the file is corrupt: rebuild it")
    actual = digest(memoryview(raw)[: len(raw) - len(trailer)])  # no copy of a large file
    if actual != value:
        raise PulsarError(f"compiled model {path}: checksum mismatch (stored {value[:19]}..., content "
                          f"{actual[:19]}...); the file is corrupt: rebuild it")
    return value
