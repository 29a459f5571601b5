"""Hostile inputs for `pulsar run`, `pulsar info` and compiled model files.

Every case runs the real command in a directory of its own and must fail cleanly (exit 2, one
``error:`` line naming the problem, no traceback, nothing created or changed in the case directory):
damaged, truncated, tampered (with a valid checksum) or newer-format model files, output directory
and list file problems, batch sizes, control characters in paths and wrong input files. The cases
run two at a time in a module fixture; the model is built once.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

import pulsar
from pulsar.core.integrity import CHECKSUM_KEY, sealed_bytes
from tests.hostile.harness import Case, Snapshot, assert_clean_failure, run_cli

SHAPE = (1, 3, 16, 16)


@dataclass(frozen=True)
class Env:
    model: Path  # the compiled tiny CNN (outside every case directory)
    onnx_model: Path  # its float source


Setup = Callable[[Path, Env], list[str]]


# --------------------------------------------------------------------------- helpers


def _run(model: str | Path, *extra: str) -> list[str]:
    return ["run", "--model", str(model), "--output_dir", "out", *extra]


def _sample(folder: Path, value: np.ndarray | None = None, name: str = "image.npy") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32) if value is None else value
    np.save(folder / name, x)
    return folder


def _copy(d: Path, env: Env) -> Path:
    dest = d / "m.pulsar"
    shutil.copyfile(env.model, dest)
    return dest


def _bytes_edit(fn: Callable[[bytearray], bytes | bytearray]) -> Setup:
    """A run of a copy of the model whose raw bytes ``fn`` changed."""
    def setup(d: Path, env: Env) -> list[str]:
        dest = _copy(d, env)
        dest.write_bytes(bytes(fn(bytearray(dest.read_bytes()))))
        return _run("m.pulsar", "--random_input")
    return setup


def _flip_weight(raw: bytearray) -> bytearray:
    model = onnx.ModelProto()
    model.ParseFromString(bytes(raw))
    weight = max(model.graph.initializer, key=lambda t: len(t.raw_data)).raw_data
    raw[raw.find(weight) + len(weight) // 2] ^= 0x04
    return raw


def _cut_checksum(raw: bytearray) -> bytearray:
    """The file cut exactly before its checksum trailer (the one-entry ModelProto at its end)."""
    model = onnx.ModelProto()
    model.ParseFromString(bytes(raw))
    tail = onnx.ModelProto()
    entry = tail.metadata_props.add()
    entry.key, entry.value = CHECKSUM_KEY, next(p.value for p in model.metadata_props if p.key == CHECKSUM_KEY)
    trailer = tail.SerializeToString()
    assert raw.endswith(trailer)
    return raw[: len(raw) - len(trailer)]


def _flip_digest(raw: bytearray) -> bytearray:
    raw[-5] = ord("a") if raw[-5] != ord("a") else ord("b")
    return raw


def _tamper(fn: Callable[[onnx.ModelProto], None], command: str = "run") -> Setup:
    """A copy of the model edited by ``fn`` and sealed again (the checksum is right)."""
    def setup(d: Path, env: Env) -> list[str]:
        dest = _copy(d, env)
        model = onnx.load(str(dest))
        fn(model)
        dest.write_bytes(sealed_bytes(model))
        return ["info", "m.pulsar"] if command == "info" else _run("m.pulsar", "--random_input")
    return setup


def _prop(key: str, value: str) -> Callable[[onnx.ModelProto], None]:
    def fn(model: onnx.ModelProto) -> None:
        next(p for p in model.metadata_props if p.key == key).value = value
    return fn


def _npu_attr(name: str, value: bytes) -> Callable[[onnx.ModelProto], None]:
    def fn(model: onnx.ModelProto) -> None:
        node = next(n for n in model.graph.node if n.domain == "pulsar.npu")
        next(a for a in node.attribute if a.name == name).s = value
    return fn


def _rewire(model: onnx.ModelProto) -> None:
    model.graph.node[-1].input[0] = "nowhere"


def _domain(model: onnx.ModelProto) -> None:
    model.graph.node[0].domain = "pulsar.gpu"


def _with_input(value: np.ndarray | None = None, name: str = "image.npy", *extra: str) -> Setup:
    def setup(d: Path, env: Env) -> list[str]:
        _sample(d / "in", value, name)
        return _run(env.model, "--input_dir", "in", *extra)
    return setup


def _with_bytes(name: str, data: bytes) -> Setup:
    def setup(d: Path, env: Env) -> list[str]:
        (d / "in").mkdir()
        (d / "in" / name).write_bytes(data)
        return _run(env.model, "--input_dir", "in")
    return setup


def _with_list(text: bytes, samples: tuple[str, ...] = ("s0",), *, input_dir: bool = True) -> Setup:
    def setup(d: Path, env: Env) -> list[str]:
        for s in samples:
            _sample(d / "in" / s)
        (d / "list.txt").write_bytes(text)
        return _run(env.model, *(["--input_dir", "in"] if input_dir else []), "--list", "list.txt")
    return setup


def _cmd(*args: str, inputs: bool = True) -> Setup:
    def setup(d: Path, env: Env) -> list[str]:
        if inputs:
            _sample(d / "in")
        return [a.replace("{model}", str(env.model)) for a in args]
    return setup


def _late_bad_sample(d: Path, env: Env) -> list[str]:
    _sample(d / "in" / "s0")
    _sample(d / "in" / "s1")
    _sample(d / "in" / "s2", np.zeros((1, 3, 8, 8), np.float32))
    (d / "list.txt").write_text("s0\ns1\ns2\n")
    return _run(env.model, "--input_dir", "in", "--list", "list.txt")


def _output_file(d: Path, env: Env) -> list[str]:
    (d / "taken").write_text("a file")
    return ["run", "--model", str(env.model), "--random_input", "--output_dir", "taken"]


def _output_under_file(d: Path, env: Env) -> list[str]:
    (d / "taken").write_text("a file")
    return ["run", "--model", str(env.model), "--random_input", "--output_dir", "taken/sub/out"]


def _both_files(d: Path, env: Env) -> list[str]:
    _sample(d / "in")
    (d / "in" / "image.bin").write_bytes(b"\0" * 3072)
    return _run(env.model, "--input_dir", "in")


def _model_dir(d: Path, env: Env) -> list[str]:
    (d / "m.pulsar").mkdir()
    return _run("m.pulsar", "--random_input")


def _plain_onnx(d: Path, env: Env) -> list[str]:
    shutil.copyfile(env.onnx_model, d / "plain.onnx")
    return _run("plain.onnx", "--random_input")


def _pickled(d: Path, env: Env) -> list[str]:
    (d / "in").mkdir()
    np.save(d / "in" / "image.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return _run(env.model, "--input_dir", "in")


def _npz(d: Path, env: Env) -> list[str]:
    (d / "in").mkdir()
    with open(d / "in" / "image.npy", "wb") as f:
        np.savez(f, image=np.zeros(SHAPE, np.float32))
    return _run(env.model, "--input_dir", "in")


def _nan() -> np.ndarray:
    x = np.zeros(SHAPE, np.float32)
    x[0, 0, 3, 4] = np.nan
    return x


def _info_missing(d: Path, env: Env) -> list[str]:
    return ["info", "missing.pulsar"]


def _info_flip(d: Path, env: Env) -> list[str]:
    dest = _copy(d, env)
    dest.write_bytes(bytes(_flip_weight(bytearray(dest.read_bytes()))))
    return ["info", "m.pulsar"]


def _info_dir(d: Path, env: Env) -> list[str]:
    (d / "model").mkdir()
    return ["info", "model"]


def _sparse(size: int) -> Setup:
    """``pulsar info`` of a sparse file of ``size`` zero bytes (no disk used)."""
    def setup(d: Path, env: Env) -> list[str]:
        with open(d / "big.pulsar", "wb") as f:
            f.truncate(size)
        return ["info", "big.pulsar"]
    return setup


# --------------------------------------------------------------------------- the corpus

CASES = [
    # compiled model files
    Case("model_missing", _cmd("run", "--model", "nope.pulsar", "--random_input", "--output_dir", "out",
                               inputs=False), ("nope.pulsar", "does not exist")),
    Case("model_is_directory", _model_dir, ("m.pulsar", "is a directory")),
    Case("model_empty", _bytes_edit(lambda raw: b""), ("m.pulsar", "truncated or corrupt")),
    Case("model_truncated", _bytes_edit(lambda raw: raw[: len(raw) // 2]), ("m.pulsar", "truncated or corrupt")),
    Case("model_random_bytes", _bytes_edit(lambda raw: np.random.default_rng(1).bytes(len(raw))),
         "truncated or corrupt"),
    Case("model_bit_flip_in_weight", _bytes_edit(_flip_weight), ("m.pulsar", "checksum mismatch", "rebuild")),
    Case("model_checksum_damaged", _bytes_edit(_flip_digest), ("m.pulsar", "checksum mismatch")),
    Case("model_plain_onnx", _plain_onnx, ("plain.onnx", "not a pulsar compiled model")),
    Case("model_cut_before_checksum", _bytes_edit(_cut_checksum), ("m.pulsar", "has no checksum", "rebuild")),
    Case("model_checksum_removed_then_weight_flipped", _bytes_edit(lambda raw: _flip_weight(_cut_checksum(raw))),
         ("m.pulsar", "has no checksum", "truncated or was edited")),
    Case("model_newer_format", _tamper(_prop("pulsar.format_version", "4")), ("newer pulsar (format 4", "upgrade")),
    Case("model_unknown_option", _tamper(_npu_attr("options", b'{"turbo": true}')),
         ("m.pulsar", "npu_0", "unknown option 'turbo'")),
    Case("model_option_wrong_type", _tamper(_npu_attr("options", b'{"lut_items_in_bits": "many"}')),
         ("npu_0", "option lut_items_in_bits", "not an integer")),
    Case("model_options_not_json", _tamper(_npu_attr("options", b"{lut")), ("npu_0", "not valid JSON")),
    Case("model_kind_mismatch", _tamper(_npu_attr("kind", b"cpu")), ("npu_0", "kind 'cpu'")),
    Case("model_metadata_inputs_not_a_list", _tamper(_prop("pulsar.inputs", "image")),
         ("metadata pulsar.inputs", "is not a list")),
    Case("model_metadata_wrong_dtype", _tamper(_prop("pulsar.outputs",
                                                     '[{"name": "logits", "dtype": "float17", "shape": [1, 10]}]')),
         ("pulsar.outputs[0].dtype", "not a numpy dtype")),
    Case("model_dataflow_broken", _tamper(_rewire), "reads 'nowhere'"),
    Case("model_unknown_domain", _tamper(_domain), "unknown domain 'pulsar.gpu'"),
    Case("model_path_control_character", _cmd("run", "--model", "m\x1b[31m.pulsar", "--random_input",
                                              "--output_dir", "out", inputs=False),
         ("--model", "control character (\\x1b)")),
    # pulsar info
    Case("info_missing", _info_missing, ("missing.pulsar", "does not exist")),
    Case("info_bit_flip", _info_flip, ("m.pulsar", "checksum mismatch")),
    Case("info_directory", _info_dir, ("model", "is a directory")),
    Case("info_sparse_6_gib", _sparse(6 << 30), ("big.pulsar", "is 6.0 GiB", "more than the 2 GiB")),
    Case("info_sparse_zeros", _sparse(64 << 20), ("big.pulsar", "does not start like an ONNX model")),
    Case("info_tampered_estimate", _tamper(_prop("pulsar.estimate", '{"cycles": -1}'), command="info"),
         ("pulsar.estimate.cycles", "out of range")),
    # --output_dir
    Case("output_dir_is_a_file", _output_file, ("--output_dir", "taken", "exists and is not a directory")),
    Case("output_dir_parent_is_a_file", _output_under_file, ("--output_dir", "taken is a file")),
    Case("output_dir_under_proc", _cmd("run", "--model", "{model}", "--random_input", "--output_dir",
                                       "/proc/pulsar-hostile/out", inputs=False),
         ("--output_dir", "/proc/pulsar-hostile/out", "cannot be created")),
    Case("output_dir_control_character", _cmd("run", "--model", "{model}", "--random_input", "--output_dir",
                                              "out\rput", inputs=False), ("--output_dir", "control character (\\r)")),
    # --list
    Case("list_not_utf8", _with_list(b"s0\n\xff\xfe\n"), ("--list", "list.txt:2", "byte 3 (0xff) is not UTF-8")),
    Case("list_is_a_directory", _cmd("run", "--model", "{model}", "--output_dir", "out", "--input_dir", "in",
                                      "--list", "in"), ("--list", "is a directory")),
    Case("list_missing", _cmd("run", "--model", "{model}", "--output_dir", "out", "--input_dir", "in",
                              "--list", "gone.txt"), ("--list", "gone.txt", "does not exist")),
    Case("list_entry_with_nul", _with_list(b"s0\ns\x000\n"), ("--list", "list.txt:2", "control character (\\x00)")),
    Case("list_missing_sample", _with_list(b"s0\nmissing\n"), ("list.txt:2", "missing", "does not exist")),
    Case("list_empty", _with_list(b"# nothing\n\n"), "lists no sample directories"),
    Case("list_without_input_dir", _with_list(b"s0\n", input_dir=False), "--list needs --input_dir"),
    Case("list_late_bad_sample", _late_bad_sample, ("s2", "image.npy", "expects shape (1, 3, 16, 16)")),
    # --batch_size
    Case("batch_size_zero", _with_input(None, "image.npy", "--batch_size", "0"), "--batch_size must be at least 1, got 0"),
    Case("batch_size_negative", _with_input(None, "image.npy", "--batch_size", "-5"), "got -5"),
    Case("batch_size_not_an_integer", _with_input(None, "image.npy", "--batch_size", "ten"),
         "--batch_size: 'ten' is not an integer"),
    Case("batch_size_beyond_memory", _cmd("run", "--model", "{model}", "--random_input", "--output_dir", "out",
                                          "--batch_size", "1000000000", inputs=False),
         ("--batch_size 1000000000 needs 3.11 TB", "MemAvailable")),
    Case("batch_file_holds_more", _with_input(np.zeros((4, 3, 16, 16), np.float32)),
         ("image.npy", "the file holds 4 samples: run with --batch_size 4")),
    Case("batch_file_holds_fewer", _with_input(np.zeros((2, 3, 16, 16), np.float32), "image.npy", "--batch_size", "4"),
         ("expects shape (4, 3, 16, 16)", "run with --batch_size 2")),
    # input files
    Case("input_wrong_dtype", _with_input(np.zeros(SHAPE, np.int32)), ("image.npy", '"image"', "dtype float32")),
    Case("input_wrong_shape", _with_input(np.zeros((1, 16, 16, 3), np.float32)), ("image.npy", "expects shape")),
    Case("input_non_finite", _with_input(_nan()), ("image.npy", '"image"', "non-finite", "(0, 0, 3, 4)")),
    Case("input_bin_wrong_size", _with_bytes("image.bin", b"\0" * 3000), ("image.bin", "needs exactly 3072 bytes")),
    Case("input_npy_garbage", _with_bytes("image.npy", b"not numpy at all"), ("image.npy", "not a plain numeric")),
    Case("input_npy_pickled_objects", _pickled, ("image.npy", "not a plain numeric")),
    Case("input_npz_named_npy", _npz, ("image.npy", "not a plain numeric")),
    Case("input_npy_and_bin", _both_files, "keep one"),
    Case("input_file_missing", _with_input(None, "other.npy"), 'no file for input "image"'),
    Case("input_dir_missing", _cmd("run", "--model", "{model}", "--output_dir", "out", "--input_dir", "nope",
                                   inputs=False), ("nope", "does not exist")),
    Case("input_dir_is_a_file", _cmd("run", "--model", "{model}", "--output_dir", "out", "--input_dir",
                                     "in/image.npy"), ("image.npy", "is not a directory")),
    # other flags
    Case("workers_zero", _with_input(None, "image.npy", "--workers", "0"), "--workers must be at least 1"),
    Case("mode_unknown", _with_input(None, "image.npy", "--mode", "Referense"), ("unknown --mode", "Reference")),
    Case("no_inputs_given", _cmd("run", "--model", "{model}", "--output_dir", "out", inputs=False),
         "give --input_dir"),
]


@pytest.fixture(scope="module")
def env(tiny, tmp_path_factory) -> Env:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]}}
    res = pulsar.build(tiny["model"], tmp_path_factory.mktemp("hostile_run_model") / "out", cfg, quiet=True)
    return Env(model=res.compiled_model, onnx_model=tiny["model"])


@pytest.fixture(scope="module")
def results(env, tmp_path_factory):
    """Every case set up, then run two at a time: id -> (case dir, snapshot before, process)."""
    root = tmp_path_factory.mktemp("hostile_run")
    prepared = {}
    for case in CASES:
        d = root / case.id
        d.mkdir()
        args = case.setup(d, env)
        prepared[case.id] = (d, args, Snapshot.of(d))
    with ThreadPoolExecutor(2) as pool:
        futures = {cid: pool.submit(run_cli, args, d) for cid, (d, args, _) in prepared.items()}
        return {cid: (prepared[cid][0], prepared[cid][2], f.result()) for cid, f in futures.items()}


def test_corpus_is_distinct():
    assert len({c.id for c in CASES}) == len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_fails_cleanly(case, results):
    d, before, proc = results[case.id]
    assert_clean_failure(proc, case.needle, before, d)
    assert not (d / "out").exists() or not any((d / "out").iterdir()), "outputs written for a failed run"
    assert proc.stdout == "", proc.stdout  # results only: a failure prints nothing on stdout


# --------------------------------------------------------------------------- lists that succeed


def test_unsafe_and_duplicate_list_entries_stay_inside_output_dir(env, tmp_path):
    """`..` and two directories both named s1 succeed, each with its own output directory, and
    nothing is written outside --output_dir."""
    inputs = tmp_path / "data" / "in"
    for sub in ("a/s1", "b/s1"):
        _sample(inputs / sub)
    _sample(tmp_path / "data")  # what `..` names
    (tmp_path / "list.txt").write_text("a/s1\nb/s1\n..\n")
    before = Snapshot.of(tmp_path)
    proc = run_cli(["run", "--model", str(env.model), "--input_dir", "data/in", "--list", "list.txt",
                    "--output_dir", "out"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    after = Snapshot.of(tmp_path)
    new = sorted(p for p in after.files if p not in before.files)
    assert new == ["out/s1/logits.npy", "out/s1_line2/logits.npy", "out/sample_line3/logits.npy"]
    assert all(before.files[p] == after.files[p] for p in before.files)  # nothing changed either
    assert "s1_line2" in proc.stderr and "sample_line3" in proc.stderr  # the renaming is logged
    assert "3 samples" in proc.stdout


# --------------------------------------------------------------------------- runs that succeed with a warning


def test_a_file_no_input_reads_is_named_in_a_warning(env, tmp_path):
    """``images.npy`` beside ``image.npy`` is a likely typo: the run succeeds and warns, naming the file
    and the input it resembles; an unrelated file is named too; hidden files are not."""
    _sample(tmp_path / "in")
    _sample(tmp_path / "in", name="images.npy")
    (tmp_path / "in" / "notes.txt").write_text("x")
    (tmp_path / "in" / ".DS_Store").write_text("x")
    proc = run_cli(_run(env.model, "--input_dir", "in"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 2, proc.stderr
    assert "in/images.npy" in warnings[0] and 'resembles image.npy, the file of input "image"' in warnings[0]
    assert "in/notes.txt" in warnings[1] and "no model input reads this file" in warnings[1]
    assert "error" not in proc.stderr.lower()
