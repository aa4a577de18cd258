"""`sudu bench sweep`: prompt speed and decode speed against context depth, for one or several
OpenAI-compatible endpoints, measured side by side over HTTP.

Two modes, each at every depth D (prompt tokens; "8k" = 8000, so that a 32k point and its decode fit a
32768-token context):
- cold: a prompt of D tokens with a unique salt at its very start (nothing reusable), then
  `decode_tokens` tokens decoded: prompt tok/s = uncached prompt tokens / TTFT, TTFT, and decode tok/s at
  depth D (1 / TPOT).
- agent: a prefix of D tokens (a salted system message) is sent once with a one-token answer to warm the
  endpoint's cache (excluded); then the turn: the same prefix and `new_tokens` new tokens after it, then
  `decode_tokens` decoded. Its TTFT is the answer time of a turn deep in a session. The cache hit is
  verified from usage's cached tokens where the endpoint reports them.

Prompts are sized per endpoint: two excluded calibration requests (no filler, then up to CALIBRATION_WORDS
filler words: a quarter of the deepest depth's tokens, an eighth of the endpoint's context at most) give the endpoint's prompt tokens of the empty prompt and per filler word, from its own
usage; every request's real prompt tokens are then recorded, and a point whose prompts miss their depth
by more than DEPTH_TOLERANCE is flagged. Repetitions are interleaved over the endpoints (depth by depth,
repetition by repetition, one endpoint after the other), so that drift on a shared machine falls on all
of them alike; requests are never concurrent. Each request goes through the bench's client (suites.send):
streamed, usage included, output tokens recounted with the model's tokenizer where sudu knows it.
Figures, report and plot: sweep_report.py."""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from sudu.bench import suites
from sudu.bench.client import ClientPool, api_base, auth_headers, fetch_server_info, make_client
from sudu.bench.sweep_report import build_report
from sudu.bench.tokens import load_token_counter
from sudu.bench.workloads import filler_text, salt
from sudu.errors import SuduError

MODES = ("cold", "agent")
CALIBRATION_WORDS = 1000
DEPTH_TOLERANCE = 0.05
CONTINUE = "Continue the text above with one more paragraph."
TURN_QUESTION = "Given the whole text above, continue the last paragraph."


@dataclass
class Endpoint:
    label: str
    url: str
    model: str | None = None


@dataclass
class SweepOptions:
    depths: list[int]
    modes: list[str] = field(default_factory=lambda: list(MODES))
    repeats: int = 3
    decode_tokens: int = 64
    new_tokens: int = 256
    ignore_eos: bool = True
    seed: int = 0


@dataclass
class Calibration:
    """An endpoint's prompt tokens as a function of filler words: base + per_word * words."""

    base_tokens: float
    per_word: float
    note: str = ""

    def words_for(self, tokens: float) -> int:
        return max(0, round((tokens - self.base_tokens) / self.per_word))


@dataclass
class Target:
    """One endpoint during a run: its request context (suites.Ctx with its own Run of records)."""

    endpoint: Endpoint
    ctx: suites.Ctx
    context_len: int | None = None
    calibration: Calibration | None = None


def parse_depths(text: str) -> list[int]:
    """`2k,8k,512` -> [2000, 8000, 512] (k = 1000)."""
    out = []
    for part in (p.strip().lower() for p in str(text).split(",")):
        if not part:
            continue
        scale = 1000 if part.endswith("k") else 1
        try:
            value = float(part[:-1] if part.endswith("k") else part) * scale
        except ValueError:
            raise SuduError(f"bad depth {part!r} in --depths: expected numbers such as 512,2k,8k") from None
        if value < 1 or value != int(value):
            raise SuduError(f"bad depth {part!r} in --depths: a whole number of tokens >= 1")
        out.append(int(value))
    if not out:
        raise SuduError("give --depths, e.g. 2k,8k,16k,24k,32k")
    return out


def parse_endpoints(urls: list[str], labels: list[str] | None, models: list[str] | None) -> list[Endpoint]:
    """--url (repeatable) with --label and --model given once per URL, or once for all (--model)."""
    labels, models = labels or [], models or []
    if labels and len(labels) != len(urls):
        raise SuduError(f"give one --label per --url ({len(urls)} URLs, {len(labels)} labels)")
    if len(models) > 1 and len(models) != len(urls):
        raise SuduError(f"give one --model per --url, or one for all ({len(urls)} URLs, {len(models)} models)")
    out = []
    for i, url in enumerate(urls):
        label = labels[i] if labels else url.split("://", 1)[-1].split("/", 1)[0]
        model = models[i] if len(models) > 1 else (models[0] if models else None)
        out.append(Endpoint(label, url, model))
    if len({e.label for e in out}) != len(out):
        raise SuduError("endpoint labels must differ (give --label per --url)")
    return out


def cold_messages(words: int, seed: int) -> list[dict]:
    return [{"role": "system", "content": salt() + filler_text(words, seed)}, {"role": "user", "content": CONTINUE}]


def planned_requests(opts: SweepOptions, n_endpoints: int) -> int:
    """Measured requests (agent turns count one each; their warming requests are excluded)."""
    return len(opts.modes) * len(opts.depths) * opts.repeats * n_endpoints


async def open_target(pool: ClientPool, endpoint: Endpoint, api_key: str | None, extra_body: dict) -> Target:
    base = api_base(endpoint.url)
    headers = auth_headers(api_key)
    async with make_client(1, 30.0) as c:
        info = await fetch_server_info(c, base, headers)
    if info.get("error", "").startswith(("ConnectError", "ConnectTimeout")):
        raise SuduError(f"cannot reach {endpoint.label} at {base}: {info['error']}")
    model = endpoint.model
    if not model:
        data = (info.get("models") or {}).get("data") or []
        if not data:
            raise SuduError(f"{endpoint.label}: no --model given and GET {base}/models listed none ({info})")
        model = data[0].get("id")
    endpoint.url, endpoint.model = base, model
    count_tokens, recount = load_token_counter(model)
    run = suites.Run(suite="sweep", target={"url": base, "model": model, "label": endpoint.label}, config={})
    run.server_info, run.token_recount = info, recount
    ctx = suites.Ctx(pool=pool, base=base, headers=headers, model=model, run=run, count_tokens=count_tokens,
                     extra_body=dict(extra_body))
    return Target(endpoint, ctx, suites.context_len_from_server(info))


def calibration_words(depths: list[int], context_len: int | None) -> int:
    """Filler words of the second calibration request: small enough to fit any tokenizer's share of the
    deepest depth and of the context (a few tokens per word at worst), large enough to average over."""
    return max(16, min(CALIBRATION_WORDS, max(depths) // 4, (context_len or 1 << 30) // 8))


async def calibrate(t: Target, seed: int, words: int) -> Calibration:
    """Prompt tokens of the empty and of a `words`-word prompt, from the endpoint's usage."""
    tokens = []
    for n in (0, words):
        rec = await suites.send(t.ctx, "calibration", "cold", cold_messages(n, seed + 7919), 1, warmup=True)
        if not rec.ok:
            raise SuduError(f"{t.endpoint.label}: the calibration request failed: {rec.error}")
        tokens.append(rec.metrics.get("prompt_tokens"))
    if None in tokens or tokens[1] <= tokens[0]:
        return Calibration(24.0, 1.0, "the endpoint reports no prompt tokens: 1 token per filler word assumed, "
                           "depths unverified")
    per_word = (tokens[1] - tokens[0]) / words
    return Calibration(float(tokens[0]), per_word,
                       f"{tokens[0]} prompt tokens without filler, {per_word:.3f} per filler word (usage, {words} words)")


def fits(t: Target, tokens: int) -> bool:
    return t.context_len is None or tokens <= t.context_len


async def cold_request(t: Target, depth: int, decode_tokens: int, seed: int) -> object:
    messages = cold_messages(t.calibration.words_for(depth), seed)
    return await suites.send(t.ctx, f"cold depth={depth}", "cold", messages, decode_tokens)


async def agent_turn(t: Target, depth: int, new_tokens: int, decode_tokens: int, seed: int) -> object:
    """Warm a salted prefix of `depth` tokens (excluded), then the turn: the prefix + `new_tokens` new ones."""
    cal = t.calibration
    system = {"role": "system", "content": salt() + filler_text(cal.words_for(depth), seed)}
    group = f"agent depth={depth}"
    # the warming request is a cold request's shape (the calibrated one), so its prompt is `depth` tokens
    warm = await suites.send(t.ctx, group, "cold", [system, {"role": "user", "content": CONTINUE}], 1, warmup=True)
    turn_words = max(1, round(new_tokens / cal.per_word))
    user = filler_text(turn_words, seed + 104729) + "\n\n" + TURN_QUESTION
    rec = await suites.send(t.ctx, group, "shared-prefix", [system, {"role": "user", "content": user}], decode_tokens)
    rec.metrics["warming_prompt_tokens"] = warm.metrics.get("prompt_tokens")
    return rec


def progress_line(i: int, total: int, label: str, mode: str, depth: int, rep: int, rec) -> str:
    m = rec.metrics
    head = f"[{i}/{total}] {label} {mode} depth={depth} rep {rep + 1}:"
    if not rec.ok:
        return f"{head} FAILED ({(rec.error or '')[:160]})"
    prompt, cached, ttft = m.get("prompt_tokens"), m.get("cached_tokens"), m.get("ttft_s")
    new = None if prompt is None else prompt - (cached or 0)
    speed = f" ({new / ttft:.0f} tok/s)" if new and ttft else ""
    cache = f", {cached} cached" if cached else ""
    decode = m.get("output_speed_tok_s")
    decode_text = f", decode {m.get('output_tokens')} tok at {decode:.1f} tok/s" if decode else ""
    return f"{head} prompt {prompt} tok{cache}, TTFT {ttft:.2f} s{speed}{decode_text}"


async def run_sweep(targets: list[Target], opts: SweepOptions, log: Callable[[str], None], done: list[dict]) -> None:
    """Calibrate each endpoint, then every (mode, depth, repetition) on each endpoint in turn. Appends one
    entry per measured request to `done` as it finishes: {endpoint, mode, depth, rep, record} (record: the
    RequestRecord), so that an interrupted run keeps what it measured."""
    for t in targets:
        t.calibration = await calibrate(t, opts.seed, calibration_words(opts.depths, t.context_len))
        log(f"{t.endpoint.label}: {t.endpoint.model} at {t.endpoint.url}; {t.calibration.note}"
            + (f"; context {t.context_len}" if t.context_len else ""))
    total = planned_requests(opts, len(targets))
    i = 0
    for mode in opts.modes:
        for depth in opts.depths:
            need = depth + opts.decode_tokens + (opts.new_tokens if mode == "agent" else 0)
            for rep in range(opts.repeats):
                seed = opts.seed + 1000 * depth + rep
                for t in targets:
                    i += 1
                    if not fits(t, need):
                        if rep == 0:
                            note = f"{mode} depth={depth}: {need} tokens exceed the endpoint's context {t.context_len}"
                            t.ctx.run.notes.append(note + ": skipped")
                            log(f"[{i}/{total}] {t.endpoint.label} {note}: skipped")
                        continue
                    if mode == "cold":
                        rec = await cold_request(t, depth, opts.decode_tokens, seed)
                    else:
                        rec = await agent_turn(t, depth, opts.new_tokens, opts.decode_tokens, seed)
                    done.append({"endpoint": t.endpoint.label, "mode": mode, "depth": depth, "rep": rep, "record": rec})
                    log(progress_line(i, total, t.endpoint.label, mode, depth, rep, rec))


def execute(endpoints: list[Endpoint], opts: SweepOptions, api_key: str | None, timeout_s: float,
            config: dict) -> tuple[dict, list[Target]]:
    """Run the sweep (Ctrl-C: what was measured so far, marked partial) and build its report."""
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    extra = {"continuous_usage": False}
    if opts.ignore_eos:
        extra["ignore_eos"] = True
    targets: list[Target] = []
    entries: list[dict] = []
    started = time.time()

    async def main() -> None:
        async with ClientPool(timeout_s) as pool:
            for e in endpoints:
                targets.append(await open_target(pool, e, api_key, extra))
            log(f"sweep: {len(endpoints)} endpoint(s) x {len(opts.modes)} mode(s) x {len(opts.depths)} depths x "
                f"{opts.repeats} repetitions = {planned_requests(opts, len(endpoints))} measured requests")
            await run_sweep(targets, opts, log, entries)

    partial = False
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        partial = True
    return build_report(targets, entries, opts, config, started, partial), targets
