"""The figures and the report of `sudu bench sweep` (sweep.py measures): per request, prompt tok/s, TTFT and
decode tok/s at depth; per (endpoint, mode, depth) point, their mean with Student's t 95% interval over the
repetitions; the checks on every point (depth reached, cache state observed); the JSON report (schema
sudu-bench-sweep/1, every request record included), its Markdown table and one PNG chart of tok/s against
depth with every endpoint on it."""
from __future__ import annotations

import datetime as dt
import json
import os

from sudu.bench.metrics import COLD_CACHED_TOKENS_LIMIT
from sudu.bench.report import environment
from sudu.bench.stats import t_interval

SCHEMA = "sudu-bench-sweep/1"
# an agent turn's cached tokens >= this share of its warming request's prompt: a hit. A cache serves whole
# blocks of the shared prefix only (the warming request's own question and the last partial block are not
# shared), so a hit stays below 100%, and far below at small depths; a miss is near 0.
AGENT_HIT_SHARE = 0.5

DEFINITIONS = {
    "depth": "Prompt tokens of a cold request, or of the prefix an agent turn continues (k = 1000). Prompts are "
    "sized per endpoint from two calibration requests' usage; each request's real prompt tokens are recorded, and "
    "a point more than 5% off its depth is flagged.",
    "ttft_s": "Request sent -> first chunk carrying generated content (metrics.md).",
    "prompt_tok_s": "Prompt tokens the endpoint had to process (usage's prompt tokens minus its cached tokens) / "
    "TTFT. TTFT also holds the first decode step and the HTTP round trip, so this slightly understates the "
    "prefill speed alone; at depth they are a small share.",
    "decode_tok_s": "1 / TPOT: tokens after the first chunk / (last content chunk - first), with "
    "`decode_tokens` tokens asked for (ignore_eos unless --no-ignore-eos): the decode speed at that depth.",
    "agent": "A salted prefix of `depth` tokens sent once with a one-token answer (excluded, it warms the "
    "cache), then the turn: the same prefix plus `new_tokens` new tokens. Hit: usage's cached tokens >= 50% "
    "of the warming request's prompt tokens (the share itself is reported); 'not reported' when the endpoint does "
    "not say.",
    "statistics": "Per point: n repetitions, mean, median, min, max, and Student's t 95% interval of the mean "
    "(mean +- t(0.975, n-1) s / sqrt(n)); none below 2 repetitions. Repetitions are interleaved over the "
    "endpoints, never concurrent.",
}


def request_figures(rec) -> dict:
    """One request's sweep figures from its record (RequestRecord with metrics filled)."""
    m = rec.metrics
    prompt, cached, ttft = m.get("prompt_tokens"), m.get("cached_tokens"), m.get("ttft_s")
    new = None if prompt is None else prompt - (cached or 0)
    return {"ok": rec.ok, "prompt_tokens": prompt, "cached_tokens": cached, "new_tokens": new, "ttft_s": ttft,
            "prompt_tok_s": new / ttft if new and ttft else None, "decode_tok_s": m.get("output_speed_tok_s"),
            "output_tokens": m.get("output_tokens"), "warming_prompt_tokens": m.get("warming_prompt_tokens")}


def describe(values) -> dict:
    """n, mean, median, min, max and the t interval of the mean over one point's repetitions."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0}
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    low, high = t_interval(xs)
    return {"n": len(xs), "mean": sum(xs) / len(xs), "median": median, "min": xs[0], "max": xs[-1],
            "ci_low": low, "ci_high": high}


def agent_cache_state(fig: dict) -> str:
    cached, warm = fig["cached_tokens"], fig["warming_prompt_tokens"]
    if cached is None or warm is None:
        return "not reported"
    return "hit" if cached >= AGENT_HIT_SHARE * warm else "miss"


def point_checks(mode: str, depth: int, figs: list[dict]) -> list[str]:
    """Flags on one point: prompts off their depth, cached tokens that contradict the mode."""
    flags = []
    ok = [f for f in figs if f["ok"]]
    if len(ok) < len(figs):
        flags.append(f"{len(figs) - len(ok)} of {len(figs)} requests failed")
    reached = [f["prompt_tokens"] if mode == "cold" else f["warming_prompt_tokens"] for f in ok]
    off = [p for p in reached if p is not None and abs(p - depth) > 0.05 * depth]
    if off:
        flags.append(f"prompt tokens {off} more than 5% off depth {depth}")
    if mode == "cold":
        warm = [f["cached_tokens"] for f in ok if (f["cached_tokens"] or 0) > COLD_CACHED_TOKENS_LIMIT]
        if warm:
            flags.append(f"declared cold but {warm} tokens cached")
    else:
        misses = sum(1 for f in ok if agent_cache_state(f) == "miss")
        if misses:
            flags.append(f"{misses} of {len(ok)} agent turns missed the cache (cached < 50% of the warmed prompt)")
    return flags


FIGURES = ("prompt_tokens", "cached_tokens", "new_tokens", "ttft_s", "prompt_tok_s", "decode_tok_s", "output_tokens")


def points(entries: list[dict], labels: list[str], opts) -> list[dict]:
    out = []
    for label in labels:
        for mode in opts.modes:
            for depth in opts.depths:
                mine = [e for e in entries if e["endpoint"] == label and e["mode"] == mode and e["depth"] == depth]
                if not mine:
                    continue
                figs = [request_figures(e["record"]) for e in mine]
                ok = [f for f in figs if f["ok"]]
                point = {"endpoint": label, "mode": mode, "depth": depth, "n_requests": len(figs), "n_ok": len(ok),
                         "figures": {k: describe([f[k] for f in ok]) for k in FIGURES},
                         "flags": point_checks(mode, depth, figs)}
                if mode == "agent":
                    states = [agent_cache_state(f) for f in ok]
                    point["cache"] = {s: states.count(s) for s in sorted(set(states))}
                    point["figures"]["cached_share"] = describe(
                        [f["cached_tokens"] / f["warming_prompt_tokens"] for f in ok
                         if f["cached_tokens"] is not None and f["warming_prompt_tokens"]])
                out.append(point)
    return out


def build_report(targets, entries: list[dict], opts, config: dict, started: float, partial: bool) -> dict:
    labels = [t.endpoint.label for t in targets]
    return {
        "schema": SCHEMA,
        "suite": "sweep",
        "started_at": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(timespec="seconds"),
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "partial": partial,
        "environment": environment(),
        "config": config,
        "definitions": DEFINITIONS,
        "endpoints": [{"label": t.endpoint.label, "url": t.endpoint.url, "model": t.endpoint.model,
                       "context_len": t.context_len, "server_info": t.ctx.run.server_info,
                       "calibration": vars(t.calibration) if t.calibration else None,
                       "token_recount": t.ctx.run.token_recount, "notes": t.ctx.run.notes} for t in targets],
        "points": points(entries, labels, opts),
        "records": [{"endpoint": e["endpoint"], "mode": e["mode"], "depth": e["depth"], "rep": e["rep"],
                     **e["record"].to_dict()} for e in entries],
        "warmup_records": [{"endpoint": t.endpoint.label, **r.to_dict()} for t in targets
                           for r in t.ctx.run.records if r.warmup],
    }


def _cell(d: dict, fmt: str, scale: float = 1.0) -> str:
    if not d.get("n"):
        return "-"
    text = fmt.format(d["mean"] * scale)
    if d.get("ci_low") is not None:
        text += f" [{fmt.format(d['ci_low'] * scale)}, {fmt.format(d['ci_high'] * scale)}]"
    return text


def markdown(report: dict) -> str:
    lines = [f"# sudu bench sweep{' (partial: interrupted)' if report['partial'] else ''}", ""]
    for e in report["endpoints"]:
        lines.append(f"- **{e['label']}**: {e['model']} at {e['url']}"
                     + (f"; {e['calibration']['note']}" if e.get("calibration") else ""))
        lines += [f"  - {n}" for n in e["notes"]]
    lines += ["", "Mean [95% t interval] over the repetitions.", "",
              "| endpoint | mode | depth | prompt tok | cached | TTFT s | prompt tok/s | decode tok/s | n |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    flags = []
    for p in report["points"]:
        f = p["figures"]
        cached = _cell(f["cached_tokens"], "{:.0f}") if p["mode"] == "agent" else "-"
        if p["mode"] == "agent" and p.get("cache"):
            cached += " (" + ", ".join(f"{k} {v}" for k, v in p["cache"].items()) + ")"
        lines.append(f"| {p['endpoint']} | {p['mode']} | {p['depth']} | {_cell(f['prompt_tokens'], '{:.0f}')} | "
                     f"{cached} | {_cell(f['ttft_s'], '{:.2f}')} | {_cell(f['prompt_tok_s'], '{:.0f}')} | "
                     f"{_cell(f['decode_tok_s'], '{:.1f}')} | {p['n_ok']}/{p['n_requests']} |")
        flags += [f"{p['endpoint']} {p['mode']} depth={p['depth']}: {x}" for x in p["flags"]]
    if flags:
        lines += ["", "## Flags", ""] + [f"- {x}" for x in flags]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> str | None:
    """tok/s against depth, every endpoint on the same axes: cold prompt tok/s, decode tok/s at depth,
    and the agent turn's TTFT; error bars are the t intervals. Returns the path, or None with no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("cold", "prompt_tok_s", "prompt tok/s (cold)"), ("cold", "decode_tok_s", "decode tok/s at depth (cold)"),
              ("agent", "ttft_s", "agent turn TTFT (s)")]
    panels = [p for p in panels if any(q["mode"] == p[0] and q["figures"][p[1]].get("n") for q in report["points"])]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (mode, key, title) in zip(axes[0], panels):
        for e in report["endpoints"]:
            pts = [p for p in report["points"] if p["endpoint"] == e["label"] and p["mode"] == mode
                   and p["figures"][key].get("n")]
            if not pts:
                continue
            xs = [p["depth"] for p in pts]
            ys = [p["figures"][key]["mean"] for p in pts]
            err = [[y - (p["figures"][key]["ci_low"] if p["figures"][key]["ci_low"] is not None else y) for y, p in zip(ys, pts)],
                   [(p["figures"][key]["ci_high"] if p["figures"][key]["ci_high"] is not None else y) - y for y, p in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=e["label"])
        ax.set_title(title)
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(report: dict, out_dir: str) -> dict:
    """sweep-<time>.json, .md and .png in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "sweep-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    paths = {"json": base + ".json", "markdown": base + ".md"}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1, default=str)
    text = markdown(report)
    png = plot(report, base + ".png")
    if png:
        paths["plot"] = png
        text += f"\n![tok/s against depth]({os.path.basename(png)})\n"
    with open(paths["markdown"], "w") as f:
        f.write(text)
    return paths
