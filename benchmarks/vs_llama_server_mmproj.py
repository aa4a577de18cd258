"""sudu serve vs llama.cpp's llama-server on the same GGUF + mmproj pair: a Gemma 3 with the 4B-27B checkpoints'
vision tower (SigLIP So400m at 896 x 896, 256 image tokens; --depth of its 27 blocks) and a small random
language model, converted by llama.cpp's own convert_hf_to_gguf.py (float32). Both servers run at once with the
same threads, each idle while the other serves; each new image (so neither server's caches hold it) goes to both
in alternating order. Per server: image-to-first-token time (a one-token answer to the image and a question, sent
to received: decoding, preprocessing, the vision tower, the prompt, one token) and the decode speed with the image
in context (the same prompt again for 32 tokens, as the server times it), medians and the sudu / llama-server
ratios.

    python benchmarks/llama_server.py --build     # once, or $LLAMA_SERVER
    python benchmarks/vs_llama_server_mmproj.py [--depth 27] [--images 3] [--threads 2] [--out DIR]

llama.cpp's source tree (for the converter): $LLAMA_CPP_SOURCE, else the places tests/helpers/tiny_gemma3_vl.py
looks.
"""
from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import llama_server  # noqa: E402
from tests.helpers.tiny_gemma3_vl import convert_to_gguf, save_dir, token_id  # noqa: E402
from tests.helpers.tiny_vlm import png_bytes, random_image  # noqa: E402

MAX_TOKENS = 32


# the language model: a small one, or gemma-3-4b-it's (its released config.json: 34 layers of width 2560, five
# sliding-window layers per global one, the 262,208-row embedding tied to the output; the global layers' linear
# rope scaling is left out, it changes no cost)
TEXT_SHAPES = {
    "tiny": dict(vocab_size=384, hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, query_pre_attn_scalar=64, num_hidden_layers=6, sliding_window=512,
                 layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "4b": dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=34,
               sliding_window=1024, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5
               + ["sliding_attention"] * 4),
}


def build_model(depth: int, shape: str = "tiny"):
    """Gemma 3 with the So400m tower (depth of 27 blocks) and the `shape` text model, random weights (the 4B one
    in bfloat16: float32 would not fit next to the converter)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(TEXT_SHAPES[shape], max_position_embeddings=8192, eos_token_id=token_id("<|im_end|>"))
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=depth, num_attention_heads=16,
                  image_size=896, patch_size=14, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256,
                       boi_token_index=token_id("<start_of_image>"), eoi_token_index=token_id("<end_of_image>"),
                       image_token_index=token_id("<image_soft_token>"))
    torch.manual_seed(0)
    if shape == "tiny":
        return Gemma3ForConditionalGeneration._from_config(cfg).float().eval()
    return Gemma3ForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16).eval()


LLAMA_QUANTIZE = "llama-quantize"  # next to llama-server in llama.cpp's build


def prepare(out: Path, depth: int, shape: str, quant: str) -> tuple[Path, Path]:
    """(the text GGUF, the mmproj GGUF): built once per (shape, depth, quant) under `out` and kept. The tiny shape
    converts to float32; the 4B shape to float16 (the released mmproj files' type) and the text model is then
    quantized by llama.cpp's own llama-quantize to `quant` (e.g. Q4_K_M)."""
    tag = f"gemma3-{shape}-vision{depth}"
    model_dir, gguf_dir = out / tag, out / f"{tag}-gguf"
    outtype = "f32" if shape == "tiny" else "f16"
    text, mmproj = gguf_dir / f"model-{outtype}.gguf", gguf_dir / f"mmproj-model-{outtype}.gguf"
    if not mmproj.exists():
        print(f"building the {shape} model ({depth} vision blocks) and converting it with llama.cpp's converter",
              flush=True)
        gguf_dir.mkdir(parents=True, exist_ok=True)
        save_dir(model_dir, build_model(depth, shape), 896, 256, gguf_ready=True)
        text, mmproj = convert_to_gguf(model_dir, gguf_dir, outtype)
    if quant.lower() in ("", "none"):
        return text, mmproj
    quantized = gguf_dir / f"model-{quant}.gguf"
    if not quantized.exists():
        tool = os.path.join(os.path.dirname(llama_server.require()), LLAMA_QUANTIZE)
        print(f"quantizing the text model to {quant} with {tool}", flush=True)
        subprocess.run([tool, str(text), str(quantized) + ".part", quant, "2"], check=True,
                       env=dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(tool)), stdout=subprocess.DEVNULL)
        os.replace(str(quantized) + ".part", quantized)
    return quantized, mmproj


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"a server exited while starting: {url}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"{url} did not come up")


def chat(url: str, image_url: str, max_tokens: int) -> tuple[float, dict]:
    """(seconds from sending to the whole answer, the response body) of one non-streamed request."""
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                      {"type": "text", "text": "Describe it."}]}]}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def decode_tok_per_s(name: str, body: dict) -> float:
    """The server's own decode speed after the first token (sudu's `sudu.decode_s`, llama-server's `timings`):
    the tiny vocabulary's tokens are bytes that often complete no character, so streamed chunks cannot time them."""
    if name == "sudu":
        return (MAX_TOKENS - 1) / body["sudu"]["decode_s"]
    return body["timings"]["predicted_per_second"]


def one_image(name: str, url: str, image_url: str) -> tuple[float, float]:
    """(image-to-first-token seconds: a one-token answer to a new image, measured by the client; decode tokens
    per second: the same prompt again, MAX_TOKENS tokens, its prompt served from the server's cache)."""
    first_s, _ = chat(url, image_url, 1)
    _, body = chat(url, image_url, MAX_TOKENS)
    return first_s, decode_tok_per_s(name, body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=27)
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/sudu-mmproj-bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    binary = llama_server.require()
    model_dir = out / f"gemma3-so400m-{args.depth}"
    text, mmproj = out / "model-f32.gguf", out / "mmproj-model-f32.gguf"
    if not mmproj.exists():
        print(f"building the model ({args.depth} vision blocks) and converting it with llama.cpp's converter")
        save_dir(model_dir, build_model(args.depth), 896, 256, gguf_ready=True)
        convert_to_gguf(model_dir, out)
    urls = {"sudu": "http://127.0.0.1:18421", "llama-server": "http://127.0.0.1:18422"}
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(binary))
    procs = {
        "sudu": start([sys.executable, "-m", "sudu.cli", "serve", str(text), "--mmproj", str(mmproj), "--port", "18421",
                       "--num-threads", str(args.threads), "--served-model-name", "m"], out / "sudu.log"),
        "llama-server": start([binary, "-m", str(text), "--mmproj", str(mmproj), "--port", "18422", "-t",
                               str(args.threads), "-tb", str(args.threads), "-c", "4096", "-np", "1"],
                              out / "llama-server.log", env),
    }
    try:
        for name, url in urls.items():
            wait_up(url, procs[name])
        print(f"both up; {args.images} new images (plus one warm-up each), {args.threads} threads, "
              f"{args.depth} of 27 vision blocks")
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in urls}
        salt = time.time_ns() % (1 << 31)  # images no earlier run sent: sudu's disk tier keeps KV across restarts
        for i in range(args.images + 1):  # image 0 warms both up and is not counted
            picture = random_image(1024, 768, seed=salt + i)
            image = "data:image/png;base64," + base64.b64encode(png_bytes(picture)).decode()
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in order:
                r = one_image(name, urls[name], image)
                if i:
                    results[name].append(r)
                print(f"  image {i} {name}: first token {r[0]:.2f} s, decode {r[1]:.1f} tok/s", flush=True)
        med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
               for name, rs in results.items()}
        s, p = med["sudu"], med["llama-server"]
        print(f"median image-to-first-token: sudu {s[0]:.2f} s, llama-server {p[0]:.2f} s, "
              f"llama-server / sudu = {p[0] / s[0]:.2f}x")
        print(f"median decode with the image in context: sudu {s[1]:.1f} tok/s, llama-server {p[1]:.1f} tok/s, "
              f"sudu / llama-server = {s[1] / p[1]:.2f}x")
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
