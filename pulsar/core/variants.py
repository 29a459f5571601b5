"""Variants of a compiled model: the same network compiled for several batch sizes and input shapes.

A compiled model (container format 3) may hold, per subgraph, several bodies: one per *variant*
``(group, batch)``. Group 0 is the model's own input shape, group ``i`` the ``i``-th
``src_extra_shapes`` entry; ``batch`` is a compiled batch size. All bodies share one copy of every
weight (bodies refer to the top-level initializers by name).

The model-level list of variants lives in the ``pulsar.variants`` metadata (index = variant id);
each subgraph node names the ids it has bodies for (``variant_ids``), so subgraphs may hold
different batch sets (``compiler.sub_configs`` may set their own, the dynamic mode chooses per NPU
subgraph). At run time each subgraph splits the samples it receives into its own compiled batches
(:func:`split_batch`) along each border tensor's batch axis (``pulsar.batch_axes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

VARIANTS_KEY = "variants"
BATCH_AXES_KEY = "batch_axes"
SHAPE_GROUPS_KEY = "shape_groups"
BATCH_SIZES_KEY = "batch_sizes"
BATCH_MODE_KEY = "batch_mode"


@dataclass(frozen=True, order=True)
class Variant:
    """One compiled (shape group, batch size) of the model."""

    group: int
    batch: int

    def to_json(self) -> dict[str, int]:
        return {"group": self.group, "batch": self.batch}

    def __str__(self) -> str:
        return f"group {self.group}, batch {self.batch}"


def variants_of(metadata: dict[str, object]) -> list[Variant]:
    """The model's variants (a single-variant list for files without the entry: group 0, batch 1)."""
    raw = metadata.get(VARIANTS_KEY)
    if not isinstance(raw, list) or not raw:
        return [Variant(0, 1)]
    return [Variant(int(v["group"]), int(v["batch"])) for v in cast("list[dict[str, Any]]", raw)]


def is_multi_batch(metadata: dict[str, object]) -> bool:
    """Whether the model was compiled with static / dynamic multi-batch (axis 0 of inputs is a batch)."""
    return metadata.get(BATCH_MODE_KEY) in ("static", "dynamic")


def split_batch(n: int, batches: Iterable[int]) -> list[int] | None:
    """``n`` samples as a sum of compiled ``batches``: fewest runs, largest batches first (1, 2, 4 ->
    3 = 2 + 1, 9 = 4 + 4 + 1); None when no sum of them makes ``n``."""
    sizes = sorted({b for b in batches if b >= 1}, reverse=True)
    if n < 1 or not sizes:
        return None
    inf = n + 1
    best = [0] + [inf] * n  # best[k]: fewest runs that make k samples
    for k in range(1, n + 1):
        best[k] = min((best[k - b] + 1 for b in sizes if b <= k), default=inf)
    if best[n] >= inf:
        return None
    plan, k = [], n
    while k:
        b = next(b for b in sizes if b <= k and best[k - b] == best[k] - 1)
        plan.append(b)
        k -= b
    return plan


def plan_text(plan: Sequence[int]) -> str:
    return " + ".join(str(b) for b in plan)


def variant_index(variants: Sequence[Variant], group: int, batch: int) -> int | None:
    for i, v in enumerate(variants):
        if v.group == group and v.batch == batch:
            return i
    return None


def variant_problem(metadata: dict[str, object], subgraphs: Sequence[Any]) -> str | None:
    """None, or one line on the first inconsistency between the variant entries and the subgraphs'
    bodies (what a run would otherwise trip over): duplicate (group, batch) pairs, groups without a
    shape group entry or without a body in some subgraph, several batches without a batch mode, a batch
    axis outside its tensor."""
    if VARIANTS_KEY not in metadata:
        return None
    variants = variants_of(metadata)
    if len(set(variants)) != len(variants):
        return f"{VARIANTS_KEY} lists a (group, batch) twice"
    groups = sorted({v.group for v in variants})
    if groups != list(range(len(groups))):
        return f"{VARIANTS_KEY} has groups {groups}; expected 0 .. {len(groups) - 1}"
    shape_groups = metadata.get(SHAPE_GROUPS_KEY)
    if not isinstance(shape_groups, list) or len(shape_groups) != len(groups):
        return f"{SHAPE_GROUPS_KEY} does not have one entry per group ({len(groups)})"
    multi = is_multi_batch(metadata)
    for sg in subgraphs:
        for g in groups:
            batches = [variants[v].batch for v in sg.variant_ids if variants[v].group == g]
            if not batches:
                return f"subgraph {sg.name!r} has no body for group {g}"
            if len(batches) > 1 and not multi:
                return f"subgraph {sg.name!r} has several batches for group {g} but {BATCH_MODE_KEY} is not set"
    axes = metadata.get(BATCH_AXES_KEY) or {}
    if multi and isinstance(axes, dict):
        ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for sg in subgraphs
                 for vi in [*sg.graph.input, *sg.graph.output]}
        for name, axis in axes.items():
            if name in ranks and not 0 <= int(axis) < max(ranks[name], 1):
                return f"{BATCH_AXES_KEY}[{name!r}] = {axis} is outside the tensor's {ranks[name]} axes"
    per_sample = [{str(t["name"]): list(t["shape"]) for t in cast("dict[str, list[dict[str, Any]]]", entry)["inputs"]}
                  for entry in shape_groups]
    for sg in subgraphs:
        for v in sg.variant_ids:
            body, variant = sg.at(v).graph, variants[v]
            for vi in body.input:
                want = per_sample[variant.group].get(vi.name)
                if want is None:
                    continue
                want = list(want)
                axis = int(axes.get(vi.name, 0)) if isinstance(axes, dict) else 0
                if multi and want and 0 <= axis < len(want) and isinstance(want[axis], int):
                    want[axis] *= variant.batch
                got = [d.dim_value for d in vi.type.tensor_type.shape.dim]
                if got != want:
                    return (f"subgraph {sg.name!r}, body of {variant}: input {vi.name!r} has shape {got}, "
                            f"the variant's shape is {want}")
    return None
