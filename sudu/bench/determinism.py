"""The `determinism` suite: does the same request get the same answer, whatever else the server does?

Each target request (a prompt x a mode: greedy = temperature 0, seeded = temperature > 0 with `seed`) is
sent several times to an OpenAI-compatible endpoint (non-streaming, chat or completions), and every run
is compared with the request's reference run:

- `alone (reference)`: the first run of the request's exact tokens, alone on the server. Its prompt
  starts with a salt fresh to this bench run, so it is cold (the cached tokens the server reports say so).
- `repeat`: the identical request again, alone: the prompt cache now holds all of it that the server keeps.
- `load c=N`: the request again while N-1 other, different requests (other prompts and lengths, longer
  answers) are in flight: they are sent first and the target joins them, so its prompt and its decode
  steps share the server's batches with them.
- `prefix`: a server never gives a cold run of tokens it has cached, so this condition uses a twin of
  the request (the same text under its own salt): the first part of its prompt is sent (one token
  asked), then the whole twin, which then finds only that part cached; the run is compared with the
  twin's own repeat, which finds the whole prompt cached (`repeat` ties that state to the cold one).

A run is identical when its text (and, with logprobs, every token and its logprob, bit for bit) equals
its reference's. For each run that is not, the report gives the first divergence: token index (from the
logprobs' tokens, else the model tokenizer's count of the common text, else only the character index)
and the two texts around it. Each run records the prompt tokens and the cached tokens the server
reported (usage.prompt_tokens_details.cached_tokens, prompt_cache_hit_tokens, or llama-server's
timings.cache_n)."""
from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

from sudu.bench.client import ClientPool
from sudu.bench.metrics import SCHEMA, cached_tokens
from sudu.bench.report import environment
from sudu.errors import SuduError

MODES = ("greedy", "seeded")
APIS = ("chat", "completions")
CONTEXT_CHARS = 40  # characters shown on each side of a divergence

# Everyday requests of different lengths (a short one, a few mid-length ones, one with code), so that
# prompts end at different places within the server's cache blocks.
PROMPTS = (
    "Write a haiku about caches.",
    "Explain in three sentences why the sky is blue, for a ten-year-old.",
    "What is the difference between a process and a thread? Give one example of when to use each, and "
    "say what they share.",
    "Review this function and suggest one improvement:\n\n```python\ndef avg(xs):\n    s = 0\n"
    "    for i in range(len(xs)):\n        s = s + xs[i]\n    return s / len(xs)\n```",
    "List four things to check before deploying a web service to production.",
    "Translate to French: The meeting is moved to Thursday because the room is booked.",
    "Write a SQL query that returns each customer's most recent order, given customers(id, name) and "
    "orders(id, customer_id, created_at, total).",
    "How do I undo the last git commit but keep the changes in my working tree?",
)
# The other requests of the load conditions: different prompts, lengths from a line to a paragraph.
LOAD_PROMPTS = (
    "Write a long, detailed essay about the history of computing, from the abacus to today.",
    "Tell a long story about a lighthouse keeper who finds a map.",
    "Explain, step by step and at length, how a compiler turns source code into machine code, covering "
    "lexing, parsing, semantic analysis, intermediate representations, optimization and code generation.",
    "Describe a city in detail.",
    "Write a Python module that implements a small key-value store with persistence, with docstrings.",
    "List one hundred animals, one per line, with a sentence about each.",
    "Summarize the plot of a novel you like, then discuss its themes and its characters in depth, "
    "paragraph by paragraph, quoting the kinds of scenes that show each theme.",
)

DEFINITIONS = {
    "reference": "Per request: its first run, alone on the server, with a prompt salted fresh for this "
    "bench run (cold; the reported cached tokens show it). The prefix condition's reference is its twin's "
    "repeat (the same text under its own salt, whole prompt cached).",
    "identical": "The run's text equals the reference's text; with --logprobs also every token and its "
    "logprob, compared bit for bit as the server sent them.",
    "first_divergence": "The first token where the run and its reference differ: its index from the "
    "servers' logprob tokens, else the model tokenizer's count of the common text (recounted), else only "
    "the character index; the two texts around that place.",
    "cached_tokens": "As the server reported them for the run: usage.prompt_tokens_details.cached_tokens, "
    "usage.prompt_cache_hit_tokens or llama-server's timings.cache_n; '-' where it reports none.",
}


@dataclass
class Target:
    """One request under test: the same body in every condition (bar the twin's salt)."""

    index: int
    prompt: str
    mode: str  # greedy | seeded
    seed: int | None
    salt: str
    twin_salt: str


@dataclass
class Answer:
    """What one non-streaming response says."""

    ok: bool
    error: str | None = None
    text: str = ""
    tokens: list[str] | None = None  # from logprobs, when asked for and sent
    logprobs: list[float] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    seconds: float = 0.0


@dataclass
class Options:
    api: str = "chat"
    max_tokens: int = 48
    temperature: float = 0.8
    seed: int = 0
    logprobs: bool = False
    concurrency: list[int] = field(default_factory=lambda: [2, 4, 8])
    repeats: int = 1  # runs per condition and request
    prefix_fraction: float = 0.5  # the prefix condition's warmed part: this share of the prompt's words
    load_lead_s: float = 0.1  # the load requests start this long before the target
    extra_body: dict = field(default_factory=dict)


def make_targets(num_prompts: int, modes: list[str], seed: int) -> list[Target]:
    run_salt = uuid.uuid4().hex[:12]
    out = []
    for i in range(num_prompts):
        for mode in modes:
            n = len(out)
            out.append(Target(n, PROMPTS[i % len(PROMPTS)], mode, seed + n if mode == "seeded" else None,
                              f"[{run_salt}-{n}]", f"[{run_salt}-{n}-twin]"))
    return out


def _cut_words(text: str, fraction: float) -> str:
    words = text.split(" ")
    return " ".join(words[:max(1, int(len(words) * fraction))])


def request_body(api: str, model: str, salt: str, prompt: str, max_tokens: int, temperature: float,
                 seed: int | None, logprobs: bool, extra: dict) -> tuple[str, dict]:
    """(path, body). The salt opens the prompt: in chat, as the system message (before any template default)."""
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": False}
    if seed is not None:
        body["seed"] = seed
    if api == "chat":
        body["messages"] = [{"role": "system", "content": salt}, {"role": "user", "content": prompt}]
        if logprobs:
            body["logprobs"] = True
        path = "/chat/completions"
    else:
        body["prompt"] = f"{salt}\n{prompt}\n"
        if logprobs:
            body["logprobs"] = 1
        path = "/completions"
    body.update(extra)
    return path, body


def _logprob_lists(choice: dict) -> tuple[list[str] | None, list[float] | None]:
    """Tokens and their logprobs from chat's `logprobs.content` or the legacy `tokens`/`token_logprobs`."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None, None
    if isinstance(lp.get("content"), list):
        entries = [e for e in lp["content"] if isinstance(e, dict)]
        return [str(e.get("token")) for e in entries], [e.get("logprob") for e in entries]
    if isinstance(lp.get("tokens"), list):
        return [str(t) for t in lp["tokens"]], list(lp.get("token_logprobs") or [])
    return None, None


def parse_answer(api: str, status: int, data: object, seconds: float) -> Answer:
    if status != 200:
        return Answer(False, f"HTTP {status}: {json.dumps(data)[:200]}", seconds=seconds)
    if not isinstance(data, dict) or not data.get("choices"):
        return Answer(False, f"no choices in the response: {json.dumps(data)[:200]}", seconds=seconds)
    choice = data["choices"][0]
    text = (choice.get("message") or {}).get("content") if api == "chat" else choice.get("text")
    tokens, logprobs = _logprob_lists(choice)
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    cached = cached_tokens(usage, data.get("sudu") if isinstance(data.get("sudu"), dict) else None)
    timings = data.get("timings")
    if cached is None and isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        cached = timings["cache_n"]
    return Answer(True, None, text or "", tokens, logprobs, usage.get("prompt_tokens"), cached,
                  choice.get("finish_reason"), seconds)


async def send(pool: ClientPool, base: str, headers: dict, path: str, body: dict, api: str) -> Answer:
    t0 = time.perf_counter()
    try:
        async with pool.acquire() as client:
            resp = await client.post(f"{base}{path}", json=body, headers=headers)
        try:
            data = resp.json()
        except ValueError:
            data = resp.text[:200]
        return parse_answer(api, resp.status_code, data, time.perf_counter() - t0)
    except httpx.HTTPError as exc:
        return Answer(False, f"{type(exc).__name__}: {exc}"[:300], seconds=time.perf_counter() - t0)


def _around(text: str, at: int) -> str:
    return text[max(0, at - CONTEXT_CHARS):at] + "⟦" + text[at:at + CONTEXT_CHARS]


def _word_start(text: str, c: int) -> int:
    """Where the word holding character c starts, its leading space included (as BPE tokens begin): the
    text before it holds whole tokens only."""
    if c < len(text) and text[c].isspace():
        return c
    while c > 0 and not text[c - 1].isspace():
        c -= 1
    return c - 1 if c > 0 and text[c - 1] == " " else c


def first_divergence(ref: Answer, run: Answer, count_tokens: Callable[[str], int] | None) -> dict | None:
    """None when `run` is identical to `ref`; else where they first differ (see DEFINITIONS). With token
    lists on both sides, a difference only in a logprob is a divergence too (`kind: logprob`)."""
    if ref.tokens is not None and run.tokens is not None:
        n = min(len(ref.tokens), len(run.tokens))
        i = next((k for k in range(n) if ref.tokens[k] != run.tokens[k]), None)
        if i is None and len(ref.tokens) != len(run.tokens):
            i = n
        if i is not None:
            char = len("".join(ref.tokens[:i]))
            return {"kind": "token", "token_index": i, "token_index_source": "logprobs", "char_index": char,
                    "reference": _around("".join(ref.tokens), char), "run": _around("".join(run.tokens), char)}
        j = next((k for k in range(n) if ref.logprobs[k] != run.logprobs[k]), None)
        if j is not None:
            char = len("".join(ref.tokens[:j]))
            return {"kind": "logprob", "token_index": j, "token_index_source": "logprobs", "char_index": char,
                    "reference": f"{ref.tokens[j]!r} logprob {ref.logprobs[j]!r}",
                    "run": f"{run.tokens[j]!r} logprob {run.logprobs[j]!r}"}
        if ref.text == run.text:
            return None
    if ref.text == run.text:
        return None
    n = min(len(ref.text), len(run.text))
    c = next((k for k in range(n) if ref.text[k] != run.text[k]), n)
    token_index, source = None, None
    if count_tokens is not None:
        token_index, source = count_tokens(ref.text[:_word_start(ref.text, c)]), "tokenizer"
    return {"kind": "text", "token_index": token_index, "token_index_source": source, "char_index": c,
            "reference": _around(ref.text, c), "run": _around(run.text, c)}


def run_record(target: Target, condition: str, answer: Answer, ref: Answer | None,
               count_tokens: Callable[[str], int] | None, reference_of: str) -> dict:
    rec = {"request": target.index, "mode": target.mode, "seed": target.seed, "condition": condition,
           "reference": reference_of, **asdict(answer)}
    if not answer.ok:
        rec.update(identical=False, divergence=None)
    elif ref is None or not ref.ok:
        rec.update(identical=None, divergence=None,
                   error=f"no reference to compare with ({ref.error if ref else 'not run'})")
    else:
        div = first_divergence(ref, answer, count_tokens)
        rec.update(identical=div is None, divergence=div)
    return rec


def summarize(records: list[dict]) -> dict:
    """Per condition, in the order first seen: runs, identical, share, cached tokens seen, errors."""
    out = {}
    for cond in dict.fromkeys(r["condition"] for r in records):
        rs = [r for r in records if r["condition"] == cond]
        compared = [r for r in rs if r["identical"] is not None]
        same = sum(bool(r["identical"]) for r in compared)
        cached = [r["cached_tokens"] for r in rs if r.get("cached_tokens") is not None]
        prompt = [r["prompt_tokens"] for r in rs if r.get("prompt_tokens") is not None]
        out[cond] = {"runs": len(rs), "compared": len(compared), "identical": same,
                     "share": same / len(compared) if compared else None,
                     "token_divergences": sum(1 for r in compared if (r["divergence"] or {}).get("kind") in ("token", "text")),
                     "logprob_only_divergences": sum(1 for r in compared if (r["divergence"] or {}).get("kind") == "logprob"),
                     "errors": sum(1 for r in rs if not r["ok"]),
                     "cached_tokens": [min(cached), max(cached)] if cached else None,
                     "prompt_tokens": [min(prompt), max(prompt)] if prompt else None}
    tested = [r for r in records if r["condition"] != "alone (reference)" and r["identical"] is not None]
    all_same = sum(bool(r["identical"]) for r in tested)
    return {"conditions": out, "runs_compared": len(tested), "runs_identical": all_same,
            "share": all_same / len(tested) if tested else None}


def _table(header: list[str], rows: list[list[str]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows])


def _span(v: list[int] | None) -> str:
    if not v:
        return "-"
    return str(v[0]) if v[0] == v[1] else f"{v[0]}-{v[1]}"


def summary_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    header = ["condition", "identical / compared", "share", "token divergences", "logprob-only", "errors",
              "prompt tokens", "cached tokens"]
    rows = []
    for cond, s in summary["conditions"].items():
        share = "-" if s["share"] is None else f"{100 * s['share']:.0f}%"
        rows.append([cond, f"{s['identical']}/{s['compared']}", share, str(s["token_divergences"]),
                     str(s["logprob_only_divergences"]), str(s["errors"]), _span(s["prompt_tokens"]),
                     _span(s["cached_tokens"])])
    share = "-" if summary["share"] is None else f"{100 * summary['share']:.0f}%"
    rows.append(["all but the reference", f"{summary['runs_identical']}/{summary['runs_compared']}", share,
                 "", "", "", "", ""])
    return header, rows


def divergence_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["request", "mode", "condition", "cached / prompt tokens", "first divergence", "reference", "this run"]
    rows = []
    for r in records:
        if r["identical"] is not False:
            continue
        cached = f"{'-' if r['cached_tokens'] is None else r['cached_tokens']} / {r['prompt_tokens'] or '-'}"
        d = r["divergence"]
        if d is None:
            rows.append([str(r["request"]), r["mode"], r["condition"], cached, f"error: {r['error']}"[:120], "", ""])
            continue
        where = (f"token {d['token_index']} ({d['token_index_source']})" if d["token_index"] is not None
                 else f"char {d['char_index']}")
        if d["kind"] == "logprob":
            where += ", logprob only"
        rows.append([str(r["request"]), r["mode"], r["condition"], cached, where, d["reference"], d["run"]])
    return header, rows


def markdown(report: dict) -> str:
    t = report["target"]
    parts = ["# sudu bench determinism" + (" (PARTIAL: interrupted)" if report["partial"] else ""),
             f"target: {t.get('url')}  model: {t.get('model')}  api: {report['config'].get('api')}  "
             f"schema: {report['schema']}"]
    det = report["determinism"]
    parts += ["## Runs identical to their reference", _table(*summary_rows(det["summary"]))]
    header, rows = divergence_rows(report["runs"])
    parts += ["## First divergence per run that differs (⟦ marks the place)",
              _table(header, rows) if rows else "none: every run equals its reference"]
    if report["flags"]:
        parts += ["## Flags", "\n".join(f"- {f}" for f in report["flags"])]
    if report["notes"]:
        parts += ["## Notes", "\n".join(f"- {n}" for n in report["notes"])]
    parts += ["## Definitions", "\n".join(f"- **{k}**: {v}" for k, v in report["definitions"].items())]
    return "\n\n".join(parts) + "\n"


def write(report: dict, out_dir: str) -> dict:
    """determinism-<time>.json and .md under out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"determinism-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    paths = {"json": base + ".json", "markdown": base + ".md"}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(paths["markdown"], "w") as f:
        f.write(markdown(report))
    return paths


def planned_requests(num_targets: int, opts: Options) -> int:
    per_target = 1 + opts.repeats * (1 + sum(opts.concurrency) + 3)  # reference; repeat, loads, prefix (3 sends)
    return num_targets * per_target


@dataclass
class Session:
    """Where and how to send, and where the runs go (an interrupted run keeps what was compared)."""

    pool: ClientPool
    base: str
    headers: dict
    model: str
    opts: Options
    count_tokens: Callable[[str], int] | None = None
    on_sent: Callable[[], None] | None = None
    records: list[dict] = field(default_factory=list)
    load_counter: int = 0

    async def ask(self, target: Target, salt: str, prompt: str | None = None, max_tokens: int | None = None) -> Answer:
        o = self.opts
        temperature = 0.0 if target.mode == "greedy" else o.temperature
        path, body = request_body(o.api, self.model, salt, prompt if prompt is not None else target.prompt,
                                  max_tokens or o.max_tokens, temperature, target.seed, o.logprobs, o.extra_body)
        answer = await send(self.pool, self.base, self.headers, path, body, o.api)
        if self.on_sent:
            self.on_sent()
        return answer

    async def load_request(self) -> Answer:
        """One request of the surrounding load: a prompt of its own (fresh salt), a longer answer."""
        k = self.load_counter
        self.load_counter += 1
        o = self.opts
        path, body = request_body(o.api, self.model, f"[{uuid.uuid4().hex[:12]}]", LOAD_PROMPTS[k % len(LOAD_PROMPTS)],
                                  2 * o.max_tokens, 0.0, None, False, o.extra_body)
        answer = await send(self.pool, self.base, self.headers, path, body, o.api)
        if self.on_sent:
            self.on_sent()
        return answer

    async def under_load(self, target: Target, concurrency: int) -> Answer:
        loads = [asyncio.create_task(self.load_request()) for _ in range(concurrency - 1)]
        await asyncio.sleep(self.opts.load_lead_s)
        answer = await self.ask(target, target.salt)
        await asyncio.gather(*loads)
        return answer

    def record(self, target: Target, condition: str, answer: Answer, ref: Answer | None, reference_of: str) -> None:
        self.records.append(run_record(target, condition, answer, ref, self.count_tokens, reference_of))


async def run_targets(session: Session, targets: list[Target]) -> None:
    """Per target: its reference, then each condition `repeats` times (order: repeat, loads, prefix)."""
    o = session.opts
    for t in targets:
        ref = await session.ask(t, t.salt)
        session.record(t, "alone (reference)", ref, None, "-")
        for _ in range(o.repeats):
            session.record(t, "repeat", await session.ask(t, t.salt), ref, "alone")
            for c in o.concurrency:
                session.record(t, f"load c={c}", await session.under_load(t, c), ref, "alone")
            twin_salt = f"{t.twin_salt[:-1]}-{uuid.uuid4().hex[:6]}]"
            await session.ask(t, twin_salt, _cut_words(t.prompt, o.prefix_fraction), max_tokens=1)
            partial = await session.ask(t, twin_salt)
            twin_full = await session.ask(t, twin_salt)
            session.record(t, "prefix", partial, twin_full, "twin repeat")
            session.records[-1]["twin_repeat"] = {"cached_tokens": twin_full.cached_tokens,
                                                  "prompt_tokens": twin_full.prompt_tokens, "text": twin_full.text}


def flags(records: list[dict]) -> list[str]:
    out = []
    for r in records:
        if r["condition"] == "alone (reference)" and (r["cached_tokens"] or 0) > 16:
            out.append(f"request {r['request']}: its reference reported {r['cached_tokens']} cached tokens "
                       "(expected cold)")
        if r["condition"] == "alone (reference)" and not r["ok"]:
            out.append(f"request {r['request']}: the reference failed ({r['error']}); its runs are not compared")
    return out


def build_report(target: dict, server_info: dict, config: dict, records: list[dict], started: float,
                 partial: bool, notes: list[str]) -> dict:
    summary = summarize(records)
    return {"schema": SCHEMA, "suite": "determinism", "partial": partial,
            "started_at": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(timespec="seconds"),
            "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "target": target, "environment": environment(), "server_info": server_info, "config": config,
            "determinism": {"summary": summary}, "definitions": DEFINITIONS, "flags": flags(records),
            "notes": notes, "runs": records}


def parse_options(args) -> Options:
    """Check the flags before anything is started; SuduError (one line) for bad input."""
    from sudu.bench.workloads import parse_list

    if args.api not in APIS:
        raise SuduError(f"--api must be one of {', '.join(APIS)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SuduError(f"--modes: comma-separated, from {', '.join(MODES)} (got {args.modes!r})")
    levels = parse_list(args.concurrency, int, "--concurrency")
    if any(c < 2 for c in levels):
        raise SuduError("--concurrency levels must be >= 2 (the target and at least one other request)")
    if args.prompts < 1 or args.max_tokens < 1 or args.repeats < 1 or args.warmup < 0:
        raise SuduError("--prompts, --max-tokens and --repeats must be >= 1, --warmup >= 0")
    if not args.temperature > 0:
        raise SuduError("--temperature is the seeded mode's temperature and must be > 0 (greedy runs use 0)")
    if not 0 < args.prefix_fraction < 1:
        raise SuduError("--prefix-fraction must be between 0 and 1 (exclusive)")
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except ValueError as exc:
        raise SuduError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise SuduError("--extra-body must be a JSON object, e.g. '{\"cache_prompt\": false}'")
    if args.ignore_eos:
        extra = {"ignore_eos": True, **extra}
    args.mode_list = modes
    return Options(api=args.api, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                   logprobs=args.logprobs, concurrency=levels, repeats=args.repeats,
                   prefix_fraction=args.prefix_fraction, extra_body=extra)


async def _run(args, opts: Options, progress, records: list[dict], info: dict) -> None:
    from sudu.bench.client import api_base, auth_headers, fetch_server_info, make_client
    from sudu.bench.tokens import load_token_counter

    base = api_base(args.url)
    headers = auth_headers(args.api_key)
    headers["Accept"] = "application/json"
    async with make_client(1, 30.0) as c:
        info["server_info"] = await fetch_server_info(c, base, headers)
    if info["server_info"].get("error", "").startswith(("ConnectError", "ConnectTimeout")):
        raise SuduError(f"cannot reach {base}: {info['server_info']['error']}")
    model = args.model
    if not model:
        data = (info["server_info"].get("models") or {}).get("data") or []
        if not data:
            raise SuduError(f"no --model given and GET {base}/models listed none ({info['server_info']})")
        model = data[0].get("id")
    info["target"].update(url=base, model=model)
    count_tokens, info["token_recount"] = load_token_counter(model)
    targets = make_targets(args.prompts, args.mode_list, opts.seed)
    bar = progress.add_task(f"determinism @ {model}", total=args.warmup + planned_requests(len(targets), opts))
    async with ClientPool(args.timeout) as pool:
        session = Session(pool, base, headers, model, opts, count_tokens, lambda: progress.advance(bar), records)
        for _ in range(args.warmup):
            await session.load_request()
        await run_targets(session, targets)


def run_determinism(args, opts: Options, progress) -> int:
    """The whole suite against args.url: runs, report (JSON + Markdown) written, summary printed."""
    records: list[dict] = []
    info = {"target": {"url": args.url, "model": args.model, "local_server": getattr(args, "local_server", None)},
            "server_info": {}, "token_recount": ""}
    config = {k: v for k, v in vars(args).items()
              if k not in ("func", "api_key") and isinstance(v, (str, int, float, bool, list, dict, type(None)))}
    config["options"] = asdict(opts)
    started, partial, notes = time.time(), False, []
    try:
        with progress:
            asyncio.run(_run(args, opts, progress, records, info))
    except KeyboardInterrupt:
        partial = True
        notes.append("interrupted by the user (Ctrl-C): partial report")
    notes.append(f"token indices without logprobs: {info['token_recount']}")
    report = build_report(info["target"], info["server_info"], config, records, started, partial, notes)
    paths = write(report, args.out)
    print(markdown(report))
    print("reports: " + "  ".join(paths.values()), file=sys.stderr)
    if partial:
        raise KeyboardInterrupt
    return 0
