"""The transformer family: Attention (opset 23+), RotaryEmbedding, RMSNormalization, and the
opset-27 LinearAttention / CausalConvWithState, in torch so that fine-tuning trains through them.

Masks are turned into one additive bias (0 = attend, -inf = masked) as the spec's function body
does; a query row whose bias is -inf everywhere yields zeros (not NaN), and its logits are replaced
before the softmax so that no NaN reaches the backward pass either."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op

__all__: list[str] = []

# softmax_precision / stash_type: ONNX element type -> torch dtype
_ONNX_FLOAT = {1: torch.float32, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16}


def _heads(t: Tensor, n: int) -> Tensor:
    """[B, S, n*D] -> [B, n, S, D]."""
    b, s, hd = t.shape
    return t.reshape(b, s, n, hd // n).transpose(1, 2)


def _neg_inf_where(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full_like(zero, -math.inf))


def _offset(nonpad: Tensor | None, past: Tensor | None, q_len: int) -> Tensor:
    """Count of valid keys before the query block: [B, 1, 1, 1] per batch (external cache) or scalar."""
    if past is None and nonpad is not None:
        return (nonpad.to(torch.int64) - q_len).reshape(-1, 1, 1, 1)
    return torch.tensor(past.shape[2] if past is not None else 0)


def _attn_bias(c: Call, q: Tensor, kv_len: int, past: Tensor | None) -> Tensor:
    """The additive bias [.., S_q, S_kv] from attn_mask, is_causal, the windows and nonpad_kv_seqlen."""
    mask, nonpad = c.input(3), c.input(6)
    q_len, dt, dev = q.shape[2], q.dtype, q.device
    bias = torch.zeros((q_len, kv_len), dtype=dt, device=dev)
    if mask is not None:
        pad = kv_len - mask.shape[-1]
        if mask.dtype == torch.bool:
            if pad > 0:
                mask = F.pad(mask, (0, pad), value=False)
            bias = bias + _neg_inf_where(mask, dt)
        else:
            if pad > 0:
                mask = F.pad(mask, (0, pad), value=-math.inf)
            bias = bias + mask.to(dt)
    i = torch.arange(q_len, device=dev).reshape(-1, 1)
    j = torch.arange(kv_len, device=dev).reshape(1, -1)
    rel = i + _offset(nonpad, past, q_len).to(dev) - j  # query's absolute position minus key's
    if c.attr("is_causal", 0):
        bias = bias + _neg_inf_where(rel >= 0, dt)
    left, right = int(c.attr("left_window_size", -1)), int(c.attr("right_window_size", -1))
    if left >= 0:
        bias = bias + _neg_inf_where(rel <= left, dt)
    if right >= 0:
        bias = bias + _neg_inf_where(-rel <= right, dt)
    if nonpad is not None:
        valid = j < nonpad.to(torch.int64).reshape(-1, 1, 1, 1).to(dev)
        bias = bias + _neg_inf_where(valid, dt)
    return bias


@op("Attention")
def attention(c: Call) -> list[Tensor]:
    """softmax(softcap(Q K^T * scale) + bias) V with GQA by repeating each KV head (h0, h0, h1, ...);
    outputs Y, present_key, present_value and the qk_matmul_output of ``qk_matmul_output_mode``."""
    q, k, v = _x(c), _x(c, 1), _x(c, 2)
    past_k, past_v = c.input(4), c.input(5)
    three_d = q.dim() == 3
    if three_d:
        q = _heads(q, int(c.attr("q_num_heads")))
        k = _heads(k, int(c.attr("kv_num_heads")))
        v = _heads(v, int(c.attr("kv_num_heads")))
    scale = c.attr("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = torch.tensor(math.sqrt(scale), dtype=q.dtype, device=q.device)
    present_k = k if past_k is None else torch.cat([past_k, k], 2)
    present_v = v if past_v is None else torch.cat([past_v, v], 2)
    bias = _attn_bias(c, q, present_k.shape[2], past_k)
    k_all, v_all = present_k, present_v
    if q.shape[1] != k_all.shape[1]:
        reps = q.shape[1] // k_all.shape[1]
        k_all, v_all = k_all.repeat_interleave(reps, 1), v_all.repeat_interleave(reps, 1)
    qk = (q * s) @ (k_all * s).transpose(-1, -2)
    mode = int(c.attr("qk_matmul_output_mode", 0))
    qk_out = qk
    softcap = float(c.attr("softcap", 0.0))
    if softcap > 0:
        qk = softcap * torch.tanh(qk / softcap)
        if mode == 1:
            qk_out = qk
    logits = qk + bias
    if mode == 2:
        qk_out = logits
    prec = c.attr("softmax_precision")
    sm_dtype = _ONNX_FLOAT.get(int(prec), q.dtype) if prec is not None else q.dtype
    dead = torch.isneginf(bias.amax(-1, keepdim=True))  # fully masked rows
    logits = torch.where(dead, torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
    probs = torch.softmax(logits.to(sm_dtype), -1)
    probs = torch.where(dead, torch.zeros((), dtype=probs.dtype, device=probs.device), probs).to(q.dtype)
    if mode == 3:
        qk_out = probs
    y = probs @ v_all
    if three_d:
        y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
    return [y, present_k, present_v, qk_out.to(q.dtype)]


@op("RotaryEmbedding")
def rotary_embedding(c: Call) -> list[Tensor]:
    """Rotate the first ``rotary_embedding_dim`` features of each head in (x1, x2) pairs: halves, or
    even/odd features when ``interleaved``."""
    x, cos, sin, pos = _x(c), _x(c, 1), _x(c, 2), c.input(3)
    shape = x.shape
    # [B, S, H, D]
    x = x.transpose(1, 2) if x.dim() == 4 else x.reshape(shape[0], shape[1], int(c.attr("num_heads")), -1)
    dim = int(c.attr("rotary_embedding_dim", 0)) or x.shape[-1]
    if pos is not None:
        cos, sin = cos[pos.to(torch.int64)], sin[pos.to(torch.int64)]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, dim/2]
    rot, rest = x[..., :dim], x[..., dim:]
    if c.attr("interleaved", 0):
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :dim // 2], rot[..., dim // 2:]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if c.attr("interleaved", 0):
        rot = torch.stack([real, imag], -1).reshape(rot.shape)
    else:
        rot = torch.cat([real, imag], -1)
    y = torch.cat([rot, rest], -1)
    return [y.transpose(1, 2) if len(shape) == 4 else y.reshape(shape)]


@op("RMSNormalization")
def rms_normalization(c: Call) -> list[Tensor]:
    """x / sqrt(mean(x^2) + eps) over the axes from ``axis`` on, in ``stash_type`` precision (never below
    the input's), then times scale."""
    x, scale = _x(c), _x(c, 1)
    axes = list(range(int(c.attr("axis", -1)) % x.dim(), x.dim()))
    stash = _ONNX_FLOAT.get(int(c.attr("stash_type", 1)), torch.float32)
    work = stash if torch.finfo(stash).bits > torch.finfo(x.dtype).bits else x.dtype
    xs = x.to(work)
    norm = xs / torch.sqrt((xs * xs).mean(axes, keepdim=True) + float(c.attr("epsilon", 1e-5)))
    return [norm.to(x.dtype) * scale]


@op("LinearAttention")
def linear_attention(c: Call) -> list[Tensor]:
    """The recurrent state S ([B, H_kv, d_k, d_v]) updated token by token (linear / gated / delta /
    gated_delta rule), read by each query as scale * q^T S; computed in float32 as the reference does."""
    q_in, k_in, v_in = _x(c), _x(c, 1), _x(c, 2)
    past, decay, beta = c.input(3), c.input(4), c.input(5)
    hq, hkv = int(c.attr("q_num_heads")), int(c.attr("kv_num_heads"))
    rule = c.attr("update_rule", "gated_delta")
    f32 = torch.float32
    q, k, v = _heads(q_in.to(f32), hq), _heads(k_in.to(f32), hkv), _heads(v_in.to(f32), hkv)
    b, _, t, d_k = q.shape
    d_v = v.shape[-1]
    scale = float(c.attr("scale", 0.0)) or 1.0 / math.sqrt(d_k)
    g = None
    if rule in ("gated", "gated_delta"):
        assert decay is not None
        g = _heads(decay.to(f32), hkv) if decay.shape[-1] == hkv * d_k else decay.to(f32).transpose(1, 2)[..., None]
    bt = None
    if rule in ("delta", "gated_delta"):
        assert beta is not None
        bt = beta.to(f32).transpose(1, 2)[..., None]  # [B, H_kv or 1, T, 1]
    state = past.to(f32) if past is not None else q.new_zeros((b, hkv, d_k, d_v))
    group = hq // hkv
    outs = []
    for i in range(t):
        k_t, v_t = k[:, :, i], v[:, :, i]
        if g is not None:
            state = state * torch.exp(g[:, :, i])[..., None]
        if bt is not None:
            v_t = bt[:, :, i] * (v_t - torch.einsum("bhdm,bhd->bhm", state, k_t))
        state = state + k_t[..., :, None] * v_t[..., None, :]
        read = state.repeat_interleave(group, 1) if group > 1 else state
        outs.append(scale * torch.einsum("bhd,bhdm->bhm", q[:, :, i], read))
    out = torch.stack(outs, 2) if outs else q.new_zeros((b, hq, 0, d_v))
    out = out.transpose(1, 2).reshape(b, t, hq * d_v).to(q_in.dtype)
    return [out, state.to(past.dtype if past is not None else q_in.dtype)]


@op("CausalConvWithState")
def causal_conv_with_state(c: Call) -> list[Tensor]:
    """Depthwise conv1d over [past_state (or zeros), input]; the last k-1 positions are the new state."""
    x, w, bias, past = _x(c), _x(c, 1), c.input(2), c.input(3)
    k = w.shape[2]
    if past is None:
        past = x.new_zeros((x.shape[0], x.shape[1], k - 1))
    padded = torch.cat([past.to(x.dtype), x], 2)
    y = F.conv1d(padded, w, bias, groups=x.shape[1])
    if c.attr("activation", "none") in ("silu", "swish"):
        y = F.silu(y.to(torch.float32)).to(x.dtype)
    return [y, padded[:, :, padded.shape[2] - (k - 1):]]
