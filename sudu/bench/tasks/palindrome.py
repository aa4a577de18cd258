"""Algorithm task: `longest_palindrome(s)` written in Python, verified by running tests (edge cases, the
first-occurrence tie rule, a 1500-character input) in a subprocess with a timeout."""
from __future__ import annotations

from sudu.bench.tasks import CheckResult, TaskInstance, extract_code
from sudu.bench.tasks.sandbox import check_by_running

TIMEOUT_S = 10.0

PROMPT = (
    "Write a Python function `longest_palindrome(s: str) -> str` that returns the longest palindromic "
    "substring of `s`. If several have the maximum length, return the one that starts first. For an empty "
    "string return an empty string. It must handle strings of a few thousand characters quickly. "
    "Reply with the complete function in one ```python code block."
)

HARNESS = r'''
import random

def _reference(s):
    best = ""
    for center in range(2 * len(s) - 1):
        lo, hi = center // 2, center // 2 + center % 2
        while lo >= 0 and hi < len(s) and s[lo] == s[hi]:
            lo -= 1
            hi += 1
        if hi - lo - 1 > len(best):
            best = s[lo + 1:hi]
    return best

from candidate import longest_palindrome

cases = ["babad", "cbbd", "", "a", "ac", "forgeeksskeegfor", "abacdfgdcaba", "aaaa", "abcba", "xabbay", "noonracecar"]
rng = random.Random(7)
cases += ["".join(rng.choice("ab") for _ in range(rng.randint(5, 40))) for _ in range(40)]
cases.append("".join(rng.choice("abc") for _ in range(1500)))
for s in cases:
    got = longest_palindrome(s)
    want = _reference(s)
    if got != want:
        raise SystemExit(f"longest_palindrome({s[:40]!r}) returned {str(got)[:40]!r}, expected {want[:40]!r}")
print("OK")
'''


def check(answer: str) -> CheckResult:
    code = extract_code(answer, ("python", "py", "python3"), must_contain="def longest_palindrome")
    if "def longest_palindrome" not in code:
        return CheckResult(False, "no longest_palindrome function in the answer")
    return check_by_running(code, HARNESS, TIMEOUT_S, "all tests pass")


def build() -> TaskInstance:
    return TaskInstance(name="palindrome", messages=[{"role": "user", "content": PROMPT}], check=check, max_tokens=1024)
