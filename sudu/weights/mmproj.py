"""llama.cpp's `mmproj` files: a vision tower and its projector in a GGUF file of their own (general.architecture
"clip"), next to the language model's GGUF. attach_mmproj turns a text checkpoint into the vision-language one:
the vision config and image preprocessing from the file's clip.* keys, its tensors under the Hugging Face names
the network takes. Gemma 3's projector (clip.projector_type "gemma3": SigLIP + average pooling + RMSNorm +
projection) is read; other projector types are refused with the reason."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from sudu.errors import SuduError
from sudu.weights.gguf import QuantizedTensor, open_gguf

SUPPORTED_PROJECTORS = ("gemma3",)
GEMMA3_IMAGE_TOKEN = "<image_soft_token>"
GEMMA3_SCALE_FACTOR = 4  # llama.cpp's pooling kernel when the file does not say (the released models': 64 -> 16)

_GLOBAL = {
    "v.patch_embd.weight": "vision_tower.embeddings.patch_embedding.weight",
    "v.patch_embd.bias": "vision_tower.embeddings.patch_embedding.bias",
    "v.position_embd.weight": "vision_tower.embeddings.position_embedding.weight",
    "v.post_ln.weight": "vision_tower.post_layernorm.weight",
    "v.post_ln.bias": "vision_tower.post_layernorm.bias",
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
}
_BLOCK = re.compile(r"^v\.blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_BLOCK_PARTS = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1",
                "ffn_down": "mlp.fc2"}


def hf_vision_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_PARTS:
        return None
    return f"vision_tower.encoder.layers.{m.group(1)}.{_BLOCK_PARTS[m.group(2)]}.{m.group(3)}"


def attach_mmproj(ckpt, path: str | Path) -> None:
    """ckpt (a GGUF text checkpoint, weights/loader.py Checkpoint) becomes the vision-language checkpoint: its
    config, preprocessing and tensors extended by the mmproj file's. SuduError for a file that is no mmproj, a
    projector sudu does not run, a language model of another family, or a tensor the network does not take."""
    gf = open_gguf(path)
    get = gf.metadata.get
    if get("general.architecture") != "clip" or not get("clip.has_vision_encoder", False):
        raise SuduError(f"{path} is not a llama.cpp mmproj file with a vision encoder")
    projector = get("clip.projector_type")
    if projector not in SUPPORTED_PROJECTORS:
        raise SuduError(f"{path}: projector type {projector!r} is not supported; sudu reads "
                        f"{', '.join(SUPPORTED_PROJECTORS)}")
    if ckpt.format != "gguf" or ckpt.config.architecture != "gemma3":
        raise SuduError(f"a {projector} mmproj file goes with a Gemma 3 GGUF language model, not "
                        f"{ckpt.config.architecture} ({ckpt.path.name})")
    image_token_id = ckpt.tokenizer.token_to_id(GEMMA3_IMAGE_TOKEN)
    if image_token_id is None:
        raise SuduError(f"{ckpt.path.name}'s vocabulary has no {GEMMA3_IMAGE_TOKEN} token for the image embeddings")
    side, patch = int(get("clip.vision.image_size")), int(get("clip.vision.patch_size"))
    vision = {
        "hidden_size": int(get("clip.vision.embedding_length")),
        "intermediate_size": int(get("clip.vision.feed_forward_length")),
        "num_hidden_layers": int(get("clip.vision.block_count")),
        "num_attention_heads": int(get("clip.vision.attention.head_count")),
        "layer_norm_eps": float(get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        "image_size": side, "patch_size": patch, "num_channels": 3, "hidden_act": "gelu_pytorch_tanh",
    }
    per_side = side // patch // int(get("clip.vision.projector.scale_factor", GEMMA3_SCALE_FACTOR))
    ckpt.config = dataclasses.replace(ckpt.config, architecture="gemma3_vl", vision_config=vision,
                                      image_token_id=image_token_id, mm_tokens_per_image=per_side * per_side)
    ckpt.preprocessor = {"image_mean": list(get("clip.vision.image_mean", [0.5] * 3)),
                         "image_std": list(get("clip.vision.image_std", [0.5] * 3)),
                         "size": {"height": side, "width": side}, "resample": 2}
    for t in gf.tensors:
        name = hf_vision_name(t.name)
        if name is None:
            raise SuduError(f"{path}: tensor {t.name} has no place in the {projector} vision network")
        qt = QuantizedTensor(name, t.name, t.ggml_type, t.shape, t.data)
        if t.name == "mm.soft_emb_norm.weight":  # stored as 1 + w, Gemma's RMSNorm takes w
            qt.norm_offset = -1.0
        ckpt._quantized[name] = qt
    ckpt.mmproj_reader = gf  # its memory map backs the tensors above
