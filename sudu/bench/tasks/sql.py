"""SQL task: a query written for a small sqlite3 fixture (customers, orders), executed on a fresh copy
(one statement only, a step budget against runaway queries) and compared row by row with the
reference result."""
from __future__ import annotations

import re
import sqlite3

from sudu.bench.tasks import CheckResult, TaskInstance, extract_code

SCHEMA = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     amount REAL NOT NULL, created_at TEXT NOT NULL);
"""

CUSTOMERS = [
    (1, "Ada", "UK"), (2, "Bo", "SE"), (3, "Chen", "CN"), (4, "Dara", "IE"), (5, "Eli", "UK"),
    (6, "Femi", "NG"), (7, "Gus", "SE"), (8, "Hana", "JP"), (9, "Ivo", "CN"), (10, "Jo", "IE"),
]
ORDERS = [
    (1, 1, 80.0, "2024-01-05"), (2, 1, 45.5, "2024-03-10"), (3, 2, 20.0, "2024-02-01"), (4, 3, 150.0, "2023-12-30"),
    (5, 3, 60.0, "2024-06-15"), (6, 4, 200.0, "2024-07-01"), (7, 5, 10.0, "2024-08-20"), (8, 6, 99.0, "2024-09-09"),
    (9, 7, 60.0, "2024-10-10"), (10, 8, 300.0, "2025-01-02"), (11, 9, 70.0, "2024-11-11"), (12, 10, 5.0, "2024-12-31"),
    (13, 2, 15.0, "2023-05-05"), (14, 6, 2.0, "2024-01-01"), (15, 8, 95.0, "2024-04-04"),
]

REFERENCE_SQL = """
SELECT c.country, SUM(o.amount) AS total
FROM orders o JOIN customers c ON c.id = o.customer_id
WHERE o.created_at >= '2024-01-01' AND o.created_at < '2025-01-01'
GROUP BY c.country HAVING SUM(o.amount) > 100 ORDER BY total DESC
"""

PROMPT = (
    "An SQLite database has these tables:\n" + SCHEMA.strip() + "\n"
    "(created_at is an ISO date string, e.g. '2024-03-10'.)\n\n"
    "Write one SQL query that returns, for each customer country, the total amount of the orders placed in "
    "the year 2024, keeping only countries whose 2024 total is greater than 100, ordered by that total "
    "from largest to smallest. Return exactly two columns: country, total. "
    "Reply with the query in one ```sql code block."
)

MAX_VM_STEPS = 5_000_000


def fixture() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?)", CUSTOMERS)
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", ORDERS)
    conn.commit()
    return conn


_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def _read_only(action: int, *_) -> int:
    """The answer runs in the bench's own process: reads of the fixture only (no ATTACH, no PRAGMA, no
    writes), whatever one statement it holds."""
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def _rows(conn: sqlite3.Connection, query: str) -> list[tuple]:
    steps = [0]

    def budget() -> int:
        steps[0] += 1
        return 1 if steps[0] * 1000 > MAX_VM_STEPS else 0

    conn.set_progress_handler(budget, 1000)
    conn.set_authorizer(_read_only)
    return [tuple(round(v, 6) if isinstance(v, float) else v for v in row) for row in conn.execute(query).fetchall()]


EXPECTED = _rows(fixture(), REFERENCE_SQL)


def check(answer: str) -> CheckResult:
    query = extract_code(answer, ("sql", "sqlite")).strip().rstrip(";").strip()
    if not re.match(r"(?is)^\s*(select|with)\b", query):
        return CheckResult(False, "the answer holds no SELECT query")
    conn = fixture()
    try:
        got = _rows(conn, query)
    except sqlite3.Error as exc:
        return CheckResult(False, f"sqlite error: {exc}")
    finally:
        conn.close()
    if got != EXPECTED:
        return CheckResult(False, f"rows {got[:6]} differ from the expected {EXPECTED}")
    return CheckResult(True, f"{len(got)} rows match")


def build() -> TaskInstance:
    return TaskInstance(name="sql", messages=[{"role": "user", "content": PROMPT}], check=check, max_tokens=512)
