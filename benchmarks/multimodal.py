"""Image encode time of Qwen2.5-VL's vision tower at the 3B checkpoint's shape (random weights), sudu vs
transformers' own tower on the same weights, side by side in one run: per image size, the median of --repeat
alternating runs, the ratio, and the largest difference of the embeddings (float32). sudu also runs with its
int8 linears (--quantization int8's path, the vision tower's q/k/v, projection, MLP and merger). The encoder
cache's hit (a repeated image) is timed too.

    python benchmarks/multimodal.py [--sizes 448x448,1024x768] [--depth 32] [--repeat 3] [--threads 2]

--depth below 32 times that many blocks (the 3B tower has 32; full attention every 8th): the per-block cost and
the ratio, not the whole tower's time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sudu.engine.network import quantize_model
from sudu.engine.vision_inputs import EncoderCache
from sudu.media.image import content_hash
from sudu.media.qwen_vl import QwenVLProcessor
from sudu.models.qwen2_5_vl import VisionTransformer

VISION_3B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                 patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                 fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, hidden_act="silu")
MAX_PIXELS = 12845056  # Qwen2.5-VL's preprocessor_config.json


def random_image(width: int, height: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(width * height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def timed(fn, *args) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="448x448,1024x768")
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    shape = dict(VISION_3B, depth=args.depth,
                 fullatt_block_indexes=[i for i in VISION_3B["fullatt_block_indexes"] if i < args.depth])
    torch.manual_seed(0)
    hf_cfg = Qwen2_5_VLVisionConfig(**shape)
    hf_cfg._attn_implementation = "sdpa"
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(hf_cfg, attn_implementation="sdpa").float().eval()
    sudu = VisionTransformer(shape)
    sudu.load_state_dict(hf.state_dict(), strict=True)
    sudu.eval()
    sudu_int8 = VisionTransformer(shape)
    sudu_int8.load_state_dict(hf.state_dict(), strict=True)
    sudu_int8 = quantize_model(sudu_int8.eval(), None, "int8")
    processor = QwenVLProcessor(image_token_id=0, max_pixels=MAX_PIXELS)
    print(f"vision tower: Qwen2.5-VL-3B shape, {args.depth} of 32 blocks, float32, {args.threads} threads")
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        image = processor.image_input(random_image(w, h), content_hash(f"{w}x{h}".encode()))
        grid, pixels = [image.grid_thw], image.pixel_values
        runs = {"sudu": [], "sudu int8": [], "transformers": []}
        outs = {}
        sides = (("sudu", lambda: sudu(pixels, grid)), ("sudu int8", lambda: sudu_int8(pixels, grid)),
                 ("transformers", lambda: hf(pixels, grid_thw=torch.tensor(grid)).pooler_output))
        for i in range(args.repeat + 1):  # the first round warms up and is not counted
            for name, fn in sides:
                s, out = timed(fn)
                if i:
                    runs[name].append(s)
                outs[name] = out
        med = {k: statistics.median(v) for k, v in runs.items()}
        diff = (outs["sudu"] - outs["transformers"]).abs().max().item()
        diff8 = (outs["sudu int8"] - outs["transformers"]).abs().max().item()
        print(f"{w}x{h}: {image.num_tokens} image tokens ({pixels.shape[0]} patches); median of {args.repeat}: "
              f"sudu {med['sudu']:.3f} s, sudu int8 {med['sudu int8']:.3f} s, transformers {med['transformers']:.3f} s;"
              f" transformers / sudu = {med['transformers'] / med['sudu']:.2f}x, / sudu int8 = "
              f"{med['transformers'] / med['sudu int8']:.2f}x; max |diff| float32 {diff:.2e}, int8 {diff8:.2e}")
        cache = EncoderCache(1 << 30)
        cache.put(image.content_hash, outs["sudu"])
        t0 = time.perf_counter()
        for _ in range(1000):
            cache.get(image.content_hash)
        print(f"  encoder cache hit: {(time.perf_counter() - t0) * 1e6 / 1000:.2f} us")


if __name__ == "__main__":
    main()
