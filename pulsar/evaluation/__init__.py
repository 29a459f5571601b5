"""Evaluation at the end of a build: the float, QDQ and compiled models scored by one metric.

The last stage: it runs the artifacts the earlier ones wrote (onnxruntime for the float and QDQ
models, :class:`pulsar.runtime.session.Session` for the compiled one) and imports only from below.
"""
