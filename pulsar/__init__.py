"""pulsar: float ONNX -> quantized, compiled NPU model, driven by one declarative config.

Python API (same semantics as the CLI)::

    import pulsar
    result = pulsar.build(input="model.onnx", output_dir="out", config="cfg.json",
                          overrides={"quant.calibration_method": "KL"})
    session = pulsar.Session(result.compiled_model)
    outputs = session.run({"input": array})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pulsar.api import BuildResult, build
    from pulsar.runtime.session import Session
    from pulsar.search import sweep

__all__ = ["BuildResult", "Session", "__version__", "build", "sweep"]


def __getattr__(name: str) -> Any:
    # Lazy: `pulsar version` and `pulsar config` should not pay for importing onnxruntime.
    if name in ("build", "BuildResult"):
        from pulsar import api

        return getattr(api, name)
    if name == "sweep":
        from pulsar.search import sweep

        return sweep
    if name == "Session":
        from pulsar.runtime.session import Session

        return Session
    raise AttributeError(f"module 'pulsar' has no attribute {name!r}")
