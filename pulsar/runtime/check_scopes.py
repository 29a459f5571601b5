"""Which tensors ``compiler.check`` compares with which options: one scope per ``compiler.sub_configs``
range (its own check, check_mode, tolerances and black list, the top level's where it leaves them
unset) and one for every tensor outside the ranges (the compiler section's options).

A range's tensors are those its NPU subgraphs compute (a sub-config range is lowered to subgraphs of
its own, tagged ``sub_config`` in their options); CPU ops inside a range, like every tensor outside
the ranges, follow the top level. Per layer, a range compares each of its tensors with each op fed the
reference's inputs; CheckOutput compares the range's output tensors with the range's subgraphs fed the
reference's values of their inputs (pulsar2 checks a sub-config subgraph on its outputs that way), and
the top level's CheckOutput compares the model outputs end to end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from pulsar.compiler.lower.model import SubRange
from pulsar.core.container import CompiledModel
from pulsar.runtime.session import Session

# the compiler options a sub-config range may set for its own check
CHECK_FIELDS = ("check", "check_mode", "check_rtol", "check_atol", "check_cosine_simularity",
                "check_tensor_black_list")


@dataclass(frozen=True)
class Scope:
    """Tensors checked with the options ``c``: those of sub-config range ``sub``, or (``sub`` None) every
    tensor outside the ranges when ``outside``, else every tensor of the model."""

    c: Any
    sub: int | None = None
    label: str = ""  # "" for a model without ranges (messages stay as they were)
    outside: bool = False
    start: tuple[str, ...] = ()
    end: tuple[str, ...] = ()

    @property
    def reference(self) -> str:
        """The reference this scope's check level compares with: check 2 an integer one, else the float QDQ one."""
        return "integer" if self.c.check == 2 else "float"

    def holds(self, tensor: str, owner: dict[str, int]) -> bool:
        if self.sub is not None:
            return owner.get(tensor) == self.sub
        return tensor not in owner if self.outside else True


def _with(c: Any, values: dict[str, Any]) -> Any:
    if dataclasses.is_dataclass(c) and not isinstance(c, type):
        return dataclasses.replace(c, **values)
    return SimpleNamespace(**{**vars(c), **values})


def scopes_of(c: Any, sub_configs: Sequence[SubRange]) -> list[Scope]:
    """The top level's scope, then one per range; a range's options are its effective ones (SubRange.options:
    the top level's, overridden), its check fields applied over ``c``."""
    if not sub_configs:
        return [Scope(c)]
    out = [Scope(c, None, "compiler (the tensors outside the sub_configs ranges)", outside=True)]
    for k, sub in enumerate(sub_configs):
        values = {f: sub.options[f] for f in CHECK_FIELDS if sub.options.get(f) is not None}
        if "check_tensor_black_list" in values:
            values["check_tensor_black_list"] = tuple(values["check_tensor_black_list"])
        label = f"compiler.sub_configs[{k}] ({', '.join(sub.start_tensor_names)} -> {', '.join(sub.end_tensor_names)})"
        out.append(Scope(_with(c, values), k, label, start=tuple(sub.start_tensor_names),
                         end=tuple(sub.end_tensor_names)))
    return out


def range_owner(compiled: CompiledModel) -> dict[str, int]:
    """Tensor -> sub-config range index, for every tensor computed by an NPU subgraph of a range."""
    out: dict[str, int] = {}
    for sg in compiled.subgraphs:
        k = sg.options.get("sub_config")
        if k is None:
            continue
        for body in [sg.graph, *(b for b, _ in sg.extra)]:
            out.update({o: int(k) for n in body.node for o in n.output if o})
    return out


def range_subgraphs(compiled: CompiledModel, sub: int) -> tuple[list[int], list[str]]:
    """The subgraphs (indices) of range ``sub`` and their outputs: what its CheckOutput compares."""
    indices = [i for i, sg in enumerate(compiled.subgraphs) if sg.options.get("sub_config") == sub]
    outputs = [o.name for i in indices for o in compiled.subgraphs[i].graph.output]
    return indices, outputs


@dataclass
class Runs:
    """The runs one sample needs, each made once whatever the number of scopes that read it."""

    sim: Session
    refs: dict[str, Session]  # "integer" / "float" -> reference session
    feed: dict[str, np.ndarray]
    _cache: dict[tuple[str, ...], dict[str, np.ndarray]] = field(default_factory=dict)

    def _get(self, key: tuple[str, ...], make: Any) -> dict[str, np.ndarray]:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def reference_all(self, kind: str) -> dict[str, np.ndarray]:
        return self._get(("all", kind), lambda: self.refs[kind].run_all(self.feed))

    def isolated(self, kind: str) -> dict[str, np.ndarray]:
        """Every tensor of the simulation, each op fed the reference's inputs."""
        return self._get(("isolated", kind), lambda: self.sim.run_isolated(self.feed, self.reference_all(kind)))

    def outputs(self, kind: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The model outputs end to end: simulation, reference."""
        return self._get(("out",), lambda: self.sim.run(self.feed)), \
            self._get(("out", kind), lambda: self.refs[kind].run(self.feed))

    def fed(self, kind: str, sub: int) -> dict[str, np.ndarray]:
        """Range ``sub``'s subgraphs, each fed the reference's values of its inputs."""
        indices, _ = range_subgraphs(self.sim.compiled, sub)
        return self._get(("fed", kind, str(sub)),
                         lambda: self.sim.run_subgraphs(self.feed, self.reference_all(kind), indices))
