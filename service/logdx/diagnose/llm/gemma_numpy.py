"""Gemma 3 (text) in numpy, for scoring: the converted ``model.safetensors`` memory-mapped, the
``tokenizer.json`` run by the Rust ``tokenizers``.

Why: the embedded scorer reads a prompt once and a dozen short continuations. With torch and
transformers that costs ~4 s of imports and weight loading per `diagnose` process before the first
token; here the weights are mapped, not loaded (the first forward pass pages them in), and the
forward pass is the same float32 BLAS work. The logits match transformers' (tested); a model of
another architecture is left to transformers.

The computation follows transformers' ``Gemma3ForCausalLM``: scaled embeddings; per layer RMSNorm
(``x * (1 + w)``), grouped-query attention with RMSNorm on queries and keys, RoPE (local base for
sliding-window layers, global base for full-attention ones), a sliding window mask, pre/post
norms around attention and the gated tanh-GELU MLP; a final norm; tied embeddings as the head.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def numpy_compatible(folder: Path) -> bool:
    """True when `folder` holds a float32 Gemma 3 text model this module runs."""
    try:
        config = json.loads((folder / "config.json").read_text())
        header = _header(folder / "model.safetensors")
    except (OSError, ValueError, struct.error):
        return False
    dtypes = {v["dtype"] for k, v in header.items() if not k.startswith("__")}
    return (config.get("model_type") == "gemma3_text" and dtypes == {"F32"}
            and config.get("hidden_activation") == "gelu_pytorch_tanh"
            and not config.get("attn_logit_softcapping") and config.get("tie_word_embeddings", True)
            and (folder / "tokenizer.json").is_file())


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    header["__offset__"] = 8 + n
    return header


def _map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Each tensor as a read-only memory map of the file: nothing is read until it is used."""
    header = _header(path)
    base = header.pop("__offset__")
    header.pop("__metadata__", None)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        out[name] = raw[base + start:base + end].view(np.float32).reshape(info["shape"])
    return out


@dataclass(frozen=True, slots=True)
class _Layer:
    sliding: bool
    ln_in: np.ndarray
    ln_post_attn: np.ndarray
    ln_pre_ff: np.ndarray
    ln_post_ff: np.ndarray
    q: np.ndarray  # (hidden, heads * head_dim): x @ q
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass(slots=True)
class KV:
    """One layer's keys and values of a prefix: (kv_heads, positions, head_dim) each."""

    k: np.ndarray
    v: np.ndarray


class NumpyGemma3:
    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        c = json.loads((folder / "config.json").read_text())
        self.hidden = int(c["hidden_size"])
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c["num_key_value_heads"])
        self.head_dim = int(c["head_dim"])
        self.eps = float(c["rms_norm_eps"])
        self.window = int(c.get("sliding_window") or 1 << 30)
        self.scale = float(c.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.softcap = c.get("final_logit_softcapping")
        ropes = c.get("rope_parameters") or {}
        self.theta = {
            True: float((ropes.get("sliding_attention") or {}).get("rope_theta", c.get("rope_local_base_freq", 10_000.0))),
            False: float((ropes.get("full_attention") or {}).get("rope_theta", c.get("rope_theta", 1_000_000.0))),
        }
        for kind in ("sliding_attention", "full_attention"):
            if (ropes.get(kind) or {}).get("rope_type", "default") != "default":
                raise ValueError(f"rope scaling {ropes[kind]['rope_type']!r} is not supported by the numpy runtime")
        types = c.get("layer_types") or ["sliding_attention"] * int(c["num_hidden_layers"])
        w = _map_safetensors(folder / "model.safetensors")
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.layers = [self._layer(w, i, t == "sliding_attention") for i, t in enumerate(types)]
        self.tokenizer: Any = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        pad = c.get("pad_token_id")
        self.pad_id = int(pad) if pad is not None else 0

    @staticmethod
    def _layer(w: dict[str, np.ndarray], i: int, sliding: bool) -> _Layer:
        p = f"model.layers.{i}."
        return _Layer(
            sliding=sliding,
            ln_in=w[p + "input_layernorm.weight"], ln_post_attn=w[p + "post_attention_layernorm.weight"],
            ln_pre_ff=w[p + "pre_feedforward_layernorm.weight"], ln_post_ff=w[p + "post_feedforward_layernorm.weight"],
            q=w[p + "self_attn.q_proj.weight"].T, k=w[p + "self_attn.k_proj.weight"].T,
            v=w[p + "self_attn.v_proj.weight"].T, o=w[p + "self_attn.o_proj.weight"].T,
            q_norm=w[p + "self_attn.q_norm.weight"], k_norm=w[p + "self_attn.k_norm.weight"],
            gate=w[p + "mlp.gate_proj.weight"].T, up=w[p + "mlp.up_proj.weight"].T, down=w[p + "mlp.down_proj.weight"].T,
        )

    # -- tokens ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, ids: np.ndarray, past: list[KV] | None = None) -> tuple[np.ndarray, list[KV]]:
        """Hidden states after the final norm, (n, t, hidden), of `ids` (n, t) placed after `past`
        (one prefix shared by every row), and each layer's keys and values of `ids` (row 0 only
        is kept when n == 1). Rows are right-padded: causal attention keeps padding from
        changing the tokens before it."""
        n, t = ids.shape
        start = 0 if past is None else past[0].k.shape[1]
        pos = np.arange(start, start + t)
        x = self.embed[ids].astype(np.float32) * np.float32(math.sqrt(self.hidden))
        rope = {s: _rope(pos, self.head_dim, self.theta[s]) for s in (True, False)}
        masks = {s: self._mask(start, t, s) for s in (True, False)}
        kvs: list[KV] = []
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer.ln_in, self.eps)
            attn, kv = self._attention(h, layer, rope[layer.sliding], masks[layer.sliding],
                                       None if past is None else past[i])
            kvs.append(kv)
            x = x + _rms(attn, layer.ln_post_attn, self.eps)
            h = _rms(x, layer.ln_pre_ff, self.eps)
            ff = (_gelu_tanh(h @ layer.gate) * (h @ layer.up)) @ layer.down
            x = x + _rms(ff, layer.ln_post_ff, self.eps)
        return _rms(x, self.norm, self.eps), kvs

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """The next-token logits of hidden states (..., hidden) -> (..., vocab)."""
        out = hidden @ self.embed.T
        if self.softcap:
            out = np.tanh(out / self.softcap) * self.softcap
        return out

    def _mask(self, start: int, t: int, sliding: bool) -> np.ndarray:
        """Additive mask (t, start + t): causal, and within the window on sliding layers."""
        q = np.arange(start, start + t)[:, None]
        k = np.arange(start + t)[None, :]
        allowed = k <= q
        if sliding:
            allowed &= k > q - self.window
        return np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)

    def _attention(self, h: np.ndarray, layer: _Layer, rope: tuple[np.ndarray, np.ndarray], mask: np.ndarray,
                   past: KV | None) -> tuple[np.ndarray, KV]:
        n, t, _ = h.shape
        hd = self.head_dim
        q = _rms((h @ layer.q).reshape(n, t, self.heads, hd), layer.q_norm, self.eps).transpose(0, 2, 1, 3)
        k = _rms((h @ layer.k).reshape(n, t, self.kv_heads, hd), layer.k_norm, self.eps).transpose(0, 2, 1, 3)
        v = (h @ layer.v).reshape(n, t, self.kv_heads, hd).transpose(0, 2, 1, 3)
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        kv = KV(k[0], v[0])
        if past is not None:
            k = np.concatenate([np.broadcast_to(past.k, (n, *past.k.shape)), k], axis=2)
            v = np.concatenate([np.broadcast_to(past.v, (n, *past.v.shape)), v], axis=2)
        group = self.heads // self.kv_heads
        q = q.reshape(n, self.kv_heads, group * t, hd)  # the heads sharing a key/value attend together
        scores = (q @ k.transpose(0, 1, 3, 2)) * np.float32(self.scale)
        scores = scores.reshape(n, self.kv_heads, group, t, -1) + mask
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        ctx = probs.reshape(n, self.kv_heads, group * t, -1) @ v
        ctx = ctx.reshape(n, self.heads, t, hd).transpose(0, 2, 1, 3).reshape(n, t, self.heads * hd)
        return ctx @ layer.o, kv


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * (np.float32(1.0) + weight)


def _rope(pos: np.ndarray, dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    freqs = pos.astype(np.float32)[:, None] * inv[None, :].astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))
