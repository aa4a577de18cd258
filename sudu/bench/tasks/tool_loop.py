"""Tool loop: the model says which city an order ships to by calling a lookup tool, `get_order`, that
sudu bench executes locally over a seeded in-memory table (no network), reading the result and
answering. The requests carry only standard OpenAI fields (`tools`, `tool_choice`,
`parallel_tool_calls`, tool calls in the answer, `role: "tool"` results), so any OpenAI-compatible
server can be measured.

Two ways to run the loop (`--tool-choice`):
- `forced` (default): an attempt's first call carries the tool with `tool_choice: "required"` and
  `parallel_tool_calls: false`, so the model must call it (choosing the arguments itself); the call
  after the tool result carries no tools, so the model answers from the result. Small models (the
  default qwen2.5-coder-0.5b-instruct) solve it this way; offered the tool again, they call it again.
- `auto`: the tool on every call, `tool_choice` left to its default ("auto"): the model decides when
  to call and when to answer, up to MAX_TOOL_ROUNDS tool results per attempt.

The answer passes only if it names the right city and no other city of the list, and that city came
back from a `get_order` call in this run: the table is drawn from the seed, so the city cannot be
known without the tool."""
from __future__ import annotations

import json
import re

import numpy as np

from sudu.bench.tasks import CheckResult, TaskInstance, strip_reasoning

CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Dublin", "Quito", "Tunis", "Perth", "Zagreb", "Riga",
          "Accra", "Bogota", "Osaka", "Porto", "Krakow", "Denver", "Leeds", "Manila", "Tbilisi")
ITEMS = ("kettle", "desk lamp", "backpack", "keyboard", "tent", "teapot", "bicycle bell", "notebook")
NUM_ORDERS = 8
MAX_TOOL_ROUNDS = 4  # tool results sent back per attempt (auto); the task needs one
TOOL_CHOICES = ("forced", "auto")

SYSTEM = "You are an order-tracking assistant. Order records are only available through the tools; never guess them."
TOOLS = [
    {"type": "function", "function": {
        "name": "get_order",
        "description": "Look up an order by its number. Returns the item and the city the order ships to.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "integer", "description": "the order number"}},
                       "required": ["order_id"]}}},
]


class Lookup:
    """The seeded orders table and the tool over it; `calls` logs every execution (name, arguments, result)."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed + 4242)
        order_ids = [int(n) for n in rng.choice(np.arange(1000, 10000), size=NUM_ORDERS, replace=False)]
        cities = rng.choice(CITIES, size=NUM_ORDERS, replace=False)
        self.orders = {oid: {"order_id": oid, "item": str(rng.choice(ITEMS)), "ship_to_city": str(city)}
                       for oid, city in zip(order_ids, cities)}
        self.asked = order_ids[int(rng.integers(NUM_ORDERS))]
        self.calls: list[tuple[str, dict | None, dict]] = []

    @property
    def expected_city(self) -> str:
        return self.orders[self.asked]["ship_to_city"]

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
        else:
            result = {"error": f"unknown tool {name!r}; tools: get_order"}
        self.calls.append((name, args if isinstance(args, dict) else None, result))
        return json.dumps(result)

    def check(self, answer: str) -> CheckResult:
        """The verdict goes back to the model on a retry, so a failing one never names the expected city
        (the report has it in the run's `info`)."""
        text = strip_reasoning(answer)
        named = [c for c in CITIES if re.search(rf"\b{c}\b", text, re.IGNORECASE)]
        if self.expected_city not in named:
            return CheckResult(False, f"the answer does not name the city order {self.asked} ships to "
                               f"(it names {', '.join(named) or 'no city'})")
        if len(named) > 1:
            return CheckResult(False, f"the answer names several cities ({len(named)}); give only one")
        if not any(name == "get_order" and result.get("ship_to_city") == self.expected_city
                   for name, _, result in self.calls):
            return CheckResult(False, f"a city named without looking up order {self.asked}")
        return CheckResult(True, f"{self.expected_city}, after {len(self.calls)} tool calls")


def request_fields(tool_choice: str, rounds: int) -> dict:
    """The tool fields of a call, by `--tool-choice` and the tool results sent back so far in the attempt."""
    if tool_choice == "auto":
        return {"tools": TOOLS}
    return {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False} if rounds == 0 else {}


def build(seed: int = 0, tool_choice: str = "forced") -> TaskInstance:
    lookup = Lookup(seed)
    user = f"Which city will order {lookup.asked} be shipped to? Call get_order to look it up, then answer with the city name only."
    return TaskInstance(name="tool_loop", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                        check=lookup.check, max_tokens=128, run_tool=lookup.run,
                        tool_fields=lambda rounds: request_fields(tool_choice, rounds),
                        max_tool_rounds=MAX_TOOL_ROUNDS if tool_choice == "auto" else 1,
                        info={"order_id": lookup.asked, "city": lookup.expected_city, "tool_choice": tool_choice})
