"""Static / dynamic multi-batch and extra input shapes, end to end on the tiny CNN: builds, the
container's variants, batch splitting (bit-exact against single samples), groups, the CLI, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import pulsar
from pulsar.core.container import load_compiled
from pulsar.core.integrity import sealed_bytes
from pulsar.errors import PulsarError
from tests.hostile.harness import assert_clean_failure, run_cli

N = 9


def _samples(session: pulsar.Session, n: int = N, seed: int = 0) -> np.ndarray:
    info = session.inputs[0]
    return np.random.default_rng(seed).standard_normal((n, *info.shape[1:])).astype(info.dtype)


def _assert_batches_equal_singles(path: Path, mode: str = "NPUBackend", sizes=(3, N)) -> None:
    sess = pulsar.Session(path, mode=mode)
    x = _samples(sess)
    singles = np.concatenate([sess.run({"image": x[i:i + 1]})["logits"] for i in range(N)])
    for n in sizes:
        got = sess.run_batches({"image": x[:n]}, n)["logits"]
        np.testing.assert_array_equal(got, singles[:n], err_msg=f"{mode}, {n} samples as {sess.batch_plan(n)}")


@pytest.fixture(scope="module")
def static(tiny, tmp_path_factory) -> Path:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": {"static_batch_sizes": [1, 2, 4], "check": 2}}
    return pulsar.build(tiny["model"], tmp_path_factory.mktemp("static") / "out", cfg, quiet=True).compiled_model


def test_static_batches_are_variants_sharing_the_weights(static):
    compiled = load_compiled(static)
    meta = compiled.metadata
    assert compiled.format_version == 3
    assert meta["batch_mode"] == "static" and meta["batch_sizes"] == [1, 2, 4]
    assert [(v["group"], v["batch"]) for v in meta["variants"]] == [(0, 4), (0, 2), (0, 1)]
    # the model's IO batch is the largest; one sample per shape group
    assert [d.dim_value for d in compiled.model.graph.input[0].type.tensor_type.shape.dim] == [4, 3, 16, 16]
    assert meta["shape_groups"][0]["inputs"][0]["shape"] == [1, 3, 16, 16]
    for sg in compiled.subgraphs:
        assert sg.variant_ids == [0, 1, 2] and len(sg.extra) == 2
    # every weight once: no initializer renamed for a clash
    names = [t.name for t in compiled.model.graph.initializer]
    assert len(names) == len(set(names)) and not any("__" in n for n in names)


@pytest.mark.parametrize("mode", ["NPUBackend", "Reference"])
def test_any_batch_runs_as_the_compiled_ones_and_equals_single_samples(static, mode):
    _assert_batches_equal_singles(static, mode, sizes=(2, 3, 4, 8, N))


def test_session_plans_largest_first(static):
    sess = pulsar.Session(static)
    assert sess.batch_sizes == [1, 2, 4]
    assert sess.batch_plan(3) == "npu_0: 2 + 1" and sess.batch_plan(9) == "npu_0: 4 + 4 + 1"
    assert sess.inputs[0].shape == (1, 3, 16, 16)
    with pytest.raises(PulsarError, match=r"expected shape \[N, 3, 16, 16\] \(N samples\)"):
        sess.run({"image": np.zeros((2, 3, 8, 8), np.float32)})


def test_cli_run_batch_size_logs_the_split(static, tmp_path):
    proc = run_cli(["run", "--model", str(static), "--random_input", "--batch_size", "9", "--output_dir", "o"],
                   tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "9 sample(s) per run as compiled batches: npu_0: 4 + 4 + 1" in proc.stderr
    assert np.load(tmp_path / "o" / "logits.npy").shape == (9, 10)
    info = run_cli(["info", str(static)], tmp_path)
    assert info.returncode == 0 and "Variants (static multi-batch [1, 2, 4]" in info.stdout
    assert "image 4x3x16x16" in info.stdout


def test_dynamic_batches_follow_the_cost_model(tiny, tmp_path):
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": {"max_dynamic_batch_size": 8}}
    res = pulsar.build(tiny["model"], tmp_path / "out", cfg, quiet=True)
    log = (tmp_path / "out" / "build.log").read_text().splitlines()
    lines = [line[line.index("dynamic batch:"):] for line in log if "dynamic batch:" in line]
    assert len(lines) == 1 and "npu_0 batches [1" in lines[0] and "stopped:" in lines[0], lines
    assert "batch 1:" in lines[0] and "ms/sample" in lines[0]
    meta = load_compiled(res.compiled_model).metadata
    assert meta["batch_mode"] == "dynamic" and meta["batch_sizes"][0] == 1
    assert max(meta["batch_sizes"]) <= 8
    _assert_batches_equal_singles(res.compiled_model)


def _tiny_with_baked_reshape(src: Path, dest: Path) -> Path:
    """The tiny CNN with its Flatten exported as a Reshape to [1, 8] (the batch baked in)."""
    model = onnx.load(str(src))
    for i, node in enumerate(model.graph.node):
        if node.op_type == "Flatten":
            model.graph.node.remove(node)
            model.graph.node.insert(i, helper.make_node("Reshape", [node.input[0], "flat_shape"], list(node.output),
                                                        name="baked_reshape"))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 8], np.int64), "flat_shape"))
    onnx.save(model, str(dest))
    return dest


def test_reshape_with_baked_batch_is_fixed_or_named(tiny, tmp_path):
    model = _tiny_with_baked_reshape(tiny["model"], tmp_path / "baked.onnx")
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": {"static_batch_sizes": [1, 2, 4]}}
    res = pulsar.build(model, tmp_path / "fixed", cfg, quiet=True)
    _assert_batches_equal_singles(res.compiled_model, sizes=(4, N))
    cfg["compiler"]["disable_ir_fix"] = True
    with pytest.raises(PulsarError, match=r"group 0, batch 2: Reshape 'baked_reshape' has batch 1 baked into a "
                                          r"constant .*disable_ir_fix is true"):
        pulsar.build(model, tmp_path / "unfixed", cfg, quiet=True)
    assert not (tmp_path / "unfixed" / "compiled.pulsar").exists()


@pytest.fixture(scope="module")
def groups(tiny, tmp_path_factory) -> Path:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "input_processors": [{"tensor_name": "image", "src_extra_shapes": [{"shape": [1, 3, 24, 24]},
                                                                             {"shape": [1, 3, 8, 12]}]}],
           "compiler": {"check": 3, "check_mode": "CheckPerLayer"}}
    return pulsar.build(tiny["model"], tmp_path_factory.mktemp("groups") / "out", cfg, quiet=True).compiled_model


def test_extra_shapes_are_groups_with_the_same_quantization(groups):
    meta = load_compiled(groups).metadata
    assert [g["inputs"][0]["shape"] for g in meta["shape_groups"]] == [[1, 3, 16, 16], [1, 3, 24, 24], [1, 3, 8, 12]]
    assert "batch_mode" not in meta
    for group, hw in ((0, (16, 16)), (1, (24, 24)), (2, (8, 12))):
        for mode in ("NPUBackend", "Reference"):
            sess = pulsar.Session(groups, group=group, mode=mode)
            assert sess.inputs[0].shape == (1, 3, *hw)
            x = np.random.default_rng(group).standard_normal((1, 3, *hw)).astype(np.float32)
            assert sess.run({"image": x})["logits"].shape == (1, 10)


def test_group_errors_list_the_groups(groups, tmp_path):
    with pytest.raises(PulsarError, match=r"--group_index 3 is not a shape group of this model; its groups: "
                                          r"0: image \[1, 3, 16, 16\]; 1: image \[1, 3, 24, 24\]; 2: image"):
        pulsar.Session(groups, group=3)
    with pytest.raises(PulsarError, match=r"expected shape \(1, 3, 24, 24\), got \(1, 3, 16, 16\) \(group 1; "
                                          r"the model's groups: 0: image"):
        pulsar.Session(groups, group=1).run({"image": np.zeros((1, 3, 16, 16), np.float32)})
    proc = run_cli(["run", "--model", str(groups), "--random_input", "--group_index", "7", "--output_dir", "o"],
                   tmp_path)
    assert_clean_failure(proc, ("--group_index 7 is not a shape group", "1: image [1, 3, 24, 24]"))
    assert not (tmp_path / "o").exists()
    ok = run_cli(["run", "--model", str(groups), "--random_input", "--group_index", "1", "--output_dir", "o"],
                 tmp_path)
    assert ok.returncode == 0, ok.stderr
    info = run_cli(["info", str(groups)], tmp_path)
    assert "image 1x3x24x24" in info.stdout and "--group_index picks the group" in info.stdout


def test_extra_shape_the_graph_cannot_take_names_the_node(tiny, tmp_path):
    model = _tiny_with_baked_reshape(tiny["model"], tmp_path / "baked.onnx")
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "input_processors": [{"tensor_name": "image", "src_extra_shapes": [{"shape": [1, 3, 24, 24]}]}]}
    pulsar.build(model, tmp_path / "ok", cfg, quiet=True)  # GAP makes [1, 8] whatever the resolution
    cfg["input_processors"][0]["src_extra_shapes"] = [{"shape": [1, 4, 16, 16]}]
    with pytest.raises(PulsarError, match=r"group 1, batch 1: node 'conv1' \(Conv\) cannot take these input dims"):
        pulsar.build(model, tmp_path / "bad", cfg, quiet=True)
    cfg["input_processors"][0]["src_extra_shapes"] = [{"shape": [1, 3, 16]}]
    with pytest.raises(PulsarError, match=r"src_extra_shapes\[0\]: shape \[1, 3, 16\] has rank 3"):
        pulsar.build(model, tmp_path / "bad2", cfg, quiet=True)


@pytest.mark.parametrize(("compiler", "needle"), [
    ({"static_batch_sizes": [1, 2], "max_dynamic_batch_size": 4}, "exclude each other"),
    ({"static_batch_sizes": [1, 2], "sub_configs": [{"start_tensor_names": ["r1"], "end_tensor_names": ["r2"],
                                                     "max_dynamic_batch_size": 2}]},
     r"compiler.sub_configs\[0\]: static_batch_sizes \[1, 2\] and max_dynamic_batch_size 2 exclude each other .*"
     "inherits what it leaves unset"),
])
def test_config_mistakes_are_one_line(tiny, tmp_path, compiler, needle):
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": compiler}
    with pytest.raises(PulsarError, match=needle):
        pulsar.build(tiny["model"], tmp_path / "out", cfg, quiet=True)
    assert not (tmp_path / "out" / "compiled.pulsar").exists()


def test_multi_batch_needs_batch_one_in_the_model(tiny, tmp_path):
    calib = tmp_path / "calib2"
    calib.mkdir()
    for i in range(8):
        np.save(calib / f"{i:03d}.npy", np.random.default_rng(i).standard_normal((2, 3, 16, 16)).astype(np.float32))
    cfg = {"input_shapes": "image:2x3x16x16",
           "quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": {"static_batch_sizes": [1, 2]}}
    model = onnx.load(str(tiny["model"]))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    onnx.save(model, str(tmp_path / "dyn.onnx"))
    with pytest.raises(PulsarError, match=r"multi-batch compilation needs batch 1 in the model: input 'image'"):
        pulsar.build(tmp_path / "dyn.onnx", tmp_path / "out", cfg, quiet=True)


def test_format_2_files_still_load(static, tmp_path):
    """A single-variant file written as format 2 (before variants) loads and runs."""
    single = pulsar.build(*_single_args(static, tmp_path)).compiled_model
    model = onnx.load(str(single))
    for p in model.metadata_props:
        if p.key == "pulsar.format_version":
            p.value = "2"
    old = tmp_path / "old.pulsar"
    old.write_bytes(sealed_bytes(model))
    loaded = load_compiled(old)
    assert loaded.format_version == 2 and all(sg.variant_ids == [0] for sg in loaded.subgraphs)
    sess = pulsar.Session(loaded)
    assert sess.run({"image": _samples(sess, 1)})["logits"].shape == (1, 10)


def _single_args(static: Path, tmp_path: Path) -> tuple:
    cfg_path = static.parent / "build_config.json"
    import json

    cfg = json.loads(cfg_path.read_text())
    cfg["compiler"]["static_batch_sizes"] = []
    cfg["compiler"]["check"] = 0
    return cfg["input"], tmp_path / "single", {k: v for k, v in cfg.items() if k not in ("input", "output_dir")}


def test_damaged_variant_attributes_are_one_line(static, tmp_path):
    model = onnx.load(str(static))
    node = model.graph.node[1]
    attr = next(a for a in node.attribute if a.name == "variant_ids")
    attr.ints[:] = [0, 1, 7]
    bad = tmp_path / "bad.pulsar"
    bad.write_bytes(sealed_bytes(model))
    with pytest.raises(PulsarError, match=r"subgraph 'npu_0' variant_ids \[0, 1, 7\] name variants the metadata "
                                          r"does not list \(3\).*rebuild it"):
        load_compiled(bad)


def test_a_sub_config_range_has_its_own_batches(tiny, tmp_path):
    """static_batch_sizes of one compiler.sub_configs range: its NPU subgraph holds batches 1, 2, 4, the
    rest of the model batch 1 only; any batch still equals single samples."""
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": {"check": 2, "sub_configs": [{"start_tensor_names": ["r1"], "end_tensor_names": ["r2"],
                                                     "static_batch_sizes": [1, 2, 4]}]}}
    res = pulsar.build(tiny["model"], tmp_path / "out", cfg, quiet=True)
    compiled = load_compiled(res.compiled_model)
    variants = [(v["group"], v["batch"]) for v in compiled.metadata["variants"]]
    batches = {sg.name: sorted(variants[k][1] for k in sg.variant_ids) for sg in compiled.subgraphs if sg.kind == "npu"}
    ranged = [sg.name for sg in compiled.subgraphs if sg.options.get("sub_config") == 0]
    assert len(ranged) == 1 and batches.pop(ranged[0]) == [1, 2, 4]
    assert batches and all(b == [1] for b in batches.values())
    sess = pulsar.Session(res.compiled_model)
    assert f"{ranged[0]}: 4 + 4 + 1" in sess.batch_plan(9)
    _assert_batches_equal_singles(res.compiled_model)


def test_batches_without_one_reject_what_they_cannot_make(tiny, tmp_path):
    """static [2, 4]: the outputs' shapes follow the batch, 6 runs as 4 + 2, 3 is refused before
    anything is written, and per-layer dumps hold the whole run."""
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": {"static_batch_sizes": [2, 4]}}
    path = pulsar.build(tiny["model"], tmp_path / "out", cfg, quiet=True).compiled_model
    meta = load_compiled(path).metadata
    assert meta["outputs"][0]["shape"] == [4, 10]
    assert meta["shape_groups"][0]["outputs"][0]["shape"] == [1, 10]
    sess = pulsar.Session(path)
    x = _samples(sess, 6)
    pairs = np.concatenate([sess.run({"image": x[i:i + 2]})["logits"] for i in (0, 2, 4)])
    np.testing.assert_array_equal(sess.run({"image": x})["logits"], pairs)
    assert sess.batch_plan(6) == "npu_0: 4 + 2"
    bad = run_cli(["run", "--model", str(path), "--random_input", "--batch_size", "3", "--output_dir", "o"], tmp_path)
    assert_clean_failure(bad, ("3 sample(s) cannot be run as the compiled batches [2, 4]", "e.g. 2, 4, 6, 8"))
    assert not (tmp_path / "o").exists()
    ok = run_cli(["run", "--model", str(path), "--random_input", "--batch_size", "4", "--enable_perlayer_output",
                  "--output_dir", "p"], tmp_path)
    assert ok.returncode == 0, ok.stderr
    dumps = {f.stem: np.load(f) for f in (tmp_path / "p" / "perlayer").glob("*.npy")}
    assert len(dumps) > 5 and dumps["image"].shape == (4, 3, 16, 16)
    np.testing.assert_array_equal(dumps["logits"], np.load(tmp_path / "p" / "logits.npy"))
    assert dumps["logits"].shape == (4, 10)


def test_shape_groups_times_batches(tiny, tmp_path):
    """An extra shape and static batches together: every group holds every batch, runs bit-exact."""
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "input_processors": [{"tensor_name": "image", "src_extra_shapes": [{"shape": [1, 3, 24, 20]}]}],
           "compiler": {"static_batch_sizes": [1, 2], "check": 2}}
    path = pulsar.build(tiny["model"], tmp_path / "out", cfg, quiet=True).compiled_model
    meta = load_compiled(path).metadata
    assert [(v["group"], v["batch"]) for v in meta["variants"]] == [(0, 2), (0, 1), (1, 2), (1, 1)]
    sess = pulsar.Session(path, group=1)
    assert sess.inputs[0].shape == (1, 3, 24, 20) and sess.batch_sizes == [1, 2]
    x = _samples(sess, 3)
    singles = np.concatenate([sess.run({"image": x[i:i + 1]})["logits"] for i in range(3)])
    np.testing.assert_array_equal(sess.run({"image": x})["logits"], singles)


def test_multi_batch_needs_batch_one_in_extra_shapes_and_an_npu_subgraph(tiny, tmp_path):
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "input_processors": [{"tensor_name": "image", "src_extra_shapes": [{"shape": [2, 3, 24, 24]}]}],
           "compiler": {"static_batch_sizes": [1, 2]}}
    with pytest.raises(PulsarError, match=r"src_extra_shapes: extra shape 0 of input 'image' is \[2, 3, 24, 24\]; "
                                          r"with multi-batch compilation dim 0 is the batch and must be 1"):
        pulsar.build(tiny["model"], tmp_path / "a", cfg, quiet=True)
    del cfg["input_processors"]
    names = [n.name for n in onnx.load(str(tiny["model"])).graph.node if n.name not in ("bn1", "identity")]
    cfg["quant"]["layer_configs"] = [{"layer_name": n, "data_type": "FP32"} for n in names]  # all on the CPU
    with pytest.raises(PulsarError, match=r"compiler.static_batch_sizes: the model has no NPU subgraph"):
        pulsar.build(tiny["model"], tmp_path / "b", cfg, quiet=True)


def _edit_meta(key, fn):
    def edit(model):
        import json

        for p in model.metadata_props:
            if p.key == f"pulsar.{key}":
                p.value = json.dumps(fn(json.loads(p.value)))
    return edit


def _swap_first_bodies(model):
    node = model.graph.node[0]  # cpu_0 reads the model input
    ids = next(a for a in node.attribute if a.name == "variant_ids")
    ids.ints[:] = [ids.ints[1], ids.ints[0], *ids.ints[2:]]


@pytest.mark.parametrize(("edit", "needle"), [
    (_edit_meta("variants", lambda v: v[:2] + [v[1]]), "variants lists a (group, batch) twice"),
    (_edit_meta("shape_groups", lambda g: g + g), "shape_groups does not have one entry per group (1)"),
    (_edit_meta("batch_axes", lambda a: {**a, "image": 7}), "batch_axes['image'] = 7 is outside"),
    (_swap_first_bodies, "subgraph 'cpu_0', body of group 0, batch 2: input 'image' has shape [4, 3, 16, 16]"),
])
def test_inconsistent_variants_are_refused_when_loaded(static, tmp_path, edit, needle):
    model = onnx.load(str(static))
    edit(model)
    bad = tmp_path / "bad.pulsar"
    bad.write_bytes(sealed_bytes(model))
    with pytest.raises(PulsarError) as exc:
        load_compiled(bad)
    assert needle in str(exc.value) and "rebuild it" in str(exc.value)
