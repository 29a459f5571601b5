"""Input / output processors: pre- and postprocessing compiled into the model.

``attach_input_processors`` puts a subgraph of standard ONNX ops (opset 11+) in front of each
processed input, so the model takes the raw deployed buffer; ``attach_output_processors`` puts a
transpose / dtype conversion behind outputs. Graph inputs and outputs keep their names (that is what
applications feed and fetch); the model's own tensors are renamed ``<input>_preprocessed`` and
``<output>_raw``.

Conventions (N: batch, H x W: the deployed image, C: channels):

Deployed input shape per ``src_format`` (``src_layout`` NHWC / NCHW):

- BGR, RGB: ``N x H x W x 3`` / ``N x 3 x H x W``; GRAY: ``N x H x W x 1`` / ``N x 1 x H x W``.
- RAW: the model input's shape (no colour handling; only dtype / layout / mean / std / pad / crop).
- YUV420SP (NV12: H rows of Y, then H/2 rows of interleaved U, V pairs) and YVU420SP (NV21: V, U
  pairs): ``N x (H*3/2) x W x 1`` / ``N x 1 x (H*3/2) x W`` (the same bytes either way). H, W even.
- YUYV422 (bytes Y0 U0 Y1 V0 ...) and UYVY422 (U0 Y0 V0 Y1 ...): ``N x H x W x 2`` / ``N x 2 x H x W``:
  pixel (h, w) holds [Y, C] (YUYV) or [C, Y] (UYVY), C being U on even w and V on odd w. W even.
- Chroma is upsampled to full resolution by nearest (each chroma sample is repeated over the 2x2
  block (4:2:0) or the 2 pixels (4:2:2) it covers); YUV always needs a csc_mode (FullRange, LimitedRange:
  BT.601, result clipped to 0..255; Matrix: ``csc_mat``, see :mod:`.color`, not clipped).

Order of the steps: cast to float32 (when any arithmetic or a dtype change is needed) -> unpack YUV
-> slicing -> colour conversion -> padding -> (x - mean) / std -> layout -> cast to the model dtype
(rounded half to even and saturated for an integer model input).

- ``slicing`` crops the deployed image: ``[top, left, bottom, right]`` pixels removed from each side
  (``[v, h]`` = ``[v, h, v, h]``), so the deployed image is larger than the model input.
- ``padding`` adds ``[top, left, bottom, right]`` pixels (``[v, h]`` = ``[v, h, v, h]``) of
  ``padding_constant_value`` after colour conversion and before mean / std: the value is in pixel
  units (114 for a grey letterbox) and the border is normalized like the image.
- So the deployed H = model H - pad top - pad bottom + crop top + crop bottom (W alike).
- ``mean`` / ``std`` are per channel in the model's channel order, applied as (x - mean) / std in
  float32; unset means the input's calibration mean / std, ``[]`` means none.
- Colour: BGR <-> RGB reverses channels; RGB / BGR -> GRAY is the BT.601 luma 0.299 R + 0.587 G +
  0.114 B (not rounded); GRAY -> RGB / BGR replicates the channel.
- AutoColorSpace: tensor_format is BGR for 3 channels, GRAY for 1, else none (RAW); src_format is
  the tensor_format.

Outputs: model outputs are taken as NCHW; ``tensor_layout`` NHWC transposes a 4-D output by
[0, 2, 3, 1]; ``dst_perm`` is any transpose (one or the other). ``output_dtype`` U8 / S8 / U16 / S16
rounds half to even and saturates; FP32 casts other float outputs to float32 and leaves integer
outputs unchanged.
"""

from __future__ import annotations

from pulsar.frontend.processors.inputs import attach_input_processors
from pulsar.frontend.processors.outputs import attach_output_processors

__all__ = ["attach_input_processors", "attach_output_processors"]
