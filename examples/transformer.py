"""A small transformer encoder exported to ONNX with LayerNorm and GELU spelt out in primitive ops.

Test and benchmark subject for pulsar's fusion passes. torch's legacy exporter emits the native
``LayerNormalization`` op from opset 17 on, which would leave the LayerNorm fusion nothing to do, so
the model is exported at opset 16: LayerNorm becomes ReduceMean / Sub / Pow / ReduceMean / Add /
Sqrt / Div / Mul / Add and GELU becomes Div / Erf / Add / Mul / Mul. pulsar's loader converts the
file to opset 17 without re-fusing anything, so pulsar's own passes have to find the patterns.

Exported in eval mode (dropout 0 as well) with torch's fused encoder fast path switched off, so
nn.MultiheadAttention is traced op by op (Gemm / MatMul / Softmax / Transpose / Reshape), never as
one opaque attention op; the export is checked for exactly that.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx

from pulsar.utils.atomic import atomic_path

log = logging.getLogger(__name__)

EXPORT_OPSET = 16
INPUT_NAME = "tokens"
OUTPUT_NAME = "features"
# Ops a spelt-out export must not contain: fused forms pulsar is meant to create itself.
_FUSED_OPS = frozenset({"LayerNormalization", "Gelu", "FastGelu", "Attention", "MultiHeadAttention"})


def transformer_encoder_module(*, d_model: int = 64, heads: int = 4, layers: int = 2, seed: int = 0):
    """The seeded ``nn.TransformerEncoder`` (post-norm, GELU, batch_first, no dropout) in eval mode.

    Feed-forward width is 2 * d_model. Every weight and bias is drawn at random, LayerNorm gains
    and biases included: the default affine (1, 0) would hide a fusion that drops them.
    """
    import torch
    from torch import nn

    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        d_model,
        heads,
        dim_feedforward=2 * d_model,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=False,
    )
    encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    with torch.no_grad():
        for module in encoder.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
            elif isinstance(module, nn.Linear | nn.MultiheadAttention):
                # The layers are deep copies of one another: draw each anew, so that a pass mixing
                # up layers shows, and the exporter cannot share one initializer between them.
                for param in module.parameters(recurse=False):
                    param.uniform_(-(d_model**-0.5), d_model**-0.5)
    return encoder.eval()


def transformer_encoder_onnx(
    path: str | Path, *, seq: int = 16, d_model: int = 64, heads: int = 4, layers: int = 2, seed: int = 0
) -> Path:
    """Export :func:`transformer_encoder_module` to ``path`` at opset 16 (see the module docstring).

    Input ``tokens`` [1, seq, d_model] float, output ``features`` of the same shape. Raises
    RuntimeError if the export holds a fused op after all (a torch upgrade that changed the
    exporter), since the model would then no longer test pulsar's fusions.
    """
    import torch

    path = Path(path)
    encoder = transformer_encoder_module(d_model=d_model, heads=heads, layers=layers, seed=seed)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    # In eval mode with grads off, each encoder layer takes torch's fused fast path, which traces
    # into one aten::_transformer_encoder_layer_fwd that ONNX cannot express: force the op-by-op path.
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with atomic_path(path) as tmp, warnings.catch_warnings(), torch.enable_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                encoder,
                (torch.zeros(1, seq, d_model),),
                str(tmp),
                opset_version=EXPORT_OPSET,
                dynamo=False,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
            )
            _check_spelt_out(onnx.load(str(tmp)), torch.__version__)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    log.info("exported a %d-layer transformer encoder to %s", layers, path)
    return path


def _check_spelt_out(model: onnx.ModelProto, torch_version: str) -> None:
    ops = {n.op_type for n in model.graph.node}
    fused = ops & _FUSED_OPS
    missing = {"MatMul", "Softmax", "ReduceMean", "Erf"} - ops
    if fused or missing:
        raise RuntimeError(
            f"torch {torch_version} exported the encoder at opset {EXPORT_OPSET} with fused op(s) "
            f"{sorted(fused)} and without {sorted(missing)}; it no longer spells LayerNorm / GELU / "
            "attention out, so it cannot test pulsar's fusions"
        )
