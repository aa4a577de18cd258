"""Cost accounting of a bench run under cache-aware token prices and/or a machine's hourly cost.

Token prices are per million tokens: input that missed the cache, input served from it, output
(`--price miss=0.14,hit=0.0028,out=0.28`, or a preset: a JSON file in sudu/bench/prices/ that says where
its figures come from and their date). Each request's tokens come from the endpoint's own usage fields
(prompt, cached as metrics.cached_tokens reads them, completion); a request without usage is not priced
and counted apart. The machine cost (`--machine-cost` per hour) is spread over the run's wall time.

Reported: total, per request, per session (a conversation, a replayed session) and per task run, each
with its mean's CI; the share the cache hits saved against the same tokens all priced as misses; tokens
(input + output, and output alone) per unit of cost."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources

from sudu.bench.metrics import cached_tokens, measured
from sudu.bench.stats import summarize
from sudu.errors import SuduError

PER_M = 1e6
_KEYS = {"miss": "input_miss_per_mtok", "input": "input_miss_per_mtok", "hit": "input_hit_per_mtok",
         "cached": "input_hit_per_mtok", "out": "output_per_mtok", "output": "output_per_mtok"}


@dataclass
class Prices:
    name: str
    input_miss_per_mtok: float
    input_hit_per_mtok: float
    output_per_mtok: float
    currency: str = "USD"
    source: str = "given on the command line"
    date: str | None = None
    notes: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("sudu.bench.prices").iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> Prices:
    if name not in preset_names():
        raise SuduError(f"unknown price preset {name!r}; presets: {', '.join(preset_names())}; "
                        "or give prices: --price miss=X,hit=Y,out=Z (per million tokens)")
    data = json.loads(resources.files("sudu.bench.prices").joinpath(f"{name}.json").read_text())
    return Prices(**{k: data[k] for k in Prices.__dataclass_fields__ if k in data})


def parse_price(text: str | None) -> Prices | None:
    """A preset name, or `miss=X,hit=Y,out=Z` per million tokens (hit defaults to miss: no discount)."""
    if not text:
        return None
    if "=" not in text:
        return load_preset(text.strip())
    values: dict[str, float] = {}
    for part in text.split(","):
        if "=" not in part:
            raise SuduError(f"bad --price entry {part!r}: expected miss=X,hit=Y,out=Z (per million tokens) or a preset")
        key, value = (x.strip().lower() for x in part.split("=", 1))
        if key not in _KEYS:
            raise SuduError(f"unknown --price key {key!r}: use miss, hit and out (per million tokens)")
        try:
            values[_KEYS[key]] = float(value)
        except ValueError:
            raise SuduError(f"bad --price value for {key}: {value!r}") from None
        if values[_KEYS[key]] < 0:
            raise SuduError(f"--price {key} must be >= 0")
    if "input_miss_per_mtok" not in values or "output_per_mtok" not in values:
        raise SuduError("--price needs at least miss=X and out=Z (per million tokens); hit=Y defaults to miss")
    values.setdefault("input_hit_per_mtok", values["input_miss_per_mtok"])
    return Prices(name="custom", **values)


def request_tokens(rec) -> dict | None:
    """(prompt, cached, output) tokens from the endpoint's usage; None when it sent none."""
    usage = rec.usage or {}
    prompt, out = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(out, int):
        return None
    cached = cached_tokens(rec.usage, rec.sudu) or 0
    return {"prompt": prompt, "cached": min(cached, prompt), "output": out}


def token_cost(tokens: dict, p: Prices) -> tuple[float, float]:
    """(cost, cost had every input token missed the cache)."""
    miss = tokens["prompt"] - tokens["cached"]
    out = tokens["output"] * p.output_per_mtok
    cost = (miss * p.input_miss_per_mtok + tokens["cached"] * p.input_hit_per_mtok + out) / PER_M
    return cost, (tokens["prompt"] * p.input_miss_per_mtok + out) / PER_M


def _per_unit(values: dict[str, float]) -> dict:
    return {"n": len(values), **summarize(list(values.values())).to_dict()} if values else {"n": 0}


def cost_summary(records, prices: Prices | None, machine_per_hour: float | None, window_s: float | None) -> dict | None:
    """The run's cost, or None when neither prices nor a machine cost were given."""
    if prices is None and machine_per_hour is None:
        return None
    recs = measured(records)
    priced = [(r, request_tokens(r)) for r in recs]
    unpriced = sum(1 for _, t in priced if t is None)
    priced = [(r, t) for r, t in priced if t is not None]
    tokens_in = sum(t["prompt"] for _, t in priced)
    tokens_cached = sum(t["cached"] for _, t in priced)
    tokens_out = sum(t["output"] for _, t in priced)
    out: dict = {"currency": prices.currency if prices else "USD", "prices": prices.to_dict() if prices else None,
                 "machine_per_hour": machine_per_hour, "requests_priced": len(priced), "requests_unpriced": unpriced,
                 "prompt_tokens": tokens_in, "cached_tokens": tokens_cached, "output_tokens": tokens_out,
                 "token_hit_rate": tokens_cached / tokens_in if tokens_in else None}
    if prices is not None and priced:
        costs = {r.request_id: token_cost(t, prices) for r, t in priced}
        total = sum(c for c, _ in costs.values())
        nocache = sum(n for _, n in costs.values())
        sessions: dict[str, float] = {}
        tasks: dict[str, float] = {}
        for r, _ in priced:
            c = costs[r.request_id][0]
            if r.session is not None:
                sessions[r.session] = sessions.get(r.session, 0.0) + c
                if r.task is not None:
                    tasks[r.session] = tasks.get(r.session, 0.0) + c
        out["tokens"] = {
            "total": total, "without_cache_hits": nocache,
            "saved_by_hits": nocache - total, "saved_share": (nocache - total) / nocache if nocache else None,
            "input_miss": sum((t["prompt"] - t["cached"]) for _, t in priced) * prices.input_miss_per_mtok / PER_M,
            "input_hit": tokens_cached * prices.input_hit_per_mtok / PER_M,
            "output": tokens_out * prices.output_per_mtok / PER_M,
            "per_request": summarize([c for c, _ in costs.values()]).to_dict(),
            "per_session": _per_unit({s: v for s, v in sessions.items() if s not in tasks}),
            "per_task": _per_unit(tasks),
            "tokens_per_unit": (tokens_in + tokens_out) / total if total else None,
            "output_tokens_per_unit": tokens_out / total if total else None,
        }
    if machine_per_hour is not None and window_s:
        total = machine_per_hour * window_s / 3600.0
        n = len(priced) or len(recs)
        out["machine"] = {"window_s": window_s, "total": total, "per_request": total / n if n else None,
                          "per_million_output_tokens": total / tokens_out * PER_M if tokens_out else None,
                          "output_tokens_per_unit": tokens_out / total if total else None}
    return out


def markdown(c: dict) -> str:
    cur = c["currency"]
    lines = []
    t = c.get("tokens")
    if t:
        p = c["prices"]
        lines.append(f"Prices ({p['name']}, {cur} per million tokens): input miss {p['input_miss_per_mtok']:g}, input hit "
                     f"{p['input_hit_per_mtok']:g}, output {p['output_per_mtok']:g}; source: {p['source']}"
                     + (f" ({p['date']})" if p.get("date") else ""))
        pr = t["per_request"]
        ci = "" if pr.get("ci_low") is None else f" (95% CI {pr['ci_low']:.6f}-{pr['ci_high']:.6f})"
        lines.append(f"Total {t['total']:.6f} {cur} for {c['requests_priced']} requests: input miss {t['input_miss']:.6f}, "
                     f"input hit {t['input_hit']:.6f}, output {t['output']:.6f}; per request mean {pr['mean']:.6f}{ci}.")
        for key, label in (("per_session", "session"), ("per_task", "task run")):
            u = t[key]
            if u["n"]:
                ci = "" if u.get("ci_low") is None else f" (95% CI {u['ci_low']:.6f}-{u['ci_high']:.6f})"
                lines.append(f"Per {label}: mean {u['mean']:.6f} {cur}{ci} over {u['n']}.")
        hit = c["token_hit_rate"]
        lines.append(f"Cache hits ({'n/a' if hit is None else f'{100 * hit:.1f}%'} of prompt tokens) saved "
                     f"{t['saved_by_hits']:.6f} {cur}, {100 * (t['saved_share'] or 0):.1f}% of the cost without them; "
                     f"{t['tokens_per_unit']:,.0f} tokens ({t['output_tokens_per_unit']:,.0f} output) per {cur}.")
    m = c.get("machine")
    if m:
        per_m = m["per_million_output_tokens"]
        lines.append(f"Machine at {c['machine_per_hour']:g} {cur}/h over {m['window_s']:.1f} s: {m['total']:.6f} {cur}, "
                     f"{m['per_request']:.6f} per request, "
                     f"{'n/a' if per_m is None else f'{per_m:.4f}'} per million output tokens.")
    if c["requests_unpriced"]:
        lines.append(f"{c['requests_unpriced']} requests had no usage and are not priced.")
    return "\n\n".join(lines)
