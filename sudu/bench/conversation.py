"""The `conversation` suite: N simulated users, each a multi-turn coding-agent session, the workload a
context cache exists for.

A session is a system prompt (an agent's instructions and the JSON descriptions of its tools), a task,
then turns: the model answers (its real answer goes into the history) and the "tool" replies with what
such tools print: source files, pytest logs with tracebacks, grep hits, diffs. The history grows every
turn, to several thousand tokens. Users form teams of `team_size` that share one system prompt (a
product's agent shares its instructions across users); each run salts every team's prompt, so nothing
from an earlier run can be reused.

Declared cache states: a team's first turn is `cold`; its other members' first turns `shared-prefix`
(they wait until the team's first turn has been answered); every later turn `warm` (the conversation up
to the previous answer was sent just before). Per turn the report gives TTFT and the share of prompt
tokens the server reported as cached, and per session the time from the first request to the last
answer. With `--restart-after-turn K` (bench starting the server itself), every session finishes turn K,
the server is stopped and started again, and the sessions continue: the turns after K show what the
cache kept across the restart.

Tool results travel as user messages ("Tool result (run_tests): ..."), which every chat template accepts.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from sudu.bench.workloads import salt

TOOLS = [
    ("read_file", "Read a file of the repository.", {"path": "string: path relative to the repository root"}),
    ("run_tests", "Run the test suite or one test file with pytest and return its output.",
     {"target": "string: a test file or node id; empty for the whole suite"}),
    ("search", "Search the repository for a regular expression.", {"pattern": "string", "glob": "string"}),
    ("edit_file", "Replace a unique snippet of a file with new text.",
     {"path": "string", "old": "string: text that occurs exactly once", "new": "string"}),
    ("git_diff", "Show the working tree's changes.", {}),
]

_NOUNS = ["order", "invoice", "user", "session", "cart", "payment", "token", "report", "queue", "job", "cache",
          "record", "account", "event", "schedule", "ticket", "message", "batch", "price", "route"]
_VERBS = ["load", "parse", "validate", "merge", "apply", "compute", "render", "flush", "resolve", "refresh",
          "encode", "split", "collect", "retry", "normalize"]
_TOOL_CYCLE = ["read_file", "run_tests", "search", "read_file", "edit_file", "run_tests", "git_diff", "read_file",
               "run_tests", "search", "edit_file", "run_tests"]


def system_prompt(team: int, seed: int) -> str:
    rng = random.Random(seed * 1000 + team)
    project = f"{rng.choice(_NOUNS)}-{rng.choice(_NOUNS)}-service"
    lines = [
        f"You are a coding agent working in the repository `{project}`. You fix bugs and implement features by "
        "calling tools, one call per reply, and you explain each step in one or two sentences first.",
        "Rules: read before you edit; keep changes minimal; run the tests after every edit; never invent file "
        "contents; when the tests pass, summarise the change and stop.",
        "Reply format: a short explanation, then exactly one tool call as JSON: "
        '{"tool": "<name>", "arguments": {...}}.',
        "",
        "Tools:",
    ]
    for name, text, params in TOOLS:
        props = ", ".join(f'"{k}": {{"type": "{v.split(":")[0]}", "description": "{v}"}}' for k, v in params.items())
        lines.append(f'- {{"name": "{name}", "description": "{text}", "parameters": {{"type": "object", '
                     f'"properties": {{{props}}}}}}}')
    lines += ["", "Coding conventions of this repository: type hints everywhere, dataclasses for records, "
              "pytest for tests, no global state, errors raised as ValueError with a message that names the "
              "offending value. Modules: " + ", ".join(f"{project.split('-')[0]}/{n}.py" for n in rng.sample(_NOUNS, 8))]
    return "\n".join(lines)


def _function(rng: random.Random, noun: str) -> list[str]:
    verb, other = rng.choice(_VERBS), rng.choice(_NOUNS)
    args = ", ".join(f"{a}: {t}" for a, t in rng.sample(
        [("items", "list[dict]"), ("limit", "int"), ("strict", "bool"), ("key", "str"), ("scale", "float")], 2))
    body = [f"def {verb}_{noun}({args}) -> dict:",
            f'    """{verb.capitalize()} the {noun} against its {other} records."""',
            "    result = {}",
            "    for entry in items if isinstance(items, list) else []:",
            f"        if entry.get('{other}_id') is None:",
            f"            raise ValueError(f'{noun} entry without {other}_id: {{entry!r}}')",
            f"        result[entry['{other}_id']] = entry.get('{rng.choice(_NOUNS)}', 0) * {rng.randint(2, 9)}",
            "    return result", ""]
    return body


def source_file(rng: random.Random, noun: str, num_functions: int) -> str:
    lines = [f'"""The {noun} module: loading, validation and totals of {noun} records."""',
             "from __future__ import annotations", "", "from dataclasses import dataclass", "", "",
             "@dataclass", f"class {noun.capitalize()}:", f"    {noun}_id: int", "    amount: float",
             "    status: str = 'new'", "", ""]
    for _ in range(num_functions):
        lines += _function(rng, noun)
    return "\n".join(lines)


def test_log(rng: random.Random, noun: str, failing: bool) -> str:
    n = rng.randint(20, 60)
    head = ["============================= test session starts ==============================",
            "platform linux -- Python 3.11.7, pytest-8.3.2, pluggy-1.5.0",
            f"rootdir: /workspace/{noun}-service", f"collected {n} items", ""]
    files = [f"tests/test_{x}.py " + "".join(rng.choice("....F" if failing else ".") for _ in range(rng.randint(5, 15)))
             for x in rng.sample(_NOUNS, 4)]
    if not failing:
        return "\n".join(head + files + ["", f"============================== {n} passed in {rng.uniform(0.5, 4):.2f}s =="])
    verb = rng.choice(_VERBS)
    tb = ["", "=================================== FAILURES ===================================",
          f"_________________________ test_{verb}_{noun}_rejects_missing_ids _________________________", "",
          f"    def test_{verb}_{noun}_rejects_missing_ids():",
          f"        items = [{{'{noun}_id': 1, 'amount': 3.5}}, {{'amount': 2.0}}]",
          "        with pytest.raises(ValueError):",
          f">           {verb}_{noun}(items, limit=10)",
          "E           Failed: DID NOT RAISE <class 'ValueError'>", "",
          f"tests/test_{noun}.py:{rng.randint(20, 200)}: Failed",
          "=========================== short test summary info ============================",
          f"FAILED tests/test_{noun}.py::test_{verb}_{noun}_rejects_missing_ids - Failed: DID NOT RAISE",
          f"========================= 1 failed, {n - 1} passed in {rng.uniform(0.5, 4):.2f}s ========================="]
    return "\n".join(head + files + tb)


def tool_output(rng: random.Random, tool: str, noun: str, turn: int, words: int) -> str:
    if tool == "read_file":
        text = source_file(rng, rng.choice(_NOUNS) if turn > 1 else noun, max(2, words // 45))
    elif tool == "run_tests":
        text = test_log(rng, noun, failing=turn < 8)
    elif tool == "search":
        text = "\n".join(f"{rng.choice(_NOUNS)}/{rng.choice(_NOUNS)}.py:{rng.randint(1, 400)}:    "
                         f"{rng.choice(_VERBS)}_{noun}(items, limit={rng.randint(1, 50)})" for _ in range(max(4, words // 12)))
    elif tool == "edit_file":
        text = f"Edited {noun}/{noun}.py: replaced 1 occurrence (lines {rng.randint(10, 90)}-{rng.randint(91, 120)})."
    else:
        body = _function(rng, noun)
        text = "\n".join([f"diff --git a/{noun}/{noun}.py b/{noun}/{noun}.py", "--- a/" + noun, "+++ b/" + noun,
                          "@@ -12,7 +12,9 @@"] + ["+" + line for line in body])
    return f"Tool result ({tool}):\n{text}"


def task_text(rng: random.Random, noun: str) -> str:
    verb = rng.choice(_VERBS)
    return (f"The test `test_{verb}_{noun}_rejects_missing_ids` fails: `{verb}_{noun}` should raise ValueError "
            f"when an entry has no id, but it silently skips such entries in some code paths. Find the cause, fix "
            f"it without changing the public signature, and make the whole suite pass.")


@dataclass
class Session:
    user: int
    team: int
    system: str
    messages: list[dict] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    noun: str = "order"


def make_sessions(users: int, team_size: int, seed: int) -> list[Session]:
    salts = {}
    sessions = []
    for u in range(users):
        team = u // team_size
        if team not in salts:
            salts[team] = salt()
        rng = random.Random(seed * 7919 + u)
        noun = rng.choice(_NOUNS)
        system = salts[team] + system_prompt(team, seed)
        s = Session(u, team, system, [{"role": "system", "content": system},
                                      {"role": "user", "content": task_text(rng, noun)}], rng, noun)
        sessions.append(s)
    return sessions


@dataclass
class ConversationOptions:
    users: int = 8
    turns: int = 10
    team_size: int = 2
    answer_tokens: int = 64
    tool_output_words: int = 220
    restart_after_turn: int | None = None
    seed: int = 0


async def run_conversation(ctx, opts: ConversationOptions, send: Callable,
                           restart: Callable[[], Awaitable[None]] | None = None) -> list[dict]:
    """Run every session to opts.turns turns; returns one summary per session. `send(ctx, group, state,
    messages, max_tokens)` is the suite's request function (records land in ctx.run)."""
    from sudu.bench.suites import Group

    sessions = make_sessions(opts.users, opts.team_size, opts.seed)
    groups: dict[str, Group] = {}
    team_ready = {s.team: asyncio.Event() for s in sessions}
    leaders = {}
    for s in sessions:
        leaders.setdefault(s.team, s.user)
    at_restart = asyncio.Barrier(len(sessions)) if restart and opts.restart_after_turn else None
    restarted = asyncio.Event()
    results = []

    def group_for(turn: int, state: str) -> str:
        name = f"turn={turn}" + (f" {state}" if turn == 1 else "")
        if name not in groups:
            groups[name] = Group(name, state, {"turn": turn})
        return name

    async def restart_point() -> None:
        if await at_restart.wait() == 0:  # the last session to arrive restarts the server for all
            await restart()
            restarted.set()
        await restarted.wait()

    async def one(s: Session) -> None:
        t0 = time.perf_counter()
        turns = []
        waited = False
        for turn in range(1, opts.turns + 1):
            if turn == 1:
                state = "cold" if s.user == leaders[s.team] else "shared-prefix"
                if state == "shared-prefix":
                    await team_ready[s.team].wait()
            else:
                state = "warm"
            rec = await send(ctx, group_for(turn, state), state, list(s.messages), opts.answer_tokens,
                             session=f"user{s.user}")
            usage = rec.usage or {}
            turns.append({"turn": turn, "ok": rec.ok, "ttft_s": rec.metrics.get("ttft_s"),
                          "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": rec.metrics.get("cached_tokens"),
                          "completion_tokens": usage.get("completion_tokens"), "error": rec.error})
            if turn == 1 and s.user == leaders[s.team]:
                team_ready[s.team].set()
            if not rec.ok:
                break
            tool = _TOOL_CYCLE[(turn - 1) % len(_TOOL_CYCLE)]
            s.messages += [{"role": "assistant", "content": rec.text},
                           {"role": "user", "content": tool_output(s.rng, tool, s.noun, turn, opts.tool_output_words)}]
            if at_restart is not None and turn == opts.restart_after_turn:
                await restart_point()
                waited = True
        if at_restart is not None and not waited:  # ended early: the others must not wait for it
            await restart_point()
        results.append({"user": s.user, "team": s.team, "turns": turns, "session_s": time.perf_counter() - t0,
                        "completed": len(turns) == opts.turns and all(t["ok"] for t in turns)})

    try:
        await asyncio.gather(*(one(s) for s in sessions))
    finally:
        ctx.run.groups += sorted(groups.values(), key=lambda g: (g.params["turn"], g.cache_state))
    return sorted(results, key=lambda r: r["user"])


def summarize(sessions: list[dict], restart_after_turn: int | None = None) -> dict:
    """Per turn: TTFT (median, mean), cached share of prompt tokens; overall token hit rate (turns >= 2
    and all turns) and session times."""
    import numpy as np

    by_turn: dict[int, list[dict]] = {}
    for s in sessions:
        for t in s["turns"]:
            if t["ok"]:
                by_turn.setdefault(t["turn"], []).append(t)

    def share(ts):
        prompt = sum(t["prompt_tokens"] or 0 for t in ts)
        cached = sum(t["cached_tokens"] or 0 for t in ts)
        return cached / prompt if prompt else None

    turns = []
    for turn, ts in sorted(by_turn.items()):
        ttfts = [t["ttft_s"] for t in ts if t["ttft_s"] is not None]
        turns.append({"turn": turn, "n": len(ts), "ttft_median_s": float(np.median(ttfts)) if ttfts else None,
                      "ttft_mean_s": float(np.mean(ttfts)) if ttfts else None,
                      "prompt_tokens_mean": float(np.mean([t["prompt_tokens"] or 0 for t in ts])),
                      "cached_share": share(ts), "after_restart": bool(restart_after_turn and turn == restart_after_turn + 1)})
    later = [t for turn, ts in by_turn.items() if turn >= 2 for t in ts]
    # the most a cache could serve at turn k: everything sent (prompt) and generated (answer) at turn k - 1
    ideal = prompt = 0
    for s in sessions:
        for prev, t in zip(s["turns"], s["turns"][1:]):
            if prev["ok"] and t["ok"] and t["prompt_tokens"]:
                ideal += min(t["prompt_tokens"], (prev["prompt_tokens"] or 0) + (prev.get("completion_tokens") or 0))
                prompt += t["prompt_tokens"]
    ttft_later = [t["ttft_s"] for t in later if t["ttft_s"] is not None]
    times = [s["session_s"] for s in sessions]
    return {
        "turns": turns,
        "token_hit_rate_turns_2plus": share(later),
        "token_hit_rate_all": share([t for ts in by_turn.values() for t in ts]),
        "ideal_hit_rate_turns_2plus": ideal / prompt if prompt else None,
        "ttft_mean_turns_2plus_s": float(np.mean(ttft_later)) if ttft_later else None,
        "session_s_mean": float(np.mean(times)) if times else None,
        "session_s_max": max(times) if times else None,
        "sessions_completed": sum(s["completed"] for s in sessions),
        "sessions": len(sessions),
        "restart_after_turn": restart_after_turn,
    }


def markdown(summary: dict) -> str:
    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"

    def ms(v):
        return "n/a" if v is None else f"{1000 * v:.0f}"

    lines = ["| turn | n | prompt tokens (mean) | TTFT median ms | TTFT mean ms | cached share |",
             "|---:|---:|---:|---:|---:|---:|"]
    for t in summary["turns"]:
        mark = " (after restart)" if t["after_restart"] else ""
        lines.append(f"| {t['turn']}{mark} | {t['n']} | {t['prompt_tokens_mean']:.0f} | {ms(t['ttft_median_s'])} | "
                     f"{ms(t['ttft_mean_s'])} | {pct(t['cached_share'])} |")
    lines.append("")
    lines.append(f"Token hit rate, turns >= 2: {pct(summary['token_hit_rate_turns_2plus'])} (all turns: "
                 f"{pct(summary['token_hit_rate_all'])}; the most a cache could hit, the previous turn's prompt "
                 f"and answer: {pct(summary.get('ideal_hit_rate_turns_2plus'))}); mean TTFT of turns >= 2: {ms(summary['ttft_mean_turns_2plus_s'])} ms; "
                 f"session time mean {summary['session_s_mean'] or 0:.1f} s, max {summary['session_s_max'] or 0:.1f} s; "
                 f"{summary['sessions_completed']}/{summary['sessions']} sessions completed.")
    return "\n".join(lines)
