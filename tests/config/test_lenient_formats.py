"""Configs as people write them: JSON with comments and trailing commas, JSON5, and prototxt.

Every format keeps what the strict readers guarantee: a key given twice and an over-long integer are
reported with their path, and a syntax error is one line naming the file, line and column.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pulsar.config import ConfigError, load_build_config
from pulsar.config.loader import MAX_JSON5_BYTES, read_config_file
from pulsar.errors import PulsarError

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO.parent / "shared" / "seeds" / "003_fe9345fab6aec8b5.txt"

# Written for these tests: a two-input detector config the way it tends to be hand-edited.
LENIENT_JSON = """\
{
  // where the model comes from
  "model_type": "ONNX",
  "npu_mode": "NPU2",   # two cores
  "quant": {
    "input_configs": [
      {
        "tensor_name": "frames",
        "calibration_dataset": "data/frames.tar",  # 64 clips
        "calibration_format": "Numpy",
        "calibration_size": 64,
      },
      {"tensor_name": "DEFAULT", "calibration_dataset": "data/rest/", "calibration_format": "Binary",},
    ],
    /* MSE did better than MinMax
       on the night-time clips */
    "calibration_method": "MSE",
    "layer_configs": [{"op_types": ["Softmax", "Sigmoid",], "data_type": "U16",},],
  },
  "compiler": {"check": 0, "static_batch_sizes": [1, 2, 4,],},
}
"""

EXPECTED = {
    "model_type": "ONNX", "npu_mode": "NPU2",
    "quant": {"input_configs": [{"tensor_name": "frames", "calibration_dataset": "data/frames.tar",
                                 "calibration_format": "Numpy", "calibration_size": 64},
                                {"tensor_name": "DEFAULT", "calibration_dataset": "data/rest/",
                                 "calibration_format": "Binary"}],
              "calibration_method": "MSE",
              "layer_configs": [{"op_types": ["Softmax", "Sigmoid"], "data_type": "U16"}]},
    "compiler": {"check": 0, "static_batch_sizes": [1, 2, 4]},
}

# The same config in protobuf text format, with every way prototxt writes a list.
PROTOTXT = """\
# where the model comes from
model_type: ONNX
npu_mode: NPU2  # two cores
quant {
  input_configs {
    tensor_name: "frames"
    calibration_dataset: 'data/frames.tar'
    calibration_format: Numpy
    calibration_size: 64
  }
  input_configs: { tensor_name: "DEFAULT" calibration_dataset: "data/rest/" calibration_format: Binary }
  calibration_method: MSE
  layer_configs { op_types: "Softmax" op_types: "Sigmoid"; data_type: U16 }
}
compiler { check: 0, static_batch_sizes: [1, 2], static_batch_sizes: 4 }
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _error(path: Path) -> str:
    with pytest.raises(PulsarError) as e:
        load_build_config(path, require_io=False)
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_json_with_comments_and_trailing_commas_reads_fast(tmp_path):
    path = _write(tmp_path, "c.json", LENIENT_JSON)
    assert read_config_file(path) == EXPECTED
    eff = load_build_config(path, require_io=False)
    assert eff.cfg.quant.layer_configs[0].op_types == ("Softmax", "Sigmoid")


def test_json5_syntax_is_read_and_keeps_duplicate_and_huge_int_checks(tmp_path):
    path = _write(tmp_path, "c.json", "{npu_mode: 'NPU2', quant: {calibration_method: 'KL', "
                                      "finetune_epochs: 0x10, enable_lsq: true}, compiler: {check: +1}}")
    eff = load_build_config(path, require_io=False)
    assert (eff.cfg.npu_mode, eff.cfg.quant.calibration_method, eff.cfg.quant.finetune_epochs,
            eff.cfg.compiler.check) == ("NPU2", "KL", 16, 1)
    path = _write(tmp_path, "dup.json", "{quant: {calibration_method: 'KL', calibration_method: 'MSE'}}")
    with pytest.raises(ConfigError, match=r"quant\.calibration_method: duplicate key"):
        load_build_config(path, require_io=False)
    path = _write(tmp_path, "huge.json", "{compiler: {check: " + "9" * 40 + ",},}")
    with pytest.raises(ConfigError, match="compiler.check: an integer with 40 digits"):
        load_build_config(path, require_io=False)


@pytest.mark.parametrize(("text", "where"), [
    ('{\n  "npu_mode": "NPU1",\n  "quant": {"calibration_method" "MSE"}\n}\n', "line 3 column"),
    ('{\n  "npu_mode": "NPU1",,\n}\n', "line 2 column"),
    ("{\n  npu_mode: 'NPU1\n}\n", "line 2 column"),
    ('{"a": {,}}', "line 1 column"),
])
def test_json_syntax_errors_are_one_line_with_line_and_column(tmp_path, text, where):
    msg = _error(_write(tmp_path, "c.json", text))
    assert msg.startswith(f"{tmp_path / 'c.json'}: invalid JSON at {where}"), msg


def test_large_json_is_not_handed_to_the_slow_json5_reader(tmp_path):
    filler = ", ".join(["0.5"] * (MAX_JSON5_BYTES // 4))
    path = _write(tmp_path, "c.json", '{"const_processors": [{name: "w", "data": [' + filler + "]}]}")
    msg = _error(path)
    assert "invalid JSON at line 1 column 24: Expecting property name enclosed in double quotes" in msg


def test_prototxt_config_reads_like_its_json(tmp_path):
    path = _write(tmp_path, "c.prototxt", PROTOTXT)
    assert read_config_file(path) == EXPECTED
    eff = load_build_config(path, require_io=False)
    assert eff.cfg.compiler.static_batch_sizes == (1, 2, 4)


def test_prototxt_lists_follow_the_schema(tmp_path):
    """A key whose schema type is array is a list even when given once; nested messages in lists;
    the boolean and number words of protobuf where the schema wants them."""
    text = """
    quant { input_configs { tensor_name: "x" calibration_dataset: "d" calibration_mean: 0.5 calibration_std: 2 }
            enable_smooth_quant: t  transformer_opt_level: 1 }
    input_processors { tensor_name: "x" src_extra_shapes { shape: [1, 3, 32, 32] } src_extra_shapes { shape: 1
                       shape: 3 shape: 64 shape: 64 } padding: [1, 1, 1, 1] padding_constant_value: -inf }
    op_processors { op_name: "pool" attrs { ceil_mode: 1 pads: 0 pads: 0 } }
    const_processors { name: "shape" data: [-1, 96, 48] }
    """
    data = read_config_file(_write(tmp_path, "c.prototxt", text))
    assert data["quant"]["input_configs"] == [{"tensor_name": "x", "calibration_dataset": "d",
                                               "calibration_mean": [0.5], "calibration_std": [2]}]
    assert data["quant"]["enable_smooth_quant"] is True
    shapes = data["input_processors"][0]["src_extra_shapes"]
    assert shapes == [{"shape": [1, 3, 32, 32]}, {"shape": [1, 3, 64, 64]}]
    assert data["input_processors"][0]["padding_constant_value"] == float("-inf")
    assert data["op_processors"] == [{"op_name": "pool", "attrs": {"ceil_mode": 1, "pads": [0, 0]}}]
    assert data["const_processors"] == [{"name": "shape", "data": [-1, 96, 48]}]


@pytest.mark.parametrize(("text", "needle"), [
    ("npu_mode: NPU1\nquant {\n  calibration_method: MSE\n", "line 4 column 1: missing '}' before the end"),
    ('quant {\n  input_configs { tensor_name: "x }\n}\n', "line 2 column 32: a string without its closing quote"),
    ("compiler { check: 1 static_batch_sizes: [1, 2 }\n", "line 1 column 47: expected ',' or ']' in a list, got '}'"),
    ("quant { device: cuda:0 }\n", "line 1 column 21: expected a field name, got ':'"),
    ("compiler { check 1 }\n", "line 1 column 18: expected ':' or '{' after 'check'"),
    ('{ "npu_mode": "NPU1" }\n', "line 1 column 1: expected a field name, got '{'"),
    ("quant { finetune_lr: 1.2.3 }\n", "'1.2.3' is not a number"),
])
def test_prototxt_syntax_errors_are_one_line_with_line_and_column(tmp_path, text, needle):
    msg = _error(_write(tmp_path, "c.prototxt", text))
    assert msg.startswith(f"{tmp_path / 'c.prototxt'}: invalid prototxt at "), msg
    assert needle in msg, msg


def test_prototxt_duplicates_and_huge_ints_are_reported_by_path(tmp_path):
    path = _write(tmp_path, "c.prototxt", "npu_mode: NPU1\ncompiler { check: 1 }\nnpu_mode: NPU2\n")
    with pytest.raises(ConfigError, match=r"npu_mode: duplicate key \(line 3\)"):
        load_build_config(path, require_io=False)
    path = _write(tmp_path, "h.prototxt", "compiler { check: " + "7" * 31 + " }\n")
    with pytest.raises(ConfigError, match="compiler.check: an integer with 31 digits"):
        load_build_config(path, require_io=False)
    path = _write(tmp_path, "n.prototxt", "x { " * 40 + "}" * 40)
    assert "nested more than 32 levels deep" in _error(path)


# -- the config examples printed in pulsar2's guide ---------------------------------------------------

def _guide_blocks() -> list[tuple[int, str]]:
    """(line, text) of every ``{ ... }`` block of the guide that starts at the top level of a page
    (not one inside a printed ``"key": [`` fragment), as printed; a block whose closing braces the
    guide never prints ends at the prose that follows it."""
    lines = GUIDE.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        before = lines[i - 1].rstrip() if i else ""
        if lines[i].strip() != "{" or before.endswith(("[", "{", ",")):
            i += 1
            continue
        j, depth = i, 0
        while j < len(lines) and _printed_json(lines[j]):
            depth += _braces(lines[j])
            if depth == 0:
                break
            j += 1
        end = j + 1 if depth == 0 else j
        blocks.append((i + 1, "\n".join(lines[i:end])))
        i = end
    return blocks


def _printed_json(line: str) -> bool:
    s = line.strip()
    return s[:1] in ('"', "{", "}", "[", "]", "#") or s == "..." or bool(re.match(r"-?[0-9.]", s))


def _braces(line: str) -> int:
    code = re.sub(r"#.*", "", re.sub(r'"(?:\\.|[^"\\])*"', '""', line))
    return code.count("{") - code.count("}")


@pytest.mark.skipif(not GUIDE.is_file(), reason="needs ../shared (pulsar2's guide)")
def test_every_config_printed_in_the_pulsar2_guide_validates(tmp_path):
    """Each example is validated as printed (``#`` comments, trailing commas and all), with three
    exceptions the guide itself makes: lines ``...`` mark an excerpt and are removed; a block whose
    closing braces are not printed gets them; a block of quant fields (the layer_configs examples)
    is an excerpt of the quant section and is validated inside ``{"quant": ...}``."""
    from pulsar.config.schema import load_schema, resolve

    blocks = _guide_blocks()
    assert len(blocks) >= 15, [line for line, _ in blocks]
    top = set(load_schema()["properties"])
    quant = set(resolve(load_schema()["$defs"]["QuantConfig"])["properties"])
    for line, text in blocks:
        body = "\n".join(ln for ln in text.splitlines() if ln.strip() != "...")
        body += "\n}" * sum(_braces(ln) for ln in body.splitlines())
        path = _write(tmp_path, f"guide_{line}.json", body)
        keys = set(read_config_file(path))
        if not keys <= top and keys <= quant:
            path = _write(tmp_path, f"guide_{line}_quant.json", '{"quant":\n' + body + "\n}")
        try:
            load_build_config(path, require_io=False)
        except PulsarError as e:
            raise AssertionError(f"the guide's config at line {line} is refused: {e}") from None


def test_guide_style_json_example_of_our_own(tmp_path):
    """A pulsar2-guide-style config (comments after values, a trailing comma before }) without the guide."""
    text = ('{\n"quant": {\n"input_configs": [\n{\n"tensor_name": "DEFAULT",\n"calibration_dataset": "c.tar",\n'
            '"calibration_format": "Binary", # tensors as the model takes them\n"calibration_size": 16, # few\n}\n],\n'
            '"calibration_method": "MinMax",\n},\n"compiler": {"check": 0} # off\n}\n')
    eff = load_build_config(_write(tmp_path, "c.json", text), require_io=False)
    assert eff.cfg.quant.input_configs[0].calibration_size == 16
    assert json.loads(json.dumps(eff.data))["compiler"]["check"] == 0
