"""ONNX conformance: the ONNX backend node tests built and run through pulsar (``python -m bench.conformance``)."""
