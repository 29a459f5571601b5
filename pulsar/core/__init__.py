"""What several stages share, below all of them: it imports no stage (tests/test_layering.py).

- the compiled-model container, read and written (:mod:`~pulsar.core.container`, with its
  :mod:`~pulsar.core.integrity`, :mod:`~pulsar.core.container_schema` and
  :mod:`~pulsar.core.container_check`), and the nested-graph scoping it relies on (:mod:`~pulsar.core.graph`);
- the integer NPU ops of NPU bodies as ONNX schemas (:mod:`~pulsar.core.int_ops`) and the
  fixed-point arithmetic both the compiler and the simulator use (:mod:`~pulsar.core.fixedpoint`);
- model inputs / outputs and their tensor files (:mod:`~pulsar.core.tensors`, :mod:`~pulsar.core.tensor_io`),
  and the onnxruntime options for float QDQ math (:mod:`~pulsar.core.ort_options`).
"""
