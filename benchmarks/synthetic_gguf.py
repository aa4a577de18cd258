"""A synthetic GGUF in a real model's layout with seeded random weights: the file behind the "7B shape"
figures of docs/benchmarks.md. Speed does not depend on the weight values, so a Qwen2.5-7B-shaped file
shows how a server's cost grows with model size on the same machine; its text is meaningless and no
quality claim comes from it.

The weights are scaled like a trained model's so activations stay finite: matrices N(0, 0.02), norms 1,
the QKV biases N(0, 0.02). The tokenizer metadata (vocabulary, merges, special ids, chat template) is
copied from a Qwen2.5 GGUF of the catalog (the family shares one tokenizer); the vocabulary is padded to
the layout's embedding rows with "[PAD<i>]" tokens of type UNUSED, as llama.cpp's converter pads it.
Tensors are written one at a time in float16 (a big one in row chunks), so memory stays near the
largest tensor's float16 size whatever the model's.

    python benchmarks/synthetic_gguf.py --out /work/big7b-data/qwen2.5-7b-shape-f16.gguf \\
        [--layout qwen2.5-7b] [--seed 0] [--quantize Q4_K_M --llama-quantize PATH]

--quantize runs llama.cpp's own llama-quantize on the float16 file (output next to it, named for the type).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

import gguf
import numpy as np
import torch

from sudu.paths import models_dir

MATRIX_STD = 0.02
BIAS_STD = 0.02
CHUNK_ELEMENTS = 64 * 1024 * 1024
TOKENIZER_SOURCE = "qwen2.5-coder-0.5b-instruct"


@dataclasses.dataclass(frozen=True)
class Qwen2Layout:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    context_length: int = 32768
    tied_embeddings: bool = False


LAYOUTS = {
    # Qwen/Qwen2.5-7B-Instruct's config.json
    "qwen2.5-7b": Qwen2Layout(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                              intermediate_size=18944, vocab_size=152064),
}


def tensor_specs(layout: Qwen2Layout) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape (rows, columns), kind) of every tensor, in llama.cpp's converter's order;
    kind is "matrix", "norm" or "bias"."""
    h, q, kv, ffn = (layout.hidden_size, layout.num_heads * layout.head_dim, layout.num_kv_heads * layout.head_dim,
                     layout.intermediate_size)
    specs = [("token_embd.weight", (layout.vocab_size, h), "matrix"), ("output_norm.weight", (h,), "norm")]
    if not layout.tied_embeddings:
        specs.append(("output.weight", (layout.vocab_size, h), "matrix"))
    for i in range(layout.num_layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (h,), "norm"),
                  (p + "attn_q.weight", (q, h), "matrix"), (p + "attn_q.bias", (q,), "bias"),
                  (p + "attn_k.weight", (kv, h), "matrix"), (p + "attn_k.bias", (kv,), "bias"),
                  (p + "attn_v.weight", (kv, h), "matrix"), (p + "attn_v.bias", (kv,), "bias"),
                  (p + "attn_output.weight", (h, q), "matrix"),
                  (p + "ffn_norm.weight", (h,), "norm"),
                  (p + "ffn_gate.weight", (ffn, h), "matrix"), (p + "ffn_up.weight", (ffn, h), "matrix"),
                  (p + "ffn_down.weight", (h, ffn), "matrix")]
    return specs


def _stored_dtype(kind: str) -> np.dtype:
    # llama.cpp's converter keeps 1-D tensors (norms, biases) in float32 and quantizes only matrices
    return np.dtype(np.float16) if kind == "matrix" else np.dtype(np.float32)


def random_tensor(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> np.ndarray:
    """One tensor's values; a matrix drawn in row chunks straight into its float16 array."""
    if kind == "norm":
        return np.ones(shape, np.float32)
    if kind == "bias":
        return (torch.randn(shape, generator=gen) * BIAS_STD).numpy()
    out = np.empty(shape, np.float16)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // shape[1])
    for start in range(0, shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, shape[0] - start)
        out[start:start + rows] = (torch.randn((rows, shape[1]), generator=gen) * MATRIX_STD).half().numpy()
    return out


def copy_tokenizer(writer: gguf.GGUFWriter, source: gguf.GGUFReader, vocab_size: int) -> None:
    """Every tokenizer.* key of the source, the vocabulary padded to vocab_size entries."""
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab_size)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab_size - len(value))
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * (vocab_size - len(value))
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)


def write_synthetic_gguf(path: str, layout: Qwen2Layout, tokenizer_gguf: str, seed: int = 0,
                         name: str = "synthetic", progress: bool = True) -> int:
    """Writes the file; returns its size in bytes."""
    source = gguf.GGUFReader(tokenizer_gguf)
    if len(source.fields["tokenizer.ggml.tokens"].contents()) > layout.vocab_size:
        raise ValueError(f"{tokenizer_gguf}'s vocabulary does not fit the layout's {layout.vocab_size} rows")
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(layout.num_layers)
    w.add_context_length(layout.context_length)
    w.add_embedding_length(layout.hidden_size)
    w.add_feed_forward_length(layout.intermediate_size)
    w.add_head_count(layout.num_heads)
    w.add_head_count_kv(layout.num_kv_heads)
    w.add_rope_freq_base(layout.rope_theta)
    w.add_layer_norm_rms_eps(layout.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(w, source, layout.vocab_size)
    specs = tensor_specs(layout)
    for tname, shape, kind in specs:
        dtype = _stored_dtype(kind)
        w.add_tensor_info(tname, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(seed)
    total = sum(int(np.prod(s)) * _stored_dtype(k).itemsize for _, s, k in specs)
    done, t0 = 0, time.monotonic()
    for i, (tname, shape, kind) in enumerate(specs):
        data = random_tensor(shape, kind, gen)
        w.write_tensor_data(data)
        done += data.nbytes
        if progress and (data.nbytes > 1 << 20 or i == len(specs) - 1):
            rate = done / max(time.monotonic() - t0, 1e-9) / 1e6
            print(f"\r  {done / 1e9:6.2f} / {total / 1e9:.2f} GB  ({rate:.0f} MB/s)  {tname:28s}", end="",
                  file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    w.close()
    return os.path.getsize(path)


def quantize(llama_quantize: str, src: str, qtype: str, threads: int) -> str:
    """llama.cpp's own quantizer (it prints its progress); returns the output path."""
    dst = src.removesuffix(".gguf").removesuffix("-f16") + f"-{qtype.lower()}.gguf"
    subprocess.run([llama_quantize, src, dst, qtype, str(threads)], check=True)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="float16 GGUF to write")
    ap.add_argument("--layout", default="qwen2.5-7b", choices=sorted(LAYOUTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-gguf", default=None,
                    help=f"GGUF to copy the tokenizer from (default: the catalog's {TOKENIZER_SOURCE})")
    ap.add_argument("--quantize", default=None, help="llama-quantize type, e.g. Q4_K_M")
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE", "llama-quantize"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tok = args.tokenizer_gguf
    if tok is None:
        tok = str(models_dir() / f"{TOKENIZER_SOURCE}.gguf")
    if not os.path.exists(tok):
        sys.exit(f"tokenizer GGUF not found: {tok} (run `sudu models pull {TOKENIZER_SOURCE}` or pass --tokenizer-gguf)")
    layout = LAYOUTS[args.layout]
    if not os.path.exists(args.out):
        print(f"writing {args.out} ({args.layout}, seed {args.seed})", file=sys.stderr)
        size = write_synthetic_gguf(args.out, layout, tok, args.seed, name=f"{args.layout}-shape-random")
        print(f"wrote {size / 1e9:.2f} GB", file=sys.stderr)
    else:
        print(f"{args.out} exists, kept", file=sys.stderr)
    if args.quantize:
        print(quantize(args.llama_quantize, args.out, args.quantize, args.threads))


if __name__ == "__main__":
    main()
