"""onnxruntime settings shared by every stage that runs float QDQ math (analysis, search, reference runs)."""

from __future__ import annotations

import onnxruntime as ort


def reference_session_options() -> ort.SessionOptions:
    """onnxruntime options for float-simulated quantization (QDQ kept as float math)."""
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    # no busy-waiting worker threads between runs: they would compete with the simulator's torch threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 4  # onnxruntime's errors reach the user as PulsarErrors (core.ort_errors)
    return opts
