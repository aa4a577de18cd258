"""Refactoring task: a blocking program (ten sequential 0.2 s fetches) rewritten with asyncio. The answer
must run: `fetch` and `main` are coroutine functions, no time.sleep is left, `asyncio.run(main())`
returns the same list in order, and concurrently (< 1 s instead of 2 s)."""
from __future__ import annotations

from sudu.bench.tasks import CheckResult, TaskInstance, extract_code
from sudu.bench.tasks.sandbox import check_by_running

TIMEOUT_S = 15.0

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

HARNESS = r'''
import ast, asyncio, inspect, time

source = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "candidate.py")).read()
for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and node.attr == "sleep" and isinstance(node.value, ast.Name) and node.value.id == "time":
        raise SystemExit("time.sleep is still used: it blocks the event loop")
import candidate
for name in ("fetch", "main"):
    if not inspect.iscoroutinefunction(getattr(candidate, name, None)):
        raise SystemExit(f"{name} is not an async def function")
t0 = time.perf_counter()
result = asyncio.run(candidate.main())
elapsed = time.perf_counter() - t0
if list(result) != [i * i for i in range(10)]:
    raise SystemExit(f"main() returned {result!r}")
if elapsed > 1.0:
    raise SystemExit(f"took {elapsed:.2f} s: the fetches did not run concurrently")
print("OK")
'''


def check(answer: str) -> CheckResult:
    code = extract_code(answer, ("python", "py", "python3"), must_contain="async def")
    if "async def" not in code:
        return CheckResult(False, "no async def in the answer")
    return check_by_running(code, HARNESS, TIMEOUT_S, "runs concurrently with the same result")


def build() -> TaskInstance:
    return TaskInstance(name="async_refactor", messages=[{"role": "user", "content": PROMPT}], check=check, max_tokens=1024)
