"""`sudu bench {single,throughput,cache,tasks,conversation,structured,multimodal,determinism,compare}`: flags, and
the run around a suite: target resolution (--url, or a local `sudu serve` started and stopped here),
server info, token recount hook, progress bar, and the report written at the end, or marked partial when
Ctrl-C interrupts the run."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from sudu.bench import cli_sessions
from sudu.errors import SuduError

DEFAULT_OUT = "bench-results"
DEFAULT_DEPTHS = "2k,8k,16k,24k,32k"  # sudu bench sweep's context depths (k = 1000)


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", default=None, help="an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1); "
                   "default: start a local `sudu serve` on the default model, run, stop it")
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models); "
                   "with no --url, the model `sudu serve` loads")
    g.add_argument("--api-key", default=os.environ.get("SUDU_BENCH_API_KEY"),
                   help="bearer token (default: $SUDU_BENCH_API_KEY)")
    g.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for a local sudu serve")
    g.add_argument("--serve-args", default="", help="with no --url: extra flags for the local `sudu serve` "
                   "(one string, e.g. \"--enable-prefix-caching false\")")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    r = p.add_argument_group("run")
    r.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default: {DEFAULT_OUT})")
    r.add_argument("--warmup", type=int, default=2, help="warm-up requests, excluded from every figure")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM, SGLang, sudu)")
    r.add_argument("--chunk-usage", choices=("auto", "on", "off"), default="auto",
                   help="ask for per-chunk token counts (stream_options.continuous_usage_stats); auto: one "
                   "excluded probe request decides")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--no-html", action="store_true", help="skip the HTML report (plots take a few seconds)")
    cli_sessions.add_shared_options(p)


def register_cli(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="measure any OpenAI-compatible endpoint (sudu's evaluation standard)",
        description="sudu bench: TTFT, TPOT, ITL, throughput, cache effect and checked tasks, with "
        "definitions, confidence intervals and reports (JSON, Markdown, HTML). See docs/bench.md.",
    )
    suites = bench.add_subparsers(dest="suite", metavar="SUITE", required=True)

    p = suites.add_parser("single", help="one short cold chat turn, repeated: TTFT, output speed, whole turn")
    _common(p)
    p.add_argument("-n", "--num-requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default=None, help="send this one prompt every time instead of the varied "
                   "coding and chat set (e.g. to reproduce one answer)")
    p.add_argument("--self-test", action="store_true",
                   help="first measure the client's own overhead against an instant local fake server")
    p.set_defaults(func=cmd_suite)

    p = suites.add_parser("throughput", help="sweep concurrency levels and/or request rates")
    _common(p)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated closed-loop concurrency levels")
    p.add_argument("--rate", default="", help="comma-separated open-loop request rates (req/s)")
    p.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: < 1 burstier than Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests in rate mode")
    p.add_argument("-n", "--num-requests", type=int, default=64, help="requests per level")
    p.add_argument("--input-words", type=int, default=128, help="filler words before the question")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=20s")
    p.set_defaults(func=cmd_suite)

    p = suites.add_parser("cache", help="TTFT cold vs warm vs shared-prefix at several prompt lengths")
    _common(p)
    p.add_argument("--lengths", default="256,1024,4096", help="prompt lengths in words")
    p.add_argument("-n", "--num-requests", type=int, default=8, help="requests per state and length")
    p.add_argument("--max-tokens", type=int, default=8)
    p.set_defaults(func=cmd_suite)

    p = suites.add_parser("tasks", help="checked end-to-end tasks, timed to a passing answer")
    _common(p)
    p.add_argument("--tasks", default="all", help="comma-separated: retrieval,palindrome,sql,svg,async_refactor,tool_loop")
    p.add_argument("--repeat", type=int, default=1, help="runs of each task")
    p.add_argument("--attempts", type=int, default=3, help="calls per task before it counts as failed")
    p.add_argument("--context-len", type=int, default=None,
                   help="the model's context in tokens (default: from /v1/models, else 4096)")
    p.add_argument("--retrieval-fraction", type=float, default=0.5, help="retrieval document length / context")
    p.add_argument("--tool-choice", choices=("forced", "auto"), default="forced",
                   help="tool_loop: forced = the first call must call the tool, the next one answers without "
                   "tools; auto = the tool on every call, the model decides (see docs/bench.md)")
    p.add_argument("--allow-remote-code", action="store_true",
                   help="run (sandboxed) code answers from a non-loopback --url too; off by default")
    p.set_defaults(func=cmd_suite, warmup=1)

    p = suites.add_parser("conversation", help="multi-turn coding-agent sessions: per-turn TTFT and cached share, "
                          "session time (the context cache's workload)")
    _common(p)
    p.add_argument("--users", type=int, default=8, help="simulated users, each one session, all at once")
    p.add_argument("--turns", type=int, default=10, help="turns per session")
    p.add_argument("--team-size", type=int, default=2, help="users sharing one system prompt")
    p.add_argument("--answer-tokens", type=int, default=64, help="max_tokens of each model turn")
    p.add_argument("--tool-output-words", type=int, default=220, help="size of a tool's output (words, about)")
    p.add_argument("--restart-after-turn", type=int, default=None, metavar="K",
                   help="with no --url: after every session's turn K, stop the local server and start it again")
    p.set_defaults(func=cmd_suite, warmup=0)

    p = suites.add_parser("structured", help="JSON-schema constrained answers (response_format), each validated: "
                          "validity rate, latency, throughput")
    _common(p)
    p.add_argument("-n", "--num-requests", type=int, default=30, help="requests, cycling through the schemas")
    p.add_argument("--schemas", default="all", help="comma-separated: person,order,weather,event,review,service_config")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (closed loop)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, seed = --seed + index")
    p.set_defaults(func=cmd_suite)

    p = suites.add_parser("multimodal", help="chat turns with a generated image of each size: image-to-first-token "
                          "cold (a new image), warm (the same request again) and shared-image (the same image after "
                          "other text: the encoder cache)")
    _common(p)
    p.add_argument("--sizes", default="448x448,1024x768", help="image sizes, WIDTHxHEIGHT, comma-separated")
    p.add_argument("--states", default="cold,warm,shared-image", help="image cache states: cold (a fresh image each "
                   "request), warm (the identical request just before), shared-image (the same image just before, "
                   "behind other text)")
    p.add_argument("-n", "--num-requests", type=int, default=4, help="measured requests per size and state")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--question", default=None, help="the text sent with each image (default: a description request)")
    p.add_argument("--no-text-baseline", action="store_true", help="skip the text-only group (the same question "
                   "without the image) that the image's cost is measured against")
    p.set_defaults(func=cmd_suite, warmup=1)

    _register_determinism(suites)
    _register_sweep(suites)

    p = suites.add_parser("compare", help="A/B ratios with bootstrap CIs between two JSON reports")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="compare even when the two runs measured different "
                   "work (the output then lists what differed)")
    p.add_argument("--html", default=None, metavar="FILE", help="also write the A/B view: a self-contained page "
                   "with every ratio's CI and verdict")
    p.set_defaults(func=cmd_compare)

    cli_sessions.register(suites, _common)
    for name in ("replay", "capacity"):
        suites.choices[name].set_defaults(func=cmd_suite)


def cmd_compare(args) -> int:
    from sudu.bench.compare import run_compare

    return run_compare(args.a, args.b, args.seed, args.force, args.html)


def _register_determinism(suites) -> None:
    """`sudu bench determinism`: its own flags (its requests are not streamed: no --chunk-usage, no HTML)."""
    p = suites.add_parser("determinism", help="the same greedy and seeded requests alone, inside concurrent load "
                          "and after cache-warming prefixes: share identical, first divergences, cache states")
    g = p.add_argument_group("target")
    g.add_argument("--url", default=None, help="an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1); "
                   "default: start a local `sudu serve` on the default model, run, stop it")
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("SUDU_BENCH_API_KEY"),
                   help="bearer token (default: $SUDU_BENCH_API_KEY)")
    g.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for a local sudu serve")
    g.add_argument("--serve-args", default="", help="with no --url: extra flags for the local `sudu serve`")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    r = p.add_argument_group("run")
    r.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions (salt as the system message) or /v1/completions (plain prompt)")
    r.add_argument("--prompts", type=int, default=4, help="everyday prompts to test (of 8; more cycle)")
    r.add_argument("--modes", default="greedy,seeded", help="greedy (temperature 0) and/or seeded "
                   "(--temperature with seed = --seed + the request's index)")
    r.add_argument("--max-tokens", type=int, default=48)
    r.add_argument("--temperature", type=float, default=0.8, help="the seeded mode's temperature")
    r.add_argument("--concurrency", default="2,4,8", help="load conditions: requests in flight, the target "
                   "included (comma-separated; empty: none)")
    r.add_argument("--repeats", type=int, default=1, help="runs of each condition per request")
    r.add_argument("--prefix-fraction", type=float, default=0.5,
                   help="the prefix condition warms this share of the prompt's words first")
    r.add_argument("--logprobs", action="store_true", help="ask for logprobs and compare every token's, bit for bit")
    r.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM, SGLang, llama.cpp, sudu)")
    r.add_argument("--extra-body", default="", help="JSON object merged into every request body, e.g. "
                   "'{\"cache_prompt\": false}' to keep llama-server's prompt cache out")
    r.add_argument("--warmup", type=int, default=1, help="warm-up requests (other prompts), not compared")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default: {DEFAULT_OUT})")
    r.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_determinism)


def cmd_determinism(args) -> int:
    from sudu.bench.determinism import parse_options, run_determinism
    from sudu.bench.local_server import run_with_local_server

    opts = parse_options(args)
    progress = _progress(args.no_progress or not sys.stderr.isatty())
    return run_with_local_server(args, lambda a: run_determinism(a, opts, progress))


def _register_sweep(suites) -> None:
    """`sudu bench sweep`: its own target flags (several endpoints in one run) and run flags."""
    p = suites.add_parser("sweep", help="prompt and decode speed against context depth (cold prompts and agent "
                          "turns on a cached prefix), several endpoints on one chart")
    g = p.add_argument_group("targets")
    g.add_argument("--url", action="append", default=None, help="an OpenAI-compatible server; repeat for several "
                   "endpoints, measured side by side (default: start a local `sudu serve`, run, stop it)")
    g.add_argument("--label", action="append", default=None, help="a name per --url, for tables and the chart "
                   "(default: host:port)")
    g.add_argument("--model", action="append", default=None, help="model name to send, one per --url or one for "
                   "all (default: the first of each GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("SUDU_BENCH_API_KEY"),
                   help="bearer token (default: $SUDU_BENCH_API_KEY)")
    g.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for a local sudu serve")
    g.add_argument("--serve-args", default="", help="with no --url: extra flags for the local `sudu serve`")
    g.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, seconds")
    r = p.add_argument_group("run")
    r.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"context depths in tokens, k = 1000 (default: {DEFAULT_DEPTHS})")
    r.add_argument("--modes", default="cold,agent", help="cold (salted prompt of each depth) and/or agent (new "
                   "tokens after a cached prefix of each depth)")
    r.add_argument("--repeats", type=int, default=3, help="repetitions of each point, for the mean and its interval")
    r.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded after each prompt")
    r.add_argument("--new-tokens", type=int, default=256, help="agent mode: new tokens after the cached prefix")
    r.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos=true (then an answer "
                   "may stop before --decode-tokens)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default: {DEFAULT_OUT})")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    from sudu.bench.local_server import run_with_local_server
    from sudu.bench.sweep import MODES, SweepOptions, execute, parse_depths, parse_endpoints
    from sudu.bench.sweep_report import markdown, write

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SuduError(f"bad --modes {args.modes!r}: use cold and/or agent")
    if args.repeats < 1 or args.decode_tokens < 2 or args.new_tokens < 1:
        raise SuduError("--repeats and --new-tokens must be >= 1, --decode-tokens >= 2 (decode speed needs two tokens)")
    opts = SweepOptions(parse_depths(args.depths), modes, args.repeats, args.decode_tokens, args.new_tokens,
                        not args.no_ignore_eos, args.seed)
    if args.url is None and (len(args.model or []) > 1 or args.label and len(args.label) > 1):
        raise SuduError("with no --url (a local sudu serve), give at most one --model and one --label")
    local_model = (args.model or [None])[0]

    def run(a) -> int:
        given = isinstance(a.url, list)  # else the local sudu serve started here
        endpoints = parse_endpoints(a.url if given else [a.url], a.label or (None if given else ["sudu"]),
                                    a.model if given else None)
        config = {k: v for k, v in vars(a).items() if isinstance(v, (str, int, float, bool, list, type(None)))
                  and k not in ("api_key", "func")}
        report, _ = execute(endpoints, opts, a.api_key, a.timeout, config)
        paths = write(report, a.out)
        print(markdown(report))
        print("reports: " + "  ".join(paths.values()), file=sys.stderr)
        if report["partial"]:
            raise KeyboardInterrupt
        return 0

    if args.url is None:  # run_with_local_server reads a single --model
        args.model = local_model
    return run_with_local_server(args, run)


def validate(args) -> dict:
    """Check flags before anything is started; returns the parsed SLOs."""
    from sudu.bench.metrics import parse_slo
    from sudu.bench.tasks import task_names
    from sudu.bench.workloads import parse_list

    cli_sessions.validate(args)
    if getattr(args, "num_requests", 1) < 1:
        raise SuduError("--num-requests must be >= 1")
    if args.warmup < 0:
        raise SuduError("--warmup must be >= 0")
    if args.suite == "throughput":
        args.concurrency_levels = parse_list(args.concurrency, int, "--concurrency")
        args.rates = parse_list(args.rate, float, "--rate")
        if not args.concurrency_levels and not args.rates:
            raise SuduError("give --concurrency and/or --rate")
        if any(c < 1 for c in args.concurrency_levels):
            raise SuduError("--concurrency levels must be >= 1")
    if args.suite == "cache":
        args.length_list = parse_list(args.lengths, int, "--lengths")
        if not args.length_list:
            raise SuduError("give --lengths")
    if args.suite == "tasks":
        names = list(task_names()) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = [n for n in names if n not in task_names()]
        if unknown or not names:
            raise SuduError(f"unknown task(s) {', '.join(unknown) or '(none)'}; tasks: {', '.join(task_names())}")
        args.task_list = names
        if args.attempts < 1 or args.repeat < 1:
            raise SuduError("--attempts and --repeat must be >= 1")
        check_code_tasks(args)
    if args.suite == "structured":
        from sudu.bench.structured import load_validator_class, schema_names

        names = list(schema_names()) if args.schemas == "all" else [t.strip() for t in args.schemas.split(",") if t.strip()]
        unknown = [n for n in names if n not in schema_names()]
        if unknown or not names:
            raise SuduError(f"unknown schema(s) {', '.join(unknown) or '(none)'}; schemas: {', '.join(schema_names())}")
        args.schema_list = names
        if args.concurrency < 1 or args.max_tokens < 1 or args.temperature < 0:
            raise SuduError("--concurrency and --max-tokens must be >= 1, --temperature >= 0")
        load_validator_class()
    if args.suite == "multimodal":
        from sudu.bench.images import parse_sizes
        from sudu.bench.multimodal import DEFAULT_QUESTION, IMAGE_STATES, MultimodalOptions

        states = [s.strip() for s in args.states.split(",") if s.strip()]
        if not states or any(s not in IMAGE_STATES for s in states):
            raise SuduError(f"bad --states {args.states!r}: use any of {', '.join(IMAGE_STATES)}")
        if args.max_tokens < 1:
            raise SuduError("--max-tokens must be >= 1")
        if args.api != "chat":
            raise SuduError(f"--api {args.api}: the multimodal suite sends chat completions' image_url parts; use --api chat")
        args.multimodal_opts = MultimodalOptions(parse_sizes(args.sizes), list(dict.fromkeys(states)), args.num_requests,
                                                 args.max_tokens, args.seed, not args.no_text_baseline,
                                                 args.question or DEFAULT_QUESTION, args.warmup)
    if args.suite == "conversation":
        if args.users < 1 or args.turns < 1 or args.team_size < 1 or args.answer_tokens < 1:
            raise SuduError("--users, --turns, --team-size and --answer-tokens must be >= 1")
        k = args.restart_after_turn
        if k is not None:
            if args.url:
                raise SuduError("--restart-after-turn needs the local server (no --url): bench cannot restart yours")
            if not 1 <= k < args.turns:
                raise SuduError(f"--restart-after-turn must be between 1 and {args.turns - 1} (--turns - 1)")
    return {} if args.suite == "capacity" else parse_slo(getattr(args, "slo", None))


def _loopback(url: str | None) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    if not url:
        return True  # the local sudu serve that bench starts itself
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_code_tasks(args) -> None:
    """Code answers run only sandboxed, and from a non-loopback endpoint only when asked explicitly."""
    from sudu.bench.tasks import CODE_TASKS
    from sudu.bench.tasks.sandbox import sandbox_problem

    code = [t for t in args.task_list if t in CODE_TASKS]
    if not code:
        return
    others = ",".join(t for t in args.task_list if t not in CODE_TASKS) or "retrieval,sql,svg,tool_loop"
    problem = sandbox_problem()
    if problem:
        raise SuduError(f"refusing to run the code tasks ({', '.join(code)}) without a sandbox: {problem}; "
                        f"or run --tasks {others}")
    if not _loopback(args.url) and not args.allow_remote_code:
        raise SuduError(f"{args.url} is not a loopback address: its answers to {', '.join(code)} would be run on "
                        f"this machine (sandboxed); pass --allow-remote-code, or run --tasks {others}")


def cmd_suite(args) -> int:
    from sudu.bench.local_server import run_with_local_server

    slo = validate(args)
    overhead = None
    if getattr(args, "self_test", False):
        from sudu.bench.overhead import run_overhead

        print("client self-test against an instant fake server ...", file=sys.stderr)
        overhead = run_overhead()
    return run_with_local_server(args, lambda a: execute(a, slo, overhead))


def _config(args) -> dict:
    from sudu.bench.suites import SAMPLING

    skip = {"func", "api_key", "trace_obj", "capacity_opts", "multimodal_opts", "prices", "json_lines_write",
            "json_lines_close"}
    config = {k: v for k, v in vars(args).items()
              if k not in skip and isinstance(v, (str, int, float, bool, list, dict, type(None)))}
    sampling = {"temperature": args.temperature} if args.suite == "structured" else dict(SAMPLING)
    return {**config, "sampling": sampling}


def execute(args, slo: dict, overhead: dict | None = None) -> int:
    from sudu.bench.report import build_report, markdown_summary, write_report
    from sudu.bench.suites import Run

    run = Run(suite=args.suite, target={"url": args.url, "model": args.model,
                                        "local_server": getattr(args, "local_server", None)},
              config=_config(args), overhead=overhead, prices=getattr(args, "prices", None),
              machine_per_hour=getattr(args, "machine_cost", None))
    interrupted = False
    try:
        asyncio.run(run_suite(args, run))
    except KeyboardInterrupt:
        interrupted = True
        run.partial = True
        run.notes.append("interrupted by the user (Ctrl-C): partial report")
    run.finished_at = time.time()
    getattr(args, "json_lines_close", lambda: None)()  # set by cli_sessions.validate
    report = build_report(run, slo)
    paths = write_report(report, args.out, with_html=not args.no_html)
    print(markdown_summary(report))
    print("reports: " + "  ".join(paths.values()), file=sys.stderr)
    if interrupted:
        raise KeyboardInterrupt
    return 0


def _progress(disabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), disable=disabled, transient=False)


def planned_requests(args) -> int | None:
    if args.suite in ("replay", "capacity"):
        return cli_sessions.planned(args)
    if args.suite == "single":
        return args.warmup + args.num_requests
    if args.suite == "throughput":
        return args.warmup + args.num_requests * (len(args.concurrency_levels) + len(args.rates))
    if args.suite == "cache":
        return 4 * args.num_requests * len(args.length_list) + len(args.length_list)
    if args.suite == "conversation":
        return args.users * args.turns
    if args.suite == "structured":
        return args.warmup + args.num_requests
    if args.suite == "multimodal":
        from sudu.bench.multimodal import planned

        return planned(args.multimodal_opts)
    return args.warmup + len(args.task_list) * args.repeat


async def run_suite(args, run) -> None:
    from sudu.bench import suites
    from sudu.bench.client import ClientPool, api_base, auth_headers, fetch_server_info, make_client
    from sudu.bench.tokens import load_token_counter

    base = api_base(args.url)
    headers = auth_headers(args.api_key)
    async with make_client(1, 30.0) as c:
        run.server_info = await fetch_server_info(c, base, headers)
    if run.server_info.get("error", "").startswith(("ConnectError", "ConnectTimeout")):
        raise SuduError(f"cannot reach {base}: {run.server_info['error']}")
    model = args.model
    if not model:
        data = (run.server_info.get("models") or {}).get("data") or []
        if not data:
            raise SuduError(f"no --model given and GET {base}/models listed none ({run.server_info})")
        model = data[0].get("id")
    run.target.update(url=base, model=model)
    tokenizer_path = getattr(args, "tokenizer", None)  # replay's --tokenizer
    count_tokens, run.token_recount = (load_token_counter(model, tokenizer_path) if tokenizer_path
                                       else load_token_counter(model))
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    with _progress(args.no_progress or not sys.stderr.isatty()) as progress:
        bar = progress.add_task(f"{args.suite} @ {model}", total=planned_requests(args))
        write_line = getattr(args, "json_lines_write", None)

        def on_done(rec, count=args.suite != "tasks"):
            if count:
                progress.advance(bar)
            if write_line is not None:
                write_line(rec)

        async with ClientPool(args.timeout) as pool:
            ctx = suites.Ctx(pool=pool, base=base, headers=headers, model=model, run=run,
                             count_tokens=count_tokens, extra_body=extra, on_done=on_done, api=getattr(args, "api", "chat"))
            run.notes.append(await suites.probe_chunk_usage(ctx, args.chunk_usage))
            if args.suite in ("replay", "capacity"):
                await cli_sessions.run(args, ctx, run, suites)
            elif args.suite == "single":
                await suites.run_single(ctx, args.num_requests, args.warmup, args.max_tokens, args.prompt)
            elif args.suite == "throughput":
                levels = suites.throughput_levels(args.concurrency_levels, args.rates, args.max_concurrency)
                await suites.run_throughput(ctx, levels, args.num_requests, args.warmup, args.input_words,
                                            args.output_len, args.arrival, args.burstiness, args.seed)
            elif args.suite == "cache":
                await suites.run_cache(ctx, args.length_list, args.num_requests, args.max_tokens, args.seed)
            elif args.suite == "structured":
                from sudu.bench.structured import run_structured

                await run_structured(ctx, suites.send, args.schema_list, args.num_requests, args.concurrency,
                                     args.max_tokens, args.temperature, args.warmup, args.seed)
            elif args.suite == "multimodal":
                from sudu.bench.multimodal import run_multimodal

                opts = args.multimodal_opts
                run.multimodal = {"sizes": opts.sizes, "states": opts.states, "evidence": {}}
                run.multimodal["evidence"] = await run_multimodal(ctx, opts, suites.send, suites.Group)
            elif args.suite == "conversation":
                from sudu.bench.conversation import ConversationOptions, run_conversation

                opts = ConversationOptions(args.users, args.turns, args.team_size, args.answer_tokens,
                                           args.tool_output_words, args.restart_after_turn, args.seed)
                restart_server = getattr(args, "restart_server", None)
                restart = (lambda: asyncio.to_thread(restart_server)) if restart_server else None
                run.sessions = await run_conversation(ctx, opts, suites.send, restart)
            else:
                context_len = args.context_len or suites.context_len_from_server(run.server_info)
                if context_len is None:
                    context_len = suites.DEFAULT_CONTEXT_LEN
                    run.notes.append(f"model context unknown: retrieval sized for {context_len} tokens (--context-len)")
                run.config["context_len_used"] = context_len
                ctx.on_done = lambda rec: (progress.advance(bar) if rec.warmup else None,
                                           write_line(rec) if write_line else None)
                await suites.run_tasks(ctx, args.task_list, args.repeat, args.attempts, context_len,
                                       args.retrieval_fraction, args.warmup, args.seed,
                                       on_task_done=lambda res: progress.advance(bar), tool_choice=args.tool_choice)
