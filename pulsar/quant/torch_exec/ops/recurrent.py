"""Recurrent layers (LSTM, GRU, RNN) as a python loop over time steps in torch, so that AdaRound /
BRECQ / LSQ can back-propagate through them into W, R and B.

The input projection ``X W^T + Wb`` of every step is one matmul ahead of the loop; only the
recurrence ``H R^T`` runs per step. ``sequence_lens`` is handled by masking with ``torch.where``
(a finished sequence keeps its state and emits zeros) and, for the reverse direction, by reversing
each sequence inside its own length before and after the loop, so that it starts at its own last
valid step. The attention family (Attention, RotaryEmbedding, ...) lives in ``attention.py``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op

__all__: list[str] = []

Act = Callable[[Tensor], Tensor]

# which of (alpha, beta) each activation reads, with the defaults of the matching ONNX op
_ACT_PARAMS: dict[str, tuple[float | None, float | None]] = {
    "affine": (1.0, 0.0), "leakyrelu": (0.01, None), "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, None),
}


def _activation(name: str, alpha: float, beta: float) -> Act:
    fns: dict[str, Act] = {
        "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu,
        "affine": lambda x: alpha * x + beta,
        "leakyrelu": lambda x: F.leaky_relu(x, alpha),
        "thresholdedrelu": lambda x: torch.where(x > alpha, x, torch.zeros_like(x)),
        "scaledtanh": lambda x: alpha * torch.tanh(beta * x),
        "hardsigmoid": lambda x: torch.clamp(alpha * x + beta, 0.0, 1.0),
        "elu": lambda x: F.elu(x, alpha),
        "softsign": F.softsign, "softplus": F.softplus,
    }
    if name not in fns:
        raise NotImplementedError(f"recurrent activation {name!r}")
    return fns[name]


def _activations(c: Call, defaults: list[str], n_dir: int) -> list[list[Act]]:
    """The node's activation functions, one list per direction. ``activation_alpha`` / ``_beta`` are
    consumed in order by the functions that take them (as onnxruntime does); a list given for one
    direction only is used for both."""
    names = [str(n).lower() for n in c.attr("activations", [])] or [d.lower() for d in defaults] * n_dir
    if len(names) == len(defaults) and n_dir == 2:
        names = names * 2
    alphas, betas = list(c.attr("activation_alpha", [])), list(c.attr("activation_beta", []))
    fns: list[Act] = []
    for name in names:
        a_def, b_def = _ACT_PARAMS.get(name, (None, None))
        a = (alphas.pop(0) if alphas else a_def) if a_def is not None else 0.0
        b = (betas.pop(0) if betas else b_def) if b_def is not None else 0.0
        fns.append(_activation(name, float(a), float(b)))
    k = len(defaults)
    return [fns[d * k:(d + 1) * k] for d in range(n_dir)]


def _reverse_within(x: Tensor, lens: Tensor) -> Tensor:
    """Reverse each batch entry of ``x`` ([seq, batch, ...]) inside its own length; padding stays put.
    Its own inverse."""
    seq = x.shape[0]
    t = torch.arange(seq, device=x.device).unsqueeze(1)
    idx = torch.where(t < lens, lens - 1 - t, t)  # [seq, batch]
    idx = idx.reshape(idx.shape + (1,) * (x.dim() - 2)).expand_as(x)
    return torch.gather(x, 0, idx)


StepFn = Callable[[Tensor, list[Tensor], int], list[Tensor]]


def _run_direction(xw: Tensor, states: list[Tensor], lens: Tensor | None, reverse: bool,
                   step: StepFn) -> tuple[Tensor, list[Tensor]]:
    """Run one direction over the projected input ``xw`` ([seq, batch, G*H]); ``step(x_t, states, d)``
    returns the new states (hidden first). Returns Y ([seq, batch, H]) and the final states."""
    seq = xw.shape[0]
    if reverse:
        xw = _reverse_within(xw, lens) if lens is not None else xw.flip(0)
    ys: list[Tensor] = []
    for t in range(seq):
        new = step(xw[t], states, t)
        if lens is None:
            states = new
            ys.append(new[0])
        else:
            alive = t < lens.reshape(-1, 1)  # [batch, 1]
            states = [torch.where(alive, n, s) for n, s in zip(new, states, strict=True)]
            ys.append(torch.where(alive, new[0], torch.zeros_like(new[0])))
    y = torch.stack(ys) if ys else xw.new_zeros((0, xw.shape[1], states[0].shape[-1]))
    if reverse:
        y = _reverse_within(y, lens) if lens is not None else y.flip(0)
    return y, states


def _recurrent(c: Call, n_gates: int, acts_default: list[str], n_states: int,
               make_step: Callable[[int, list[Act], Tensor, Tensor | None, Tensor | None], StepFn]
               ) -> list[Tensor]:
    """What LSTM / GRU / RNN share: layout, directions, biases, initial states, sequence lengths and
    the output shapes. ``make_step(hidden, acts, R, Rb, P)`` builds one direction's step."""
    x, w, r = _x(c), _x(c, 1), _x(c, 2)
    b, lens_in = c.input(3), c.input(4)
    init = [c.input(5), c.input(6)][:n_states]
    peep = c.input(7)
    layout = int(c.attr("layout", 0))
    direction = c.attr("direction", "forward")
    n_dir = 2 if direction == "bidirectional" else 1
    hidden = r.shape[-1]
    if layout:
        x = x.transpose(0, 1)
        init = [None if s is None else s.transpose(0, 1) for s in init]
    seq, batch = x.shape[0], x.shape[1]
    lens: Tensor | None = None
    if lens_in is not None:
        lens = lens_in.to(torch.int64).reshape(1, -1).to(x.device)
        if bool((lens >= seq).all()):
            lens = None  # every sequence full length: the plain (faster) path
    acts = _activations(c, acts_default, n_dir)
    ys, finals = [], []
    for d in range(n_dir):
        wb = rb = None
        if b is not None:
            wb, rb = b[d, :n_gates * hidden], b[d, n_gates * hidden:]
        xw = x @ w[d].transpose(0, 1)
        if wb is not None:
            xw = xw + wb
        states = [x.new_zeros((batch, hidden)) if s is None else s[d] for s in init]
        step = make_step(hidden, acts[d], r[d], rb, None if peep is None else peep[d])
        reverse = direction == "reverse" or d == 1
        y, st = _run_direction(xw, states, lens, reverse, step)
        ys.append(y)
        finals.append(st)
    y_all = torch.stack(ys, 1)  # [seq, dir, batch, H]
    outs = [torch.stack([f[k] for f in finals]) for k in range(n_states)]  # [dir, batch, H]
    if layout:
        y_all = y_all.permute(2, 0, 1, 3)
        outs = [o.transpose(0, 1) for o in outs]
    return [y_all, *outs]


def _clipper(c: Call) -> Act:
    clip = c.attr("clip")
    if clip is None:
        return lambda v: v
    lim = float(clip)
    return lambda v: torch.clamp(v, -lim, lim)


@op("LSTM")
def lstm(c: Call) -> list[Tensor]:
    """Gates in ONNX order i, o, f, c; peepholes P = [Pi, Po, Pf]; ``input_forget`` couples f = 1 - i."""
    clip = _clipper(c)
    coupled = bool(c.attr("input_forget", 0))

    def make_step(h: int, acts: list[Act], r: Tensor, rb: Tensor | None, p: Tensor | None) -> StepFn:
        f_act, g_act, h_act = acts

        def step(xw_t: Tensor, states: list[Tensor], t: int) -> list[Tensor]:
            h_prev, c_prev = states
            g = xw_t + h_prev @ r.transpose(0, 1)
            if rb is not None:
                g = g + rb
            gi, go, gf, gc = g[:, :h], g[:, h:2 * h], g[:, 2 * h:3 * h], g[:, 3 * h:]
            if p is not None:
                gi, gf = gi + p[:h] * c_prev, gf + p[2 * h:] * c_prev
            i = f_act(clip(gi))
            f = 1 - i if coupled else f_act(clip(gf))
            c_new = f * c_prev + i * g_act(clip(gc))
            if p is not None:
                go = go + p[h:2 * h] * c_new
            o = f_act(clip(go))
            return [o * h_act(c_new), c_new]
        return step

    return _recurrent(c, 4, ["Sigmoid", "Tanh", "Tanh"], 2, make_step)


@op("GRU")
def gru(c: Call) -> list[Tensor]:
    """Gates in ONNX order z, r, h; ``linear_before_reset`` applies r after the recurrence matmul
    (and its bias) instead of before."""
    clip = _clipper(c)
    lbr = bool(c.attr("linear_before_reset", 0))

    def make_step(h: int, acts: list[Act], r: Tensor, rb: Tensor | None, p: Tensor | None) -> StepFn:
        f_act, g_act = acts
        rt = r.transpose(0, 1)

        def step(xw_t: Tensor, states: list[Tensor], t: int) -> list[Tensor]:
            h_prev = states[0]
            zr = h_prev @ rt[:, :2 * h]
            if rb is not None:
                zr = zr + rb[:2 * h]
            zr = f_act(clip(xw_t[:, :2 * h] + zr))
            z, rg = zr[:, :h], zr[:, h:]
            if lbr:
                rh = h_prev @ rt[:, 2 * h:]
                if rb is not None:
                    rh = rh + rb[2 * h:]
                pre = xw_t[:, 2 * h:] + rg * rh
            else:
                pre = xw_t[:, 2 * h:] + (rg * h_prev) @ rt[:, 2 * h:]
                if rb is not None:
                    pre = pre + rb[2 * h:]
            h_new = g_act(clip(pre))
            return [(1 - z) * h_new + z * h_prev]
        return step

    return _recurrent(c, 3, ["Sigmoid", "Tanh"], 1, make_step)


@op("RNN")
def rnn(c: Call) -> list[Tensor]:
    clip = _clipper(c)

    def make_step(h: int, acts: list[Act], r: Tensor, rb: Tensor | None, p: Tensor | None) -> StepFn:
        rt = r.transpose(0, 1)

        def step(xw_t: Tensor, states: list[Tensor], t: int) -> list[Tensor]:
            pre = xw_t + states[0] @ rt
            if rb is not None:
                pre = pre + rb
            return [acts[0](clip(pre))]
        return step

    return _recurrent(c, 1, ["Tanh"], 1, make_step)
