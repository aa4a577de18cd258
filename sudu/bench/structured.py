"""The `structured` suite: N chat requests with `response_format: {"type": "json_schema", ...}` over a set
of schemas (nested objects, enums, arrays with bounds, numbers with bounds, patterns, required fields,
no extra properties), every answer parsed and validated against its schema with `jsonschema`.

It is a suite of its own, not a task: a task is timed to a passing answer and retried on failure, while
here every answer counts once and the figure is the share of valid answers (a server that enforces the
schema gives 100%), next to the usual latency and throughput of the requests (one group, `structured`).
The schemas and prompts are fixed; requests cycle through schema x prompt, cold (salted), greedy unless
`--temperature` is given (then each request carries `seed` = --seed + its index)."""
from __future__ import annotations

import json
from typing import Callable

from sudu.errors import SuduError

_NAME = {"type": "string", "minLength": 1, "maxLength": 40}
_DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]


def _obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SCHEMAS: dict[str, dict] = {
    "person": _obj({
        "name": _NAME,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["Python", "Rust", "Go", "C++", "Java", "TypeScript"]},
                      "minItems": 1, "maxItems": 3},
        "remote": {"type": "boolean"},
    }),
    "order": _obj({
        "order_id": {"type": "integer", "minimum": 1000, "maximum": 9999},
        "customer": _obj({"name": _NAME, "country": {"enum": ["UK", "SE", "CN", "IE", "NG", "JP", "US"]}}),
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
            "unit_price": {"type": "number", "minimum": 0.01, "maximum": 1000},
        })},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
    }),
    "weather": _obj({
        "city": _NAME,
        "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "fog", "storm"]},
        "forecast": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
            "day": {"enum": _DAYS},
            "high_c": {"type": "number", "minimum": -60, "maximum": 60},
            "low_c": {"type": "number", "minimum": -60, "maximum": 60},
        })},
    }),
    "event": _obj({
        "title": {"type": "string", "minLength": 1, "maxLength": 60},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
        "location": _obj({"venue": _NAME, "lat": {"type": "number", "minimum": -90, "maximum": 90},
                          "lon": {"type": "number", "minimum": -180, "maximum": 180}}),
        "attendees": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 4},
        "online": {"type": "boolean"},
    }),
    "review": _obj({
        "product": _NAME,
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "pros": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
        "cons": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
    }),
    "service_config": _obj({
        "service": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,30}$"},
        "replicas": {"type": "integer", "minimum": 1, "maximum": 10},
        "environment": {"enum": ["dev", "staging", "prod"]},
        "ports": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 65535},
                  "minItems": 1, "maxItems": 4},
        "resources": _obj({"cpu_cores": {"type": "number", "minimum": 0.1, "maximum": 64},
                           "memory_mb": {"type": "integer", "minimum": 128, "maximum": 65536}}),
    }),
}

PROMPTS: dict[str, list[str]] = {
    "person": ["Describe a fictional backend developer from Brazil as JSON.",
               "Give me a JSON profile of a retired engineer who still writes code for fun.",
               "Create a JSON record for a student who is learning systems programming."],
    "order": ["Invent a customer order for two kitchen items, as JSON.",
              "Give a JSON example of an order from Japan that has already shipped.",
              "Write a JSON order that was cancelled, with one item."],
    "weather": ["Report today's weather in Oslo as JSON, with a short forecast.",
                "Give a JSON weather report for a rainy day in Lima.",
                "Describe the weather in a desert city as JSON, with a three-day forecast."],
    "event": ["Create a JSON entry for a small Python meetup in Dublin next spring.",
              "Describe an online book club meeting as JSON.",
              "Give a JSON record for a team offsite in the mountains."],
    "review": ["Write a JSON review of a cheap pair of headphones.",
               "Give a JSON review of a mechanical keyboard the writer loves.",
               "Review a slow, unreliable laptop as JSON."],
    "service_config": ["Write a JSON deployment config for a small web API in production.",
                       "Give a JSON config for a staging worker service that processes images.",
                       "Create a JSON config for a dev database proxy."],
}


def schema_names() -> tuple[str, ...]:
    return tuple(SCHEMAS)


def load_validator_class():
    """jsonschema's validator class factory; a clear error when the package is missing (it is a test
    dependency of sudu, not a runtime one: it pulls in compiled rpds-py)."""
    try:
        from jsonschema.validators import validator_for
    except ImportError:
        raise SuduError("the structured suite validates answers with jsonschema, which is not installed: "
                        "pip install jsonschema") from None
    return validator_for


def make_validators(names: list[str]) -> dict[str, Callable[[object], str | None]]:
    """Per schema: a function returning None for a valid instance, else the most relevant error."""
    from jsonschema.exceptions import best_match

    validator_for = load_validator_class()
    out = {}
    for name in names:
        cls = validator_for(SCHEMAS[name])
        cls.check_schema(SCHEMAS[name])
        validator = cls(SCHEMAS[name])

        def check(instance, validator=validator) -> str | None:
            error = best_match(validator.iter_errors(instance))
            if error is None:
                return None
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return f"{where}: {error.message}"[:200]
        out[name] = check
    return out


def check_answer(text: str, validate: Callable[[object], str | None]) -> str | None:
    """None when `text` is one JSON value valid under the schema, else why not. Strict: no code fences or
    prose around the JSON (`response_format` asks for the JSON itself)."""
    from sudu.bench.tasks import strip_reasoning

    try:
        value = json.loads(strip_reasoning(text))
    except ValueError as exc:
        return f"not JSON: {exc}"[:200]
    return validate(value)


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def plan(names: list[str], n: int) -> list[tuple[str, str]]:
    """n (schema, prompt) pairs, cycling schemas first, then each schema's prompts."""
    out = []
    for i in range(n):
        name = names[i % len(names)]
        prompts = PROMPTS[name]
        out.append((name, prompts[(i // len(names)) % len(prompts)]))
    return out


def summarize(results: list[dict]) -> dict:
    """Validity overall and per schema: answers that parse and validate / requests sent (a failed request
    is not a valid answer), with the first error of each schema."""
    def block(rs: list[dict]) -> dict:
        valid = sum(r["valid"] for r in rs)
        errors = [r for r in rs if not r["valid"]]
        return {"n": len(rs), "valid": valid, "validity_rate": valid / len(rs) if rs else None,
                "truncated": sum(r["finish_reason"] == "length" for r in rs),
                "first_error": errors[0]["error"] if errors else None}

    by_schema = {name: block([r for r in results if r["schema"] == name])
                 for name in dict.fromkeys(r["schema"] for r in results)}
    return {**block(results), "schemas": by_schema}


def markdown(summary: dict) -> str:
    lines = ["| schema | valid / n | validity | cut by max_tokens | first error |", "|---|---|---|---|---|"]
    rows = list(summary["schemas"].items()) + [("all", summary)]
    for name, s in rows:
        rate = "-" if s["validity_rate"] is None else f"{100 * s['validity_rate']:.1f}%"
        err = (s["first_error"] or "").replace("|", "\\|").replace("\n", " ")[:100]
        lines.append(f"| {name} | {s['valid']}/{s['n']} | {rate} | {s['truncated']} | {err} |")
    return "\n".join(lines)


async def run_structured(ctx, send: Callable, names: list[str], n: int, concurrency: int, max_tokens: int,
                         temperature: float, warmups: int, seed: int) -> None:
    """Send the planned requests (closed loop, `concurrency` in flight) and validate each answer into
    `ctx.run.structured` as it comes (an interrupted run keeps what was checked)."""
    from sudu.bench.suites import Group, closed_loop, warmup
    from sudu.bench.workloads import make_messages, prompt_set_id

    validators = make_validators(names)
    await warmup(ctx, warmups)
    work = plan(names, n)
    ctx.run.groups.append(Group("structured", "cold", {
        "schemas": names, "max_tokens": max_tokens, "temperature": temperature, "concurrency": concurrency,
        "prompt_set": prompt_set_id("structured", [f"{s}:{json.dumps(SCHEMAS[s], sort_keys=True)}:{p}" for s, p in work])}))
    queue = iter(enumerate(work))

    async def send_one() -> None:
        i, (name, prompt) = next(queue)
        extra = {"response_format": response_format(name), "temperature": temperature}
        if temperature > 0:
            extra["seed"] = seed + i
        rec = await send(ctx, "structured", "cold", make_messages("cold", prompt), max_tokens, extra=extra)
        error = check_answer(rec.text, validators[name]) if rec.ok else f"request failed: {rec.error}"
        ctx.run.structured.append({"request_id": rec.request_id, "schema": name, "valid": error is None, "error": error,
                        "finish_reason": rec.finish_reason})

    await closed_loop(n, concurrency, send_one)
