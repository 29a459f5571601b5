"""Control flow that survives the frontend: If, Loop and Scan, their bodies run by the executor.

The body is a GRAPH attribute; ``Call.run_graph`` runs it on its inputs with the enclosing scope's
tensors visible (ONNX's outer-scope names). Bodies run in float: the QDQ export quantizes no tensor
inside a body, so the fake-quantized graph's body is the float one."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, op


def _body(c: Call, name: str, inputs: Sequence[Tensor | None]) -> list[Tensor]:
    if c.run_graph is None:
        raise NotImplementedError(f"{c.attr('_op')} needs the executor's subgraph runner")
    return c.run_graph(c.attr(name), inputs)


@op("If")
def if_(c: Call) -> list[Tensor]:
    cond = c.inputs[0]
    assert cond is not None
    return _body(c, "then_branch" if bool(cond.reshape(-1)[0]) else "else_branch", [])


def _stack(items: list[Tensor], axis: int = 0) -> Tensor:
    return torch.stack(items, dim=axis)


@op("Loop")
def loop(c: Call) -> list[Tensor]:
    """``for i < M while cond``: carried values and the per-iteration scan outputs (stacked on axis 0)."""
    trip, cond = c.input(0), c.input(1)
    carried = [t for t in c.inputs[2:]]
    n_carried = len(carried)
    limit = None if trip is None else int(trip.reshape(-1)[0])
    keep = True if cond is None else bool(cond.reshape(-1)[0])
    scans: list[list[Tensor]] = []
    i = 0
    while keep and (limit is None or i < limit):
        it = torch.tensor(i, dtype=torch.int64)
        c_in = torch.tensor(keep)
        outs = _body(c, "body", [it, c_in, *carried])
        keep = bool(outs[0].reshape(-1)[0])
        carried = list(outs[1:1 + n_carried])
        extra = outs[1 + n_carried:]
        if not scans:
            scans = [[] for _ in extra]
        for acc, t in zip(scans, extra, strict=True):
            acc.append(t)
        i += 1
    n_scan = c.n_outputs - n_carried
    stacked = [_stack(acc) if acc else torch.zeros(0) for acc in scans] or [torch.zeros(0)] * n_scan
    return [*[t for t in carried if t is not None], *stacked]


def _scan(c: Call, states: list[Tensor], xs: list[Tensor], in_axes: list[int], in_rev: list[int],
          out_axes: list[int], out_rev: list[int], length: int | None = None) -> list[Tensor]:
    steps = length if length is not None else (xs[0].shape[in_axes[0]] if xs else 0)
    per_step: list[list[Tensor]] = []
    for t in range(steps):
        sl = [x.select(a, steps - 1 - t if r else t) for x, a, r in zip(xs, in_axes, in_rev, strict=True)]
        outs = _body(c, "body", [*states, *sl])
        states = outs[:len(states)]
        per_step.append(outs[len(states):])
    n_out = len(per_step[0]) if per_step else 0
    ys = []
    for k in range(n_out):
        seq = [step[k] for step in per_step]
        if out_rev[k]:
            seq.reverse()
        ys.append(_stack(seq, out_axes[k] % (seq[0].dim() + 1)))
    return [*states, *ys]


@op("Scan")
def scan(c: Call) -> list[Tensor]:
    """Opset 9+: states then scan inputs, any scan axes and directions. Opset 8: a leading
    (optional) ``sequence_lens`` input and a batch axis 0 in front of every input."""
    m = int(c.attr("num_scan_inputs"))
    if c.attr("_opset", 9) < 9:
        lens = c.input(0)
        ins = [t for t in c.inputs[1:] if t is not None]
        states, xs = ins[:len(ins) - m], ins[len(ins) - m:]
        dirs = list(c.attr("directions", [0] * m))
        per_batch = []
        for b in range(xs[0].shape[0]):
            n = int(lens[b]) if lens is not None else None
            per_batch.append(_scan(c, [s[b] for s in states], [x[b] for x in xs], [0] * m, dirs, [0] * 64, [0] * 64, n))
        return [_stack(list(outs)) for outs in zip(*per_batch, strict=True)]
    ins = [t for t in c.inputs if t is not None]
    states, xs = ins[:len(ins) - m], ins[len(ins) - m:]
    in_axes = [a % xs[k].dim() for k, a in enumerate(c.attr("scan_input_axes", [0] * m))]
    in_rev = list(c.attr("scan_input_directions", [0] * m))
    n_out = c.n_outputs - len(states)
    out_axes = list(c.attr("scan_output_axes", [0] * n_out))
    out_rev = list(c.attr("scan_output_directions", [0] * n_out))
    return _scan(c, states, xs, in_axes, in_rev, out_axes, out_rev)
