"""The checked-in config classes (pulsar/config/generated.py) match the schema, and to_typed builds them."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

from pulsar.config import codegen, generated, load_build_config
from pulsar.config.generated import (
    AutoMixedPrecision,
    BuildConfig,
    CompilerConfig,
    CompilerOptions,
    ConstProcessor,
    InputProcessor,
    InputQuantConfig,
    LayerConfig,
    OnnxOptConfig,
    OpProcessor,
    QuantConfig,
    SubConfig,
)
from pulsar.config.model import to_dict, to_typed
from pulsar.config.schema import def_name, fill_defaults, is_object, load_schema, resolve

REPO = Path(__file__).resolve().parents[2]


def test_generated_classes_are_up_to_date(capsys):
    rc = codegen.main(["--check"])
    assert rc == 0, f"{capsys.readouterr().err.strip()}  (from {REPO}: `{codegen.REGENERATE}`)"


def _classes_and_nodes() -> list[tuple[type[Any], dict[str, Any]]]:
    """(generated class, resolved schema node) for every object node of the schema, found by walking it
    the way the generator names classes: $defs name, else property CamelCase + Config."""
    found: dict[str, dict[str, Any]] = {}

    def walk(node: dict[str, Any], name: str) -> None:
        node_r = resolve(node)
        if is_object(node_r):
            name = def_name(node) or name
            if name in found:
                return
            found[name] = node_r
            for prop, sub in node_r["properties"].items():
                walk(sub, codegen.camel(prop))
        elif node_r.get("type") == "array" and isinstance(node_r.get("items"), dict):
            walk(node_r["items"], name)

    walk(load_schema(), "BuildConfig")
    for name in load_schema()["$defs"]:
        walk({"$ref": f"#/$defs/{name}"}, name)
    return [(getattr(generated, name), node) for name, node in found.items()]


def test_every_schema_property_is_a_field_of_its_class_and_vice_versa():
    pairs = _classes_and_nodes()
    assert {"BuildConfig", "QuantConfig", "LayerConfig", "CompilerConfig", "SubConfig", "CompilerOptions",
            "InputProcessor", "SrcExtraShapesConfig"} <= {cls.__name__ for cls, _ in pairs}
    for cls, node in pairs:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
        fields = [f.name for f in dataclasses.fields(cls)]
        assert fields == list(node["properties"]), cls.__name__
        assert all(f.default is None for f in dataclasses.fields(cls)), cls.__name__
    assert {cls.__name__ for cls, _ in pairs} == {
        name for name, value in vars(generated).items()
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == generated.__name__}


def test_field_types_follow_the_schema():
    """None only where a field may be unset after the loader filled the defaults and validated."""
    hints = typing.get_type_hints(QuantConfig)
    assert hints["calibration_method"] == Literal["MinMax", "Percentile", "MSE", "KL", "ACIQ_Laplace", "ACIQ_Gauss",
                                                   "Std", "Mean", "WeightedScale", "InIR"]
    assert hints["calibration_percentile"] is float
    assert hints["transformer_opt_level"] is int
    assert hints["enable_smooth_quant"] is bool
    assert hints["device"] is str
    assert hints["layer_configs"] == tuple[LayerConfig, ...]
    assert hints["auto_mixed_precision"] is AutoMixedPrecision
    assert typing.get_type_hints(BuildConfig)["quant"] is QuantConfig
    assert typing.get_type_hints(BuildConfig)["target_hardware"] is str  # a built-in name or a file
    layer = typing.get_type_hints(LayerConfig)  # no defaults: each entry sets what it needs
    assert layer["layer_name"] == str | None
    assert layer["layer_names"] == tuple[str, ...] | None
    assert set(typing.get_args(layer["start_tensor_names"])) == {str, tuple[str, ...], type(None)}
    assert typing.get_type_hints(OpProcessor)["attrs"] == dict[str, Any]  # required, free-form
    assert typing.get_type_hints(ConstProcessor)["data"] == tuple[Any, ...] | None
    sub = typing.get_type_hints(SubConfig)  # x-inherit: unset options inherit from the compiler section
    assert sub["check"] == int | None and sub["start_tensor_names"] == tuple[str, ...]  # required
    assert typing.get_type_hints(CompilerConfig)["check"] is int
    assert issubclass(CompilerConfig, CompilerOptions)


def test_default_config_round_trips_through_the_typed_objects():
    eff = load_build_config({}, require_io=False)
    assert to_dict(to_typed(eff.data)) == eff.data
    data = fill_defaults({
        "input": "m.onnx",
        "quant": {"layer_configs": [{"op_types": ["Conv"], "data_type": "U16"},
                                    {"start_tensor_names": "a", "end_tensor_names": ["b"]}],
                  "input_configs": [{"tensor_name": "DEFAULT", "calibration_dataset": "d",
                                     "calibration_mean": [1.0, 2.0]}]},
        "input_processors": [{"tensor_name": "x", "src_extra_shapes": [{"shape": [1, 3, 8, 8]}]}],
        "op_processors": [{"op_name": "n", "attrs": {"axis": [1, 2]}}],
        "compiler": {"sub_configs": [{"start_tensor_names": ["a"], "end_tensor_names": ["b"], "check": 1}]},
    })
    assert to_dict(to_typed(data)) == data


def _none_where_typed_not_none(obj: Any, path: str = "cfg") -> list[str]:
    """Fields whose annotation leaves out None but that hold None (the generated types would lie)."""
    if isinstance(obj, tuple):
        return [p for i, v in enumerate(obj) for p in _none_where_typed_not_none(v, f"{path}[{i}]")]
    if not dataclasses.is_dataclass(obj):
        return []
    hints = typing.get_type_hints(type(obj))
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and type(None) not in typing.get_args(hints[f.name]):
            out.append(f"{path}.{f.name}")
        out += _none_where_typed_not_none(value, f"{path}.{f.name}")
    return out


def test_fields_typed_without_none_are_always_set_by_the_loader():
    eff = load_build_config({"quant": {"layer_configs": [{"op_type": "Conv", "weight_data_type": "S8"}],
                                       "input_configs": [{"tensor_name": "DEFAULT", "calibration_dataset": "d"}]},
                             "input_processors": [{"tensor_name": "x", "src_extra_shapes": [{"shape": [1, 3]}]}],
                             "output_processors": [{"tensor_name": "y"}],
                             "const_processors": [{"name": "c", "data": [1.0]}],
                             "op_processors": [{"op_name": "n", "attrs": {"axis": 1}}],
                             "compiler": {"sub_configs": [{"start_tensor_names": ["a"], "end_tensor_names": ["b"]}]}},
                            require_io=False)
    assert _none_where_typed_not_none(eff.cfg) == []
    for name in ("mobilenetv2", "ocr_rec"):
        eff = load_build_config(REPO / "configs" / f"{name}.json", require_io=False)
        assert _none_where_typed_not_none(eff.cfg) == [], name


def test_to_typed_builds_the_generated_classes():
    cfg = load_build_config({"quant": {"layer_configs": [{"layer_name": "conv1", "data_type": "U16"}],
                                       "input_configs": [{"tensor_name": "DEFAULT", "calibration_dataset": "d"}]},
                             "input_processors": [{"tensor_name": "x", "src_extra_shapes": [{"shape": [1, 3]}]}],
                             "compiler": {"sub_configs": [{"start_tensor_names": ["a"], "end_tensor_names": ["b"]}]}},
                            require_io=False).cfg
    assert isinstance(cfg, BuildConfig)
    assert isinstance(cfg.onnx_opt, OnnxOptConfig)
    assert isinstance(cfg.quant, QuantConfig) and isinstance(cfg.quant.auto_mixed_precision, AutoMixedPrecision)
    assert cfg.quant.calibration_method == "MinMax"
    (lc,) = cfg.quant.layer_configs or ()
    assert isinstance(lc, LayerConfig) and lc.layer_name == "conv1" and lc.layer_names is None
    assert isinstance(cfg.quant.input_configs, tuple) and isinstance(cfg.quant.input_configs[0], InputQuantConfig)
    (proc,) = cfg.input_processors or ()
    assert isinstance(proc, InputProcessor) and isinstance(proc.src_extra_shapes, tuple)
    assert isinstance(proc.src_extra_shapes[0], generated.SrcExtraShapesConfig)
    assert proc.src_extra_shapes[0].shape == (1, 3)
    assert isinstance(cfg.compiler, CompilerConfig)
    (sub,) = cfg.compiler.sub_configs or ()
    # the loader completes each range with the options it inherits (build_config.json shows them)
    assert isinstance(sub, SubConfig) and sub.start_tensor_names == ("a",) and sub.check == cfg.compiler.check
    assert sub.npu_perf is None  # a whole-model option: never per range


def test_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "generated.py"
    stale.write_text(codegen.render().replace("    layer_name: str | None = None\n", ""))
    monkeypatch.setattr(codegen, "GENERATED", stale)
    assert codegen.main(["--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and codegen.REGENERATE in err[0]
    assert codegen.main([]) == 0 and codegen.main(["--check"]) == 0  # rewritten
