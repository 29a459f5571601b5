"""A real compiled file: checksum (bit flips, re-saves, older files), readable metadata values, and the
loader's validation of options, kinds, metadata and dataflow (tampered files with a valid checksum)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import pulsar
from pulsar.config.schema import load_schema, resolve
from pulsar.core.container import load_compiled
from pulsar.core.container_schema import SUB_CONFIG_KEY, decode_value, encode_value, option_schemas
from pulsar.core.integrity import CHECKSUM_KEY, sealed_bytes
from pulsar.errors import PulsarError
from pulsar.runtime import Session


@pytest.fixture(scope="module")
def compiled(tiny, tmp_path_factory) -> Path:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]}}
    return pulsar.build(tiny["model"], tmp_path_factory.mktemp("integrity") / "out", cfg, quiet=True).compiled_model


@pytest.fixture
def copy(compiled, tmp_path) -> Path:
    dest = tmp_path / "model.pulsar"
    dest.write_bytes(compiled.read_bytes())
    return dest


def _props(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _tamper(path: Path, fn: Callable[[onnx.ModelProto], None]) -> None:
    """Edit the file and seal it again, so only the structure checks can notice."""
    model = onnx.load(str(path))
    fn(model)
    path.write_bytes(sealed_bytes(model))


def _load_error(path: Path) -> str:
    with pytest.raises(PulsarError) as exc:
        load_compiled(path)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def _set_prop(key: str, value: str) -> Callable[[onnx.ModelProto], None]:
    def fn(model: onnx.ModelProto) -> None:
        for p in model.metadata_props:
            if p.key == key:
                p.value = value
                return
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    return fn


def _set_attr(node_kind: str, attr: str, value: bytes) -> Callable[[onnx.ModelProto], None]:
    def fn(model: onnx.ModelProto) -> None:
        node = next(n for n in model.graph.node if n.domain == f"pulsar.{node_kind}")
        next(a for a in node.attribute if a.name == attr).s = value
    return fn


# ----------------------------------------------------------------------------- checksum


def test_file_ends_with_its_checksum_and_standard_tools_read_it(compiled):
    raw = compiled.read_bytes()
    model = onnx.load(str(compiled))
    value = _props(model)[CHECKSUM_KEY]
    assert value.startswith("sha256:") and len(value) == len("sha256:") + 64
    onnx.checker.check_model(model)
    loaded = load_compiled(compiled)
    assert CHECKSUM_KEY not in _props(loaded.model)  # verified and dropped: never a stale copy
    assert "checksum" not in loaded.metadata
    assert raw.endswith(value.encode())


def test_bit_flip_in_a_weight_is_a_checksum_error(copy):
    model = onnx.load(str(copy))
    weight = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    assert len(weight.raw_data) >= 64
    raw = bytearray(copy.read_bytes())
    offset = raw.find(weight.raw_data)
    assert offset > 0
    raw[offset + len(weight.raw_data) // 2] ^= 0x10
    copy.write_bytes(bytes(raw))
    parsed = onnx.load(str(copy))  # still a well-formed model: only the checksum can tell
    assert numpy_helper.to_array(next(t for t in parsed.graph.initializer if t.name == weight.name)).shape
    msg = _load_error(copy)
    assert "checksum mismatch" in msg and "corrupt" in msg and "rebuild" in msg


def test_damaged_checksum_entry_is_an_error(copy):
    raw = bytearray(copy.read_bytes())
    raw[-3] = ord("0") if raw[-3] != ord("0") else ord("1")  # a hex digit of the stored digest
    copy.write_bytes(bytes(raw))
    assert "checksum mismatch" in _load_error(copy)


def test_resaved_by_onnx_still_loads(copy):
    onnx.save(onnx.load(str(copy)), str(copy))
    assert load_compiled(copy).subgraphs


def test_edited_without_resealing_is_a_checksum_error(copy):
    model = onnx.load(str(copy))
    _set_prop("pulsar.npu_mode", "NPU4")(model)
    onnx.save(model, str(copy))
    assert "checksum mismatch" in _load_error(copy)


def _without_checksum(path: Path, format_version: str | None = None) -> onnx.ModelProto:
    model = onnx.load(str(path))
    kept = [p for p in model.metadata_props if p.key != CHECKSUM_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if format_version is not None:
        _set_prop("pulsar.format_version", format_version)(model)
    return model


def test_format_2_file_without_checksum_loads_unverified(copy, caplog):
    copy.write_bytes(_without_checksum(copy, "2").SerializeToString())  # what pulsar wrote before checksums
    with caplog.at_level(logging.DEBUG, logger="pulsar"):
        loaded = load_compiled(copy)
    assert loaded.metadata["target_hardware"] == "VNPU-M" and loaded.checksum is None
    assert "no checksum" in caplog.text


def test_format_3_file_without_checksum_is_refused(copy):
    """From format 3 on the checksum is mandatory: a file cut just before it, or whose entry was removed
    and whose weights were then changed, is refused, not run unverified."""
    raw = copy.read_bytes()
    body = _without_checksum(copy).SerializeToString()
    assert raw.startswith(body) and len(raw) > len(body)  # the trailer is all that follows the body
    copy.write_bytes(body)
    msg = _load_error(copy)
    assert "has no checksum" in msg and "truncated or was edited" in msg and "rebuild" in msg
    weight = max(onnx.load(str(copy)).graph.initializer, key=lambda t: len(t.raw_data)).raw_data
    flipped = bytearray(body)
    flipped[flipped.find(weight) + len(weight) // 2] ^= 0x04
    copy.write_bytes(bytes(flipped))
    assert "has no checksum" in _load_error(copy)


def test_what_cannot_be_a_model_is_refused_before_it_is_read(tmp_path):
    """A sparse 6 GiB file (beyond protobuf's 2 GiB) and one that does not start with a ModelProto
    field are named without reading them whole (a read of 6 GiB would run out of memory)."""
    big = tmp_path / "big.pulsar"
    with open(big, "wb") as f:
        f.truncate(6 << 30)
    msg = _load_error(big)
    assert "is 6.0 GiB" in msg and "more than the 2 GiB" in msg
    zeros = tmp_path / "zeros.pulsar"
    zeros.write_bytes(bytes(4096))
    assert "does not start like an ONNX model: first bytes 00 00 00 00" in _load_error(zeros)
    text = tmp_path / "text.pulsar"
    text.write_text("hello")
    assert "truncated or corrupt" in _load_error(text)


# ----------------------------------------------------------------------------- metadata values


def test_strings_are_stored_plainly_and_structured_values_as_json(compiled):
    props = _props(onnx.load(str(compiled)))
    assert props["pulsar.target_hardware"] == "VNPU-M" and props["pulsar.npu_mode"] == "NPU1"
    assert json.loads(props["pulsar.inputs"]) == [{"name": "image", "dtype": "float32", "shape": [1, 3, 16, 16]}]
    meta = load_compiled(compiled).metadata
    assert meta["target_hardware"] == "VNPU-M" and isinstance(meta["estimate"]["cycles"], int)


@pytest.mark.parametrize("value", ["VNPU-M", "123", "true", "null", '"quoted"', " 5", "NaN", "", "a\nb",
                                   5, 2.5, True, None, [1, "x"], {"a": [1, 2]}])
def test_metadata_value_round_trip(value):
    assert decode_value(encode_value(value)) == value
    if isinstance(value, str):
        assert decode_value(json.dumps(value)) == value  # the old encoding reads back the same


def test_old_json_encoded_metadata_still_loads(copy):
    def requote(model: onnx.ModelProto) -> None:
        for p in model.metadata_props:
            if p.key in ("pulsar.target_hardware", "pulsar.npu_mode", "pulsar.config_hash"):
                p.value = json.dumps(p.value)

    _tamper(copy, requote)
    assert _props(onnx.load(str(copy)))["pulsar.target_hardware"] == '"VNPU-M"'
    meta = load_compiled(copy).metadata
    assert meta["target_hardware"] == "VNPU-M" and meta["npu_mode"] == "NPU1"


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("edit", "needles"), [
    (_set_attr("npu", "options", b'{"lut_items_in_bits": 10, "turbo": true}'), ("npu_0", "unknown option 'turbo'")),
    (_set_attr("npu", "options", b'{"lut_items_in_bits": "ten"}'),
     ("npu_0", "option lut_items_in_bits", "'ten' is not an integer")),
    (_set_attr("npu", "options", b'{"lut_items_in_bits": 99}'), ("option lut_items_in_bits", "at most 16")),
    (_set_attr("npu", "options", b'{"check_mode": "Sometimes"}'), ("option check_mode", "is not one of")),
    (_set_attr("npu", "options", b'{"lut_items_in_bits": 10'), ("npu_0", "options are not valid JSON")),
    (_set_attr("npu", "options", b'[1, 2]'), ("npu_0", "is not a mapping")),
    (_set_attr("npu", "options", b'\xff\xfe'), ("npu_0", "'options' is not UTF-8")),
    (_set_attr("npu", "kind", b"cpu"), ("npu_0", "kind 'cpu'", "expected a NpuSubgraph of kind 'npu'")),
    (_set_attr("cpu", "kind", b"gpu"), ("kind 'gpu'", "of kind 'cpu'")),
    (_set_prop("pulsar.inputs", "not json"), ("metadata pulsar.inputs", "is not a list")),
    (_set_prop("pulsar.inputs", '[{"name": "image", "shape": [1, 3, 16, 16]}]'),
     ("metadata pulsar.inputs[0]", "missing key 'dtype'")),
    (_set_prop("pulsar.inputs", '[{"name": "image", "dtype": "float99", "shape": [1, 3, 16, 16]}]'),
     ("pulsar.inputs[0].dtype", "not a numpy dtype")),
    (_set_prop("pulsar.inputs", '[{"name": "img", "dtype": "float32", "shape": [1, 3, 16, 16]}]'),
     ("pulsar.inputs", "does not describe the model's inputs", "'image'")),
    (_set_prop("pulsar.outputs", '[{"name": "logits", "dtype": "float32", "shape": [1, -10]}]'),
     ("pulsar.outputs[0].shape[1]", "not a dimension")),
    (_set_prop("pulsar.estimate", '{"cycles": "many"}'), ("pulsar.estimate.cycles", "not an integer")),
    (_set_prop("pulsar.target_hardware", "[1]"), ("pulsar.target_hardware", "is not a string")),
    (_set_prop("pulsar.cpu_fallbacks", '[{"node": "x"}]'), ("pulsar.cpu_fallbacks[0]", "missing key 'op_type'")),
])
def test_tampered_file_with_valid_checksum_is_refused(copy, edit, needles):
    _tamper(copy, edit)
    load = onnx.load(str(copy))  # the checksum is right: the structure checks must catch it
    assert CHECKSUM_KEY in _props(load)
    msg = _load_error(copy)
    assert "checksum" not in msg
    for needle in needles:
        assert needle in msg, msg
    with pytest.raises(PulsarError):
        Session(copy)  # the same one line, never a KeyError later


def test_dataflow_is_checked(copy):
    def rewire(model: onnx.ModelProto) -> None:
        node = model.graph.node[-1]
        node.input[0] = "nowhere"

    _tamper(copy, rewire)
    assert "reads 'nowhere', which no model input or earlier subgraph provides" in _load_error(copy)


def test_unknown_graph_input_type_is_checked(copy):
    _tamper(copy, lambda m: setattr(m.graph.input[0].type.tensor_type, "elem_type", 77))
    assert "model input 'image' has unknown element type 77" in _load_error(copy)


def test_newer_format_with_valid_checksum(copy):
    _tamper(copy, _set_prop("pulsar.format_version", "4"))
    assert "newer pulsar (format 4" in _load_error(copy)


def test_caller_metadata_is_free_but_known_keys_are_typed(tmp_path, compiled):
    loaded = load_compiled(compiled)
    from pulsar.core.container import package

    common = dict(inputs=list(loaded.model.graph.input), outputs=list(loaded.model.graph.output),
                  opset_imports=list(loaded.model.opset_import))
    path = package(loaded.subgraphs, **common, metadata={"my_notes": {"any": ["json", 1]}, "npu_mode": "NPU2"},
                   path=tmp_path / "ok.pulsar")
    assert load_compiled(path).metadata == {"my_notes": {"any": ["json", 1]}, "npu_mode": "NPU2"}
    with pytest.raises(ValueError, match="pulsar.npu_mode: 2 is not a string"):
        package(loaded.subgraphs, **common, metadata={"npu_mode": 2}, path=tmp_path / "bad.pulsar")
    loaded.subgraphs[0].options = {"lut_bits": 8}
    with pytest.raises(ValueError, match="unknown option 'lut_bits'"):
        package(loaded.subgraphs, **common, metadata={}, path=tmp_path / "bad.pulsar")
    assert not (tmp_path / "bad.pulsar").exists()


def test_loaded_model_runs_like_the_original(copy, compiled):
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    onnx.save(onnx.load(str(copy)), str(copy))
    np.testing.assert_array_equal(Session(copy).run({"image": x})["logits"], Session(compiled).run({"image": x})["logits"])


def test_subgraph_options_are_the_build_configs_compiler_options():
    """core reads the build-config schema file itself (it imports no stage); it must see what the config stage sees."""
    props = resolve(load_schema()["$defs"]["CompilerOptions"])["properties"]
    want = {k: {key: v for key, v in resolve(s).items() if key not in ("default", "description")}
            for k, s in props.items()}
    got = option_schemas()
    assert {k: v for k, v in got.items() if k != SUB_CONFIG_KEY} == want
    assert "lut_items_in_bits" in got and SUB_CONFIG_KEY in got
