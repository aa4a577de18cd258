"""Every task checker accepts a correct answer and rejects several wrong ones."""
import re
import time


from sudu.bench.tasks import build_task, extract_code, task_names
from tests.helpers.code_answers import GOOD_ASYNC, GOOD_PALINDROME, GOOD_SQL, GOOD_SVG, needs_sandbox

WRONG_PALINDROMES = [
    "I cannot do that.",
    "```python\ndef longest_palindrome(s):\n    return s[:1]\n```",
    # ties resolved to the last occurrence
    "```python\ndef longest_palindrome(s):\n    best = ''\n    for i in range(len(s)):\n        for j in range(i, len(s)):\n"
    "            t = s[i:j+1]\n            if t == t[::-1] and len(t) >= len(best):\n                best = t\n    return best\n```",
    "```python\ndef longest_palindrome(s)\n    return s\n```",  # syntax error
    "```python\ndef longest_palindrome(s):\n    while True:\n        pass\n```",  # infinite loop
]

WRONG_SQL = [
    "```sql\nSELECT c.country, SUM(o.amount) AS total FROM orders o JOIN customers c ON c.id = o.customer_id "
    "GROUP BY c.country HAVING total > 100 ORDER BY total DESC\n```",  # no year filter
    "```sql\nSELECT c.country, SUM(o.amount) AS total FROM orders o JOIN customers c ON c.id = o.customer_id "
    "WHERE o.created_at LIKE '2024%' GROUP BY c.country HAVING total > 100 ORDER BY total ASC\n```",  # order
    "```sql\nSELECT c.country, SUM(o.amount) AS total FROM orders o JOIN customers c ON c.id = o.customer_id "
    "WHERE o.created_at LIKE '2024%' GROUP BY c.country ORDER BY total DESC\n```",  # no HAVING
    "```sql\nSELEC country FROM customers\n```",
    "```sql\nSELECT 1; DROP TABLE orders\n```",
    "```sql\nWITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r\n```",
]

WRONG_SVG = [
    GOOD_SVG.replace("</svg>", ""),  # not well-formed
    GOOD_SVG.replace('r="50"', 'r="40"'),
    GOOD_SVG.replace("fill: red", "fill: green"),
    GOOD_SVG.replace('fill="blue"', 'fill="black"'),
    GOOD_SVG.replace(">sudu<", ">hello<"),
    GOOD_SVG.replace('width="200" height="200"', 'width="100" height="100"'),
    "Sorry, I can only describe it: a red circle.",
]

WRONG_ASYNC = [
    # sequential awaits: right answer, too slow
    "```python\nimport asyncio\nasync def fetch(i):\n    await asyncio.sleep(0.2)\n    return i * i\n"
    "async def main():\n    return [await fetch(i) for i in range(10)]\n```",
    # still blocking
    "```python\nimport asyncio, time\nasync def fetch(i):\n    time.sleep(0.2)\n    return i * i\n"
    "async def main():\n    return await asyncio.gather(*(fetch(i) for i in range(10)))\n```",
    # wrong result
    "```python\nimport asyncio\nasync def fetch(i):\n    await asyncio.sleep(0.2)\n    return i\n"
    "async def main():\n    return await asyncio.gather(*(fetch(i) for i in range(10)))\n```",
    # main not async
    "```python\nimport asyncio\nasync def fetch(i):\n    await asyncio.sleep(0.2)\n    return i * i\n"
    "def main():\n    return [i * i for i in range(10)]\n```",
]


def _check(name, answer):
    return build_task(name, context_len=2048).check(answer)


def test_extract_code_prefers_language_and_strips_reasoning():
    text = "<think>```python\nbad()\n```</think>Text\n```bash\nls\n```\n```python\ndef f():\n    return 1\n```"
    assert extract_code(text, ("python",)) == "def f():\n    return 1"
    assert extract_code("no fences here", ("python",)) == "no fences here"
    assert extract_code("```python\ndef g(): pass", ("python",)) == "def g(): pass"  # cut off at max_tokens


@needs_sandbox
def test_palindrome_checker():
    assert _check("palindrome", GOOD_PALINDROME).passed
    for wrong in WRONG_PALINDROMES:
        assert not _check("palindrome", wrong).passed, wrong


@needs_sandbox
def test_python_checker_survives_infinite_loop(monkeypatch):
    from sudu.bench.tasks import palindrome

    monkeypatch.setattr(palindrome, "TIMEOUT_S", 1.0)
    t0 = time.perf_counter()
    res = palindrome.check(WRONG_PALINDROMES[-1])
    assert not res.passed and "timed out" in res.detail
    assert time.perf_counter() - t0 < 10


def test_sql_checker():
    assert _check("sql", GOOD_SQL).passed
    assert _check("sql", "SELECT c.country, SUM(o.amount) total FROM customers c JOIN orders o ON o.customer_id=c.id "
                  "WHERE o.created_at BETWEEN '2024-01-01' AND '2024-12-31' GROUP BY 1 HAVING SUM(o.amount)>100 "
                  "ORDER BY 2 DESC").passed
    for wrong in WRONG_SQL:
        assert not _check("sql", wrong).passed, wrong


def test_svg_checker():
    assert _check("svg", GOOD_SVG).passed
    assert _check("svg", GOOD_SVG.replace('width="200" height="200"', 'viewBox="0 0 200 200"')).passed
    for wrong in WRONG_SVG:
        assert not _check("svg", wrong).passed, wrong


@needs_sandbox
def test_async_refactor_checker():
    assert _check("async_refactor", GOOD_ASYNC).passed
    for wrong in WRONG_ASYNC:
        assert not _check("async_refactor", wrong).passed, wrong


def test_retrieval_checker_and_length_scaling():
    small = build_task("retrieval", context_len=2048, seed=3)
    big = build_task("retrieval", context_len=16384, seed=3)
    assert len(big.messages[0]["content"]) > 6 * len(small.messages[0]["content"])
    code = re.search(r"north vault is (\d+)", small.messages[0]["content"]).group(1)
    assert small.check(code).passed
    assert small.check(f"The access code is {code}.").passed
    wrong_code = str(int(code) + 1)
    for wrong in [wrong_code, "I don't know.", f"Either {code} or {wrong_code}", f"{code[:3]}"]:
        assert not small.check(wrong).passed, wrong


def test_all_tasks_build():
    for name in task_names():
        t = build_task(name, context_len=4096)
        assert t.messages and t.max_tokens > 0
