"""A transformer as the transformers library exports it: the padding mask indexed out of the
``attention_mask`` input (a Gather on a run-time tensor), combined with boolean ops (And / Not) and
turned into ``Where(mask, 0, finfo.min)``, LayerNormalization ops and a token-type input. The mask is
recognised, added in float, and the padded sentences' embeddings keep their cosine with float."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tests.unseen.helpers import build_and_run, calib_config

S, D, H, V = 16, 32, 4, 50


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)
        self.ln1 = torch.nn.LayerNorm(D)
        self.ff = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D))
        self.ln2 = torch.nn.LayerNorm(D)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(D, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(1, S, H, D // H).transpose(1, 2)

        scores = heads(q) @ heads(k).transpose(-1, -2) / (D // H) ** 0.5 + bias
        a = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(1, S, D)
        x = self.ln1(x + self.out(a))
        return self.ln2(x + self.ff(x))


class HFLike(torch.nn.Module):
    """Embeddings (word + token type + position), HF-style boolean mask, two encoder blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.word = torch.nn.Embedding(V, D)
        self.tok = torch.nn.Embedding(2, D)
        self.pos = torch.nn.Embedding(S, D)
        self.ln = torch.nn.LayerNorm(D)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(S)
        x = self.ln(self.word(input_ids) + self.tok(token_type_ids) + self.pos(idx)[None])
        keep = attention_mask.bool()[:, idx]                              # Gather on the input
        allowed = keep[:, None, None, :] & (idx[None, None, :, None] >= 0)  # And with a (folded) causal-style term
        bias = torch.where(~(~allowed), torch.tensor(0.0), torch.tensor(torch.finfo(torch.float32).min))
        for b in self.blocks:
            x = b(x, bias)
        return x


def _export(path: Path) -> Path:
    args = (torch.zeros(1, S, dtype=torch.long), torch.ones(1, S, dtype=torch.long), torch.zeros(1, S, dtype=torch.long))
    torch.onnx.export(HFLike().eval(), args, str(path), opset_version=17, dynamo=False,
                      input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["hidden"])
    return path


def _feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(4, S))
        mask = (np.arange(S) < length).astype(np.int64)[None]
        ids = np.where(mask > 0, rng.integers(1, V, size=(1, S)), 0).astype(np.int64)
        types = np.where(np.arange(S) >= length // 2, 1, 0).astype(np.int64)[None] * mask
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
    return out


def _embedding(h: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float64)
    v = (h * m).sum(1) / m.sum(1)
    return v / np.linalg.norm(v)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_hf_style_boolean_mask_is_recognised_and_embeddings_hold(tmp_path: Path) -> None:
    model = _export(tmp_path / "hf.onnx")
    ops = {n.op_type for n in onnx.load(model).graph.node}
    assert {"Where", "And", "Gather", "LayerNormalization"} <= ops  # the exporter's own spelling
    calib = _feeds(24, 1)
    cfg = calib_config(tmp_path, {k: [f[k] for f in calib] for k in calib[0]})
    cos = []
    for i, feed in enumerate(_feeds(6, 2)):
        outs = build_and_run(model, tmp_path / "out", cfg, feed) if i == 0 else None
        if outs is None:
            from pulsar.runtime.session import Session
            from tests.unseen.helpers import ort_run

            sess = Session(tmp_path / "out" / "compiled.pulsar", mode="NPUBackend")
            outs = {"float": ort_run(model, feed), "npu": [sess.run(feed)["hidden"]]}
        a, b = _embedding(outs["float"][0], feed["attention_mask"]), _embedding(outs["npu"][0], feed["attention_mask"])
        cos.append(float((a * b).sum()))
    assert min(cos) > 0.99, cos
    log = (tmp_path / "out" / "build.log").read_text()
    assert "attention mask" in log
