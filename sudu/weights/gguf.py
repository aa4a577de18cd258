"""GGUF files: metadata -> ModelConfig, tensor names -> Hugging Face names, and dequantization.

Reading: a small parser here reads the header, metadata and tensor table with `struct` and maps the
tensor data with numpy (nothing is copied until a tensor is dequantized). `gguf.GGUFReader` does the
same but builds a numpy view per array element, which takes seconds on a 262k-token vocabulary -- at
every start; this parser reads only what it needs (docs/cpu_speed.md, "Figures from code comments"). The `gguf` package still provides the type
tables and the k-quant dequantizers, and tests check this parser against `GGUFReader`. Every tensor is kept as a `QuantizedTensor` (its original blocks, a view into the
file) so later CPU work can repack the quantized weights without reading the file again.

Dequantized tensors follow Hugging Face conventions, because the model code is written against them:
llama.cpp's Q/K row permutation (llama arch only) is undone, and Gemma's RMSNorm weights, which
llama.cpp stores as (1 + w), are stored back as w.

Dequantization: the block formats of the big matrices (Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, Q8_K) and the float
types are decoded here in torch, bit-identical to `gguf.quants` and multi-threaded (numpy's is not;
single-threaded the two cost about the same); the k-quants (Q2_K..Q6_K) use `gguf.quants`, where a torch
port measured slower. Tests check every type against an independent per-block reference.
"""
from __future__ import annotations

import mmap
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sudu.errors import SuduError
from sudu.model_config import ModelConfig

FLOAT_TYPES = ("F32", "F16", "BF16")
# What sudu dequantizes; the first group is what the catalog models contain.
SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "BF16", "Q4_0", "Q5_K", "Q8_K", "Q2_K", "Q3_K",
                   "Q4_1", "Q5_1")
_SLIDING_PATTERN_GEMMA3 = 6  # gemma3: every 6th layer attends globally


@dataclass
class QuantizedTensor:
    """One GGUF tensor as stored: its blocks are a read-only view into the memory-mapped file."""

    name: str  # Hugging Face name
    gguf_name: str
    ggml_type: str  # "Q4_K", "F32", ...
    shape: tuple[int, ...]  # logical shape in Hugging Face order: (out_features, in_features)
    blocks: np.ndarray  # uint8, (rows, bytes per row); rows run over shape[:-1]
    # llama arch q/k only: HF row r lives in blocks row row_permutation[r] (llama.cpp reorders rows).
    row_permutation: np.ndarray | None = None
    # gemma norms: HF weight = stored + norm_offset (llama.cpp stores 1 + w).
    norm_offset: float = 0.0

    @property
    def is_float(self) -> bool:
        return self.ggml_type in FLOAT_TYPES


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                 12: "<f8"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass
class GGUFTensorInfo:
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # Hugging Face order (GGUF lists dims fastest-first; this is reversed)
    data: np.ndarray  # uint8 view of the tensor's bytes in the memory map


@dataclass
class GGUFFile:
    """A parsed GGUF file: all metadata as Python values (arrays as lists), tensors as memory-mapped bytes."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    mapping: Any = None  # the file's mmap.mmap

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def release_pages(self) -> None:
        """Drop the map's resident pages (the file's bytes stay mapped and come back from the page cache
        or disk if read again). Loading reads every block once to repack it; the map then held the whole
        file in the resident set, though the engine no longer reads it."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)


class _Cursor:
    def __init__(self, buf, offset: int = 0):
        self.buf, self.offset = buf, offset

    def scalar(self, kind: int):
        fmt = _SCALAR_FORMATS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.offset)
        start = self.offset + 8
        self.offset = start + length
        if self.offset > len(self.buf):
            raise ValueError("string runs past the end of the file")
        return bytes(self.buf[start:self.offset]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind = self.scalar(4)
            count = self.scalar(10)
            if item_kind == _STRING:
                return [self.string() for _ in range(count)]
            if item_kind == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY_DTYPES[item_kind])
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offset)
            self.offset += count * dtype.itemsize
            return values.tolist()
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(kind)


def _parse(path: Path) -> GGUFFile:
    import gguf

    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    buf = memoryview(raw)
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"starts with {bytes(buf[:4])!r}, not b'GGUF'")
    cur.offset = 4
    version = cur.scalar(4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (sudu reads versions 2 and 3, little-endian)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar(4))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
        infos.append((name, cur.scalar(4), dims, cur.scalar(10)))
    alignment = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.offset // alignment) * alignment
    tensors = []
    for name, type_id, dims, offset in infos:
        qtype = gguf.GGMLQuantizationType(type_id)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims)) if dims else 1
        n_bytes = n_elements // block_size * type_size
        start = data_start + offset
        if start + n_bytes > len(raw):
            raise ValueError(f"tensor {name} ends at byte {start + n_bytes}, past the end of the file ({len(raw)})")
        shape = tuple(int(d) for d in reversed(dims))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = raw[start:start + n_bytes].reshape(rows, n_bytes // rows) if n_bytes else raw[start:start]
        tensors.append(GGUFTensorInfo(name, qtype.name, shape, np.asarray(data)))
    return GGUFFile(path, meta, tensors, mapping)


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file, or one clear SuduError for a missing, truncated or corrupt file."""
    path = Path(path)
    if not path.is_file():
        raise SuduError(f"no such GGUF file: {path}")
    try:
        return _parse(path)
    except (ValueError, struct.error, IndexError, KeyError, UnicodeDecodeError) as exc:
        raise SuduError(f"{path} is not a readable GGUF file (truncated or corrupt): {exc}") from None


def _nice_float(x: float) -> float:
    # GGUF stores float32; 9.999999974752427e-07 means the 1e-06 written in config.json.
    return float(f"{x:.7g}")


GGUF_ARCHITECTURES = ("qwen2", "llama", "gemma3", "qwen3", "qwen2moe", "qwen3moe", "deepseek2")


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    meta = gf.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise SuduError(f"unsupported GGUF architecture {arch!r}; sudu runs {', '.join(GGUF_ARCHITECTURES)}")

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    names = {t.name for t in gf.tensors}
    embed = next((t for t in gf.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise SuduError("GGUF file has no token_embd.weight tensor")
    missing = [key for key in ("embedding_length", "attention.head_count", "block_count")
               if get(key) is None]
    if missing:
        raise SuduError(f"GGUF file lacks metadata {', '.join(f'{arch}.{k}' for k in missing)}")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    # block_count includes DeepSeek-V3's multi-token-prediction layers, stored after the decoder's
    num_layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    kwargs: dict[str, Any] = dict(
        architecture="mixtral" if arch == "llama" and get("expert_count") else arch,
        vocab_size=int(embed.shape[0]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=_nice_float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 32768)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[] if meta.get("tokenizer.ggml.eos_token_id") is None else [meta["tokenizer.ggml.eos_token_id"]],
    )
    if get("rope.scaling.type") == "linear":
        kwargs["rope_scaling_factor"] = float(get("rope.scaling.factor"))
    if get("rope.scaling.type") == "yarn" and arch != "deepseek2":  # deepseek2's own reading: _mla_config
        factor, original = float(get("rope.scaling.factor")), int(get("rope.scaling.original_context_length"))
        kwargs["rope_yarn"] = {"factor": factor, "original_max_position_embeddings": original}
        for key in ("beta_fast", "beta_slow"):
            if get(f"rope.scaling.yarn_{key}") is not None:
                kwargs["rope_yarn"][key] = float(get(f"rope.scaling.yarn_{key}"))
        kwargs["max_position_embeddings"] = max(kwargs["max_position_embeddings"], int(original * factor))
    if arch in ("qwen2", "qwen2moe"):
        kwargs["attention_bias"] = True
    if get("expert_count"):
        _moe_config(arch, get, names, kwargs)
    if arch == "deepseek2":
        _mla_config(get, kwargs)
    if arch == "gemma3":
        kwargs["hidden_act"] = "gelu_pytorch_tanh"
        # llama.cpp does not store these for gemma3; its runtime hard-codes the same values transformers'
        # Gemma3TextConfig defaults to (local RoPE base 10000, scale by key_length).
        kwargs["rope_local_base_freq"] = float(get("rope.local.freq_base", 10000.0))
        kwargs["query_pre_attn_scalar"] = float(get("attention.query_pre_attn_scalar", kwargs["head_dim"]))
        kwargs["sliding_window"] = int(get("attention.sliding_window", 512))
        kwargs["layer_types"] = [
            "full_attention" if (i + 1) % _SLIDING_PATTERN_GEMMA3 == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    return ModelConfig(**kwargs)


# llama.cpp's expert_gating_func values
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def _moe_config(arch: str, get, names: set[str], kwargs: dict) -> None:
    """Routed-expert fields from {arch}.expert_* metadata; a layer is routed where its file has a router."""
    num_layers = kwargs["num_hidden_layers"]
    kwargs["num_experts"] = int(get("expert_count"))
    kwargs["num_experts_per_tok"] = int(get("expert_used_count"))
    kwargs["moe_intermediate_size"] = int(get("expert_feed_forward_length", kwargs["intermediate_size"]))
    kwargs["moe_layers"] = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(num_layers)]
    # llama.cpp's defaults where the file says nothing: Qwen3-MoE and Mixtral renormalise, the others not
    kwargs["norm_topk_prob"] = bool(get("expert_weights_norm", arch in ("qwen3moe", "llama")))
    if arch == "qwen2moe":
        kwargs["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
        kwargs["shared_expert_gate"] = "blk.0.ffn_gate_inp_shexp.weight" in names or any(
            n.endswith("ffn_gate_inp_shexp.weight") for n in names)
    if arch == "deepseek2":
        kwargs["shared_expert_intermediate_size"] = int(get("expert_shared_count", 0)) * kwargs["moe_intermediate_size"]
        kwargs["routed_scaling_factor"] = float(get("expert_weights_scale", 1.0))
        kwargs["scoring_func"] = _GATING_FUNCS[int(get("expert_gating_func", 1))]
        kwargs["router_correction_bias"] = any(n.endswith("exp_probs_b.bias") for n in names)
        kwargs["n_group"] = int(get("expert_group_count", 1)) or 1
        kwargs["topk_group"] = int(get("expert_group_used_count", 1)) or 1


def _mla_config(get, kwargs: dict) -> None:
    """Multi-head latent attention fields. Files from llama.cpp's MLA-aware converter store the per-head
    key/value widths as key_length_mla / value_length_mla (key_length is then the latent + rope width)."""
    rope = int(get("rope.dimension_count"))
    qk_head = int(get("attention.key_length_mla", get("attention.key_length")))
    kwargs["q_lora_rank"] = int(get("attention.q_lora_rank", 0)) or None
    kwargs["kv_lora_rank"] = int(get("attention.kv_lora_rank"))
    kwargs["qk_rope_head_dim"] = rope
    kwargs["qk_nope_head_dim"] = qk_head - rope
    kwargs["v_head_dim"] = int(get("attention.value_length_mla", get("attention.value_length")))
    kwargs["head_dim"] = rope
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs["num_nextn_predict_layers"] = int(get("nextn_predict_layers", 0))
    if get("rope.scaling.type") == "yarn":
        # llama.cpp writes yarn_log_multiplier = 0.1 * mscale_all_dim (DeepSeek sets mscale = mscale_all_dim)
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        kwargs["rope_yarn"] = {"factor": float(get("rope.scaling.factor")),
                               "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                               "mscale": mscale, "mscale_all_dim": mscale}


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",  # MLA-aware files: kv_b_proj split (weights/gguf.py merge_kv_b)
    "attn_v_b": "self_attn.v_b_proj",
}
# stacked experts [experts, rows, cols]: one tensor per expert in Hugging Face names
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# The norm after attention and before the MLP is `ffn_norm` in llama/qwen2 files; gemma3 has four norms.
_LAYER_NAMES_BY_ARCH = {
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "mixtral": {"ffn_norm": "post_attention_layernorm"},
    "qwen3": {"ffn_norm": "post_attention_layernorm"},
    "qwen2moe": {"ffn_norm": "post_attention_layernorm"},
    "qwen3moe": {"ffn_norm": "post_attention_layernorm"},
    "deepseek2": {"ffn_norm": "post_attention_layernorm", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                  "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_ROUTER_BIAS = re.compile(r"^blk\.(\d+)\.exp_probs_b\.bias$")
# DeepSeek-V3's multi-token-prediction layer parts (the rest of that layer has the decoder's names)
_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.([a-z_]+)\.weight$")
_NEXTN_NAMES = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "embed_tokens": "embed_tokens",
                "shared_head_head": "shared_head.head", "shared_head_norm": "shared_head.norm"}


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors sudu does not use (e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _ROUTER_BIAS.match(gguf_name)
    if m is not None:
        return f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"
    m = _NEXTN.match(gguf_name)
    if m is not None and m.group(2) in _NEXTN_NAMES:
        return f"model.layers.{m.group(1)}.{_NEXTN_NAMES[m.group(2)]}.weight"
    m = _BLOCK_RE.match(gguf_name)
    if m is None:
        return None
    layer, part, kind = m.groups()
    if part in _EXPERT_NAMES:
        return f"model.layers.{layer}.mlp.experts.{{}}.{_EXPERT_NAMES[part]}.{kind}"  # one per expert
    mapped = _LAYER_NAMES_BY_ARCH[arch].get(part) or _LAYER_NAMES.get(part)
    if mapped is None:
        return None
    return f"model.layers.{layer}.{mapped}.{kind}"


def _llama_row_permutation(rows: int, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from [first half | second half] (HF rotate_half)
    # to interleaved pairs; HF row r is therefore stored at row perm[r].
    stored = np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(rows)
    perm = np.empty(rows, dtype=np.int64)
    perm[stored] = np.arange(rows)
    return perm


def _is_gemma_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def quantized_tensors(gf: GGUFFile, config: ModelConfig) -> dict[str, QuantizedTensor]:
    """Every tensor sudu uses, by Hugging Face name, in file order (no data is read)."""
    arch = config.architecture
    out: dict[str, QuantizedTensor] = {}
    for t in gf.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        if "{}" in name:  # stacked experts [experts, rows, cols] -> one [rows, cols] view per expert
            experts, rows = t.shape[0], t.shape[1]
            for e in range(experts):
                out[name.format(e)] = QuantizedTensor(name.format(e), t.name, t.ggml_type, t.shape[1:],
                                                      t.data[e * rows:(e + 1) * rows])
            continue
        shape = t.shape
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp stores it as [hidden]
            shape = (1, shape[0])
        qt = QuantizedTensor(name, t.name, t.ggml_type, shape, t.data)
        if arch in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            qt.row_permutation = _llama_row_permutation(t.shape[0], n_head)
        if arch == "gemma3" and _is_gemma_norm(name):
            qt.norm_offset = -1.0
        out[name] = qt
    return out


def _u8_tensor(blocks: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # The memory map is read-only and torch warns about that; we only ever read from it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(blocks.reshape(-1))


def _f16_at(b: torch.Tensor, start: int) -> torch.Tensor:
    return b[:, start:start + 2].contiguous().view(torch.float16).float()


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 34)  # f16 d, int8 q[32]
    return _f16_at(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 18)  # f16 d, 16 bytes of nibbles: low nibbles are elements 0..15, high 16..31
    qs = b[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return (q.float() - 8) * _f16_at(b, 0)


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 20)  # f16 d, f16 m, nibbles
    qs = b[:, 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return _f16_at(b, 0) * q.float() + _f16_at(b, 2)


def _high_bits(qh_bytes: torch.Tensor) -> torch.Tensor:
    # Bit j of the little-endian u32 is the 5th bit of element j; numpy's unpackbits is the fast path.
    bits = np.unpackbits(qh_bytes.contiguous().numpy(), axis=1, bitorder="little")
    return torch.from_numpy(bits) << 4


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 22)  # f16 d, u32 high bits, nibbles
    qs = b[:, 6:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1) | _high_bits(b[:, 2:6])
    return (q.float() - 16) * _f16_at(b, 0)


def _deq_q5_1(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 24)  # f16 d, f16 m, u32 high bits, nibbles
    qs = b[:, 8:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1) | _high_bits(b[:, 4:8])
    return _f16_at(b, 0) * q.float() + _f16_at(b, 2)


def _deq_q8_k(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 292)  # f32 d, int8 q[256], int16 bsums[16] (bsums only serve dot products)
    d = b[:, :4].contiguous().view(torch.float32)
    return d * b[:, 4:260].contiguous().view(torch.int8).float()


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block: bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11
    the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _low_nibbles_by_32(qs: torch.Tensor) -> torch.Tensor:
    """[n, 32 * k] bytes -> [n, 2k, 32] nibbles: each 32-byte run gives its low nibbles, then its high ones."""
    runs = qs.reshape(qs.shape[0], -1, 1, 32)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(qs.shape[0], -1, 32)


# K-quants in the float32 operations, and their order, of the gguf package's reference dequantization
# (so a float32 model sudu loads equals the one transformers loads from the same file, bit for bit)
def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 144)  # f16 d, f16 dmin, 12 bytes of scales and mins, 128 bytes of nibbles
    sc, mn = _k_scales_mins(b[:, 4:16])
    d = (_f16_at(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16_at(b, 2) * mn.float()).unsqueeze(-1)
    return (d * _low_nibbles_by_32(b[:, 16:]).float() - dm).reshape(-1, 256)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 176)  # f16 d, f16 dmin, 12 bytes of scales and mins, 32 bytes of 5th bits, 128 of nibbles
    sc, mn = _k_scales_mins(b[:, 4:16])
    d = (_f16_at(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16_at(b, 2) * mn.float()).unsqueeze(-1)
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 0x01  # bit j of byte i: the 5th bit of element 32 j + i
    q = _low_nibbles_by_32(b[:, 48:]) | (high << 4)
    return (d * q.float() - dm).reshape(-1, 256)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:
    b = b.view(-1, 210)  # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d
    n = b.shape[0]
    d = (_f16_at(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).view(n, 16, 1)
    low = b[:, :128].reshape(n, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16)
    return (d * q.float()).reshape(n, 256)


_TORCH_DEQUANT = {"Q8_0": _deq_q8_0, "Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1, "Q5_0": _deq_q5_0, "Q5_1": _deq_q5_1,
                  "Q8_K": _deq_q8_k, "Q4_K": _deq_q4_k, "Q5_K": _deq_q5_k, "Q6_K": _deq_q6_k}
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize_blocks(blocks: np.ndarray, ggml_type: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF bytes of one tensor -> float32 tensor of `shape` (row-major, last dim contiguous)."""
    if ggml_type in _FLOAT_DTYPES:
        return _u8_tensor(blocks).view(_FLOAT_DTYPES[ggml_type]).to(torch.float32).reshape(shape)
    if ggml_type in _TORCH_DEQUANT:
        return _TORCH_DEQUANT[ggml_type](_u8_tensor(blocks)).reshape(shape)
    if ggml_type not in SUPPORTED_TYPES:
        raise SuduError(f"GGUF tensor type {ggml_type} is not supported; sudu reads {', '.join(SUPPORTED_TYPES)}")
    import gguf.quants

    qtype = gguf.GGMLQuantizationType[ggml_type]
    values = gguf.quants.dequantize(np.ascontiguousarray(blocks).reshape(-1, blocks.shape[-1]), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """llama.cpp's MLA-aware files split DeepSeek's kv_b_proj per head into k_b [heads, kv_lora_rank, qk_nope]
    (transposed) and v_b [heads, v_head, kv_lora_rank]; this is the kv_b_proj weight [heads * (qk_nope +
    v_head), kv_lora_rank] they came from."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """A GGUF tensor as the float32 tensor Hugging Face's checkpoint holds under `qt.name`."""
    blocks = qt.blocks
    if qt.row_permutation is not None:
        blocks = blocks[qt.row_permutation]
    out = dequantize_blocks(blocks, qt.ggml_type, qt.shape)
    if qt.norm_offset:
        out = out + qt.norm_offset
    return out
