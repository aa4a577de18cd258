"""The suites of sudu bench and the run state they fill: `single` (one short cold chat turn, repeated),
`throughput` (a sweep over concurrency levels and/or request rates), `cache` (TTFT cold vs warm vs
shared-prefix at several prompt lengths) and `tasks` (checked end-to-end tasks, timed to a passing
answer); `conversation` and `structured` live in their own files. Every request lands in Run.records
as soon as it finishes, so an interrupted run still has everything measured so far."""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from sudu.bench.client import ClientPool, RequestRecord, chat_body, stream_chat
from sudu.bench.metrics import request_metrics
from sudu.bench.tasks import build_task
from sudu.bench.workloads import (
    CHAT_CODE_PROMPTS,
    LONG_ANSWER_QUESTION,
    SHORT_QUESTION,
    arrival_offsets,
    filler_text,
    length_summary,
    long_prompt,
    make_messages,
    prompt_set_id,
    salt,
)

DEFAULT_CONTEXT_LEN = 4096
SAMPLING = {"temperature": 0.0}  # every request; recorded in the report's config so compare can check it
_CONTEXT_KEYS = ("max_model_len", "context_length", "context_window", "max_context_length", "n_ctx", "n_ctx_train")


@dataclass
class Group:
    """One workload point: its records share `name`; `params` say what was varied."""

    name: str
    cache_state: str
    params: dict = field(default_factory=dict)


@dataclass
class Run:
    suite: str
    target: dict
    config: dict
    records: list[RequestRecord] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    task_results: list[dict] = field(default_factory=list)
    sessions: list[dict] = field(default_factory=list)  # the conversation suite's per-session results
    structured: list[dict] = field(default_factory=list)  # the structured suite's per-answer validation
    multimodal: dict | None = None  # the multimodal suite's sizes and encoder-cache evidence per group
    server_info: dict = field(default_factory=dict)
    token_recount: str = ""
    overhead: dict | None = None
    notes: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    partial: bool = False
    replay: dict | None = None  # sudu/bench/replay.py's summary
    capacity: dict | None = None  # sudu/bench/capacity.py's search
    prices: object = None  # cost.Prices, from --price
    machine_per_hour: float | None = None


@dataclass
class Ctx:
    """What every request needs: the HTTP client, where to send, how to count tokens, where to record."""

    pool: ClientPool
    base: str
    headers: dict
    model: str
    run: Run
    count_tokens: Callable[[str], int] | None = None
    extra_body: dict = field(default_factory=dict)
    on_done: Callable[[RequestRecord], None] | None = None
    ids: itertools.count = field(default_factory=itertools.count)
    api: str = "chat"  # chat | completions | messages | responses (sudu/bench/apis.py)


async def send(ctx: Ctx, group: str, cache_state: str, messages: list[dict], max_tokens: int,
               warmup: bool = False, task: str | None = None, extra: dict | None = None,
               session: str | None = None, prompt: str | None = None, images: list[dict] | None = None) -> RequestRecord:
    """One streamed request; `extra` adds (or overrides) body fields: `tools`, `response_format`, ...;
    `session`: the unit (conversation, task run, replayed session) its cost is summed into; `prompt`: raw
    text instead of `messages` (sent as is to completions, as one user message to the other APIs); `images`:
    what the report records of the images the messages carry."""
    rec = RequestRecord(request_id=next(ctx.ids), group=group, cache_state=cache_state, warmup=warmup, task=task,
                        session=session, images=images)
    body = chat_body(ctx.model, messages, max_tokens, **SAMPLING, **ctx.extra_body)
    body.update(extra or {})
    if prompt is not None:
        body["prompt"] = prompt
        body.pop("messages", None)
    async with ctx.pool.acquire() as client:
        await stream_chat(client, ctx.base, body, ctx.headers, rec, ctx.count_tokens, api=ctx.api)
    rec.metrics = request_metrics(rec)
    # a tool call's tokens include the model's call syntax, which the text assembled here does not hold
    if ctx.count_tokens is not None and rec.ok and not rec.tool_calls:
        rec.metrics["output_tokens_recounted"] = ctx.count_tokens(rec.reasoning_text + rec.text)
    ctx.run.records.append(rec)
    if ctx.on_done is not None:
        ctx.on_done(rec)
    return rec


def context_len_from_server(server_info: dict) -> int | None:
    models = (server_info.get("models") or {}).get("data") or []
    for entry in models:
        for source in (entry, entry.get("meta") or {}):
            for key in _CONTEXT_KEYS:
                if isinstance(source.get(key), int) and source[key] > 0:
                    return source[key]
    return None


async def probe_chunk_usage(ctx: Ctx, mode: str) -> str:
    """Decide whether to ask for per-chunk token counts (`stream_options.continuous_usage_stats`); returns
    a note for the report. auto: one excluded request asks for them, and they are used when the server
    sent them; a server that rejects the field (an API that validates stream_options) is not asked again."""
    if mode != "auto":
        ctx.extra_body["continuous_usage"] = mode == "on"
        return f"per-chunk usage {'requested' if mode == 'on' else 'not requested'} (--chunk-usage {mode})"
    ctx.extra_body["continuous_usage"] = True
    rec = await send(ctx, "probe", "cold", make_messages("cold", SHORT_QUESTION), 8, warmup=True)
    if rec.status == 200 and "usage" in (rec.chunk_server_kind or ""):
        return "per-chunk token counts from the server (stream_options.continuous_usage_stats)"
    ctx.extra_body["continuous_usage"] = False
    if rec.status is not None and 400 <= rec.status < 500:
        return (f"the server rejected stream_options.continuous_usage_stats ({(rec.error or '')[:120]}): tokens per "
                "chunk from usage apportioned over the chunks")
    return "the server sends no per-chunk usage: tokens per chunk from usage apportioned over the chunks"


async def warmup(ctx: Ctx, n: int, max_tokens: int = 16) -> None:
    for _ in range(n):
        await send(ctx, "warmup", "cold", make_messages("cold", SHORT_QUESTION), max_tokens, warmup=True)


async def run_single(ctx: Ctx, n: int, warmups: int, max_tokens: int, prompt: str | None = None) -> None:
    """One chat turn at a time, cold, cycling through CHAT_CODE_PROMPTS (or `prompt` every time)."""
    await warmup(ctx, warmups)
    used = [prompt or CHAT_CODE_PROMPTS[i % len(CHAT_CODE_PROMPTS)] for i in range(n)]
    ctx.run.groups.append(Group("single", "cold", {"max_tokens": max_tokens,
                                                   "prompt_set": prompt_set_id("custom" if prompt else "chat-code", used),
                                                   "prompt_lengths": length_summary(used)}))
    for text in used:
        await send(ctx, "single", "cold", make_messages("cold", text), max_tokens)


def throughput_levels(concurrencies: list[int], rates: list[float], max_concurrency: int | None) -> list[Group]:
    levels = [Group(f"concurrency={c}", "cold", {"concurrency": c}) for c in concurrencies]
    levels += [Group(f"rate={r:g}", "cold", {"rate": r, "max_concurrency": max_concurrency}) for r in rates]
    return levels


async def closed_loop(n: int, concurrency: int, send_one: Callable) -> None:
    """`concurrency` workers; each sends its next request as soon as its previous one is done."""
    remaining = iter(range(n))

    async def worker() -> None:
        for _ in remaining:
            await send_one()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))


async def open_loop(offsets: list[float], max_concurrency: int | None, send_one: Callable) -> None:
    """Start each request at its arrival offset. With a cap, an arrival waits for a free slot (so the
    offered rate is only met while the server keeps up)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one() -> None:
        try:
            await send_one()
        finally:
            if slots is not None:
                slots.release()

    tasks = []
    t0 = time.perf_counter()
    for offset in offsets:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)


async def run_throughput(ctx: Ctx, levels: list[Group], n: int, warmups: int, input_words: int, output_len: int,
                         arrival: str, burstiness: float, seed: int) -> None:
    await warmup(ctx, warmups)
    base_prompt = long_prompt(input_words, seed, LONG_ANSWER_QUESTION) if input_words else LONG_ANSWER_QUESTION
    for level in levels:
        level.params["prompt_set"] = prompt_set_id("filler-essay", [base_prompt])
        ctx.run.groups.append(level)

        def send_one(name=level.name):
            return send(ctx, name, "cold", make_messages("cold", base_prompt), output_len)

        if "concurrency" in level.params:
            level.params["arrival"] = "closed-loop"
            await closed_loop(n, level.params["concurrency"], send_one)
            continue
        level.params["arrival"] = arrival
        if arrival == "gamma":
            level.params["burstiness"] = burstiness
        offsets = arrival_offsets(n, level.params["rate"], arrival, burstiness, seed)
        await open_loop(offsets, level.params.get("max_concurrency"), send_one)


async def run_cache(ctx: Ctx, lengths: list[int], n: int, max_tokens: int, seed: int) -> None:
    """Per prompt length: n cold requests; n warm ones (each right after an identical, excluded
    priming request); n shared-prefix ones (a common system prompt primed once, distinct tails)."""
    for length in lengths:
        cold = Group(f"cold len={length}", "cold", {"prompt_words": length})
        warm = Group(f"warm len={length}", "warm", {"prompt_words": length})
        shared = Group(f"shared-prefix len={length}", "shared-prefix", {"prompt_words": length})
        for g in (cold, warm, shared):
            g.params["prompt_set"] = prompt_set_id("filler", [str(length), str(seed), str(n)])
        ctx.run.groups += [cold, warm, shared]
        for i in range(n):
            await send(ctx, cold.name, "cold", make_messages("cold", long_prompt(length, seed + i)), max_tokens)
        for i in range(n):
            messages = make_messages("warm", salt() + long_prompt(length, seed + i))
            await send(ctx, warm.name, "cold", messages, max_tokens, warmup=True)
            await send(ctx, warm.name, "warm", messages, max_tokens)
        system = salt() + "Answer questions about this text.\n\n" + filler_text(length, seed)
        await send(ctx, shared.name, "cold", make_messages("shared-prefix", "Say OK.", system), max_tokens, warmup=True)
        for i in range(n):
            tail = f"Question {i} ({salt().strip()}): which word appears most often in the text?"
            await send(ctx, shared.name, "shared-prefix", make_messages("shared-prefix", tail, system), max_tokens)


def retry_message(detail: str) -> str:
    return (f"Your answer did not pass the check: {detail}. Reply with a corrected, complete answer "
            "in the requested format.")


def tool_turn(rec: RequestRecord, run_tool: Callable[[str, str], str]) -> list[dict]:
    """The assistant message with its tool calls and one `role: "tool"` result per call, executed here."""
    calls = []
    for i, call in enumerate(rec.tool_calls or ()):
        calls.append({"id": call.get("id") or f"call_{rec.request_id}_{i}", "type": "function",
                      "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}})
    turn = [{"role": "assistant", "content": rec.text or None, "tool_calls": calls}]
    turn += [{"role": "tool", "tool_call_id": c["id"], "content": run_tool(c["function"]["name"], c["function"]["arguments"])}
             for c in calls]
    return turn


async def run_tasks(ctx: Ctx, names: list[str], repeat: int, attempts: int, context_len: int,
                    retrieval_fraction: float, warmups: int, seed: int,
                    on_task_done: Callable[[dict], None] | None = None, tool_choice: str = "forced") -> None:
    """Each task: start the clock, ask, check; on failure send the checker's verdict back and ask again
    (up to `attempts` attempts, every call counted). Time stops when an answer passes the checker.

    A task with tools sends the tool fields it asks for with each call; within an attempt, an answer that
    calls tools gets their results (executed here) and the model is called again, up to
    `max_tool_rounds` times, until it answers with text, which is then checked.

    First calls are cold (group "task <name>"). A retry resends the whole conversation so far, which the
    server has just seen: its requests go to their own group, "task <name> retries", declared
    shared-prefix, and so do the calls after a tool result ("task <name> tool rounds"), so that cold
    figures never mix with reused ones."""
    await warmup(ctx, warmups)
    for name in names:
        first_group, retry_group, tool_group = f"task {name}", f"task {name} retries", f"task {name} tool rounds"
        ctx.run.groups.append(Group(first_group, "cold", {"task": name}))
        later = {g: Group(g, "shared-prefix", {"task": name}) for g in (retry_group, tool_group)}
        for r in range(repeat):
            inst = build_task(name, context_len, seed + r, retrieval_fraction, tool_choice)
            if r == 0:
                prompt_set = prompt_set_id(f"task-{name}", [m["content"] for m in inst.messages])
                ctx.run.groups[-1].params["prompt_set"] = prompt_set
                for g in later.values():
                    g.params["prompt_set"] = prompt_set
            # a task's own system message keeps its place; the cold salt goes at its start
            system = inst.messages[0]["content"] if inst.messages[0]["role"] == "system" else None
            rest = inst.messages[1:] if system is not None else inst.messages
            messages = make_messages("cold", rest[0]["content"], system) + rest[1:]
            result = {"task": name, "repeat": r, "passed": False, "passed_first": False, "task_time_s": None,
                      "first_call_s": None, "calls": 0, "model_time_s": 0.0, "output_tokens": 0, "detail": "",
                      "info": inst.info}
            if inst.run_tool:
                result.update(tool_rounds=0, tool_calls=0)
            t0 = time.perf_counter()
            for attempt in range(attempts):
                group, state = (first_group, "cold") if attempt == 0 else (retry_group, "shared-prefix")
                rounds = 0
                while True:
                    if group in later and later[group] not in ctx.run.groups:
                        ctx.run.groups.append(later[group])
                    extra = inst.tool_fields(rounds) if inst.tool_fields else None
                    rec = await send(ctx, group, state, messages, inst.max_tokens, task=name, extra=extra,
                                     session=f"{name}#{r}")
                    result["calls"] += 1
                    result["model_time_s"] += rec.done_s or 0.0
                    result["output_tokens"] += rec.metrics.get("output_tokens") or 0
                    if result["first_call_s"] is None:
                        result["first_call_s"] = rec.done_s
                    if not (rec.ok and rec.tool_calls and inst.run_tool) or rounds == inst.max_tool_rounds:
                        break
                    rounds += 1
                    result["tool_rounds"] += 1
                    result["tool_calls"] += len(rec.tool_calls)
                    messages = messages + tool_turn(rec, inst.run_tool)
                    group, state = tool_group, "shared-prefix"
                if not rec.ok:
                    result["detail"] = f"request failed: {rec.error}"
                    break
                if rec.tool_calls and inst.run_tool:
                    result["detail"] = f"no answer after {rounds} tool rounds: still calling tools"
                    break
                verdict = inst.check(rec.text)
                result["detail"] = verdict.detail
                if verdict.passed:
                    result["passed"] = True
                    result["passed_first"] = attempt == 0
                    result["task_time_s"] = time.perf_counter() - t0
                    break
                messages = messages + [{"role": "assistant", "content": rec.text},
                                       {"role": "user", "content": retry_message(verdict.detail)}]
            result["elapsed_s"] = time.perf_counter() - t0
            ctx.run.task_results.append(result)
            if on_task_done is not None:
                on_task_done(result)
