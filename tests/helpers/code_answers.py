"""Known-good answers to the bench's code tasks, and `needs_sandbox`: tests that run answers' code skip
where bubblewrap is missing, except under CI (`CI=true` or `SUDU_REQUIRE_NATIVE=1`, as .ci/run sets),
where they fail: a CI run must not pass without the sandbox it tests."""
import functools
import os

import pytest

from sudu.bench.tasks.sandbox import sandbox_problem


def ci_requires_everything() -> bool:
    """Whether this run is CI's, where a missing prerequisite is a failure rather than a skip."""
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("CI", "SUDU_REQUIRE_NATIVE"))


def needs_sandbox(test):
    """Marks a test that runs an answer's code: skipped where bubblewrap cannot run, failed instead under CI."""
    problem = sandbox_problem()
    if problem is None:
        return test
    if not ci_requires_everything():
        return pytest.mark.skip(reason=f"no sandbox here: {problem} (.ci/run installs bubblewrap)")(test)

    @functools.wraps(test)
    def fails(*args, **kwargs):
        pytest.fail(f"no sandbox here: {problem}; CI requires it (.ci/run installs bubblewrap)")

    return fails


GOOD_PALINDROME = '''Here you go:

```python
def longest_palindrome(s: str) -> str:
    best = ""
    for c in range(2 * len(s) - 1):
        lo, hi = c // 2, c // 2 + c % 2
        while lo >= 0 and hi < len(s) and s[lo] == s[hi]:
            lo -= 1
            hi += 1
        if hi - lo - 1 > len(best):
            best = s[lo + 1:hi]
    return best
```
'''


GOOD_SQL = """```sql
SELECT c.country, SUM(o.amount) AS total
FROM orders o JOIN customers c ON c.id = o.customer_id
WHERE strftime('%Y', o.created_at) = '2024'
GROUP BY c.country
HAVING total > 100
ORDER BY total DESC;
```"""


GOOD_SVG = """```svg
<svg xmlns="http://www.w3.org/2000/svg" width="200" height="200">
  <rect x="10" y="10" width="40" height="30" fill="blue"/>
  <circle cx="100" cy="100" r="50" style="fill: red"/>
  <text x="80" y="190">sudu</text>
</svg>
```"""


GOOD_ASYNC = """```python
import asyncio


async def fetch(i):
    await asyncio.sleep(0.2)
    return i * i


async def main():
    return list(await asyncio.gather(*(fetch(i) for i in range(10))))


if __name__ == "__main__":
    print(asyncio.run(main()))
```"""
