"""A tiny random Qwen2.5-VL built with transformers (the reference), saved as a Hugging Face directory with its
tokenizer (the three vision special tokens added) and preprocessor_config.json, and the reference's own inputs:
the prompt with each image's pad token repeated as transformers' processor grid says, its pixel values and
grids, and its greedy continuation."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.helpers.tiny_models import build_tokenizer as byte_level_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS]
VOCAB_SIZE = 384
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 48
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def token_id(name: str) -> int:
    return VOCAB_SIZE - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(name)


def build_vl_tokenizer():
    fast = byte_level_tokenizer(SPECIAL_TOKENS)
    assert fast.convert_tokens_to_ids("<|image_pad|>") == token_id("<|image_pad|>")
    return fast


def hf_vl_config():
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                eos_token_id=token_id("<|im_end|>"))
    # windows of 2 x 2 merged patches (56 px), full attention at block 1: both attention kinds run
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, temporal_patch_size=2,
                  spatial_merge_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1], in_channels=3)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=token_id("<|image_pad|>"),
                            vision_start_token_id=token_id("<|vision_start|>"),
                            vision_end_token_id=token_id("<|vision_end|>"), tie_word_embeddings=False)


def build_hf_vl_model(seed: int = 0):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration._from_config(hf_vl_config(), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():  # norms off identity and biases off zero, so their conventions are really tested
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.normal_(0, 0.02)
    return model


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def save_tiny_vlm(path: Path, seed: int = 0):
    """(directory, the transformers model)."""
    model = build_hf_vl_model(seed)
    model.save_pretrained(path)
    build_vl_tokenizer().save_pretrained(path)
    image_processor().save_pretrained(path)
    return Path(path), model


def random_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random RGB image (gradients plus noise), so resizing has real work."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_bytes(image: Image.Image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def reference_inputs(tokenizer, text: str, images: list[Image.Image]) -> dict:
    """transformers' inputs for a chat prompt whose user text holds one PLACEHOLDER per image: input_ids with
    each pad token repeated grid / merge^2 times, pixel_values, image_grid_thw, mm_token_type_ids."""
    feats = image_processor()(images=images, return_tensors="pt")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pad = token_id("<|image_pad|>")
    counts = iter((feats["image_grid_thw"].prod(-1) // 4).tolist())
    expanded = []
    for t in ids:
        expanded.extend([pad] * next(counts) if t == pad else [t])
    input_ids = torch.tensor([expanded])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "pixel_values": feats["pixel_values"], "image_grid_thw": feats["image_grid_thw"],
            "mm_token_type_ids": (input_ids == pad).int()}


@torch.no_grad()
def reference_greedy(model, inputs: dict, max_new_tokens: int, logprobs: list | None = None) -> list[int]:
    """transformers' greedy tokens, each from a whole forward pass over the prompt and the tokens so far (no
    cache, end-of-sequence ignored: the same length as the engine's ignore_eos run); logprobs, when given, gets
    each chosen token's log-probability. Generated tokens are text in the type ids that mark image tokens
    (Qwen2.5-VL's mm_token_type_ids, Gemma 3's token_type_ids)."""
    inputs = dict(inputs)
    out = []
    for _ in range(max_new_tokens):
        logits = model(**inputs).logits[0, -1]
        token = int(logits.argmax())
        if logprobs is not None:
            logprobs.append(float(torch.log_softmax(logits.double(), -1)[token]))
        out.append(token)
        grow = torch.tensor([[token]])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], grow], 1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        for key in ("mm_token_type_ids", "token_type_ids"):
            if key in inputs:
                inputs[key] = torch.cat([inputs[key], torch.zeros_like(grow, dtype=inputs[key].dtype)], 1)
    return out


def sudu_processor(model_dir):
    """sudu's checkpoint of a saved tiny vision model and its image processor (media/processors.py)."""
    from sudu.media.processors import image_processor
    from sudu.weights.loader import load_checkpoint

    ckpt = load_checkpoint(str(model_dir), pull=False, progress=False)
    return ckpt, image_processor(ckpt.config, ckpt.preprocessor)


def step_requests(engine, requests, on_step=None) -> tuple[dict, dict]:
    """requests: (request id, prompt ids, images, params, step at which it is added). Tokens and logprobs by
    request id; on_step(engine, step index) after each step."""
    outputs, logprobs, step = {}, {}, 0
    pending = sorted(requests, key=lambda r: r[4])
    while pending or engine.has_unfinished():
        while pending and pending[0][4] <= step:
            rid, ids, images, params, _ = pending.pop(0)
            engine.add_request(rid, engine.check_request(ids, params, images))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.outputs[0].logprobs)
        if on_step is not None:
            on_step(engine, step)
        step += 1
    return outputs, logprobs
