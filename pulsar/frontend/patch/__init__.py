"""User patches from the config: ``const_processors``, ``op_processors`` and ``quant_op_processors``.

Exported models sometimes bake in a value the user must change before the build can go on (a
Reshape's hard-coded batch of 1, an AveragePool exported with ``ceil_mode=0``). These functions
patch such values in place. Every entry is checked first, against the constant's dtype and shape or
against the operator schema, so that a typo fails here with the config field named instead of as
a wrong result or an obscure error later in the build.
"""

from pulsar.frontend.patch.consts import apply_const_processors
from pulsar.frontend.patch.ops import apply_op_processors

__all__ = ["apply_const_processors", "apply_op_processors"]
