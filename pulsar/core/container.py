"""The compiled model container: one ONNX file that standard tools can open.

Container format, version 3 (``FORMAT_VERSION``). Keep it stable: files written by one pulsar
release must load in the next; anything incompatible bumps the version. Format 2 files (one body per
subgraph) load as single-variant models; format 1 files (no integer program) are refused.

- The file is a single serialized ``onnx.ModelProto`` (``onnx.load`` and Netron open it; it does
  not run in onnxruntime directly because of the custom domains below), followed by its checksum
  (below).
- ``metadata_props``:
  ``pulsar.format`` = ``pulsar-compiled-model``, ``pulsar.format_version`` = ``"3"``,
  ``pulsar.version`` = the pulsar release that wrote it, and every caller metadata entry ``k`` as
  ``pulsar.<k>`` (target_hardware, npu_mode, config_hash, inputs / outputs with dtype and shape,
  processors, cpu_fallbacks, estimate, ...): a string as it is, any other value as JSON (a string
  that would parse as JSON is JSON-quoted; files from before this rule hold every value as JSON and
  read back the same). Types of the keys pulsar writes: :mod:`pulsar.core.container_schema`.
- ``pulsar.checksum`` = ``sha256:<hex>``, the digest of every byte before it, appended as a
  one-entry ``ModelProto`` at the very end of the file (protobuf merges concatenated messages, so it
  reads as one more metadata entry; :mod:`pulsar.core.integrity`). Added within format 2: format 2
  files without it (written before) load unverified; from format 3 on it is mandatory.
- The file is at most 2 GiB (the protobuf limit of one ``ModelProto``) and starts with a
  ``ModelProto`` field; the loader checks both before it reads the file whole.
- The top-level graph has the model's inputs and outputs and one node per subgraph, in execution
  order. NPU subgraphs are ``NpuSubgraph`` nodes of domain ``pulsar.npu``, CPU subgraphs
  ``CpuSubgraph`` nodes of domain ``pulsar.cpu`` (both registered in ``opset_import``, version 1,
  next to the default domain's opset). Node attributes:
  ``body`` (GraphProto: for an NPU subgraph the integer program of ``pulsar.int`` ops and data
  movement on integer tensors, see docs/integer_semantics.md; for a CPU subgraph standard float
  ONNX ops, including the QuantizeLinear / DequantizeLinear at the borders),
  ``reference_body`` (NPU subgraphs: the float QDQ fragment with the same inputs and outputs, run by
  ``--mode Reference``),
  ``name`` (string), ``kind`` (``"npu"`` / ``"cpu"``, matching the domain), ``options`` (JSON
  mapping: the per-subgraph compile options, keys from the build config's compiler options plus
  ``sub_config``).
- Node inputs / outputs are the tensors crossing the subgraph border, and they carry the same
  names as the body's graph inputs / outputs (binding is by name, not only by position); every node
  input is a model input or an earlier node's output.
- Variants (format 3, :mod:`pulsar.core.variants`): a model compiled for several batch sizes and / or
  input shape groups lists them in the ``pulsar.variants`` metadata (``[{group, batch}]``, index =
  variant id; ``pulsar.batch_axes``, ``pulsar.shape_groups``, ``pulsar.batch_sizes``,
  ``pulsar.batch_mode`` describe them). A subgraph node then also carries ``variant_ids`` (ints: the
  variant of ``body``, then of each ``variant_bodies`` entry), ``variant_bodies`` (graphs) and, for NPU
  subgraphs, ``variant_reference_bodies``; every body has the node's interface names. The top-level
  inputs / outputs are those of variant 0 (group 0 at the largest batch). A single-variant model
  writes none of these.
- Weights are stored once: every initializer lives in the top-level graph and bodies refer to it
  by name (ONNX outer-scope reference), so batch / shape variants added later share them.
  Initializers of different subgraphs that have the same name and content are merged; a name
  clash with different content renames the later one inside its body.

The loader (:func:`load_compiled`) checks all of the above and reports any deviation as one line
naming the file, the subgraph and the entry.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from pulsar.core.container_check import (
    check_dataflow,
    check_io_types,
    check_metadata,
    parse_options,
    string_attr,
)
from pulsar.core.container_schema import decode_value, encode_value, metadata_problem, option_problem
from pulsar.core.graph import assign_fields, outer_scope_inputs, subgraphs
from pulsar.core.int_ops import INT_DOMAIN
from pulsar.core.integrity import CHECKSUM_KEY, sealed_bytes, verify
from pulsar.core.variants import VARIANTS_KEY, variant_problem
from pulsar.errors import PulsarError
from pulsar.utils.atomic import atomic_write_bytes, pending_bytes

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 1: NPU bodies held the QDQ graph (no integer program); 2: one body per subgraph
CHECKSUM_REQUIRED_FROM = 3  # format 2 files may predate the checksum; every later file ends with one
_MAX_BYTES = 2**31 - 1  # one serialized ModelProto (protobuf's limit)
# ModelProto field number -> wire type (0 varint, 2 length-delimited): what a model file can start with
_MODEL_FIELDS = {1: 0, 2: 2, 3: 2, 4: 2, 5: 0, 6: 2, 7: 2, 8: 2, 14: 2, 20: 2, 25: 2, 26: 2}
FORMAT_NAME = "pulsar-compiled-model"
META_PREFIX = "pulsar."
META_FORMAT = "pulsar.format"
META_FORMAT_VERSION = "pulsar.format_version"
META_VERSION = "pulsar.version"
_RESERVED_META = {META_FORMAT, META_FORMAT_VERSION, META_VERSION, CHECKSUM_KEY}


@dataclass(frozen=True)
class _Kind:
    kind: str
    op_type: str
    domain: str


# kind -> how its node is spelled; the loader inverts it by domain.
SUBGRAPH_KINDS: dict[str, _Kind] = {
    "npu": _Kind("npu", "NpuSubgraph", "pulsar.npu"),
    "cpu": _Kind("cpu", "CpuSubgraph", "pulsar.cpu"),
}
_KIND_BY_DOMAIN = {k.domain: k for k in SUBGRAPH_KINDS.values()}


def pulsar_version() -> str:
    try:
        from pulsar import __version__
    except ImportError:
        return "0.1.0"
    return str(__version__)


@dataclass
class Subgraph:
    """One partition of the model; ``graph`` is self-contained (own inputs / outputs / initializers)."""

    name: str
    kind: str
    graph: onnx.GraphProto
    options: dict[str, Any] = field(default_factory=dict)
    # NPU subgraphs: the float QDQ fragment computing the same integer outputs (Reference mode)
    reference: onnx.GraphProto | None = None
    # format 3: the model variants (ids into pulsar.variants) of [graph, *extra]; extra holds the
    # other variants' (body, reference body), same interface names as ``graph``
    variant_ids: list[int] = field(default_factory=lambda: [0])
    extra: list[tuple[onnx.GraphProto, onnx.GraphProto | None]] = field(default_factory=list)

    def has(self, variant: int) -> bool:
        return variant in self.variant_ids

    def at(self, variant: int) -> Subgraph:
        """This subgraph as compiled for one variant (a single-body view)."""
        if variant not in self.variant_ids:
            raise KeyError(variant)
        k = self.variant_ids.index(variant)
        graph, reference = (self.graph, self.reference) if k == 0 else self.extra[k - 1]
        return Subgraph(self.name, self.kind, graph, self.options, reference, [variant])


@dataclass
class CompiledModel:
    """A loaded compiled model; ``subgraphs[i].graph`` has its referenced weights copied in."""

    model: onnx.ModelProto
    format_version: int
    metadata: dict[str, object]
    subgraphs: list[Subgraph]
    checksum: str | None = None  # the verified "sha256:<hex>"; None for a file written before checksums

    @property
    def pulsar_version(self) -> str:
        return _metadata_props(self.model).get(META_VERSION, "unknown")


# --------------------------------------------------------------------------- graph helpers


def _defined_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    names |= {o for n in graph.node for o in n.output if o}
    return names


def outer_references(graph: onnx.GraphProto) -> set[str]:
    """Names ``graph`` (and graphs nested in it) uses but does not define."""
    return outer_scope_inputs(graph)


def _rename_refs(graph: onnx.GraphProto, old: str, new: str, *, rename_outputs: bool) -> None:
    """Point every use of ``old`` in ``graph`` (respecting shadowing in nested graphs) to ``new``."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for sub in subgraphs(node):
            if old not in _defined_names(sub):
                _rename_refs(sub, old, new, rename_outputs=True)
    if rename_outputs:
        for out in graph.output:
            if out.name == old:
                out.name = new


def _same_tensor(a: onnx.TensorProto, b: onnx.TensorProto) -> bool:
    if a.SerializeToString() == b.SerializeToString():
        return True
    if a.data_type != b.data_type or list(a.dims) != list(b.dims):
        return False
    x, y = numpy_helper.to_array(a), numpy_helper.to_array(b)
    if x.dtype == object:
        return bool(x.tolist() == y.tolist())
    return x.tobytes() == y.tobytes()


def _unique_name(base: str, taken: set[str]) -> str:
    i = 1
    while f"{base}__{i}" in taken:
        i += 1
    return f"{base}__{i}"


# --------------------------------------------------------------------------- writing


def _encode_metadata(metadata: dict[str, object]) -> list[tuple[str, str]]:
    props = [
        (META_FORMAT, FORMAT_NAME),
        (META_FORMAT_VERSION, str(FORMAT_VERSION)),
        (META_VERSION, pulsar_version()),
    ]
    for key, value in metadata.items():
        full = META_PREFIX + str(key)
        if full in _RESERVED_META:
            raise ValueError(f"metadata key {key!r} is reserved by the container format")
        props.append((full, encode_value(value)))
    problem = metadata_problem(metadata)
    if problem:
        raise ValueError(f"metadata {problem}")
    return props


def _interface(graph: onnx.GraphProto) -> tuple[list[str], list[str]]:
    return [i.name for i in graph.input], [o.name for o in graph.output]


def _check_variants(sg: Subgraph, body: onnx.GraphProto, reference: onnx.GraphProto | None,
                    extra: list[tuple[onnx.GraphProto, onnx.GraphProto | None]], n_variants: int) -> None:
    """Every body of a subgraph has the same interface; ids are distinct and listed in the metadata."""
    if len(sg.variant_ids) != 1 + len(extra) or len(set(sg.variant_ids)) != len(sg.variant_ids):
        raise ValueError(f"subgraph {sg.name!r}: variant_ids {sg.variant_ids} do not match its {1 + len(extra)} "
                         "bodies (distinct ids, one per body)")
    if any(not 0 <= v < n_variants for v in sg.variant_ids):
        raise ValueError(f"subgraph {sg.name!r}: variant_ids {sg.variant_ids} outside the metadata's "
                         f"{n_variants} variants")
    want = _interface(body)
    for i, (g, r) in enumerate([(body, reference), *extra]):
        if _interface(g) != want or (r is not None and _interface(r) != want):
            raise ValueError(f"subgraph {sg.name!r}: the body of variant {sg.variant_ids[i]} has another interface "
                             "than its first body")
        if (r is None) != (reference is None):
            raise ValueError(f"subgraph {sg.name!r}: every variant needs a reference body, or none does")


def package(
    subgraphs: list[Subgraph],
    *,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    opset_imports: list[onnx.OperatorSetIdProto],
    metadata: dict[str, object],
    path: str | Path,
    ir_version: int | None = None,
) -> Path:
    """Write ``subgraphs`` (in execution order) as one compiled model file at ``path``.

    ``ir_version`` defaults to the lowest IR version that the default-domain opset needs, which
    keeps the bodies loadable by the widest range of onnxruntime releases.
    """
    top_inits: dict[str, onnx.TensorProto] = {}
    # Names that are values (not weights) anywhere: an initializer must never shadow one of them.
    taken = {v.name for v in inputs} | {v.name for v in outputs}
    for sg in subgraphs:
        for g in [sg.graph, *(body for body, _ in sg.extra)]:
            init_names = {t.name for t in g.initializer}
            taken |= {i.name for i in g.input if i.name not in init_names}
            taken |= {o for n in g.node for o in n.output if o}
    n_variants = len(metadata.get(VARIANTS_KEY) or [None])  # type: ignore[arg-type]

    nodes: list[onnx.NodeProto] = []
    border_infos: dict[str, onnx.ValueInfoProto] = {}

    def hoist(graph: onnx.GraphProto, sg_name: str) -> onnx.GraphProto:
        """A copy of ``graph`` whose initializers moved to the top level (merged by name + content): the
        copy leaves them out, and the top-level graph copies each once (a transformer's embedding table
        is tens of MB)."""
        body = onnx.GraphProto()
        assign_fields(body, graph, skip="initializer")
        inits = list(graph.initializer)
        init_names = {t.name for t in inits}
        # Old-style graphs list weights as inputs too; they are constants, not border tensors.
        kept = [i for i in body.input if i.name not in init_names]
        del body.input[:]
        body.input.extend(kept)
        output_names = {o.name for o in body.output}
        for tensor in inits:
            name = tensor.name
            existing = top_inits.get(name)
            if existing is not None and _same_tensor(existing, tensor):
                continue
            if existing is None and name not in taken:
                top_inits[name] = tensor
                continue
            new = _unique_name(name, taken | set(top_inits) | _defined_names(body))
            log.debug("subgraph %s: initializer %s renamed to %s (name clash)", sg_name, name, new)
            _rename_refs(body, name, new, rename_outputs=False)
            if name in output_names:  # keep the body's interface: output = Identity(weight)
                body.node.append(helper.make_node("Identity", [new], [name], name=f"{new}_as_output"))
            renamed = copy.deepcopy(tensor)
            renamed.name = new
            top_inits[new] = renamed
        return body

    for sg in subgraphs:
        if sg.kind not in SUBGRAPH_KINDS:
            raise ValueError(
                f"subgraph {sg.name!r}: unknown kind {sg.kind!r} (known: {sorted(SUBGRAPH_KINDS)})"
            )
        body = hoist(sg.graph, sg.name)
        reference = hoist(sg.reference, sg.name) if sg.reference is not None else None
        extra = [(hoist(g, sg.name), None if r is None else hoist(r, sg.name)) for g, r in sg.extra]
        _check_variants(sg, body, reference, extra, n_variants)
        problem = option_problem(sg.options)
        if problem:
            raise ValueError(f"subgraph {sg.name!r}: {problem}")
        kind = SUBGRAPH_KINDS[sg.kind]
        node = helper.make_node(
            kind.op_type,
            [i.name for i in body.input],
            [o.name for o in body.output],
            name=sg.name,
            domain=kind.domain,
        )
        # built by hand: make_node's own ``name`` keyword would swallow the "name" attribute
        node.attribute.extend(
            [
                helper.make_attribute("body", body),
                helper.make_attribute("name", sg.name),
                helper.make_attribute("kind", sg.kind),
                helper.make_attribute("options", json.dumps(sg.options, sort_keys=True)),
            ]
        )
        if reference is not None:
            node.attribute.append(helper.make_attribute("reference_body", reference))
        if sg.variant_ids != [0]:
            node.attribute.append(helper.make_attribute("variant_ids", list(sg.variant_ids)))
        if extra:
            node.attribute.append(helper.make_attribute("variant_bodies", [g for g, _ in extra]))
            if reference is not None:
                refs = [r for _, r in extra if r is not None]
                node.attribute.append(helper.make_attribute("variant_reference_bodies", refs))
        nodes.append(node)
        for vi in list(body.input) + list(body.output):
            border_infos.setdefault(vi.name, vi)

    io_names = {v.name for v in inputs} | {v.name for v in outputs}
    value_info = [vi for name, vi in border_infos.items() if name not in io_names]
    opsets = [op for op in opset_imports if op.domain not in _KIND_BY_DOMAIN]
    opsets += [helper.make_opsetid(k.domain, 1) for k in SUBGRAPH_KINDS.values()]
    body_domains = {n.domain for sg in subgraphs for n in sg.graph.node}
    if INT_DOMAIN in body_domains and all(op.domain != INT_DOMAIN for op in opsets):
        opsets.append(helper.make_opsetid(INT_DOMAIN, 1))
    if ir_version is None:
        default = [op for op in opsets if op.domain in ("", "ai.onnx")]
        ir_version = max(helper.find_min_ir_version_for(default, ignore_unknown=True), 4)
    model = helper.make_model(
        onnx.GraphProto(), opset_imports=opsets, producer_name="pulsar", producer_version=pulsar_version()
    )
    # the graph filled in place: make_graph, then make_model's copy of it, would copy the weights twice
    graph = model.graph
    graph.name = "pulsar_compiled_model"
    graph.node.extend(nodes)
    graph.input.extend(inputs)
    graph.output.extend(outputs)
    graph.initializer.extend(top_inits.values())
    graph.value_info.extend(value_info)
    model.ir_version = ir_version
    helper.set_model_props(model, dict(_encode_metadata(metadata)))
    path = Path(path)
    atomic_write_bytes(path, sealed_bytes(model), background=True)  # the load check reads the bytes meanwhile
    log.debug("wrote compiled model %s (%d subgraphs, %d initializers)", path, len(nodes), len(top_inits))
    return path


def tensor_infos(values: Iterable[onnx.ValueInfoProto]) -> list[dict[str, object]]:
    """JSON-friendly name / dtype / shape of graph inputs or outputs (symbolic dims as strings)."""
    infos: list[dict[str, object]] = []
    for v in values:
        t = v.type.tensor_type
        dtype = str(np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))) if t.elem_type else None
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        infos.append({"name": v.name, "dtype": dtype, "shape": shape})
    return infos


# --------------------------------------------------------------------------- loading


def _metadata_props(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _decode_metadata(props: dict[str, str]) -> dict[str, object]:
    return {key[len(META_PREFIX):]: decode_value(value) for key, value in props.items()
            if key.startswith(META_PREFIX) and key not in _RESERVED_META}


def _attrs(node: onnx.NodeProto) -> dict[str, onnx.AttributeProto]:
    return {a.name: a for a in node.attribute}


def _body(path: Path, node: onnx.NodeProto, attr: onnx.AttributeProto | None, what: str,
          inits: dict[str, onnx.TensorProto]) -> onnx.GraphProto:
    """A copy of a body graph with the weights it refers to copied in; its interface is the node's."""
    if attr is None or attr.type != onnx.AttributeProto.GRAPH:
        raise PulsarError(f"compiled model {path}: subgraph {node.name!r} has no {what} graph; the file is corrupt: "
                          "rebuild it")
    body = copy.deepcopy(attr.g)
    if [i.name for i in body.input] != list(node.input) or [o.name for o in body.output] != list(node.output):
        raise PulsarError(f"compiled model {path}: subgraph {node.name!r} inputs / outputs do not match its {what}; "
                          "the file is corrupt: rebuild it")
    for name in sorted(outer_references(body)):
        if name in inits:
            body.initializer.append(inits[name])
    return body


def _read_subgraph(path: Path, node: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
                   n_variants: int) -> Subgraph:
    kind = _KIND_BY_DOMAIN.get(node.domain)
    if kind is None:
        raise PulsarError(
            f"{path}: subgraph node {node.name!r} has unknown domain {node.domain!r} "
            f"(this pulsar knows {sorted(_KIND_BY_DOMAIN)}); it was written by another tool or a newer pulsar"
        )
    attrs = _attrs(node)
    declared = string_attr(path, node, attrs.get("kind"))
    if declared is not None and declared != kind.kind or node.op_type != kind.op_type:
        raise PulsarError(f"compiled model {path}: subgraph {node.name!r} is a {node.op_type} of kind "
                          f"{declared!r} in domain {node.domain!r} (expected a {kind.op_type} of kind {kind.kind!r}); "
                          "the file is corrupt or was edited: rebuild it")
    body = _body(path, node, attrs.get("body"), "body", inits)
    reference = _body(path, node, attrs["reference_body"], "reference body", inits) \
        if "reference_body" in attrs else None
    name = string_attr(path, node, attrs.get("name")) or node.name
    options = parse_options(path, name, string_attr(path, node, attrs.get("options")))
    ids, extra = _read_variants(path, node, attrs, inits, n_variants, reference is not None)
    return Subgraph(name=name, kind=kind.kind, graph=body, options=options, reference=reference,
                    variant_ids=ids, extra=extra)


def _read_variants(path: Path, node: onnx.NodeProto, attrs: dict[str, onnx.AttributeProto],
                   inits: dict[str, onnx.TensorProto], n_variants: int,
                   has_reference: bool) -> tuple[list[int], list[tuple[onnx.GraphProto, onnx.GraphProto | None]]]:
    """Format 3: the variant ids of a subgraph's bodies and its other variants' bodies."""
    ids_attr, bodies_attr = attrs.get("variant_ids"), attrs.get("variant_bodies")
    refs_attr = attrs.get("variant_reference_bodies")
    ids = list(ids_attr.ints) if ids_attr is not None else [0]
    bodies = list(bodies_attr.graphs) if bodies_attr is not None else []
    refs = list(refs_attr.graphs) if refs_attr is not None else []
    problem = None
    if len(ids) != 1 + len(bodies) or len(set(ids)) != len(ids):
        problem = f"variant_ids {ids} do not match its {1 + len(bodies)} bodies"
    elif any(not 0 <= v < n_variants for v in ids):
        problem = f"variant_ids {ids} name variants the metadata does not list ({n_variants})"
    elif has_reference and len(refs) != len(bodies) or not has_reference and refs:
        problem = f"has {len(refs)} variant reference bodies for {len(bodies)} variant bodies"
    if problem:
        raise PulsarError(f"compiled model {path}: subgraph {node.name!r} {problem}; the file is corrupt or was "
                          "edited: rebuild it")
    extra = []
    for k, g in enumerate(bodies):
        graph_attr = helper.make_attribute("body", g)
        ref = _body(path, node, helper.make_attribute("body", refs[k]), f"variant {ids[k + 1]} reference body",
                    inits) if has_reference else None
        extra.append((_body(path, node, graph_attr, f"variant {ids[k + 1]} body", inits), ref))
    return ids, extra


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, or those of this build's write of it still on its way to the disk."""
    written = pending_bytes(path)
    if written is not None:
        return written
    if "\0" in str(path):
        raise PulsarError(f"compiled model path {str(path)!r} contains a NUL byte; fix the path")
    if path.is_dir():
        hint = f" (did you mean {path / 'compiled.pulsar'}?)" if (path / "compiled.pulsar").is_file() else ""
        raise PulsarError(f"compiled model {path} is a directory; give the compiled model file{hint}")
    if not path.exists():
        raise PulsarError(f"compiled model {path} does not exist; build it with `pulsar build` or fix the path")
    if not path.is_file():
        raise PulsarError(f"compiled model {path} is not a regular file; give the compiled model file")
    try:
        _check_size_and_header(path)
        return path.read_bytes()
    except OSError as exc:
        raise PulsarError(f"compiled model {path} cannot be read ({exc.strerror or exc})") from None


def _first_tag(head: bytes) -> tuple[int, int] | None:
    """(field number, wire type) of the protobuf tag ``head`` starts with, None when it holds none."""
    value = 0
    for i, byte in enumerate(head[:5]):
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value >> 3, value & 7
    return None


def _check_size_and_header(path: Path) -> None:
    """Refuse what cannot be a compiled model before reading it whole: a file beyond the protobuf
    limit (a sparse 6 GiB file would otherwise be read into memory) or one that does not start with
    a ``ModelProto`` field (zeros, text, an archive)."""
    size = path.stat().st_size
    if size > _MAX_BYTES:
        raise PulsarError(f"compiled model {path} is {size / 2**30:.1f} GiB, more than the 2 GiB one ONNX model "
                          "file can hold; it is not a pulsar compiled model (or is damaged): rebuild it")
    if size == 0:
        return  # parsed as an empty model: "truncated or corrupt (no graph)"
    with open(path, "rb") as f:
        head = f.read(16)
    tag = _first_tag(head)
    if tag is None or _MODEL_FIELDS.get(tag[0]) != tag[1]:
        raise PulsarError(f"compiled model {path} is truncated or corrupt (it does not start like an ONNX model: "
                          f"first bytes {head[:4].hex(' ')}); rebuild it")


def _format_version(path: Path, props: dict[str, str]) -> int:
    if props.get(META_FORMAT) != FORMAT_NAME:
        raise PulsarError(
            f"{path} is not a pulsar compiled model (it looks like a plain ONNX model; "
            "build it with `pulsar build` first)"
        )
    try:
        version = int(props.get(META_FORMAT_VERSION, ""))
    except ValueError:
        raise PulsarError(
            f"compiled model {path} is truncated or corrupt (bad {META_FORMAT_VERSION} "
            f"{props.get(META_FORMAT_VERSION)!r}); rebuild it"
        ) from None
    if version > FORMAT_VERSION:
        raise PulsarError(
            f"compiled model {path} was written by a newer pulsar (format {version}, this pulsar reads "
            f"up to {FORMAT_VERSION}): upgrade pulsar"
        )
    if version < 1:
        raise PulsarError(f"compiled model {path} has invalid format version {version}; rebuild it")
    if version < 2:
        raise PulsarError(f"compiled model {path} was written by an older pulsar (format {version}, without the "
                          f"integer NPU program); rebuild it with this pulsar")
    return version


def load_compiled(path: str | Path) -> CompiledModel:
    """Read and check a compiled model (format, checksum, structure, options, metadata); every problem
    is a one-line PulsarError naming the file and the entry. ``model`` holds no checksum entry."""
    path = Path(path)
    raw = _read_bytes(path)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise PulsarError(f"compiled model {path} is truncated or corrupt ({exc}); rebuild it") from None
    if not model.HasField("graph") or not model.opset_import:
        raise PulsarError(f"compiled model {path} is truncated or corrupt (no graph); rebuild it")
    version = _format_version(path, _metadata_props(model))
    checksum = verify(path, raw, model, required=version >= CHECKSUM_REQUIRED_FROM)
    check_io_types(path, model.graph)
    check_dataflow(path, model.graph)
    inits = {t.name: t for t in model.graph.initializer}
    metadata = _decode_metadata(_metadata_props(model))
    raw_variants = metadata.get(VARIANTS_KEY)
    n_variants = len(raw_variants) if isinstance(raw_variants, list) and raw_variants else 1
    check_metadata(path, metadata, {"inputs": tensor_infos(model.graph.input),
                                    "outputs": tensor_infos(model.graph.output)})
    subgraphs = [_read_subgraph(path, node, inits, n_variants) for node in model.graph.node]
    problem = variant_problem(metadata, subgraphs)
    if problem:
        raise PulsarError(f"compiled model {path}: {problem}; the file is corrupt or was edited: rebuild it")
    return CompiledModel(model=model, format_version=version, metadata=metadata, subgraphs=subgraphs,
                         checksum=checksum)
