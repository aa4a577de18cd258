"""Tool loop: the model answers a question about an order by calling two lookup tools that sudu bench
executes locally over a seeded in-memory table (no network): `get_order` gives the order's customer,
`get_customer` the customer's city. The request carries only standard OpenAI fields (`tools`, tool
calls in the answer, `role: "tool"` results), so any OpenAI-compatible server can be measured.

The answer passes only if it names the right city and no other city of the table, and the city was
looked up in this run (a `get_customer` call for the order's customer): the tables are drawn from the
seed, so the city cannot be known without the tools."""
from __future__ import annotations

import json
import re

import numpy as np

from sudu.bench.tasks import CheckResult, TaskInstance, strip_reasoning

CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Dublin", "Quito", "Tunis", "Perth", "Zagreb", "Riga",
          "Accra", "Bogota", "Osaka", "Porto", "Krakow", "Denver", "Leeds", "Manila", "Tbilisi")
NAMES = ("Ada", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jo")
ITEMS = ("kettle", "desk lamp", "backpack", "keyboard", "tent", "teapot", "bicycle bell", "notebook")
NUM_ORDERS = 8
NUM_CUSTOMERS = 6
MAX_TOOL_ROUNDS = 4  # model calls answered with tool results per attempt; the task needs 2

TOOLS = [
    {"type": "function", "function": {
        "name": "get_order",
        "description": "Look up an order by its number. Returns the order's item and the id of the customer who placed it.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "integer", "description": "the order number"}},
                       "required": ["order_id"]}}},
    {"type": "function", "function": {
        "name": "get_customer",
        "description": "Look up a customer by id. Returns the customer's name and the city they live in.",
        "parameters": {"type": "object", "properties": {"customer_id": {"type": "string", "description": "e.g. C-101"}},
                       "required": ["customer_id"]}}},
]


class Lookup:
    """The seeded tables and the tools over them; `calls` logs every execution (name, arguments, result)."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed + 4242)
        cities = rng.choice(CITIES, size=NUM_CUSTOMERS, replace=False)
        names = rng.choice(NAMES, size=NUM_CUSTOMERS, replace=False)
        ids = [f"C-{n}" for n in rng.choice(np.arange(100, 1000), size=NUM_CUSTOMERS, replace=False)]
        self.customers = {cid: {"customer_id": cid, "name": str(n), "city": str(c)} for cid, n, c in zip(ids, names, cities)}
        order_ids = [int(n) for n in rng.choice(np.arange(1000, 10000), size=NUM_ORDERS, replace=False)]
        self.orders = {oid: {"order_id": oid, "item": str(rng.choice(ITEMS)), "customer_id": ids[int(rng.integers(NUM_CUSTOMERS))]}
                       for oid in order_ids}
        self.asked = order_ids[int(rng.integers(NUM_ORDERS))]
        self.calls: list[tuple[str, dict | None, dict]] = []

    @property
    def expected_customer(self) -> str:
        return self.orders[self.asked]["customer_id"]

    @property
    def expected_city(self) -> str:
        return self.customers[self.expected_customer]["city"]

    def run(self, name: str, arguments: str) -> str:
        """Execute one tool call; a bad call gets an error result the model can read, never an exception."""
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            result = {"error": f"arguments must be a JSON object, got {arguments[:80]!r}"}
        elif name == "get_order":
            oid = args.get("order_id")
            oid = int(oid) if isinstance(oid, (int, str)) and str(oid).strip().isdigit() else None
            result = self.orders.get(oid) or {"error": f"no order {args.get('order_id')!r}"}
        elif name == "get_customer":
            cid = str(args.get("customer_id", "")).strip()
            result = self.customers.get(cid) or {"error": f"no customer {cid!r}"}
        else:
            result = {"error": f"unknown tool {name!r}; tools: get_order, get_customer"}
        self.calls.append((name, args if isinstance(args, dict) else None, result))
        return json.dumps(result)

    def check(self, answer: str) -> CheckResult:
        text = strip_reasoning(answer)
        named = [c for c in CITIES if re.search(rf"\b{c}\b", text, re.IGNORECASE)]
        if self.expected_city not in named:
            return CheckResult(False, f"expected the city {self.expected_city}, the answer names {', '.join(named) or 'none'}")
        if len(named) > 1:
            return CheckResult(False, f"expected only {self.expected_city}, the answer names {', '.join(named)}")
        looked_up = any(name == "get_customer" and result.get("city") == self.expected_city
                        for name, _, result in self.calls)
        if not looked_up:
            return CheckResult(False, f"{self.expected_city} named without looking up customer {self.expected_customer}")
        return CheckResult(True, f"{self.expected_city}, after {len(self.calls)} tool calls")


def build(seed: int = 0) -> TaskInstance:
    lookup = Lookup(seed)
    user = (f"Which city will order {lookup.asked} be shipped to? Use the tools: look up the order to find its "
            "customer, then look up that customer to find their city. Answer with the city name only.")
    return TaskInstance(name="tool_loop", messages=[{"role": "user", "content": user}], check=lookup.check,
                        max_tokens=256, tools=TOOLS, run_tool=lookup.run, max_tool_rounds=MAX_TOOL_ROUNDS,
                        info={"order_id": lookup.asked, "customer_id": lookup.expected_customer,
                              "city": lookup.expected_city})
