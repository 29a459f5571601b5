"""Integer limits and type errors: every integer field has a maximum the schema checks (so 10**20
is one line, not a traceback deep in the build), shapes are bounded before anything is built, and a
value of the wrong type is reported as that, before any rule that combines fields."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pulsar.config import ConfigError, load_build_config
from pulsar.config.schema import load_schema


def _integer_nodes(node: Any, path: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        types = node.get("type")
        if types == "integer" or (isinstance(types, list) and "integer" in types):
            yield path, node
        for key, value in node.items():
            yield from _integer_nodes(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _integer_nodes(value, f"{path}/{i}")


def test_every_integer_field_has_a_maximum_that_fits_int32():
    nodes = list(_integer_nodes(load_schema()))
    assert len(nodes) >= 16
    for path, node in nodes:
        assert isinstance(node.get("maximum"), int), path
        assert node["maximum"] <= 2**31 - 1, path
        assert node.get("minimum", 0) >= -(2**31), path


BIG = 10**25  # fits the 30-digit limit of the parsers, not int64


@pytest.mark.parametrize(("config", "where"), [
    ({"quant": {"auto_mixed_precision": {"enable": True, "num_samples": 10**20}}},
     "quant.auto_mixed_precision.num_samples"),
    ({"quant": {"auto_mixed_precision": {"max_16bit_layers": BIG}}}, "quant.auto_mixed_precision.max_16bit_layers"),
    ({"quant": {"enable_lsq": True, "finetune_epochs": BIG}}, "quant.finetune_epochs"),
    ({"quant": {"finetune_block_size": BIG}}, "quant.finetune_block_size"),
    ({"quant": {"finetune_batch_size": BIG}}, "quant.finetune_batch_size"),
    ({"quant": {"transformer_opt_level": BIG}}, "quant.transformer_opt_level"),
    ({"quant": {"check": BIG}}, "quant.check"),
    ({"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": "d", "calibration_size": BIG}]}},
     "quant.input_configs[0].calibration_size"),
    ({"evaluation": {"input_configs": [{"tensor_name": "x", "calibration_dataset": "d", "calibration_size": BIG}]}},
     "evaluation.input_configs[0].calibration_size"),
    ({"compiler": {"static_batch_sizes": [BIG]}}, "compiler.static_batch_sizes[0]"),
    ({"compiler": {"max_dynamic_batch_size": BIG}}, "compiler.max_dynamic_batch_size"),
    ({"compiler": {"check": BIG}}, "compiler.check"),
    ({"compiler": {"lut_items_in_bits": BIG}}, "compiler.lut_items_in_bits"),
    ({"compiler": {"sub_configs": [{"start_tensor_names": ["a"], "end_tensor_names": ["b"],
                                    "static_batch_sizes": [BIG]}]}}, "compiler.sub_configs[0].static_batch_sizes[0]"),
    ({"input_processors": [{"tensor_name": "x", "src_extra_shapes": [{"shape": [1, 3, BIG, 8]}]}]},
     "input_processors[0].src_extra_shapes[0].shape[2]"),
    ({"input_processors": [{"tensor_name": "x", "padding": [BIG, 0, 0, 0]}]}, "input_processors[0].padding[0]"),
    ({"input_processors": [{"tensor_name": "x", "slicing": [0, BIG, 0, 0]}]}, "input_processors[0].slicing[1]"),
    ({"output_processors": [{"tensor_name": "x", "dst_perm": [0, BIG]}]}, "output_processors[0].dst_perm[1]"),
])
def test_integers_beyond_their_maximum_are_one_problem(config, where):
    with pytest.raises(ConfigError) as e:
        load_build_config(config, require_io=False)
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith(f"{where}: "), e.value.problems
    assert "is out of range; it must be at most" in e.value.problems[0]


def test_a_shape_group_is_bounded_by_memory_and_input_shapes_by_int32():
    with pytest.raises(ConfigError) as e:
        load_build_config({"input_processors": [{"tensor_name": "x", "src_extra_shapes": [
            {"shape": [1, 3, 224, 224]}, {"shape": [16, 3, 65536, 65536]}]}]}, require_io=False)
    assert e.value.problems == ["input_processors[0].src_extra_shapes[1].shape: [16, 3, 65536, 65536] holds more "
                                "than 1,073,741,824 values (4 GiB as float32, the most a shape group may take); "
                                "give a smaller shape"]
    with pytest.raises(ConfigError) as e:
        load_build_config({"input_shapes": "a:1x3;b:1x" + "9" * 25}, require_io=False)
    assert e.value.problems == [f"input_shapes: input 'b' has a dim {'9' * 25}; a dim is at most 2,147,483,647"]
    load_build_config({"input_shapes": "x:1x3x2147483647"}, require_io=False)  # the largest dim is fine


@pytest.mark.parametrize(("config", "problem"), [
    ({"compiler": "fast"}, "compiler: 'fast' is a string, expected a mapping"),
    ({"compiler": ["fast"], "quant": {"calibration_method": "KL"}}, "compiler: [\"fast\"] is a list, expected a mapping"),
    ({"quant": 3}, "quant: 3 is an integer, expected a mapping"),
    ({"input_processors": [{"tensor_name": "x", "src_extra_shapes": [[1, 3, 256, 256]]}]},
     'input_processors[0].src_extra_shapes[0]: [1, 3, 256, 256] is a list, expected a mapping with key \'shape\' '
     '(write {"shape": [1, 3, 256, 256]})'),
    ({"input_processors": ["image"]},
     "input_processors[0]: 'image' is a string, expected a mapping with key 'tensor_name' (write "
     '{"tensor_name": "image"})'),
    ({"quant": {"layer_configs": ["Conv"]}}, "quant.layer_configs[0]: 'Conv' is a string, expected a mapping"),
    ({"const_processors": [5]}, "const_processors[0]: 5 is an integer, expected a mapping with key 'name' "
                                '(write {"name": 5})'),
])
def test_a_value_of_the_wrong_type_is_reported_as_such_and_alone(config, problem):
    """Not as a rule that combines fields of the section (``exclude each other``, ``exactly one
    selector``): those only make sense on a well-typed section."""
    with pytest.raises(ConfigError) as e:
        load_build_config(config, require_io=False)
    assert e.value.problems == [problem]


def test_type_errors_come_first_and_other_sections_are_still_checked():
    with pytest.raises(ConfigError) as e:
        load_build_config({"npu_mode": "NPU9", "compiler": "fast"}, require_io=False)
    assert e.value.problems[0] == "compiler: 'fast' is a string, expected a mapping"
    assert e.value.problems[1].startswith("npu_mode: 'NPU9' is not one of")
    assert len(e.value.problems) == 2
