"""The GGUF -> safetensors converter, on a tiny Gemma 3 written here with the `gguf` package's own
writer (quantised as llama.cpp does): names, layout, the norm shift, the config, the tokenizer.
The real packaged model is converted by `make install`; tests/test_llm.py checks what it scores."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from logdx.diagnose.llm.gemma_numpy import NumpyGemma3, _map_safetensors, numpy_compatible
from logdx.diagnose.llm.gguf_convert import GGUFError, convert_gguf, hf_name, read_gguf

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF, LAYERS = 64, 2, 1, 32, 96, 2
# control (3), normal (1), a run of spaces and a marker llama.cpp calls user-defined (4), bytes (6)
TOKENS = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 1), ("[multimodal]", 4), ("  ", 4),
          ("▁", 1), ("a", 1), ("b", 1), ("ab", 1), ("▁a", 1), ("▁ab", 1), ("<0x21>", 6)]
# GGUF layout (llama.cpp's names) -> (numpy shape as used, how it is stored)
WEIGHTS = {"token_embd.weight": ((len(TOKENS), HIDDEN), Q.Q8_0), "output_norm.weight": ((HIDDEN,), Q.F32)}
for i in range(LAYERS):
    WEIGHTS |= {
        f"blk.{i}.attn_norm.weight": ((HIDDEN,), Q.F32),
        f"blk.{i}.attn_q.weight": ((HEADS * HEAD_DIM, HIDDEN), Q.Q5_0),
        f"blk.{i}.attn_k.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q5_0),
        f"blk.{i}.attn_v.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0),
        f"blk.{i}.attn_output.weight": ((HIDDEN, HEADS * HEAD_DIM), Q.Q8_0),
        f"blk.{i}.attn_q_norm.weight": ((HEAD_DIM,), Q.F32),
        f"blk.{i}.attn_k_norm.weight": ((HEAD_DIM,), Q.F32),
        f"blk.{i}.post_attention_norm.weight": ((HIDDEN,), Q.F32),
        f"blk.{i}.ffn_norm.weight": ((HIDDEN,), Q.F32),
        f"blk.{i}.post_ffw_norm.weight": ((HIDDEN,), Q.F32),
        f"blk.{i}.ffn_gate.weight": ((FF, HIDDEN), Q.Q8_0),
        f"blk.{i}.ffn_up.weight": ((FF, HIDDEN), Q.Q8_0),
        f"blk.{i}.ffn_down.weight": ((HIDDEN, FF), Q.Q5_0),
    }


def write_gemma3(path: Path, weights: dict[str, tuple[tuple[int, ...], Q]] = WEIGHTS) -> dict[str, np.ndarray]:
    """A tiny Gemma 3 GGUF; returns the values each tensor holds once de-quantised (as stored)."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_uint32("gemma3.context_length", 2048)
    w.add_uint32("gemma3.embedding_length", HIDDEN)
    w.add_uint32("gemma3.block_count", LAYERS)
    w.add_uint32("gemma3.feed_forward_length", FF)
    w.add_uint32("gemma3.attention.head_count", HEADS)
    w.add_uint32("gemma3.attention.head_count_kv", KV_HEADS)
    w.add_uint32("gemma3.attention.key_length", HEAD_DIM)
    w.add_uint32("gemma3.attention.value_length", HEAD_DIM)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("gemma3.rope.freq_base", 1_000_000.0)
    w.add_uint32("gemma3.attention.sliding_window", 16)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", [t for t, _ in TOKENS])
    w.add_array("tokenizer.ggml.scores", [0.0] * len(TOKENS))
    w.add_array("tokenizer.ggml.token_type", [k for _, k in TOKENS])
    for key, value in {"bos": 2, "eos": 1, "unknown": 3, "padding": 0}.items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    stored = {}
    for name, (shape, qtype) in weights.items():
        x = rng.normal(0, 0.5, size=shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, x)
            stored[name] = x
        else:
            packed = quantize(x, qtype)
            w.add_tensor(name, packed, raw_dtype=qtype)
            stored[name] = dequantize(packed, qtype).reshape(shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray], list[tuple[int, int]]]:
    root = tmp_path_factory.mktemp("gguf")
    stored = write_gemma3(root / "tiny.gguf")
    out = root / "out"
    out.mkdir()
    seen: list[tuple[int, int]] = []
    convert_gguf(root / "tiny.gguf", out, lambda done, total: seen.append((done, total)))
    return out, stored, seen


def test_every_tensor_keeps_its_values_under_transformers_name_and_layout(converted) -> None:
    out, stored, _ = converted
    tensors = _map_safetensors(out / "model.safetensors")
    assert sorted(tensors) == sorted(hf_name(n) for n in stored)
    for name, values in stored.items():
        got = tensors[hf_name(name)]
        assert got.dtype == np.float32 and got.shape == values.shape, name
        # llama.cpp stores Gemma's norm weights as 1 + w; transformers' RMSNorm multiplies by 1 + w
        expected = values - 1 if name.endswith("norm.weight") else values
        np.testing.assert_array_equal(got, expected, err_msg=name)
    assert hf_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"


def test_progress_follows_the_bytes_written(converted) -> None:
    out, _, seen = converted
    total = (out / "model.safetensors").stat().st_size
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and seen[-1][0] == seen[-1][1]
    assert total - 8 - 4096 < seen[-1][1] < total  # the tensors: the file less its header


def test_config_describes_the_model_for_both_runtimes(converted) -> None:
    out, _, _ = converted
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "sliding_window",
                                   "vocab_size", "bos_token_id", "pad_token_id")} == {
        "model_type": "gemma3_text", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": FF, "sliding_window": 16,
        "vocab_size": len(TOKENS), "bos_token_id": 2, "pad_token_id": 0}
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1_000_000.0
    assert numpy_compatible(out)
    model = NumpyGemma3(out)
    hidden, past = model.forward(np.asarray([model.encode("ab a")], dtype=np.int64))
    assert hidden.shape[-1] == HIDDEN and len(past) == LAYERS and np.isfinite(hidden).all()


def test_tokenizer_is_gemmas_sentencepiece_shape(converted) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(converted[0] / "tokenizer.json"))
    enc = tok.encode("ab a")
    assert enc.tokens == ["<bos>", "ab", "▁a"]  # BOS added; spaces are "▁"; merges rebuilt from the vocabulary
    assert tok.encode("[multimodal]b", add_special_tokens=False).tokens == ["[multimodal]", "b"]  # kept whole
    assert tok.encode("!", add_special_tokens=False).tokens == ["<0x21>"]  # byte fallback
    assert tok.decode(tok.encode("ab a").ids, skip_special_tokens=True) == "ab a"


def test_not_a_gguf_or_not_gemma_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(tmp_path / "x.gguf")
    write_gemma3(tmp_path / "odd.gguf", {**WEIGHTS, "blk.0.attn_qkv.weight": ((HIDDEN, HIDDEN), Q.F32)})
    (tmp_path / "out").mkdir()
    with pytest.raises(GGUFError, match="blk.0.attn_qkv.weight is not part of a Gemma 3"):
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "out")
