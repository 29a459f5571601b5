"""Quantization precision analysis (Reference mode): per-layer cosine / MSE / SQNR of a QDQ model
against its float model, as a text table, a rich console table and a mermaid graph coloured by cosine.

    rows = analyze(float_model, qdq_model, samples, method="PerLayer", quant_json=cfg)
    write_table(rows, "precision.txt"); show(precision_table(rows)); write_mermaid(float_model, rows, "graph.mmd")
"""

from __future__ import annotations

from pulsar.quant.analysis.mermaid import mermaid_text, worst_rows, write_mermaid
from pulsar.quant.analysis.metrics import COSINE_GOOD, COSINE_OK, Accumulator, grade
from pulsar.quant.analysis.perlayer import METHODS, LayerPrecision, analyze, layer_name
from pulsar.quant.analysis.table import precision_table, table_text, write_table

__all__ = ["COSINE_GOOD", "COSINE_OK", "METHODS", "Accumulator", "LayerPrecision", "analyze", "grade",
           "layer_name", "mermaid_text", "precision_table", "table_text", "worst_rows", "write_mermaid",
           "write_table"]
