"""Preparing a compiled model's programs (the compiler's load check in every build) does not import
torch: it costs 1.5 s and 140 MB per build, and only running the kernels needs it."""

from __future__ import annotations

import subprocess
import sys

import pulsar


def test_the_load_check_leaves_torch_unloaded(tmp_path, tiny, tiny_config):
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, quiet=True)
    code = ("import sys; from pulsar.runtime.validate import check_loadable; "
            f"n = check_loadable({str(res.compiled_model)!r}); print(n, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, loaded = out.stdout.split()
    assert int(count) >= 2 and loaded == "False", out.stdout
