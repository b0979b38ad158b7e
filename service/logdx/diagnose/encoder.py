"""A sentence-transformers BERT model (BERT, mean pooling, L2 normalisation), run in numpy.

Why: retrieval embeds a handful of lines per diagnosis, and importing sentence-transformers (torch,
transformers) costs 3-8 s per `diagnose` process, far more than the encoding itself (milliseconds).
The same weights (``model.safetensors``) and tokenizer (``tokenizer.json``, Rust ``tokenizers``) give
the same vectors as ``SentenceTransformer.encode`` (cosine > 0.9999, tested), so the FAISS index built
either way is one vector space. A folder of any other shape is left to sentence-transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAX_BATCH = 32


def numpy_compatible(folder: Path) -> bool:
    """True when `folder` is a sentence-transformers model this module runs exactly: a BERT encoder
    with absolute positions and GELU, then mean pooling, then Normalize."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        config = json.loads((folder / "config.json").read_text())
        pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return False
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    mean_only = pooling.get("pooling_mode_mean_tokens") and not any(
        v for k, v in pooling.items() if k.startswith("pooling_mode_") and k != "pooling_mode_mean_tokens")
    return (kinds == ["Transformer", "Pooling", "Normalize"] and bool(mean_only)
            and config.get("model_type") == "bert" and config.get("hidden_act") == "gelu"
            and config.get("position_embedding_type", "absolute") == "absolute"
            and (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file())


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv_w: np.ndarray  # (hidden, 3 * hidden): query, key, value side by side
    qkv_b: np.ndarray
    out_w: np.ndarray
    out_b: np.ndarray
    ln1: tuple[np.ndarray, np.ndarray]
    up_w: np.ndarray
    up_b: np.ndarray
    down_w: np.ndarray
    down_b: np.ndarray
    ln2: tuple[np.ndarray, np.ndarray]


class NumpyBertEncoder:
    """`encode(texts)` → (n, hidden) float32, L2-normalised, as SentenceTransformer.encode would."""

    def __init__(self, folder: Path) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        config = json.loads((folder / "config.json").read_text())
        st = json.loads((folder / "sentence_bert_config.json").read_text()) \
            if (folder / "sentence_bert_config.json").is_file() else {}
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.max_len = int(st.get("max_seq_length") or config.get("max_position_embeddings", 512))
        w = load_file(str(folder / "model.safetensors"))
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in w else ""
        self._w = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
        self.dim = int(config["hidden_size"])
        self._layers = [self._layer(i) for i in range(int(config["num_hidden_layers"]))]
        self.tokenizer: Any = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_len)
        self.tokenizer.no_padding()

    def _ln(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self._w[f"{name}.weight"], self._w[f"{name}.bias"]

    def _layer(self, i: int) -> _Layer:
        p = f"encoder.layer.{i}."
        w = self._w
        qkv = [w[f"{p}attention.self.{k}.weight"].T for k in ("query", "key", "value")]
        return _Layer(
            qkv_w=np.ascontiguousarray(np.concatenate(qkv, axis=1)),
            qkv_b=np.concatenate([w[f"{p}attention.self.{k}.bias"] for k in ("query", "key", "value")]),
            out_w=np.ascontiguousarray(w[f"{p}attention.output.dense.weight"].T),
            out_b=w[f"{p}attention.output.dense.bias"],
            ln1=self._ln(f"{p}attention.output.LayerNorm"),
            up_w=np.ascontiguousarray(w[f"{p}intermediate.dense.weight"].T),
            up_b=w[f"{p}intermediate.dense.bias"],
            down_w=np.ascontiguousarray(w[f"{p}output.dense.weight"].T),
            down_b=w[f"{p}output.dense.bias"],
            ln2=self._ln(f"{p}output.LayerNorm"),
        )

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        encodings = self.tokenizer.encode_batch(list(texts))
        # shortest first so that a batch pads little; the answer keeps the caller's order
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(order), _MAX_BATCH):
            idx = order[start:start + _MAX_BATCH]
            out[idx] = self._encode_batch([encodings[i].ids for i in idx])
        return out

    def _encode_batch(self, ids: list[list[int]]) -> np.ndarray:
        n, width = len(ids), max(len(x) for x in ids)
        tokens = np.zeros((n, width), dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.float32)
        for i, row in enumerate(ids):
            tokens[i, :len(row)] = row
            mask[i, :len(row)] = 1.0
        w = self._w
        x = (w["embeddings.word_embeddings.weight"][tokens]
             + w["embeddings.position_embeddings.weight"][:width][None, :, :]
             + w["embeddings.token_type_embeddings.weight"][0][None, None, :])
        x = _layer_norm(x, *self._ln("embeddings.LayerNorm"), self.eps)
        bias = ((1.0 - mask) * np.finfo(np.float32).min)[:, None, None, :]  # padding is never attended
        for layer in self._layers:
            x = self._block(x, layer, bias)
        summed = (x * mask[:, :, None]).sum(axis=1)
        pooled = summed / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
        return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)

    def _block(self, x: np.ndarray, layer: _Layer, bias: np.ndarray) -> np.ndarray:
        n, t, d = x.shape
        h, hd = self.heads, d // self.heads
        qkv = (x @ layer.qkv_w + layer.qkv_b).reshape(n, t, 3, h, hd).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(0, 1, 3, 2)) / np.float32(np.sqrt(hd)) + bias
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(n, t, d)
        x = _layer_norm(ctx @ layer.out_w + layer.out_b + x, *layer.ln1, self.eps)
        up = _gelu(x @ layer.up_w + layer.up_b)
        return _layer_norm(up @ layer.down_w + layer.down_b + x, *layer.ln2, self.eps)


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's exact GELU, x * Phi(x), with erf from Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7):
    numpy has no erf, and scipy is not worth its import here."""
    z = x * np.float32(0.7071067811865476)
    s = np.sign(z)
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = s * (1.0 - poly * np.exp(-a * a))
    return (0.5 * x * (1.0 + erf)).astype(np.float32)
