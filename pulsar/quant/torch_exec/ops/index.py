"""Indexing ops: Gather / GatherElements / GatherND, Scatter / ScatterElements / ScatterND /
TensorScatter, Compress, NonZero, TopK, Unique, NonMaxSuppression and TfIdfVectorizer.

Negative indices count from the end of their axis (the spec, for every op here); indices produced
are int64."""

from __future__ import annotations

import math

import torch

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op

_REDUCTION = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _wrap(idx: Tensor, n: int | Tensor) -> Tensor:
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + n, idx)


@op("Gather")
def gather(c: Call) -> list[Tensor]:
    x, idx = _x(c), _x(c, 1)
    axis = c.attr("axis", 0) % x.dim()
    idx = _wrap(idx, x.shape[axis])
    out = x.index_select(axis, idx.reshape(-1))
    return [out.reshape(*x.shape[:axis], *idx.shape, *x.shape[axis + 1:])]


@op("GatherElements")
def gather_elements(c: Call) -> list[Tensor]:
    x = _x(c)
    axis = c.attr("axis", 0) % x.dim()
    return [torch.gather(x, axis, _wrap(_x(c, 1), x.shape[axis]))]


def _linear(idx: Tensor, dims: list[int]) -> Tensor:
    """Row-major linear index over ``dims`` of the last axis of ``idx`` (k = len(dims) entries)."""
    idx = _wrap(idx, torch.tensor(dims, device=idx.device))
    strides = [math.prod(dims[j + 1:]) for j in range(len(dims))]
    return (idx * torch.tensor(strides, dtype=torch.int64, device=idx.device)).sum(-1)


@op("GatherND")
def gather_nd(c: Call) -> list[Tensor]:
    """Batch dims flattened into one, the k indexed dims into one, then one advanced-index read."""
    x, idx = _x(c), _x(c, 1)
    b = c.attr("batch_dims", 0)
    k = idx.shape[-1]
    batch = math.prod(x.shape[:b])
    flat = x.reshape(batch, math.prod(x.shape[b:b + k]), *x.shape[b + k:])
    lin = _linear(idx.reshape(batch, -1, k), list(x.shape[b:b + k]))
    out = flat[torch.arange(batch, device=x.device)[:, None], lin]
    return [out.reshape(*idx.shape[:-1], *x.shape[b + k:])]


@op("ScatterElements", "Scatter")
def scatter_elements(c: Call) -> list[Tensor]:
    x, upd = _x(c), _x(c, 2)
    axis = c.attr("axis", 0) % x.dim()
    idx = _wrap(_x(c, 1), x.shape[axis])
    reduction = c.attr("reduction", "none")
    if reduction == "none":
        return [torch.scatter(x, axis, idx, upd)]
    return [torch.scatter_reduce(x, axis, idx, upd, _REDUCTION[reduction], include_self=True)]


@op("ScatterND")
def scatter_nd(c: Call) -> list[Tensor]:
    """The k indexed dims flattened into one: a scatter of whole slices along it."""
    x, idx, upd = _x(c), _x(c, 1), _x(c, 2)
    k = idx.shape[-1]
    rest = x.shape[k:]
    flat = x.reshape(math.prod(x.shape[:k]), *rest)
    lin = _linear(idx.reshape(-1, k), list(x.shape[:k]))
    upd = upd.reshape(-1, *rest)
    reduction = c.attr("reduction", "none")
    if reduction in ("none", "add"):
        out = flat.index_put((lin,), upd, accumulate=reduction == "add")
    else:
        where = lin.reshape(-1, *[1] * len(rest)).expand(upd.shape)
        out = flat.scatter_reduce(0, where, upd, _REDUCTION[reduction], include_self=True)
    return [out.reshape(x.shape)]


@op("TensorScatter")
def tensor_scatter(c: Call) -> list[Tensor]:
    """The update written along ``axis`` from each batch's write index (modulo the length if circular)."""
    past, upd = _x(c), _x(c, 1)
    axis = c.attr("axis", -2) % past.dim()
    w = c.input(2)
    start = torch.zeros(past.shape[0], dtype=torch.int64, device=past.device) if w is None else w.to(torch.int64)
    pos = start[:, None] + torch.arange(upd.shape[axis], device=past.device)[None, :]
    if c.attr("mode", "linear") == "circular":
        pos = pos % past.shape[axis]
    view = [1] * past.dim()
    view[0], view[axis] = past.shape[0], upd.shape[axis]
    return [torch.scatter(past, axis, pos.reshape(view).expand(upd.shape), upd)]


@op("Compress")
def compress(c: Call) -> list[Tensor]:
    """Slices where the condition holds; a condition shorter than the axis drops the rest."""
    x, cond = _x(c), _x(c, 1).reshape(-1).to(torch.bool)
    axis = c.attr("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis %= x.dim()
    keep = torch.nonzero(cond[: x.shape[axis]]).reshape(-1)
    return [x.index_select(axis, keep)]


@op("NonZero")
def non_zero(c: Call) -> list[Tensor]:
    x = _x(c)
    return [torch.nonzero(x.reshape(1) if x.dim() == 0 else x).t().contiguous()]


@op("TopK")
def top_k(c: Call) -> list[Tensor]:
    """A stable sort, so equal values come lowest index first (as onnxruntime); always sorted."""
    x = _x(c)
    k = c.attr("k") if c.input(1) is None else int(_x(c, 1).reshape(-1)[0])
    axis = c.attr("axis", -1) % x.dim()
    vals, idx = torch.sort(x, dim=axis, descending=bool(c.attr("largest", 1)), stable=True)
    return [vals.narrow(axis, 0, k), idx.narrow(axis, 0, k)]


@op("Unique")
def unique(c: Call) -> list[Tensor]:
    """torch.unique for values, inverse and counts; first occurrences by a min-scatter of positions;
    ``sorted`` = 0 orders the uniques by first occurrence."""
    x = _x(c)
    axis = c.attr("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis %= x.dim()
    _, inv, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True,
                                  dim=axis if x.dim() > 1 else None)
    inv = inv.reshape(-1)
    n = counts.numel()
    pos = torch.arange(x.shape[axis], device=x.device)
    first = torch.full((n,), x.shape[axis], dtype=torch.int64, device=x.device)
    first = first.scatter_reduce(0, inv, pos, "amin")
    if not c.attr("sorted", 1):
        order = torch.argsort(first)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n, device=x.device)
        first, counts, inv = first[order], counts[order], rank[inv]
    return [x.index_select(axis, first), first, inv, counts.to(torch.int64)][: c.n_outputs]


def _corners(b: Tensor, center: bool) -> Tensor:
    """[y1, x1, y2, x2] with y1 <= y2, x1 <= x2 (corners may come in any order), from either format."""
    if center:
        xc, yc, w, h = b.unbind(-1)
        return torch.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], -1)
    y1, x1, y2, x2 = b.unbind(-1)
    return torch.stack([torch.minimum(y1, y2), torch.minimum(x1, x2), torch.maximum(y1, y2),
                        torch.maximum(x1, x2)], -1)


def _iou(a: Tensor, b: Tensor) -> float:
    h = (torch.minimum(a[2], b[2]) - torch.maximum(a[0], b[0])).clamp(min=0)
    w = (torch.minimum(a[3], b[3]) - torch.maximum(a[1], b[1])).clamp(min=0)
    inter = float(h * w)
    area_a = float((a[2] - a[0]) * (a[3] - a[1]))
    area_b = float((b[2] - b[0]) * (b[3] - b[1]))
    if area_a <= 0 or area_b <= 0 or inter <= 0:
        return 0.0
    return inter / (area_a + area_b - inter)


def _first(c: Call, i: int, default: float) -> float:
    """An optional scalar input's value (an omitted or empty one: ``default``)."""
    t = c.input(i)
    return default if t is None or t.numel() == 0 else float(t.reshape(-1)[0])


@op("NonMaxSuppression")
def non_max_suppression(c: Call) -> list[Tensor]:
    """onnxruntime's greedy loop: candidates above the score threshold by descending score (ties lower
    index first), each kept unless its IoU with a kept box exceeds the threshold; [batch, class, box]."""
    boxes, scores = _x(c), _x(c, 1)
    limit, iou_t, score_t = int(_first(c, 2, 0)), _first(c, 3, 0.0), _first(c, 4, -math.inf)
    corners = _corners(boxes.detach().float(), bool(c.attr("center_point_box", 0)))
    rows: list[list[int]] = []
    for b in range(scores.shape[0]):
        for k in range(scores.shape[1]):
            s = scores[b, k].detach().float()
            cand = [i for i in range(s.numel()) if float(s[i]) > score_t]
            cand.sort(key=lambda i: (-float(s[i]), i))
            kept: list[int] = []
            for i in cand:
                if len(kept) >= limit:
                    break
                if all(_iou(corners[b, i], corners[b, j]) <= iou_t for j in kept):
                    kept.append(i)
            rows += [[b, k, i] for i in kept]
    return [torch.tensor(rows, dtype=torch.int64, device=boxes.device).reshape(-1, 3)]


def _ngrams(c: Call) -> dict[tuple[int, ...], int]:
    """The pool's n-grams (of the lengths the node counts) -> their output column."""
    pool = list(c.attr("pool_int64s") or [])
    counts = list(c.attr("ngram_counts"))
    cols = list(c.attr("ngram_indexes"))
    lo, hi = c.attr("min_gram_length"), c.attr("max_gram_length")
    table: dict[tuple[int, ...], int] = {}
    ngram_id = 0
    for n, start in enumerate(counts, 1):
        end = counts[n] if n < len(counts) else len(pool)
        for p in range(start, end - n + 1, n):
            if lo <= n <= hi:
                table[tuple(pool[p:p + n])] = cols[ngram_id]
            ngram_id += 1
    return table


@op("TfIdfVectorizer")
def tfidf_vectorizer(c: Call) -> list[Tensor]:
    """N-gram counts per row, skips of up to ``max_skip_count`` between items (unigrams counted once),
    then TF / IDF / TFIDF weighting; integer pools only (torch holds no strings)."""
    x = _x(c)
    if c.attr("pool_strings"):
        raise NotImplementedError("TfIdfVectorizer on strings: the torch executor holds no string tensors")
    table = _ngrams(c)
    size = max(c.attr("ngram_indexes")) + 1
    lo, hi, skips = c.attr("min_gram_length"), c.attr("max_gram_length"), c.attr("max_skip_count")
    rows = x.reshape(1, -1) if x.dim() <= 1 else x
    freq = torch.zeros(rows.shape[0], size, dtype=torch.float32)
    for r, row in enumerate(rows.tolist()):
        for n in range(max(lo, 1), hi + 1):
            for d in range(1, (skips if n > 1 else 0) + 2):
                for s in range(len(row) - (n - 1) * d):
                    col = table.get(tuple(row[s:s + (n - 1) * d + 1:d]))
                    if col is not None:
                        freq[r, col] += 1
    mode = c.attr("mode")
    w = c.attr("weights")
    weights = torch.tensor(w, dtype=torch.float32) if w else torch.ones(size)
    if mode == "IDF":
        freq = (freq > 0).float() * weights
    elif mode == "TFIDF":
        freq = freq * weights
    out = freq.to(x.device)
    return [out.reshape(size) if x.dim() <= 1 else out]
