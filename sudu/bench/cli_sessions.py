"""The flags and runs of `sudu bench replay`, `sudu bench trace` and `sudu bench capacity`, and the options
every suite shares with them: `--api`, `--price`, `--machine-cost`, `--json-lines`. cli.py registers these
next to its own suites and hands a run here when its suite is one of them."""
from __future__ import annotations

import argparse
import json
import sys

from sudu.bench import capacity as C
from sudu.bench import replay as R
from sudu.bench.apis import APIS
from sudu.bench.cost import parse_price
from sudu.bench.metrics import parse_slo
from sudu.bench.suites import Group
from sudu.bench.tokens import load_tokenizer
from sudu.bench.trace import load_trace, synthetic_sessions, write_jsonl
from sudu.bench.workloads import LONG_ANSWER_QUESTION, arrival_offsets, long_prompt, make_messages, prompt_set_id
from sudu.errors import SuduError


def add_shared_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API, cost and logs")
    g.add_argument("--api", choices=APIS, default="chat", help="the streaming API to measure: chat (/v1/chat/completions), "
                   "completions (/v1/completions), messages (Anthropic /v1/messages), responses (/v1/responses)")
    g.add_argument("--price", default=None, help="token prices per million tokens: a preset (deepseek-v4-flash, "
                   "deepseek-v4-pro, deepseek-chat-v3, claude-opus-4.5) or miss=X,hit=Y,out=Z; adds the cost section")
    g.add_argument("--machine-cost", type=float, default=None, metavar="PER_HOUR",
                   help="the endpoint's machine cost per hour (self-hosted): spread over the run's wall time")
    g.add_argument("--json-lines", default=None, metavar="FILE",
                   help="append one JSON line per finished request to FILE ('-': stdout) as the run goes")


def register(suites, common) -> None:
    """The replay, trace and capacity subcommands (`common` adds the target and run flags)."""
    p = suites.add_parser("replay", help="replay a session trace (sudu JSONL or Mooncake): its timing, tool waits "
                          "and prefix sharing; reached vs ideal cache hit rate")
    common(p)
    p.add_argument("trace", metavar="TRACE", help="a JSONL trace (docs/bench.md: Trace format)")
    p.add_argument("--mode", choices=R.MODES, default="open", help="open: arrivals at the trace's offsets; closed: "
                   "--concurrency sessions at a time")
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: sessions in flight")
    p.add_argument("--speedup", type=float, default=1.0, help="divide arrival offsets and tool waits by this")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests of the trace")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="the server's tokenizer (a model directory or "
                   ".gguf) when sudu's catalog does not know the model: prompts are then token-exact")
    p.add_argument("--respect-eos", action="store_true", help="let answers stop early (default: ignore_eos, so that "
                   "every answer has the trace's output_length)")
    p.set_defaults(func=None, api="completions", warmup=0)

    p = suites.add_parser("trace", help="write a synthetic agent-session trace (sudu JSONL) to replay")
    p.add_argument("out", metavar="OUT.jsonl")
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--teams", type=int, default=4, help="sessions sharing one system prompt")
    p.add_argument("--block-size", type=int, default=64, help="tokens per hash block")
    p.add_argument("--system-blocks", type=int, default=4)
    p.add_argument("--blocks-per-turn", type=int, default=2)
    p.add_argument("--output-length", type=int, default=16)
    p.add_argument("--tool-wait", type=float, default=1.0, help="mean tool time between turns, seconds")
    p.add_argument("--arrival-gap", type=float, default=0.5, help="seconds between sessions' first requests")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_trace)

    p = suites.add_parser("capacity", help="the highest concurrency (or request rate) meeting p99 TTFT and p99 ITL "
                          "targets, with confirmation runs; goodput there; Pareto of per-user vs total tok/s")
    common(p)
    p.add_argument("--slo", required=True, help="targets, e.g. ttft=500ms,itl=50ms (p99 of each level)")
    p.add_argument("--mode", choices=C.MODES, default="concurrency")
    p.add_argument("--start", type=float, default=1, help="first level")
    p.add_argument("--max", type=float, default=256, help="highest level tried")
    p.add_argument("--tolerance", type=float, default=0.05, help="rate mode: stop bisecting at this relative width")
    p.add_argument("--confirm", type=int, default=2, help="confirmation runs at the answer")
    p.add_argument("-n", "--num-requests", type=int, default=32, help="requests per level (at least 2x the level "
                   "in concurrency mode)")
    p.add_argument("--input-words", type=int, default=128, help="filler words before the question")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.set_defaults(func=None)


def cmd_trace(args) -> int:
    for name in ("sessions", "turns", "teams", "block_size", "system_blocks", "output_length"):
        if getattr(args, name) < 1:
            raise SuduError(f"--{name.replace('_', '-')} must be >= 1")
    if args.blocks_per_turn < 0 or args.tool_wait < 0 or args.arrival_gap < 0:
        raise SuduError("--blocks-per-turn, --tool-wait and --arrival-gap must be >= 0")
    rows = synthetic_sessions(args.sessions, args.turns, args.teams, args.block_size, args.system_blocks,
                              args.blocks_per_turn, args.output_length, args.tool_wait, args.arrival_gap, args.seed)
    try:
        write_jsonl(rows, args.out)
    except OSError as exc:
        raise SuduError(f"cannot write {args.out}: {exc.strerror}") from None
    print(f"wrote {len(rows) - 1} requests in {args.sessions} sessions to {args.out}", file=sys.stderr)
    return 0


def validate(args) -> None:
    """Checks of the shared options and of replay/capacity flags, before any server is started."""
    args.prices = parse_price(getattr(args, "price", None))
    args.json_lines_write, args.json_lines_close = json_lines_sink(args.json_lines)
    if getattr(args, "machine_cost", None) is not None and args.machine_cost < 0:
        raise SuduError("--machine-cost must be >= 0 (per hour)")
    if args.api != "chat" and args.suite in ("tasks", "structured"):
        raise SuduError(f"--api {args.api}: the {args.suite} suite needs chat completions' tools and "
                        "response_format; use --api chat")
    if args.suite == "replay":
        args.trace_obj = load_trace(args.trace, args.max_requests)
        if args.speedup <= 0:
            raise SuduError("--speedup must be > 0")
        if args.concurrency < 1:
            raise SuduError("--concurrency must be >= 1")
        if args.max_requests is not None and args.max_requests < 1:
            raise SuduError("--max-requests must be >= 1")
        args.ignore_eos = not args.respect_eos
    if args.suite == "capacity":
        slo = parse_slo(args.slo)
        extra = set(slo) - {"ttft_s", "itl_s"}
        if extra:
            raise SuduError(f"capacity targets are p99 TTFT and p99 ITL: {', '.join(sorted(extra))} not supported")
        args.capacity_opts = C.CapacityOptions(args.mode, slo.get("ttft_s"), slo.get("itl_s"), args.start, args.max,
                                               args.tolerance, args.confirm)
        C.validate(args.capacity_opts)


def planned(args) -> int | None:
    if args.suite == "replay":
        return len(args.trace_obj.requests) + args.warmup
    return None  # capacity: the search decides


def json_lines_sink(path: str | None):
    """A callback writing each finished request as one JSON line (flushed), and a closer."""
    if not path:
        return None, lambda: None
    try:
        f = sys.stdout if path == "-" else open(path, "a", encoding="utf-8")
    except OSError as exc:
        raise SuduError(f"cannot open --json-lines {path}: {exc.strerror}") from None

    def write(rec) -> None:
        f.write(json.dumps(rec.to_dict(), default=str) + "\n")
        f.flush()

    return write, (lambda: f.close() if f is not sys.stdout else None)


async def run(args, ctx, run_state, suites) -> None:
    """The replay or capacity suite on a ready `ctx` (suites.Ctx)."""
    if args.suite == "replay":
        trace = args.trace_obj
        await suites.warmup(ctx, args.warmup)
        opts = R.ReplayOptions(args.mode, args.concurrency, args.speedup, args.seed)
        tokenizer, note = load_tokenizer(ctx.model, args.tokenizer)
        synth = R.PromptSynth(trace.block_size, args.seed, R.single_token_words(tokenizer) if tokenizer else None)
        run_state.notes.append("replay prompts: one word per token on the model's tokenizer" if tokenizer else
                               f"replay prompts: common English words, about one token each (no tokenizer: {note})")
        group = Group("replay", "trace", {"trace": args.trace, "format": trace.format, "mode": args.mode,
                                          "speedup": args.speedup, "requests": len(trace.requests),
                                          "prompt_set": f"trace@{trace.path}"})
        run_state.groups.append(group)

        def send_one(req, body):
            return suites.send(ctx, "replay", "trace", body.get("messages") or [], req.output_length,
                               session=req.session, prompt=body.get("prompt"))

        rows = await R.run_replay(ctx, trace, opts, send_one, synth)
        run_state.replay = R.summarize(trace, rows, opts)
        if run_state.replay["dependency_violations"]:
            run_state.notes.append(f"replay: {len(run_state.replay['dependency_violations'])} dependencies violated")
        return
    opts: C.CapacityOptions = args.capacity_opts
    await suites.warmup(ctx, args.warmup)
    base_prompt = long_prompt(args.input_words, args.seed, LONG_ANSWER_QUESTION) if args.input_words else LONG_ANSWER_QUESTION

    async def run_level(load: float, label: str) -> list:
        group = Group(label, "cold", {opts.mode: load, "prompt_set": prompt_set_id("filler-essay", [base_prompt])})
        run_state.groups.append(group)
        n = max(args.num_requests, int(2 * load)) if opts.mode == "concurrency" else args.num_requests

        def send_one():
            return suites.send(ctx, label, "cold", make_messages("cold", base_prompt), args.output_len)

        if opts.mode == "concurrency":
            await suites.closed_loop(n, int(load), send_one)
        else:
            await suites.open_loop(arrival_offsets(n, load, "poisson", 1.0, args.seed), None, send_one)
        return [r for r in run_state.records if r.group == label and not r.warmup]

    run_state.capacity = await C.search(run_level, opts)
    run_state.capacity["pareto"] = C.pareto(run_state.capacity["probes"])
