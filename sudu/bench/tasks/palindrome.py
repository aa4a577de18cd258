"""Algorithm task: `longest_palindrome(s)` written in Python, verified by running tests (edge cases, the
first-occurrence tie rule, random inputs drawn at check time, a 1500-character input) against a reference
computed here; the candidate runs in the sandbox and only answers calls."""
from __future__ import annotations

import random
import secrets

from sudu.bench.tasks import CheckResult, TaskInstance, extract_code
from sudu.bench.tasks.sandbox import run_calls

TIMEOUT_S = 10.0

PROMPT = (
    "Write a Python function `longest_palindrome(s: str) -> str` that returns the longest palindromic "
    "substring of `s`. If several have the maximum length, return the one that starts first. For an empty "
    "string return an empty string. It must handle strings of a few thousand characters quickly. "
    "Reply with the complete function in one ```python code block."
)

CALLS = "CALLS = {'solve': lambda candidate, cases: [candidate.longest_palindrome(s) for s in cases]}"


def reference(s: str) -> str:
    best = ""
    for center in range(2 * len(s) - 1):
        lo, hi = center // 2, center // 2 + center % 2
        while lo >= 0 and hi < len(s) and s[lo] == s[hi]:
            lo -= 1
            hi += 1
        if hi - lo - 1 > len(best):
            best = s[lo + 1:hi]
    return best


def cases() -> list[str]:
    """Fixed edge cases, then random ones drawn fresh for every check (a candidate cannot know them)."""
    rng = random.Random(secrets.randbits(64))
    out = ["babad", "cbbd", "", "a", "ac", "forgeeksskeegfor", "abacdfgdcaba", "aaaa", "abcba", "xabbay", "noonracecar"]
    out += ["".join(rng.choice("ab") for _ in range(rng.randint(5, 40))) for _ in range(40)]
    out.append("".join(rng.choice("abc") for _ in range(1500)))
    return out


def check(answer: str) -> CheckResult:
    code = extract_code(answer, ("python", "py", "python3"), must_contain="def longest_palindrome")
    if "def longest_palindrome" not in code:
        return CheckResult(False, "no longest_palindrome function in the answer")
    inputs = cases()
    results, error = run_calls(code, CALLS, TIMEOUT_S, [("solve", inputs)])
    if error:
        return CheckResult(False, error)
    got = results[0].result if isinstance(results[0].result, list) else []
    for i, s in enumerate(inputs):
        want = reference(s)
        if i >= len(got) or got[i] != want:
            value = got[i] if i < len(got) else None
            return CheckResult(False, f"longest_palindrome({s[:40]!r}) returned {str(value)[:40]!r}, expected {want[:40]!r}")
    return CheckResult(True, f"all {len(inputs)} tests pass")


def build() -> TaskInstance:
    return TaskInstance(name="palindrome", messages=[{"role": "user", "content": PROMPT}], check=check, max_tokens=1024)
