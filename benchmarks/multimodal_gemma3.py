"""Image encode time of Gemma 3's SigLIP vision tower at the 4B-27B checkpoints' shape (random weights; 896 x 896
pixels, 4,096 patches), sudu vs transformers' own tower on the same weights, side by side in one run: the median
of --repeat alternating runs, the ratio, and the largest difference of the outputs (float32). sudu also runs with
its int8 linears (--quantization int8's path: q/k/v, out, fc1, fc2). The projector (pooling to 256 tokens, a norm,
one product) is left out on both sides: it is a small fraction of the tower.

    python benchmarks/multimodal_gemma3.py [--depth 27] [--repeat 3] [--threads 2]

--depth below 27 times that many blocks: the per-block cost and the ratio, not the whole tower's time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from PIL import Image

from sudu.engine.network import quantize_model
from sudu.media.gemma3_vl import Gemma3Processor
from sudu.media.image import content_hash
from sudu.models.gemma3_vl import SiglipVisionModel

VISION_4B = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                 image_size=896, patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", num_channels=3)


def timed(fn) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=27)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import SiglipVisionConfig, SiglipVisionModel as HFSiglip

    shape = dict(VISION_4B, num_hidden_layers=args.depth)
    torch.manual_seed(0)
    hf = HFSiglip._from_config(SiglipVisionConfig(**shape, vision_use_head=False), attn_implementation="sdpa")
    hf = hf.float().eval()
    state = {n.removeprefix("vision_model."): t for n, t in hf.state_dict().items()}
    sudu = SiglipVisionModel(shape)
    sudu.load_state_dict(state, strict=True)
    sudu_int8 = SiglipVisionModel(shape)
    sudu_int8.load_state_dict(state, strict=True)
    sudu_int8 = quantize_model(sudu_int8.eval(), None, "int8")
    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8), "RGB")
    image = Gemma3Processor(image_token_id=0).image_input(picture, content_hash(b"1024x768"))
    pixels = image.pixel_values
    print(f"vision tower: Gemma 3 4B shape (SigLIP So400m), {args.depth} of 27 blocks, float32, {args.threads} threads")
    sides = (("sudu", lambda: sudu(pixels)), ("sudu int8", lambda: sudu_int8(pixels)),
             ("transformers", lambda: hf(pixel_values=pixels[None]).last_hidden_state[0]))
    runs: dict[str, list[float]] = {name: [] for name, _ in sides}
    outs = {}
    for i in range(args.repeat + 1):  # the first round warms up and is not counted
        for name, fn in sides:
            s, out = timed(fn)
            if i:
                runs[name].append(s)
            outs[name] = out
    med = {k: statistics.median(v) for k, v in runs.items()}
    diff = (outs["sudu"] - outs["transformers"]).abs().max().item()
    diff8 = (outs["sudu int8"] - outs["transformers"]).abs().max().item()
    print(f"1024x768 -> 896x896: {pixels.shape[1] // 14 * pixels.shape[2] // 14} patches; median of {args.repeat}: "
          f"sudu {med['sudu']:.3f} s, sudu int8 {med['sudu int8']:.3f} s, transformers {med['transformers']:.3f} s; "
          f"transformers / sudu = {med['transformers'] / med['sudu']:.2f}x, / sudu int8 = "
          f"{med['transformers'] / med['sudu int8']:.2f}x; max |diff| float32 {diff:.2e}, int8 {diff8:.2e}")


if __name__ == "__main__":
    main()
