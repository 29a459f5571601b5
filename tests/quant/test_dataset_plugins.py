"""Dataset plugins (``calibration_dataset: my_data.py:samples``): a build calibrated from a plugin equals the
build from the same arrays saved as .npy files; samples are streamed (memory does not grow with the
dataset); every plugin mistake is one error line naming the plugin, the sample and the fix."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import pulsar
from pulsar.errors import PulsarError
from pulsar.quant.datasets import CalibrationData, DatasetConfig, InputSpec
from pulsar.utils.user_code import load_callable, load_module
from tests.cli_fork import run_pulsar

IMAGE = InputSpec("image", (1, 3, 16, 16), np.float32)


def _write(folder: Path, body: str, name: str = "my_data.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def _open(spec: str, size: int = 32, inputs: list[InputSpec] | None = None, **kw) -> CalibrationData:
    return CalibrationData(inputs or [IMAGE], [DatasetConfig("DEFAULT", spec, calibration_size=size, **kw)])


def _quant_config(out: Path) -> dict:
    return json.loads((out / "quant" / "quant_config.json").read_text())


# -- the real thing: a build ----------------------------------------------------------------------------
def test_plugin_build_equals_the_npy_build(tiny, tiny_config, tmp_path, monkeypatch) -> None:
    """The plugin yields the fixture's .npy arrays (as torch tensors, without the batch dim): the quant
    config (every range) and the quantized model are the same as those of the build that reads the files."""
    _write(tmp_path, f"""
        from pathlib import Path
        import numpy as np
        import torch

        def samples():
            for f in sorted(Path({str(tiny["calib"])!r}).glob("*.npy")):
                yield {{"image": torch.from_numpy(np.load(f)[0])}}
        """)
    monkeypatch.chdir(tmp_path)  # plugin paths resolve like the other dataset paths: from the current directory
    cfg = {"quant": {"input_configs": [{"tensor_name": "DEFAULT", "calibration_dataset": "my_data.py:samples",
                                        "calibration_size": 8}]}}
    plugin = pulsar.build(tiny["model"], tmp_path / "plugin", cfg, quiet=True)
    files = pulsar.build(tiny["model"], tmp_path / "files", tiny_config, quiet=True)
    assert _quant_config(tmp_path / "plugin") == _quant_config(tmp_path / "files")
    assert plugin.quantized_model.read_bytes() == files.quantized_model.read_bytes()


def test_plugin_error_is_one_cli_line_and_nothing_is_written(tiny, tmp_path) -> None:
    """Preflight draws the samples before the output directory exists: a plugin failing at sample 2 stops
    the build with one line (plugin, sample, its own words), exit 2, no traceback, no output."""
    _write(tmp_path, """
        import numpy as np

        def samples():
            for i in range(8):
                if i == 2:
                    raise ValueError("corrupt record 17 in shard b")
                yield np.zeros((1, 3, 16, 16), np.float32)
        """)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"quant": {"input_configs": [
        {"tensor_name": "DEFAULT", "calibration_dataset": "my_data.py:samples"}]}}))
    out = tmp_path / "out"
    proc = run_pulsar(["build", "--input", str(tiny["model"]), "--output_dir",
                      str(out), "--config", str(cfg)], cwd=tmp_path, timeout=120, env={**os.environ, "COLUMNS": "400"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, text
    assert lines[0].startswith("error: quant.input_configs[0].calibration_dataset: plugin my_data.py:samples: "
                               "sample 2: the plugin raised ValueError: corrupt record 17 in shard b"), text
    assert not out.exists()


# -- what a plugin may return -----------------------------------------------------------------------------
def test_map_style_dataset_is_read_by_index_up_to_calibration_size(tmp_path) -> None:
    """A torch Dataset (__len__ + __getitem__) is read by index, never past calibration_size; its tensors
    become the arrays the model gets, unchanged."""
    plugin = _write(tmp_path, """
        import torch
        from torch.utils.data import Dataset

        READ = []

        class Frames(Dataset):
            def __len__(self):
                return 1000

            def __getitem__(self, i):
                READ.append(i)
                return {"image": torch.full((1, 3, 16, 16), float(i))}

        def frames():
            return Frames()
        """)
    with _open(f"{plugin}:frames", size=5) as data:
        got = [s["image"] for s in data]
    assert len(data) == 5 and [float(a[0, 0, 0, 0]) for a in got] == [0, 1, 2, 3, 4]
    assert all(a.dtype == np.float32 and a.shape == (1, 3, 16, 16) for a in got)
    read = load_module(plugin, "test").READ
    assert read == [0, 1, 2, 3, 4] * 2  # the checking pass, then the stream: nothing beyond sample 4


def test_list_of_bare_arrays_and_all_samples(tmp_path) -> None:
    plugin = _write(tmp_path, """
        import numpy as np

        def samples():
            return [np.full((3, 16, 16), i, np.float64) for i in range(3)]
        """)
    with _open(f"{plugin}:samples", size=-1) as data:
        got = list(data)
    assert len(data) == 3 and len(got) == 3
    assert got[2]["image"].shape == (1, 3, 16, 16) and got[2]["image"].dtype == np.float32  # batch added, narrowed
    assert data.describe()[0]["format"] == "Plugin"


def test_multi_input_plugin_feeds_every_input_and_fingerprint_follows_the_data(tmp_path) -> None:
    a, b = InputSpec("a", (1, 4), np.float32), InputSpec("b", (1, 2), np.int64)
    plugin = _write(tmp_path, """
        import numpy as np
        SCALE = 1.0

        def pairs():
            for i in range(4):
                yield {"b": np.array([[i, i]], np.int64), "a": np.full((1, 4), SCALE * i, np.float32)}
        """)
    with _open(f"{plugin}:pairs", inputs=[a, b]) as data:
        samples = list(data)
        first = data.fingerprint()
    assert [int(s["b"][0, 0]) for s in samples] == [0, 1, 2, 3]
    load_module(plugin, "test").SCALE = 2.0  # the data changed: the calibration cache must not be reused
    with _open(f"{plugin}:pairs", inputs=[a, b]) as data:
        assert data.fingerprint() != first


# -- bounded memory ---------------------------------------------------------------------------------------
def test_samples_are_streamed_with_bounded_memory(tmp_path) -> None:
    """An endless generator of 1 MB samples: opening draws exactly calibration_size of them, and the peak
    memory while opening and streaming 100 samples (200 MB drawn in all) stays a few samples' worth."""
    plugin = _write(tmp_path, """
        import numpy as np
        DRAWN = []
        CLOSED = []

        def endless():
            i = 0
            try:
                while True:
                    DRAWN.append(i)
                    yield {"image": np.full((1, 256, 32, 32), i % 7, np.float32)}  # 1 MiB
                    i += 1
            finally:
                CLOSED.append(i)
        """)
    big = InputSpec("image", (1, 256, 32, 32), np.float32)
    module = load_module(plugin, "test")
    tracemalloc.start()
    try:
        with _open(f"{plugin}:endless", size=100, inputs=[big]) as data:
            assert len(module.DRAWN) == 100 and len(module.CLOSED) == 1  # lazily drawn, the generator closed
            total = sum(float(s["image"][0, 0, 0, 0]) for s in data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(data) == 100 and total == sum(i % 7 for i in range(100))
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB: samples are being kept"


# -- every mistake is one line ----------------------------------------------------------------------------
BAD = {
    "raises_on_call": ("def samples():\n    raise OSError('no such bucket: s3://x')\n",
                       "plugin {p} raised OSError: no such bucket: s3://x when called; fix the plugin"),
    "raises_mid_stream": ("def samples():\n    yield {'image': np.zeros((1, 3, 16, 16), np.float32)}\n"
                          "    raise KeyError('frame_42')\n",
                          "sample 1: the plugin raised KeyError: 'frame_42'; fix the plugin"),
    "not_iterable": ("def samples():\n    return 42\n", "returned a int 42, not an iterable of samples"),
    "returns_one_dict": ("def samples():\n    return {'image': np.zeros((1, 3, 16, 16), np.float32)}\n",
                         "returned a dict, not an iterable of samples"),
    "wrong_type": ("def samples():\n    yield 'img_001.jpg'\n",
                   "sample 0 is a str 'img_001.jpg'; yield a dict {{input_name: array}}"),
    "wrong_value": ("def samples():\n    yield {'image': [[0.0]]}\n",
                    "sample 0: input 'image' is a list; give a numpy array or a torch tensor"),
    "wrong_name": ("def samples():\n    yield {'imag': np.zeros((1, 3, 16, 16), np.float32)}\n",
                   "sample 0 has key 'imag', not an input it feeds (did you mean \"image\"?)"),
    "wrong_shape": ("def samples():\n    yield {'image': np.zeros((1, 16, 16, 3), np.float32)}\n",
                    "sample 0: input 'image' has shape [1, 16, 16, 3], the model expects [1, 3, 16, 16]"),
    "wrong_dtype": ("def samples():\n    yield np.zeros((1, 3, 16, 16), np.uint8)\n",
                    "sample 0: input 'image' is uint8, the model expects float32; convert it with .astype"),
    "nan": ("def samples():\n    yield np.full((1, 3, 16, 16), np.nan, np.float32)\n",
            "sample 0: input 'image' holds 768 NaN"),
    "empty": ("def samples():\n    return iter(())\n", "yielded no samples"),
    "import_fails": ("import not_a_module_xyz\ndef samples():\n    return []\n",
                     "importing {f} raised ModuleNotFoundError: No module named 'not_a_module_xyz'"),
    "exits": ("import sys\nsys.exit(3)\n", "importing {f} raised SystemExit: 3"),
    "missing_callable": ("def sample():\n    return []\n", "has no 'samples' (it defines: sample); define"),
    "not_callable": ("samples = [1, 2]\n", "plugin {p} is a list, not callable"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_plugin_mistakes_are_one_line(tmp_path, case) -> None:
    body, needle = BAD[case]
    plugin = _write(tmp_path, "import numpy as np\n" + body)
    spec = f"{plugin}:samples"
    with pytest.raises(PulsarError) as err:
        _open(spec)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("quant.input_configs[0].calibration_dataset: ")
    assert spec in message or str(plugin) in message
    assert needle.format(p=spec, f=plugin) in message, message


def test_missing_file_and_malformed_spec(tmp_path) -> None:
    with pytest.raises(PulsarError, match=r"plugin file .*nope\.py does not exist; check the path"):
        _open(f"{tmp_path}/nope.py:samples")
    with pytest.raises(PulsarError, match=r"is not 'path/to/file.py:function'"):
        load_callable("data.py:", tmp_path, "field")


def test_shared_iterator_is_refused_on_the_second_pass(tmp_path) -> None:
    plugin = _write(tmp_path, """
        import numpy as np
        ONCE = (np.zeros((1, 3, 16, 16), np.float32) for _ in range(3))

        def samples():
            return ONCE
        """)
    with _open(f"{plugin}:samples") as data, pytest.raises(PulsarError, match="return a fresh iterable"):
        list(data)


def test_plugin_with_mean_or_mixed_with_files_is_refused(tmp_path, tiny) -> None:
    plugin = _write(tmp_path, "def samples():\n    return []\n")
    with pytest.raises(PulsarError, match=r"calibration_mean: a dataset plugin's arrays are fed .* as they are"):
        _open(f"{plugin}:samples", calibration_mean=(0.5, 0.5, 0.5))
    a, b = InputSpec("a", (1, 4), np.float32), InputSpec("b", (1, 4), np.float32)
    configs = [DatasetConfig("a", f"{plugin}:samples", field_path="quant.input_configs[0]"),
               DatasetConfig("b", str(tiny["calib"]), "Numpy", field_path="quant.input_configs[1]")]
    with pytest.raises(PulsarError, match=r"input 'b' reads .* a plugin feeds every input"):
        CalibrationData([a, b], configs)


# -- importing user code ----------------------------------------------------------------------------------
def test_user_files_are_isolated_modules(tmp_path) -> None:
    """Two plugins both named data.py do not collide; a plugin imports a helper beside it; sys.path is left
    as it was and no bytecode is written next to the user's file."""
    for name in ("x", "y"):
        (tmp_path / name).mkdir()
        _write(tmp_path / name, f"HELPER = {name!r}\n", f"helper_{name}.py")
        _write(tmp_path / name, f"from helper_{name} import HELPER\ndef which():\n    return HELPER\n", "data.py")
    before = list(sys.path)
    fx = load_callable("x/data.py:which", tmp_path, "f")
    fy = load_callable(str(tmp_path / "y" / "data.py") + ":which", Path("/nonexistent"), "f")
    assert (fx(), fy()) == ("x", "y")
    assert fx.__module__ != fy.__module__ and "data" not in sys.modules
    assert sys.path == before
    assert not list(tmp_path.rglob("__pycache__"))
    assert load_callable("x/data.py:which", tmp_path, "f") is fx  # the same file runs once
