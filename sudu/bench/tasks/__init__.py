"""End-to-end tasks for `sudu bench tasks`: each task builds its prompt and a checker, and the runner
(sudu.bench.suites) times start -> a passing answer. Checkers are strict and deterministic: a wrong
answer fails, so it can never count as a fast one.

Tasks: retrieval (a fact hidden in a long document), palindrome (Python, run against tests in a
subprocess), sql (executed against an sqlite3 fixture), svg (well-formed, required elements),
async_refactor (a blocking program rewritten with asyncio, run and timed), tool_loop (an answer reached by
calling a tool that the runner executes: `tools` in the request, the tool's result sent back, until the
model answers)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from sudu.errors import SuduError


@dataclass
class CheckResult:
    passed: bool
    detail: str = ""


@dataclass
class TaskInstance:
    name: str
    messages: list[dict]
    check: Callable[[str], CheckResult]
    max_tokens: int = 1024
    info: dict | None = None  # e.g. the retrieval document's length and the fact's depth
    run_tool: Callable[[str, str], str] | None = None  # (name, arguments JSON) -> the tool message's content
    # tool results sent back so far in the attempt -> the call's tool fields (`tools`, `tool_choice`, ...)
    tool_fields: Callable[[int], dict] | None = None
    max_tool_rounds: int = 0  # tool results sent back per attempt before the attempt fails


_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def strip_reasoning(text: str) -> str:
    return _THINK.sub("", text).strip()


def extract_code(text: str, langs: tuple[str, ...] = (), must_contain: str | None = None) -> str:
    """The code in a model's answer: the fenced block in one of `langs` (the one containing
    `must_contain` when given, else the longest), any fenced block, or the whole answer."""
    text = strip_reasoning(text)
    blocks = [(lang.lower(), body.strip()) for lang, body in _FENCE.findall(text)]
    for candidates in ([b for lang, b in blocks if lang in langs], [b for _, b in blocks]):
        if must_contain:
            hits = [b for b in candidates if must_contain in b]
            if hits:
                return max(hits, key=len)
        if candidates:
            return max(candidates, key=len)
    return text


CODE_TASKS = ("palindrome", "async_refactor")  # their answers are executed (sandboxed)


def task_names() -> tuple[str, ...]:
    return ("retrieval", "palindrome", "sql", "svg", "async_refactor", "tool_loop")


def build_task(name: str, context_len: int, seed: int = 0, retrieval_fraction: float = 0.5,
               tool_choice: str = "forced") -> TaskInstance:
    from sudu.bench.tasks import async_refactor, palindrome, retrieval, sql, svg, tool_loop

    if name == "retrieval":
        return retrieval.build(context_len, seed, retrieval_fraction)
    if name == "tool_loop":
        return tool_loop.build(seed, tool_choice)
    builders = {"palindrome": palindrome.build, "sql": sql.build, "svg": svg.build, "async_refactor": async_refactor.build}
    if name not in builders:
        raise SuduError(f"unknown task {name!r}; tasks: {', '.join(task_names())}")
    return builders[name]()
