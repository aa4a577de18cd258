"""sudu serve vs llama.cpp's llama-server on the same GGUF + mmproj pair: a Gemma 3 with the 4B-27B checkpoints'
vision tower (SigLIP So400m at 896 x 896, 256 image tokens; --depth of its 27 blocks) and a language model of
--shape tiny (6 layers of 256, float32) or 4b (gemma-3-4b-it's, float16 then quantized by llama.cpp's own
llama-quantize to --quant, Q4_K_M by default), random weights, converted by llama.cpp's own convert_hf_to_gguf.py
(the mmproj in float32 for tiny, float16 for 4b). Both servers are up at once with the same threads, one serving
at a time; each new image (so neither server's caches hold it) goes to both in alternating order. Per server
and image size, medians of:
- image encode: the server's own seconds in the vision tower (sudu's /metrics, llama-server's log);
- image-to-first-token: a one-token answer to text, the new image and a question, sent to received (decoding,
  preprocessing, the tower, the prompt, one token);
- the same image behind other text: the prompt differs before the image, so a prefix cache cannot serve the
  image, only an encoder cache (sudu's) can;
- decode speed with the image in context: that prompt again for 32 tokens, as the server times it.

    python benchmarks/llama_server.py --build     # once, or $LLAMA_SERVER (llama-quantize is built beside it)
    python benchmarks/vs_llama_server_mmproj.py [--shape 4b] [--depth 27] [--images 3] [--sizes 448x448,1024x768]

llama.cpp's source tree (for the converter): $LLAMA_CPP_SOURCE, else the places tests/helpers/tiny_gemma3_vl.py
looks. The converted files are kept under --out and reused.
"""
from __future__ import annotations

import argparse
import os
import re
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
from sudu.bench.images import make_image, parse_sizes  # noqa: E402

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


def pad_vocab(tokenizer_json: Path, vocab_size: int) -> None:
    """Fill the tiny tokenizer's vocabulary with unused tokens up to the model's embedding rows: llama.cpp's
    converter cuts the embedding (and so the tied output head) to the tokenizer's size, and a 4B shape needs
    its 262,208-row head. The added tokens are never produced by its merges: tokenization is unchanged."""
    import json

    body = json.loads(tokenizer_json.read_text())
    vocab = body["model"]["vocab"]
    vocab.update({t["content"]: t["id"] for t in body["added_tokens"]})  # so that they keep their ids
    taken = set(vocab.values())
    vocab.update({f"<unused{i}>": i for i in range(vocab_size) if i not in taken})
    tokenizer_json.write_text(json.dumps(body))


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
        pad_vocab(model_dir / "tokenizer.json", TEXT_SHAPES[shape]["vocab_size"])
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


def chat(url: str, image_url: str, max_tokens: int, prefix: str) -> tuple[float, dict]:
    """(seconds from sending to the whole answer, the response body) of one non-streamed request: `prefix` text,
    then the image, then the question."""
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": prefix},
                                                      {"type": "image_url", "image_url": {"url": image_url}},
                                                      {"type": "text", "text": "Describe it."}]}]}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def decode_tok_per_s(name: str, body: dict) -> float:
    """The server's own decode speed after the first token (sudu's `sudu.decode_s`, llama-server's `timings`):
    the tiny vocabulary's tokens are bytes that often complete no character, so streamed chunks cannot time them."""
    if name == "sudu":
        return (MAX_TOKENS - 1) / body["sudu"]["decode_s"]
    return body["timings"]["predicted_per_second"]


def _log_seconds(stamp: str) -> float:
    """llama.cpp's log timestamp `M.SS.mmm.uuu` (with --log-timestamps, the default) in seconds."""
    minutes, secs, ms, us = (int(x) for x in stamp.split("."))
    return minutes * 60 + secs + ms / 1e3 + us / 1e6


def llama_encode_spans(log: str) -> list[float]:
    """llama-server's image encode times (seconds) from its log (-lv 4): from `encoding mtmd batch` to the next
    `decoding image batch` (where the language model starts on the image's embeddings)."""
    spans, start = [], None
    for m in re.finditer(r"^(\d+\.\d+\.\d+\.\d+) I .*?(encoding mtmd batch|decoding image batch)", log, re.M):
        if m.group(2) == "encoding mtmd batch":
            start = _log_seconds(m.group(1))
        elif start is not None:
            spans.append(_log_seconds(m.group(1)) - start)
            start = None
    return spans


class EncodeClock:
    """Seconds each server spent encoding images, read after each request: sudu's /metrics counter
    `sudu:encoder_seconds_total`; llama-server's log (llama_encode_spans)."""

    def __init__(self, name: str, url: str, log: Path):
        self.name, self.url, self.log, self.seen = name, url, log, 0.0

    def total(self) -> float | None:
        if self.name == "sudu":
            for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
                if line.startswith("sudu:encoder_seconds_total "):
                    return float(line.split()[1])
            return None
        spans = llama_encode_spans(self.log.read_text(errors="replace"))
        return sum(spans) if spans else None

    def since_last(self) -> float | None:
        now = self.total()
        if now is None:
            return None
        spent, self.seen = now - self.seen, now
        return spent


def one_image(name: str, url: str, image_url: str, salt: str, clock: EncodeClock, warmup: bool = False) -> dict:
    """One new image on one server: `first` (image-to-first-token: a one-token answer, client-timed) and
    `encode` (the server's own encoder seconds for it); `hit` (the same image behind other text, one token: the
    prompt differs before the image, so only an encoder cache can skip the tower); `decode` (that prompt again
    for MAX_TOKENS tokens, as the server times it, the image in context)."""
    clock.since_last()
    first_s, _ = chat(url, image_url, 1, f"Request {salt}a.")
    encode_s = clock.since_last()
    if warmup:
        return {"first": first_s, "encode": encode_s, "hit": None, "decode": None}
    hit_s, _ = chat(url, image_url, 1, f"Request {salt}b.")
    _, body = chat(url, image_url, MAX_TOKENS, f"Request {salt}b.")
    return {"first": first_s, "encode": encode_s, "hit": hit_s, "decode": decode_tok_per_s(name, body)}


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=27)
    ap.add_argument("--shape", choices=sorted(TEXT_SHAPES), default="tiny", help="the language model's shape")
    ap.add_argument("--quant", default=None, help="llama-quantize type for the text model (default: Q4_K_M for the "
                    "4B shape, none for the tiny one)")
    ap.add_argument("--sizes", default="1024x768", help="image sizes sent (Gemma 3 resizes each to 896 x 896)")
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="llama-server's context (-c)")
    ap.add_argument("--out", default="/tmp/sudu-mmproj-bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    binary = llama_server.require()
    quant = args.quant if args.quant is not None else ("Q4_K_M" if args.shape == "4b" else "none")
    text, mmproj = prepare(out, args.depth, args.shape, quant)
    sizes = parse_sizes(args.sizes)
    urls = {"sudu": "http://127.0.0.1:18421", "llama-server": "http://127.0.0.1:18422"}
    logs = {"sudu": out / "sudu.log", "llama-server": out / "llama-server.log"}
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(binary))
    procs = {
        "sudu": start([sys.executable, "-m", "sudu.cli", "serve", str(text), "--mmproj", str(mmproj), "--port", "18421",
                       "--num-threads", str(args.threads), "--served-model-name", "m"], logs["sudu"]),
        "llama-server": start([binary, "-m", str(text), "--mmproj", str(mmproj), "--port", "18422", "-t",
                               str(args.threads), "-tb", str(args.threads), "-c", str(args.ctx), "-np", "1",
                               "-lv", "4"], logs["llama-server"], env),
    }
    try:
        for name, url in urls.items():
            wait_up(url, procs[name], timeout_s=1800)
        clocks = {name: EncodeClock(name, url, logs[name]) for name, url in urls.items()}
        print(f"both up ({text.name} + {mmproj.name}); {args.images} new images per size (plus one warm-up), "
              f"{args.threads} threads each, {args.depth} of 27 vision blocks, one server at a time", flush=True)
        results: dict[tuple[str, tuple[int, int]], list[dict]] = {}
        run_salt = f"{time.time_ns() % (1 << 40):x}"  # no earlier run sent these: sudu's disk tier keeps KV
        step = 0
        for i in range(args.images + 1):  # image 0 (of the first size, one token) warms both up, not counted
            for size in sizes if i else sizes[:1]:
                image = make_image(*size, seed=0, salt=f"{run_salt}:{i}:{size}").data_url
                order = list(urls) if step % 2 == 0 else list(reversed(urls))
                step += 1
                for name in order:
                    r = one_image(name, urls[name], image, f"{run_salt}-{i}-{size[0]}", clocks[name], warmup=not i)
                    if i:
                        results.setdefault((name, size), []).append(r)
                    f = {k: "-" if v is None else f"{v:.2f}" for k, v in r.items()}
                    print(f"  image {i} {size[0]}x{size[1]} {name}: first token {f['first']} s (encode {f['encode']} s), "
                          f"same image after other text {f['hit']} s, decode {f['decode']} tok/s", flush=True)
        for size in sizes:
            s = {k: _median(results[("sudu", size)], k) for k in ("first", "encode", "hit", "decode")}
            p = {k: _median(results[("llama-server", size)], k) for k in ("first", "encode", "hit", "decode")}
            print(f"{size[0]}x{size[1]}, medians of {args.images}:")
            for key, label, faster in (("encode", "image encode s", "llama-server / sudu"),
                                       ("first", "image-to-first-token s", "llama-server / sudu"),
                                       ("hit", "same image after other text s", "llama-server / sudu"),
                                       ("decode", "decode tok/s, image in context", "sudu / llama-server")):
                a, b = s[key], p[key]
                ratio = "-" if a is None or b is None else f"{(b / a if key != 'decode' else a / b):.2f}x"
                fa = "-" if a is None else f"{a:.2f}"
                fb = "-" if b is None else f"{b:.2f}"
                print(f"  {label}: sudu {fa}, llama-server {fb}, {faster} = {ratio}")
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
