"""`sudu bench capacity`: the highest load (closed-loop concurrency, or open-loop request rate) at which p99
TTFT and p99 ITL meet their targets, found by a search with confirmation runs, and the goodput there.

Search: the load doubles from `start` until a level misses a target (or `max` is reached), then the
interval between the last level that met both and the first that missed is bisected until it is within
`tolerance` (one step for concurrency). The best level is then run `confirm` more times; a confirmation
that misses lowers the answer (to the middle of the gap down to the next lower level that passed, or to
that level when nothing lies between, or one step when none passed) and confirms again.
Every level's figures are kept: they also give the Pareto curve of per-user output speed against total
throughput. A level passes when every request succeeded and its p99 TTFT and p99 ITL (pooled per-token
gaps) are within target; with n requests per level, p99 is close to the worst of them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from sudu.bench.metrics import throughput
from sudu.errors import SuduError

MODES = ("concurrency", "rate")


@dataclass
class CapacityOptions:
    mode: str = "concurrency"
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    start: float = 1
    max: float = 256
    tolerance: float = 0.05  # rate mode: relative width at which bisection stops
    confirm: int = 2
    max_steps_down: int = 4


def validate(opts: CapacityOptions) -> None:
    if opts.mode not in MODES:
        raise SuduError(f"unknown capacity mode {opts.mode!r}; use one of {', '.join(MODES)}")
    if opts.ttft_p99_s is None and opts.itl_p99_s is None:
        raise SuduError("give a target: --slo ttft=500ms,itl=50ms (p99 TTFT and/or p99 ITL)")
    for name, v in (("ttft", opts.ttft_p99_s), ("itl", opts.itl_p99_s)):
        if v is not None and (not math.isfinite(v) or v <= 0):
            raise SuduError(f"impossible SLO: {name} target must be > 0 (got {v:g} s)")
    if opts.start <= 0 or opts.max < opts.start:
        raise SuduError("--start must be > 0 and --max >= --start")
    if opts.mode == "concurrency" and (opts.start != int(opts.start) or opts.max != int(opts.max)):
        raise SuduError("concurrency levels are whole numbers: --start and --max must be integers")
    if opts.confirm < 0 or not 0 < opts.tolerance < 1:
        raise SuduError("--confirm must be >= 0 and --tolerance between 0 and 1")


def level_figures(records, opts: CapacityOptions) -> dict:
    """p99 TTFT, p99 ITL, pass/fail and throughput figures of one level's records."""
    ok = [r for r in records if r.ok]
    ttft = [r.metrics["ttft_s"] for r in ok if r.metrics.get("ttft_s") is not None]
    itl = [g for r in ok for g in r.metrics.get("itl_s", [])]
    speed = [r.metrics["output_speed_tok_s"] for r in ok if r.metrics.get("output_speed_tok_s")]
    p99_ttft = float(np.percentile(ttft, 99)) if ttft else None
    p99_itl = float(np.percentile(itl, 99)) if itl else None
    failed = len(records) - len(ok)
    misses = []
    if failed:
        misses.append(f"{failed} of {len(records)} requests failed")
    if opts.ttft_p99_s is not None and (p99_ttft is None or p99_ttft > opts.ttft_p99_s):
        misses.append(f"p99 TTFT {_ms(p99_ttft)} > {_ms(opts.ttft_p99_s)}")
    if opts.itl_p99_s is not None and (p99_itl is None or p99_itl > opts.itl_p99_s):
        misses.append(f"p99 ITL {_ms(p99_itl)} > {_ms(opts.itl_p99_s)}")
    thr = throughput(records)
    window = thr.get("window_s") or 0.0
    good = sum(1 for r in ok if _request_meets(r, opts))
    return {"n": len(records), "ok": len(ok), "p99_ttft_s": p99_ttft, "p99_itl_s": p99_itl, "passed": not misses,
            "misses": misses, "total_tok_s": thr.get("mean_tok_s"), "requests_per_s": thr.get("requests_per_s"),
            "per_user_tok_s": float(np.median(speed)) if speed else None,
            "goodput_req_s": good / window if window else None, "good_fraction": good / len(records) if records else None}


def _request_meets(rec, opts: CapacityOptions) -> bool:
    """Goodput counts a request whose own TTFT and own p99 ITL are within the targets."""
    m = rec.metrics
    if opts.ttft_p99_s is not None and (m.get("ttft_s") is None or m["ttft_s"] > opts.ttft_p99_s):
        return False
    gaps = m.get("itl_s") or []
    return opts.itl_p99_s is None or not gaps or float(np.percentile(gaps, 99)) <= opts.itl_p99_s


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{1e3 * v:.1f} ms"


def _ms_cell(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def _step_down(x: float, mode: str) -> float:
    return x - 1 if mode == "concurrency" else x * 0.9


def _mid(lo: float, hi: float, mode: str) -> float:
    return (lo + hi) // 2 if mode == "concurrency" else math.sqrt(lo * hi)


def _narrow(lo: float, hi: float, opts: CapacityOptions) -> bool:
    return hi - lo <= 1 if opts.mode == "concurrency" else hi / lo - 1 <= opts.tolerance


async def search(run_level: Callable[[float, str], Awaitable[list]], opts: CapacityOptions) -> dict:
    """`run_level(load, label)` runs one level and returns its records. Returns every probe, the answer
    (None: even `start` misses), and its confirmation runs."""
    probes: list[dict] = []

    async def probe(x: float, phase: str) -> dict:
        label = f"{opts.mode}={x:g} {phase}"
        fig = {"load": x, "phase": phase, "group": label, **level_figures(await run_level(x, label), opts)}
        probes.append(fig)
        return fig

    lo, hi, x = None, None, opts.start
    while True:
        if (await probe(x, "search"))["passed"]:
            lo = x
            if x >= opts.max:
                break
            x = min(opts.max, x * 2)
        else:
            hi = x
            break
    if lo is not None and hi is not None:
        while not _narrow(lo, hi, opts):
            mid = _mid(lo, hi, opts.mode)
            if mid <= lo or mid >= hi:
                break
            if (await probe(mid, "search"))["passed"]:
                lo = mid
            else:
                hi = mid
    answer, confirmations = lo, []
    steps = 0
    while answer is not None and opts.confirm:
        runs = [await probe(answer, f"confirm {k + 1}") for k in range(opts.confirm)]
        confirmations = runs
        if all(r["passed"] for r in runs):
            break
        steps += 1
        passing_below = [p["load"] for p in probes if p["passed"] and p["load"] < answer and p["phase"] == "search"]
        lower = max(passing_below) if passing_below else _step_down(answer, opts.mode)
        between = _mid(lower, answer, opts.mode)
        if lower < between < answer and not _narrow(lower, answer, opts):
            lower = between  # untried levels between the last pass and the failed answer: the closest first
        answer = lower if lower >= opts.start and steps <= opts.max_steps_down else None
    at = [p for p in probes if answer is not None and p["load"] == answer]
    result = {"mode": opts.mode, "targets": {"ttft_p99_s": opts.ttft_p99_s, "itl_p99_s": opts.itl_p99_s},
              "answer": answer, "first_miss": hi, "reached_max": hi is None and lo is not None,
              "confirmations": confirmations, "probes": probes}
    if at:
        result["goodput_req_s"] = float(np.mean([p["goodput_req_s"] or 0.0 for p in at]))
        result["total_tok_s"] = float(np.mean([p["total_tok_s"] or 0.0 for p in at]))
        result["per_user_tok_s"] = float(np.median([p["per_user_tok_s"] or 0.0 for p in at]))
    return result


def pareto(probes: list[dict]) -> list[dict]:
    """Levels not beaten on both per-user speed and total throughput by another level, by total tok/s."""
    pts = [p for p in probes if p.get("total_tok_s") and p.get("per_user_tok_s")]
    front = [p for p in pts if not any(q["total_tok_s"] >= p["total_tok_s"] and q["per_user_tok_s"] >= p["per_user_tok_s"]
                                       and (q["total_tok_s"], q["per_user_tok_s"]) != (p["total_tok_s"], p["per_user_tok_s"])
                                       for q in pts)]
    return sorted(front, key=lambda p: p["total_tok_s"])


def markdown(c: dict) -> str:
    unit = "concurrency" if c["mode"] == "concurrency" else "req/s"
    t = c["targets"]
    head = f"Targets: p99 TTFT {_ms(t['ttft_p99_s'])}, p99 ITL {_ms(t['itl_p99_s'])}."
    if c["answer"] is None:
        failed = [p for p in c["probes"] if not p["passed"]]
        passed = [p["load"] for p in c["probes"] if p["passed"] and p["phase"] == "search"]
        why = "; ".join(failed[-1]["misses"]) if failed else "no level ran"
        ans = (f"No level meets the targets reliably: {max(passed):g} met them in the search but missed a "
               f"confirmation run ({why})." if passed else f"No level met the targets, not even the lowest ({why}).")
    else:
        conf = ", ".join("passed" if r["passed"] else "missed (" + "; ".join(r["misses"]) + ")" for r in c["confirmations"])
        ans = (f"Capacity: {c['answer']:g} {unit}" + (" (the search's maximum: the knee is higher)" if c["reached_max"] else "")
               + f"; goodput there {c.get('goodput_req_s', 0):.2f} req/s, {c.get('total_tok_s', 0):.1f} output tok/s in "
               f"total, {c.get('per_user_tok_s', 0):.1f} tok/s per user. Confirmation runs: {conf or 'none asked'}.")
    rows = ["| load | phase | n ok/n | p99 TTFT ms | p99 ITL ms | total tok/s | per-user tok/s | goodput req/s | verdict |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in c["probes"]:
        rows.append(f"| {p['load']:g} | {p['phase']} | {p['ok']}/{p['n']} | {_ms_cell(p['p99_ttft_s'])} | "
                    f"{_ms_cell(p['p99_itl_s'])} | {p['total_tok_s'] or 0:.1f} | {p['per_user_tok_s'] or 0:.1f} | "
                    f"{p['goodput_req_s'] or 0:.2f} | {'meets' if p['passed'] else 'misses: ' + '; '.join(p['misses'])} |")
    return "\n\n".join([head, ans, "\n".join(rows)])
