"""quant_config.json's layout: the same JSON value, one line per tensor and per node."""

from __future__ import annotations

import json
import math

from pulsar.utils.jsonrows import dumps_rows


def test_rows_round_trip_with_one_line_per_entry() -> None:
    doc = {
        "version": 3,
        "conventions": {"scale": "real = (q - zero_point) * scale"},  # a dict of strings: not a table
        "tensors": {"conv1": {"dtype": "U8", "scale": [0.1, 0.25], "range": [-1.5, 2.0]},
                    'odd "name"\n': {"dtype": "S16", "scale": 1e-9, "nan": math.nan}},
        "nodes": {},
        "empty": [],
    }
    text = dumps_rows(doc)
    back = json.loads(text)
    assert back.keys() == doc.keys() and back["tensors"]["conv1"] == doc["tensors"]["conv1"]
    assert math.isnan(back["tensors"]['odd "name"\n']["nan"])
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and text.endswith("\n")
    assert sum('"dtype"' in line for line in lines) == 2  # each tensor on a line of its own
    assert any(line.startswith('  "conv1": {"dtype": "U8", "scale": [0.1, 0.25]') for line in lines)
    assert ' "conventions": {"scale": "real = (q - zero_point) * scale"},' in lines
