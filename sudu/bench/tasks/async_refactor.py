"""Refactoring task: a blocking program (ten sequential 0.2 s fetches) rewritten with asyncio. The answer
must run: `fetch` and `main` are coroutine functions (checked on the source here, and at run time), no
time.sleep is left, `asyncio.run(main())` returns the same list in order and ten fetches of inputs drawn
at check time come back right, each concurrently (< 1 s instead of 2 s, timed by the checker)."""
from __future__ import annotations

import ast
import secrets

from sudu.bench.tasks import CheckResult, TaskInstance, extract_code
from sudu.bench.tasks.sandbox import run_calls

TIMEOUT_S = 15.0
MAX_CONCURRENT_S = 1.0  # sequential fetches take 2 s

ORIGINAL = '''import time


def fetch(i):
    time.sleep(0.2)  # stands for a network call
    return i * i


def main():
    return [fetch(i) for i in range(10)]


if __name__ == "__main__":
    print(main())
'''

PROMPT = (
    "Refactor this program to use asyncio so that the ten fetches run concurrently. Keep the names: "
    "`fetch(i)` and `main()` must become `async def` functions, `asyncio.run(main())` must return the same "
    "list in the same order, and the simulated network call must not block the event loop.\n\n"
    "```python\n" + ORIGINAL + "```\n\nReply with the complete refactored program in one ```python code block."
)

CALLS = """
import asyncio, inspect
def _kinds(candidate):
    return [inspect.iscoroutinefunction(getattr(candidate, name, None)) for name in ("fetch", "main")]
async def _gather(candidate, ks):
    return await asyncio.gather(*(candidate.fetch(k) for k in ks))
CALLS = {
    "kinds": _kinds,
    "main": lambda candidate: list(asyncio.run(candidate.main())),
    "fetch_many": lambda candidate, ks: list(asyncio.run(_gather(candidate, ks))),
}
"""


def static_problem(code: str) -> str | None:
    """Checked here, on the source: both functions are top-level `async def`, and time.sleep is gone."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return f"syntax error: {exc.msg} (line {exc.lineno})"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "sleep" and isinstance(node.value, ast.Name) \
                and node.value.id == "time":
            return "time.sleep is still used: it blocks the event loop"
    defined = {n.name for n in tree.body if isinstance(n, ast.AsyncFunctionDef)}
    missing = [name for name in ("fetch", "main") if name not in defined]
    return f"{', '.join(missing)} not defined as a top-level async def function" if missing else None


def check(answer: str) -> CheckResult:
    code = extract_code(answer, ("python", "py", "python3"), must_contain="async def")
    if "async def" not in code:
        return CheckResult(False, "no async def in the answer")
    problem = static_problem(code)
    if problem:
        return CheckResult(False, problem)
    ks = [secrets.randbelow(1000) for _ in range(10)]
    results, error = run_calls(code, CALLS, TIMEOUT_S, [("kinds",), ("main",), ("fetch_many", ks)])
    if error:
        return CheckResult(False, error)
    kinds, main, many = results
    if kinds.result != [True, True]:
        return CheckResult(False, "fetch and main are not both coroutine functions at run time")
    if main.result != [i * i for i in range(10)]:
        return CheckResult(False, f"main() returned {str(main.result)[:80]}")
    if many.result != [k * k for k in ks]:
        return CheckResult(False, f"fetch(k) for k in {ks} returned {str(many.result)[:80]}")
    for name, res in (("main()", main), ("ten concurrent fetch calls", many)):
        if res.elapsed_s > MAX_CONCURRENT_S:
            return CheckResult(False, f"{name} took {res.elapsed_s:.2f} s: the fetches did not run concurrently")
    return CheckResult(True, "runs concurrently with the same result")


def build() -> TaskInstance:
    return TaskInstance(name="async_refactor", messages=[{"role": "user", "content": PROMPT}], check=check, max_tokens=1024)
