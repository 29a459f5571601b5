"""Frontend stage: load a float ONNX model, fix its input shapes and optimize the graph.

Entry points: :mod:`pulsar.frontend.loader` (load / input shapes) and
:mod:`pulsar.frontend.pass_manager` (passes + transformation check).
"""
