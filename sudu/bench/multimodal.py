"""The `multimodal` suite of sudu bench: chat turns carrying one generated image (images.py) of each set size
with a question, in declared cache states for the image as for text, and the image-to-first-token summary.

Cache states of an image request (every prompt opens with a fresh text salt in its system message, as `cold`
text prompts do, unless the state says otherwise):
- cold: a fresh image each request (the scene salted per request): neither a prefix cache nor an encoder
  cache can hold it;
- warm: the identical request (same salt, same image) was sent just before: the prefix cache can serve the
  whole prompt, the image included;
- shared-image: the same image was sent just before behind another text salt: the prompt differs before the
  image, so a prefix cache misses from the salt on, and only an encoder cache (image embeddings kept by
  content) can save the image's encoding.
A text-only group (the same question without an image, cold) gives the baseline that the image's cost is
measured against. Where the server exposes sudu's encoder-cache counters on /metrics, they are read around
each measured request (outside its timing) as evidence of what the encoder cache did."""
from __future__ import annotations

import statistics
import uuid
from dataclasses import dataclass

import httpx

from sudu.bench.images import make_image
from sudu.bench.metrics import COLD_CACHED_TOKENS_LIMIT, measured
from sudu.bench.workloads import make_messages, prompt_set_id, salt

IMAGE_STATES = ("cold", "warm", "shared-image")
TEXT_GROUP = "text only"
DEFAULT_QUESTION = "Describe this image in detail: what is shown, and what do the text lines say?"
ENCODER_COUNTERS = {"sudu:encoder_cache_hits": "hits", "sudu:encoder_cache_misses": "misses",
                    "sudu:encoder_seconds": "seconds"}


@dataclass
class MultimodalOptions:
    sizes: list[tuple[int, int]]
    states: list[str]
    n: int
    max_tokens: int
    seed: int = 0
    text_baseline: bool = True
    question: str = DEFAULT_QUESTION
    warmups: int = 1


def group_name(width: int, height: int, state: str) -> str:
    return f"image {width}x{height} {state}"


def image_messages(image_url: str, question: str) -> list[dict]:
    """A fresh text salt (system message), then the user turn: the image, then the question."""
    return make_messages("cold", "")[:-1] + [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": question}]}]


def planned(opts: MultimodalOptions) -> int:
    per_size = sum({"cold": 1, "warm": 2, "shared-image": 2}[s] for s in opts.states) * opts.n
    return opts.warmups + (opts.n if opts.text_baseline else 0) + per_size * len(opts.sizes)


def metrics_url(base: str) -> str:
    """The server's Prometheus endpoint: /metrics at the root of an API base ending in /v1."""
    root = base[: -len("/v1")] if base.rstrip("/").endswith("/v1") else base
    return root.rstrip("/") + "/metrics"


async def encoder_counters(client: httpx.AsyncClient, url: str) -> dict | None:
    """sudu's encoder-cache counters ({"hits", "misses", "seconds"}), or None where the server has none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = await client.get(url, timeout=10.0)
        if resp.status_code != 200:
            return None
        out = {}
        for family in text_string_to_metric_families(resp.text):
            if family.name in ENCODER_COUNTERS and family.samples:
                out[ENCODER_COUNTERS[family.name]] = float(family.samples[0].value)
        return out if len(out) == len(ENCODER_COUNTERS) else None
    except (httpx.HTTPError, ValueError):
        return None


async def run_multimodal(ctx, opts: MultimodalOptions, send, group_cls) -> dict:
    """Send the workload through `send` (suites.send), adding one `group_cls` (suites.Group) per point to the
    run; returns the encoder-cache evidence per group ({group: {"hits", "misses", "seconds", "requests"}})."""
    run_salt = uuid.uuid4().hex  # images no earlier run sent: a disk tier keeps KV across restarts
    counter = iter(range(1 << 62))
    evidence: dict[str, dict] = {}
    url = metrics_url(ctx.base)
    scrape = httpx.AsyncClient(headers={k: v for k, v in ctx.headers.items() if k.lower() == "authorization"})

    def fresh(width: int, height: int):
        return make_image(width, height, opts.seed, f"{run_salt}:{next(counter)}")

    async def measure(group: str, state: str, image, messages) -> None:
        before = await encoder_counters(scrape, url)
        await send(ctx, group, state, messages, opts.max_tokens, images=[image.record()])
        after = await encoder_counters(scrape, url) if before is not None else None
        if after is not None:
            ev = evidence.setdefault(group, {"hits": 0.0, "misses": 0.0, "seconds": 0.0, "requests": 0})
            for key in ("hits", "misses", "seconds"):
                ev[key] += after[key] - before[key]
            ev["requests"] += 1

    try:
        w0, h0 = opts.sizes[0]
        for _ in range(opts.warmups):
            image = fresh(w0, h0)
            await send(ctx, "warmup", "cold", image_messages(image.data_url, opts.question), opts.max_tokens,
                       warmup=True, images=[image.record()])
        prompt_set = prompt_set_id("image-question", [opts.question, str(opts.seed)])
        if opts.text_baseline:
            ctx.run.groups.append(group_cls(TEXT_GROUP, "cold", {"images": 0, "prompt_set": prompt_set}))
            for _ in range(opts.n):
                await send(ctx, TEXT_GROUP, "cold", make_messages("cold", opts.question), opts.max_tokens)
        for width, height in opts.sizes:
            for state in opts.states:
                name = group_name(width, height, state)
                ctx.run.groups.append(group_cls(name, state, {"images": 1, "width": width, "height": height,
                                                              "prompt_set": prompt_set}))
                for _ in range(opts.n):
                    image = fresh(width, height)
                    messages = image_messages(image.data_url, opts.question)
                    if state == "warm":
                        await send(ctx, name, "cold", messages, opts.max_tokens, warmup=True, images=[image.record()])
                    elif state == "shared-image":
                        await send(ctx, name, "cold", image_messages(image.data_url, opts.question),
                                   opts.max_tokens, warmup=True, images=[image.record()])
                    await measure(name, state, image, messages)
    finally:
        await scrape.aclose()
    return evidence


# ---------- the summary: image-to-first-token per size ----------

def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ok(records, group: str) -> list:
    return [r for r in measured(records) if r.group == group and r.ok]


def _state_row(records, group: str, evidence: dict | None) -> dict | None:
    recs = _ok(records, group)
    if not recs:
        return None
    row = {"n": len(recs),
           "ttft_s": _median(r.metrics.get("ttft_s") for r in recs),
           "prompt_tokens": _median(r.metrics.get("prompt_tokens") for r in recs),
           "cached_tokens": _median(r.metrics.get("cached_tokens") for r in recs),
           "output_speed_tok_s": _median(r.metrics.get("output_speed_tok_s") for r in recs)}
    if evidence:
        row["encoder"] = dict(evidence)
    return row


def summarize(records, sizes: list[tuple[int, int]], evidence: dict | None = None) -> dict:
    """Per size: each state's median image-to-first-token (the TTFT of requests carrying the image), prompt and
    cached tokens, output speed; the image's tokens and its cost over the text-only baseline (medians of the
    image group minus the text group's); cold / warm and cold / shared-image ratios. Flags: a shared-image
    request whose cached tokens reach past the salt (it was not the state declared), and encoder counters
    that contradict a state (a cold image that hit, a shared image that was encoded again)."""
    evidence = evidence or {}
    text = _state_row(records, TEXT_GROUP, None)
    rows, flags = [], []
    for width, height in sizes:
        row = {"width": width, "height": height}
        for state in IMAGE_STATES:
            row[state] = _state_row(records, group_name(width, height, state), evidence.get(group_name(width, height, state)))
        cold = row["cold"]
        if cold and text:
            if cold["prompt_tokens"] is not None and text["prompt_tokens"] is not None:
                row["image_tokens"] = cold["prompt_tokens"] - text["prompt_tokens"]
            if cold["ttft_s"] is not None and text["ttft_s"] is not None:
                row["image_cost_s"] = cold["ttft_s"] - text["ttft_s"]
        for state in ("warm", "shared-image"):
            other = row[state]
            if cold and other and cold["ttft_s"] and other["ttft_s"]:
                row[f"cold_over_{state.replace('-', '_')}"] = cold["ttft_s"] / other["ttft_s"]
        rows.append(row)
        name = group_name(width, height, "shared-image")
        for r in measured(records):
            c = r.metrics.get("cached_tokens")
            if r.group == name and c is not None and c > COLD_CACHED_TOKENS_LIMIT:
                flags.append(f"request {r.request_id} ({name}): declared shared-image (a new text salt before the "
                             f"image) but {c} cached tokens (> {COLD_CACHED_TOKENS_LIMIT})")
        ev = evidence.get(group_name(width, height, "cold"))
        if ev and ev["hits"] > 0:
            flags.append(f"{group_name(width, height, 'cold')}: declared cold but the encoder cache reported "
                         f"{ev['hits']:.0f} hits")
        ev = evidence.get(name)
        if ev and ev["misses"] > 0:
            flags.append(f"{name}: the image was sent just before, yet the server encoded it again "
                         f"{ev['misses']:.0f} of {ev['requests']} times (encoder cache misses)")
    return {"text_only": text, "sizes": rows, "flags": flags}


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _cell(row: dict | None, with_cached: bool = True) -> str:
    if not row:
        return "-"
    cached = row.get("cached_tokens")
    return _ms(row["ttft_s"]) + (f" ({'not reported' if cached is None else f'{cached:.0f}'})" if with_cached else "")


def rows(summary: dict | None) -> tuple[list[str], list[list[str]]]:
    header = ["image", "image tokens (obs.)", "text-only TTFT ms", "cold: image-to-first-token ms (cached tok)",
              "image cost ms (cold - text)", "warm ms (cached tok)", "shared-image ms (encoder hits/requests)",
              "cold/warm", "cold/shared-image", "decode tok/s p50 (cold)"]
    out = []
    for row in (summary or {}).get("sizes", []):
        shared = row.get("shared-image")
        enc = (shared or {}).get("encoder")
        shared_cell = "-" if not shared else _ms(shared["ttft_s"]) + (
            f" ({enc['hits']:.0f}/{enc['requests']})" if enc else " (not reported)")
        ratio = lambda k: "-" if row.get(k) is None else f"{row[k]:.2f}x"  # noqa: E731
        tokens = row.get("image_tokens")
        speed = (row.get("cold") or {}).get("output_speed_tok_s")
        out.append([f"{row['width']}x{row['height']}", "-" if tokens is None else f"{tokens:.0f}",
                    _cell(summary.get("text_only"), False), _cell(row.get("cold")), _ms(row.get("image_cost_s")),
                    _cell(row.get("warm")), shared_cell, ratio("cold_over_warm"), ratio("cold_over_shared_image"),
                    "-" if speed is None else f"{speed:.1f}"])
    return header, out
