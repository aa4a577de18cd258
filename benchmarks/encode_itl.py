"""A decoding stream's inter-token latency (ITL) while another request's image is encoded: the vision tower run
a stage (a block's attention, or its MLP) at a time between steps (sudu's default, engine/image_encoding.py)
against the whole tower at once before the step that reads the image, side by side in one process, rounds
alternating.

The model: Gemma 3 with the 4B-27B checkpoints' SigLIP tower shape (896 x 896 pixels, 4,096 patches, hidden
1152; --depth of its 27 layers) and a small text model, random weights (speed does not depend on their values),
int8 linears. Each round, one text request decodes; after --lead steps a request with a fresh image (no cache
hit: --encoder-cache-memory 0 and new pixels each round) arrives. Reported per mode: the text stream's largest
and median gap between tokens from the image's arrival to its first token, and the image request's time to
first token (image-to-first-token).

    python benchmarks/encode_itl.py [--depth 27] [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sudu.engine.vision_inputs as vision_inputs  # noqa: E402
from sudu.config import EngineConfig  # noqa: E402
from sudu.engine.llm_engine import LLMEngine  # noqa: E402
from sudu.media.image import content_hash  # noqa: E402
from sudu.sampling import SamplingParams  # noqa: E402
from tests.helpers.tiny_gemma3_vl import VOCAB_SIZE, save_dir, token_id  # noqa: E402
from tests.helpers.tiny_vlm import png_bytes, random_image  # noqa: E402

IMAGE_SIZE, TOKENS_PER_IMAGE = 896, 256


def build(path: Path, depth: int) -> Path:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=VOCAB_SIZE, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=512,
                layer_types=["sliding_attention"] * 5 + ["full_attention"], eos_token_id=token_id("<|im_end|>"))
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=depth, num_attention_heads=16,
                  image_size=IMAGE_SIZE, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          boi_token_index=token_id("<start_of_image>"), eoi_token_index=token_id("<end_of_image>"),
                          image_token_index=token_id("<image_soft_token>"))
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration._from_config(config).float().eval()
    return save_dir(path, model, IMAGE_SIZE, TOKENS_PER_IMAGE, gguf_ready=False)


def one_round(engine: LLMEngine, seed: int, lead: int) -> dict:
    """Text request decoding; the image request after `lead` steps; runs until the image request's first
    token. The text stream's gaps between tokens from the image's arrival on, and image-to-first-token."""
    tok, processor = engine.tokenizer, engine.image_processor
    text_ids = tok.encode("<|im_start|>user\nSay something long.<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
    image = random_image(IMAGE_SIZE, IMAGE_SIZE, seed)
    prompt = f"<|im_start|>user\n{processor.placeholder}Describe it.<|im_end|>\n<|im_start|>assistant\n"
    ids, placed = processor.expand(tok.encode(prompt, add_special_tokens=False),
                                   [processor.image_input(image, content_hash(png_bytes(image)))])
    params = SamplingParams(temperature=0.0, max_tokens=2048, ignore_eos=True)
    engine.add_request(f"text-{seed}", engine.check_request(text_ids, params))
    for _ in range(lead):
        engine.step()
    arrived = last = time.perf_counter()
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request(f"image-{seed}", engine.check_request(ids, one_token, placed))
    gaps, first_token = [], None
    while first_token is None:
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id.startswith("text") and out.outputs[0].token_ids:
                gaps.append(now - last)
                last = now
            elif out.request_id.startswith("image") and out.outputs[0].token_ids:
                first_token = now - arrived
    engine.abort(f"text-{seed}")
    while engine.has_unfinished():
        engine.step()
    return {"max_itl": max(gaps), "median_itl": statistics.median(gaps), "ttft": first_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=27, help="SigLIP layers (27 in the released checkpoints)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lead", type=int, default=8, help="decode steps before the image request arrives")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building a Gemma 3 directory: {args.depth}-layer 4B-shape SigLIP, small text model ...", flush=True)
        model_dir = build(Path(tmp) / "model", args.depth)
        engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=4096, quantization="int8",
                                        num_threads=args.threads, encoder_cache_memory=0, speculative="none",
                                        kv_cache_memory=256 << 20), progress=False)
        spread = vision_inputs.encode_allowance
        modes = {"whole tower at once": lambda scheduler: None, "a stage at a time (default)": spread}
        results = {name: [] for name in modes}
        one_round(engine, 10_000, args.lead)  # warm-up: first calls page in and build what later ones reuse
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for name in order:
                vision_inputs.encode_allowance = modes[name]
                # a new image every round and mode: the prefix cache must not hold the image's tokens
                results[name].append(one_round(engine, 1000 * (r + 1) + list(modes).index(name), args.lead))
                print(f"round {r + 1}, {name}: " + ", ".join(f"{k} {v * 1e3:.0f} ms"
                                                            for k, v in results[name][-1].items()), flush=True)
        vision_inputs.encode_allowance = spread
    print("\nmedian over rounds:")
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in results.items()}
    for name, m in med.items():
        print(f"  {name}: text stream's largest gap {m['max_itl'] * 1e3:.0f} ms, median gap "
              f"{m['median_itl'] * 1e3:.0f} ms; image-to-first-token {m['ttft'] * 1e3:.0f} ms")
    whole, chunked = med["whole tower at once"], med["a stage at a time (default)"]
    print(f"largest gap whole / spread: {whole['max_itl'] / chunked['max_itl']:.1f}x; "
          f"image-to-first-token spread / whole: {chunked['ttft'] / whole['ttft']:.2f}x")


if __name__ == "__main__":
    main()
