"""Which body of each subgraph runs, and how a batch of samples is split among compiled batches.

A session runs one shape group of a compiled model (``group``; 0 is the model's own input shape).
In a multi-batch model (``pulsar.batch_mode``) a sample is one item on axis 0 of every input, and a
call may carry any number N of them: each subgraph splits its inputs into its own compiled batches
(:func:`pulsar.core.variants.split_batch`, largest first) along each border tensor's batch axis
(``pulsar.batch_axes``), runs them, and joins the outputs on the same axes. Other models run the
group's single body as compiled (one "sample" is the compiled input).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from pulsar.core.container import CompiledModel, tensor_infos
from pulsar.core.tensors import TensorInfo
from pulsar.core.variants import (
    BATCH_AXES_KEY,
    SHAPE_GROUPS_KEY,
    Variant,
    is_multi_batch,
    plan_text,
    split_batch,
    variants_of,
)
from pulsar.errors import PulsarError


def _infos(entries: list[dict[str, object]]) -> list[TensorInfo]:
    out = []
    for e in entries:
        dims = cast("list[object]", e["shape"])  # checked when loaded: a list of dims
        shape = tuple(d if isinstance(d, int) else -1 for d in dims)
        out.append(TensorInfo(str(e["name"]), shape, np.dtype(str(e["dtype"]))))
    return out


def group_text(compiled: CompiledModel) -> str:
    """Every shape group with its inputs' shapes (for error messages and ``pulsar info``)."""
    groups = compiled.metadata.get(SHAPE_GROUPS_KEY)
    if not isinstance(groups, list) or not groups:
        return "0: " + ", ".join(f"{t['name']} {t['shape']}" for t in tensor_infos(compiled.model.graph.input))
    return "; ".join(f"{g}: " + ", ".join(f"{t['name']} {t['shape']}" for t in entry["inputs"])
                     for g, entry in enumerate(groups))


@dataclass
class GroupView:
    """One shape group of a compiled model: per-sample inputs / outputs and each subgraph's bodies."""

    group: int
    multi_batch: bool
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    bodies: list[dict[int, int]]  # per subgraph: batch -> variant id
    batch_axes: dict[str, int]

    @classmethod
    def of(cls, compiled: CompiledModel, group: int) -> GroupView:
        variants = variants_of(compiled.metadata)
        groups = sorted({v.group for v in variants})
        if not isinstance(group, int) or isinstance(group, bool) or group not in groups:
            raise PulsarError(f"--group_index {group!r} is not a shape group of this model; its groups: "
                              f"{group_text(compiled)}")
        multi = is_multi_batch(compiled.metadata)
        bodies = [{variants[v].batch: v for v in sg.variant_ids if variants[v].group == group}
                  for sg in compiled.subgraphs]
        shape_groups = compiled.metadata.get(SHAPE_GROUPS_KEY)
        if isinstance(shape_groups, list) and shape_groups:
            entry = shape_groups[group]
            inputs, outputs = _infos(entry["inputs"]), _infos(entry["outputs"])
        else:
            inputs = _infos(tensor_infos(compiled.model.graph.input))
            outputs = _infos(tensor_infos(compiled.model.graph.output))
        axes = compiled.metadata.get(BATCH_AXES_KEY)
        return cls(group, multi, inputs, outputs, bodies, dict(axes) if isinstance(axes, dict) else {})

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({b for per in self.bodies for b in per})

    def plan(self, index: int, n: int, name: str) -> list[int]:
        """The compiled batches subgraph ``index`` runs ``n`` samples as (an error when none add up)."""
        if not self.multi_batch:
            return [1]
        per = self.bodies[index]
        if n in per:
            return [n]
        plan = split_batch(n, per)
        if plan is None:
            sums = [k for k in range(1, 4 * max(per) + 1) if split_batch(k, per) is not None][:6]
            raise PulsarError(f"{n} sample(s) cannot be run as the compiled batches {sorted(per)} (of subgraph "
                              f"{name!r}): use a number of samples they add up to, e.g. "
                              f"{', '.join(map(str, sums))}")
        return plan

    def variant(self, index: int, batch: int) -> int:
        per = self.bodies[index]
        return per[batch] if self.multi_batch else next(iter(per.values()))


def split_feeds(feeds: dict[str, np.ndarray], plan: Sequence[int], axes: dict[str, int], n: int
                ) -> list[dict[str, np.ndarray]]:
    """``feeds`` of ``n`` samples cut into chunks of ``plan`` samples along each tensor's batch axis."""
    chunks: list[dict[str, np.ndarray]] = [{} for _ in plan]
    for name, value in feeds.items():
        axis = axes.get(name, 0)
        if value.shape[axis] % n:
            raise PulsarError(f"tensor {name!r} of shape {value.shape} does not hold {n} samples on axis {axis}")
        per = value.shape[axis] // n
        bounds = np.cumsum([0, *plan]) * per
        for k in range(len(plan)):
            index = [slice(None)] * value.ndim
            index[axis] = slice(int(bounds[k]), int(bounds[k + 1]))
            chunks[k][name] = value[tuple(index)]
    return chunks


def join_outputs(parts: list[dict[str, np.ndarray]], axes: dict[str, int]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([p[name] for p in parts], axis=axes.get(name, 0)) for name in parts[0]}


def run_split(run: Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]], feeds: dict[str, np.ndarray],
              plan: list[int], axes: dict[str, int], n: int,
              parallel: Callable[[Callable[[tuple[int, dict[str, np.ndarray]]], dict[str, np.ndarray]],
                                  list[tuple[int, dict[str, np.ndarray]]]], list[dict[str, np.ndarray]]],
              ) -> dict[str, np.ndarray]:
    """Run ``feeds`` (``n`` samples) as the chunks of ``plan``: ``run(batch, chunk)`` per chunk."""
    if len(plan) == 1:
        return run(plan[0], feeds)
    chunks = list(zip(plan, split_feeds(feeds, plan, axes, n), strict=True))
    return join_outputs(parallel(lambda item: run(item[0], item[1]), chunks), axes)


def describe_plan(view: GroupView, names: list[str], kinds: list[str], n: int) -> str:
    """``npu_0: 4 + 4 + 1`` for each NPU subgraph (what a run of ``n`` samples does)."""
    parts = []
    for i, (name, kind) in enumerate(zip(names, kinds, strict=True)):
        if kind == "npu":
            parts.append(f"{name}: {plan_text(view.plan(i, n, name))}")
    return ", ".join(parts)


__all__ = ["GroupView", "Variant", "describe_plan", "group_text", "join_outputs", "run_split", "split_feeds"]
