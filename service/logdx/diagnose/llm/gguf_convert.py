"""The packaged GGUF (Gemma 3, quantised) de-quantised straight into the float32 ``model.safetensors``
that ``gemma_numpy`` memory-maps, with its ``config.json`` and ``tokenizer.json``: numpy, the
``gguf`` package's de-quantisers and ``tokenizers``; no torch, no transformers.

Why not transformers' own GGUF loading: it builds the whole model in memory (3.5 GB peak) and
parses the 262k-token vocabulary into numpy objects one by one (minutes on 2 cores). Here the
tensors are de-quantised a slice of rows at a time and written as they come (peak memory is the
vocabulary and one slice), and the header is read with `struct`.

The output is the checkpoint transformers would write for this file (same tensor names, shapes and
values, the same config and tokenizer), so the transformers runtime loads it too. Conventions
followed, from llama.cpp's ``convert_hf_to_gguf.py``: GGUF names (``blk.N.attn_q``...), dimensions
stored innermost first, and Gemma's norm weights stored as ``1 + w`` (transformers' RMSNorm
multiplies by ``1 + w``, llama.cpp's by ``w``).
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = ["GGUFError", "GGUFFile", "convert_gguf", "gemma3_config", "gemma_tokenizer", "read_gguf"]

Progress = Callable[[int, int], None]  # (bytes written, bytes in all)

_SLICE_BYTES = 8 << 20  # float32 output per de-quantised slice: bounds the peak, not the speed


class GGUFError(ValueError):
    """Not a GGUF file this converter understands."""


# --- reading ----------------------------------------------------------------------------------------

# GGUF value types: struct code of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), as the tensor is used
    qtype: int  # gguf.GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[TensorInfo]

    def raw(self, info: TensorInfo, data: mmap.mmap) -> np.ndarray:
        """A tensor's stored bytes, one row a line (rows x bytes per row): nothing is read yet."""
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        flat = np.frombuffer(data, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(rows, info.nbytes // rows)


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        raw = self.f.read(size)
        if len(raw) != size:
            raise GGUFError("truncated GGUF header")
        return struct.unpack("<" + fmt, raw)[0]

    def string(self) -> str:
        n = self.take("Q")
        raw = self.f.read(n)
        if len(raw) != n:
            raise GGUFError("truncated GGUF header")
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("I"), self.take("Q")
            if etype in _SCALARS and etype != 7:
                dtype = np.dtype("<" + _SCALARS[etype])
                raw = self.f.read(n * dtype.itemsize)
                if len(raw) != n * dtype.itemsize:
                    raise GGUFError("truncated GGUF header")
                return np.frombuffer(raw, dtype=dtype).tolist()
            return [self.value(etype) for _ in range(n)]
        raise GGUFError(f"unknown GGUF value type {vtype}")


def read_gguf(path: Path) -> GGUFFile:
    """The metadata and the tensors' places of a GGUF file (version 2 or 3); no tensor is read."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file")
        version = r.take("I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = r.take("Q"), r.take("Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.take("I"))
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.take("Q") for _ in range(r.take("I"))]
            qtype, offset = r.take("I"), r.take("Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = int(metadata.get("general.alignment", 32))
        start = -(-f.tell() // align) * align
    tensors = []
    for name, shape, qtype, offset in infos:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name} has an unknown type {qtype}") from None
        n = int(np.prod(shape))
        if n % block:
            raise GGUFError(f"{path}: tensor {name} of {n} values is not whole blocks of {block}")
        tensors.append(TensorInfo(name, shape, qtype, start + offset, n // block * size))
    return GGUFFile(Path(path), metadata, tensors)


# --- tensors ----------------------------------------------------------------------------------------

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """transformers' name of a Gemma 3 GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER and layer.isdigit():
            return f"model.layers.{layer}.{_LAYER[part]}.{suffix}"
    elif base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    raise GGUFError(f"tensor {gguf_name} is not part of a Gemma 3 text model")


def _slices(gguf: GGUFFile, info: TensorInfo, data: mmap.mmap) -> Iterator[np.ndarray]:
    """The tensor as float32, a slice of rows at a time, norm weights shifted back to transformers'."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.qtype)
    raw = gguf.raw(info, data)
    row_values = info.shape[-1]
    step = max(1, _SLICE_BYTES // (4 * row_values))
    shift = np.float32(1.0) if info.name.endswith("norm.weight") else None
    for i in range(0, raw.shape[0], step):
        w = dequantize(raw[i:i + step], qtype).astype("<f4", copy=False).reshape(-1, row_values)
        yield w - shift if shift is not None else w


def write_safetensors(gguf: GGUFFile, out: Path, progress: Progress | None = None) -> None:
    """Every tensor of `gguf`, de-quantised to float32, into the safetensors file `out`."""
    named = sorted(((hf_name(t.name), t) for t in gguf.tensors), key=lambda nt: nt[0])
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in named:
        size = 4 * int(np.prod(t.shape))
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-aligned, as safetensors writes it
    total, done = offset, 0
    with open(gguf.path, "rb") as src, mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ) as data, \
            open(out, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, t in named:
            for w in _slices(gguf, t, data):
                # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12
                f.write(memoryview(np.ascontiguousarray(w)).cast("B"))  # type: ignore[arg-type]
                done += w.nbytes
                if progress is not None:
                    progress(done, total)
    if done != total:
        raise GGUFError(f"wrote {done} bytes of tensors, expected {total}")


# --- config -----------------------------------------------------------------------------------------

_SLIDING_PATTERN = 6  # Gemma 3: every sixth layer attends globally, the others within the window
_LOCAL_ROPE_BASE = 10_000.0  # Gemma 3's sliding layers; the file carries only the global base


def gemma3_config(meta: dict[str, Any]) -> dict[str, Any]:
    """transformers' `Gemma3TextConfig` of a Gemma 3 GGUF, as `config.json` holds it."""
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise GGUFError(f"architecture {arch!r} is not Gemma 3")

    def g(key: str) -> Any:
        try:
            return meta[f"gemma3.{key}"]
        except KeyError:
            raise GGUFError(f"the GGUF file has no gemma3.{key}") from None

    layers = int(g("block_count"))
    head_dim = int(g("attention.key_length"))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        "dtype": "float32",
        "eos_token_id": int(meta.get("tokenizer.ggml.eos_token_id", 1)),
        "final_logit_softcapping": None,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": int(g("embedding_length")),
        "initializer_range": 0.02,
        "intermediate_size": int(g("feed_forward_length")),
        "layer_types": ["full_attention" if (i + 1) % _SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "max_position_embeddings": int(g("context_length")),
        "model_type": "gemma3_text",
        "num_attention_heads": int(g("attention.head_count")),
        "num_hidden_layers": layers,
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", 0)),
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "full_attention": {"rope_theta": float(g("rope.freq_base")), "rope_type": "default"},
            "sliding_attention": {"rope_theta": _LOCAL_ROPE_BASE, "rope_type": "default"},
        },
        "sliding_window": int(g("attention.sliding_window")),
        "tie_word_embeddings": True,
        "unk_token_id": int(meta.get("tokenizer.ggml.unknown_token_id", 3)),
        "use_bidirectional_attention": False,
        "use_cache": True,
        "vocab_size": len(meta.get("tokenizer.ggml.tokens") or ()) or int(g("vocab_size")),
        "_sliding_window_pattern": _SLIDING_PATTERN,
    }


# --- tokenizer --------------------------------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def _merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges recovered from a sentencepiece vocabulary that lists none: every split of a token
    into two tokens, best first. Gemma's merge order is the order of the vocabulary (its scores do
    not follow it), and ties go to the longer left piece, as transformers orders them."""
    rank = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, r in rank.items():
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in rank and right in rank:
                local.append((rank[left], rank[right], left, right))
        local.sort()
        merges.extend((r, -len(left), -len(right), left, right) for _, _, left, right in local)
    merges.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in merges]


def gemma_tokenizer(meta: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` of a Gemma GGUF's sentencepiece vocabulary (BPE with byte
    fallback), as transformers' `GemmaTokenizer` builds it."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    if meta.get("tokenizer.ggml.model") != "llama":
        raise GGUFError(f"tokenizer {meta.get('tokenizer.ggml.model')!r} is not a sentencepiece vocabulary")
    stored = meta["tokenizer.ggml.tokens"]
    # A token of two or more spaces is stored as real spaces; the normalizer looks it up as "▁▁".
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in stored]
    kinds = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    names = {k: tokens[int(meta[f"tokenizer.ggml.{k}_token_id"])]
             for k in ("unknown", "bos", "eos", "padding") if f"tokenizer.ggml.{k}_token_id" in meta}
    unk, bos = names.get("unknown", "<unk>"), names.get("bos", "<bos>")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(tokens), fuse_unk=True, unk_token=unk, dropout=None,
                        byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = [names.get("padding", "<pad>"), names.get("eos", "<eos>"), bos, unk, "<mask>"]
    specials += [t for t, k in zip(stored, kinds) if k == _CONTROL]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(specials)])
    # Added whole, as llama.cpp matches them; the runs of spaces among them are ordinary tokens.
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(stored, kinds)
                    if k == _USER_DEFINED and t in vocab])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])
    return tok


def _tokenizer_config(meta: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def name(key: str, default: str) -> str:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None else default

    return {"backend": "tokenizers", "bos_token": name("bos", "<bos>"), "eos_token": name("eos", "<eos>"),
            "mask_token": "<mask>", "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,
            "pad_token": name("padding", "<pad>"), "tokenizer_class": "GemmaTokenizer",
            "unk_token": name("unknown", "<unk>")}


# --- all of it --------------------------------------------------------------------------------------


def convert_gguf(source: Path, out_dir: Path, progress: Progress | None = None) -> None:
    """`source` (a Gemma 3 GGUF) -> `out_dir`: model.safetensors, config.json, generation_config.json,
    tokenizer.json, tokenizer_config.json. `progress(done, total)` follows the tensor bytes written."""
    gguf = read_gguf(source)
    config = gemma3_config(gguf.metadata)
    tokenizer = gemma_tokenizer(gguf.metadata)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(gguf.metadata, tokenizer), indent=2))
    del tokenizer
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} | {"use_cache": True}, indent=2))
    write_safetensors(gguf, out_dir / "model.safetensors", progress)
