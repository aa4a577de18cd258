"""Reports of sudu bench: the versioned JSON (schema sudu-bench/1: every per-request record, the
environment, server info, definitions, per-group summaries, cost, replay and capacity results), the
Markdown summary printed at the end with matplotlib PNGs beside it (TTFT and ITL CDFs, throughput vs
concurrency, cold vs warm TTFT, a request timeline), and the self-contained interactive HTML page
(html_page.py)."""
from __future__ import annotations

import base64
import datetime as dt
import importlib.metadata
import io
import json
import os
import platform
import socket
import sys

from sudu.bench import capacity as capacity_mod
from sudu.bench import cost as cost_mod
from sudu.bench import html_page
from sudu.bench.multimodal import rows as multimodal_rows
from sudu.bench import metrics as M
from sudu.bench import replay as replay_mod
from sudu.bench.stats import TOO_FEW, summarize

PER_REQUEST = ("ttft_s", "ttft_reasoning_s", "ttft_answer_s", "tpot_s", "output_speed_tok_s", "e2e_s", "output_tokens", "cached_tokens",
               "acceptance_rate", "mean_accepted_len")
ATTRIBUTION = ("network_client_s", "queue_s", "prefill_s", "decode_s")
MAX_TIMELINE_REQUESTS = 400


def environment() -> dict:
    versions = {}
    for name in ("httpx", "numpy", "matplotlib", "torch"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        from sudu import __version__ as sudu_version
    except ImportError:
        sudu_version = "?"
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {
        "sudu": sudu_version,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": cpus,
        "hostname": socket.gethostname(),
        "packages": versions,
    }


def _iso(ts: float | None) -> str | None:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds") if ts else None


def group_summary(run, group, slo: dict) -> dict:
    recs = [r for r in run.records if r.group == group.name and not r.warmup]
    ok = [r for r in recs if r.ok]
    out = {
        "name": group.name,
        "cache_state": group.cache_state,
        "params": group.params,
        "n_requests": len(recs),
        "n_ok": len(ok),
        "errors": sorted({r.error for r in recs if r.error})[:5],
        "metrics": {},
    }
    for key in PER_REQUEST:
        values = [r.metrics.get(key) for r in ok]
        if any(v is not None for v in values):
            out["metrics"][key] = summarize(values).to_dict()
    itl = [r.metrics.get("itl_s", []) for r in ok]
    if any(itl):
        out["metrics"]["itl_s"] = summarize(itl, kind="cluster").to_dict()
    parts = [r.metrics["attribution"] for r in ok if "attribution" in r.metrics]
    if parts:
        out["attribution"] = {k: summarize([p[k] for p in parts]).to_dict() for k in ATTRIBUTION}
    thr = M.throughput(recs)
    if thr.get("per_second_tok"):
        thr["per_second_summary"] = summarize(thr["per_second_tok"], kind="block").to_dict()
    out["throughput"] = thr
    out["goodput"] = M.goodput(recs, slo, thr.get("window_s") or 0.0)
    out["observed_cache"] = M.observed_cache(recs)
    failed = len(recs) - len(ok)
    out["flags"] = ([f"{group.name}: {failed} of {len(recs)} requests failed ({out['errors'][0]})"] if failed else [])
    token_flags, out["notes"] = M.token_checks(recs)
    cache_flags = M.cache_flags(recs)
    out["cache_contradictions"] = len(cache_flags)
    out["flags"] += cache_flags + token_flags
    if thr.get("failed_streams"):
        out["notes"].append(f"{thr['failed_streams']} streams failed partway after {thr['failed_stream_tokens']} "
                            "tokens: not in the throughput")
    resent = sum(1 for r in recs if r.resent)
    if resent:
        out["notes"].append(f"{resent} requests were sent again on a new connection: the server closed a kept-alive "
                            "connection before responding (timed from the resend)")
    sources: dict[str, int] = {}
    for r in ok:
        sources[r.token_source] = sources.get(r.token_source, 0) + 1
    out["chunk_token_source"] = sources
    return out


def task_summaries(results: list[dict]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["task"] for r in results):
        rs = [r for r in results if r["task"] == name]
        passed = [r for r in rs if r["passed"]]
        first = [r for r in rs if r.get("passed_first")]
        out.append({
            "task": name,
            "runs": len(rs),
            "passed": len(passed),
            "pass_at_1": len(first) / len(rs),
            "pass_rate": len(passed) / len(rs),
            "task_time_s": summarize([r["task_time_s"] for r in passed]).to_dict(),
            "first_attempt_task_time_s": summarize([r["task_time_s"] for r in first]).to_dict(),
            "calls": sum(r["calls"] for r in rs),
            "last_detail": rs[-1]["detail"],
        })
        if any("tool_calls" in r for r in rs):
            out[-1]["tool_rounds"] = sum(r.get("tool_rounds", 0) for r in rs)
            out[-1]["tool_calls"] = sum(r.get("tool_calls", 0) for r in rs)
    return out


def conversation_summary(run) -> dict | None:
    if not run.sessions:
        return None
    from sudu.bench.conversation import summarize

    return {**summarize(run.sessions, run.config.get("restart_after_turn")), "session_runs": run.sessions}


def structured_summary(run) -> dict | None:
    if not run.structured:
        return None
    from sudu.bench.structured import summarize

    return {**summarize(run.structured), "answers": run.structured}


def multimodal_summary(run) -> dict | None:
    if not run.multimodal:
        return None
    from sudu.bench.multimodal import summarize

    return summarize(run.records, [tuple(s) for s in run.multimodal["sizes"]], run.multimodal.get("evidence"))


def build_report(run, slo: dict | None = None) -> dict:
    slo = slo or {}
    groups = [group_summary(run, g, slo) for g in run.groups]
    flags = [f for g in groups for f in g["flags"]]
    multimodal = multimodal_summary(run)
    if multimodal:
        flags += multimodal["flags"]
    structured = structured_summary(run)
    if structured and structured["valid"] < structured["n"]:
        flags.append(f"structured: {structured['n'] - structured['valid']} of {structured['n']} answers not valid "
                     f"under their schema (first: {structured['first_error']})")
    if run.overhead and not run.overhead.get("meets_targets"):
        flags.append("client self-test: the client missed its own targets (see client_overhead)")
    if run.replay and run.replay["dependency_violations"]:
        flags += [f"replay: {v}" for v in run.replay["dependency_violations"][:20]]
    return {
        "schema": M.SCHEMA,
        "suite": run.suite,
        "partial": run.partial,
        "started_at": _iso(run.started_at),
        "finished_at": _iso(run.finished_at),
        "target": run.target,
        "environment": environment(),
        "server_info": run.server_info,
        "definitions": M.DEFINITIONS,
        "config": run.config,
        "token_recount": run.token_recount,
        "client_overhead": run.overhead,
        "groups": groups,
        "tasks": task_summaries(run.task_results),
        "task_runs": run.task_results,
        "conversation": conversation_summary(run),
        "structured": structured,
        "multimodal": multimodal,
        "replay": run.replay,
        "capacity": run.capacity,
        "cost": cost_mod.cost_summary(run.records, run.prices, run.machine_per_hour, _window(run.records)),
        "flags": flags,
        "notes": run.notes + [f"{g['name']}: {n}" for g in groups for n in g["notes"]],
        "records": [r.to_dict() for r in run.records],
    }


def _window(records) -> float | None:
    """First measured request sent -> last one done (seconds): the span a machine was busy for the run."""
    recs = [r for r in M.measured(records) if r.done_s is not None]
    if not recs:
        return None
    return max(r.t_sent_s + r.done_s for r in recs) - min(r.t_sent_s for r in recs)


# ---------- text ----------

def _ms(s: dict | None, key: str = "median") -> str:
    if not s or s.get(key) is None:
        return "-"
    return f"{s[key] * 1e3:.1f}"


def _ci_ms(s: dict | None) -> str:
    if not s or s.get("ci_low") is None:
        return TOO_FEW if s and s.get("n") else "-"
    return f"[{s['ci_low'] * 1e3:.1f}, {s['ci_high'] * 1e3:.1f}]"


def _num(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def group_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["group", "cache (declared)", "cached tok (obs.)", "n ok/n", "TTFT ms p50 (p90, p99)", "TTFT mean 95% CI",
              "TPOT ms p50", "speed tok/s p50", "ITL ms p50 (p99)", "E2E ms p50 (p99)", "tok/s mean (peak 1 s)", "goodput"]
    rows = []
    for g in report["groups"]:
        m = g["metrics"]
        thr = g["throughput"]
        cached = g["observed_cache"]
        gp = g.get("goodput")
        rows.append([
            g["name"],
            g["cache_state"],
            _num(cached.get("mean_cached_tokens"), "{:.0f}") if cached.get("reported") else "not reported",
            f"{g['n_ok']}/{g['n_requests']}",
            f"{_ms(m.get('ttft_s'))} ({_ms(m.get('ttft_s'), 'p90')}, {_ms(m.get('ttft_s'), 'p99')})",
            _ci_ms(m.get("ttft_s")),
            _ms(m.get("tpot_s")),
            _num((m.get("output_speed_tok_s") or {}).get("median")),
            f"{_ms(m.get('itl_s'))} ({_ms(m.get('itl_s'), 'p99')})",
            f"{_ms(m.get('e2e_s'))} ({_ms(m.get('e2e_s'), 'p99')})",
            f"{_num(thr.get('mean_tok_s'))} ({_num(thr.get('peak_tok_s'))})",
            "-" if not gp else f"{_num(gp['goodput_req_s'], '{:.2f}')} req/s ({_num(100 * (gp['fraction'] or 0), '{:.0f}')}%)",
        ])
    return header, rows


def attribution_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["group", "network/client ms", "queue ms", "prefill ms", "decode ms", "acceptance rate", "mean accepted len"]
    rows = []
    for g in report["groups"]:
        a = g.get("attribution")
        m = g["metrics"]
        if not a and "acceptance_rate" not in m:
            continue
        a = a or {}
        rows.append([g["name"]] + [_ms(a.get(k), "mean") for k in ATTRIBUTION]
                    + [_num((m.get(k) or {}).get("mean"), "{:.2f}") for k in ("acceptance_rate", "mean_accepted_len")])
    return header, rows


def cache_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The cache suite at a glance: median TTFT per state and prompt length, with the cached tokens the
    server reported as evidence, and cold/warm, cold/shared-prefix speedups."""
    header = ["prompt words", "cold TTFT ms (cached tok)", "warm TTFT ms (cached tok)",
              "shared-prefix TTFT ms (cached tok)", "cold/warm", "cold/shared-prefix"]
    by_key = {(g["params"]["prompt_words"], g["cache_state"]): g for g in report["groups"] if "prompt_words" in g["params"]}
    rows = []
    for length in sorted({k[0] for k in by_key}):
        cells, medians = [str(length)], {}
        for state in ("cold", "warm", "shared-prefix"):
            g = by_key.get((length, state))
            ttft = (g or {}).get("metrics", {}).get("ttft_s")
            medians[state] = ttft["median"] if ttft else None
            cached = (g or {}).get("observed_cache", {})
            evidence = _num(cached.get("mean_cached_tokens"), "{:.0f}") if cached.get("reported") else "not reported"
            cells.append(f"{_ms(ttft)} ({evidence})")
        for state in ("warm", "shared-prefix"):
            a, b = medians["cold"], medians[state]
            cells.append(f"{a / b:.2f}x" if a and b else "-")
        rows.append(cells)
    return header, rows


def task_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["task", "pass@1", "passed (any attempt)", "task time s p50 (passing only)", "mean 95% CI",
              "first-attempt passes: task time s p50", "calls", "last check"]
    rows = []
    for t in report["tasks"]:
        s = t["task_time_s"]
        ci = "-" if s.get("ci_low") is None else f"[{s['ci_low']:.2f}, {s['ci_high']:.2f}]"
        rows.append([t["task"], _num(t.get("pass_at_1"), "{:.2f}"), f"{t['passed']}/{t['runs']}",
                     _num(s.get("median"), "{:.2f}"), ci,
                     _num((t.get("first_attempt_task_time_s") or {}).get("median"), "{:.2f}"),
                     str(t["calls"]) + (f" ({t['tool_calls']} tool calls in {t['tool_rounds']} rounds)"
                                        if "tool_calls" in t else ""),
                     t["last_detail"][:80]])
    return header, rows


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_summary(report: dict) -> str:
    t = report["target"]
    parts = [f"# sudu bench {report['suite']}" + (" (PARTIAL: interrupted)" if report["partial"] else ""),
             f"target: {t.get('url')}  model: {t.get('model')}  schema: {report['schema']}  "
             f"output tokens: {report['token_recount'] or 'not recounted'}"]
    header, rows = group_rows(report)
    if rows:
        parts.append(_md_table(header, rows))
        parts.append("Tokens per chunk (ITL, TPOT): " + "; ".join(
            f"{g['name']}: " + ", ".join(f"{src} ({k})" for src, k in g["chunk_token_source"].items())
            for g in report["groups"] if g.get("chunk_token_source")))
    header, rows = cache_rows(report)
    if rows:
        parts += ["## Cache effect (median TTFT; observed cached tokens as evidence)", _md_table(header, rows)]
    header, rows = multimodal_rows(report.get("multimodal"))
    if rows:
        parts += ["## Images: image-to-first-token (median TTFT of requests carrying the image; observed tokens "
                  "as evidence)", _md_table(header, rows)]
    header, rows = attribution_rows(report)
    if rows:
        parts += ["## Where the time went (server-reported breakdown, means)", _md_table(header, rows)]
    header, rows = task_rows(report)
    if rows:
        parts += ["## Tasks (a wrong answer has no time)", _md_table(header, rows)]
    if report.get("conversation"):
        from sudu.bench.conversation import markdown

        parts += ["## Conversation: per turn (cached share = cached / prompt tokens, as the server reported)",
                  markdown(report["conversation"])]
    if report.get("structured"):
        from sudu.bench.structured import markdown

        parts += ["## Structured output: answers valid under their JSON schema (jsonschema)",
                  markdown(report["structured"])]
    if report.get("replay"):
        parts += ["## Replay", replay_mod.markdown(report["replay"])]
    if report.get("capacity"):
        parts += ["## Capacity (p99 targets, search with confirmation runs)", capacity_mod.markdown(report["capacity"])]
    if report.get("cost"):
        parts += ["## Cost (from the endpoint's usage fields)", cost_mod.markdown(report["cost"])]
    oh = report.get("client_overhead")
    if oh:
        parts += ["## Client self-test",
                  f"TTFT against an instant server: median {oh['ttft_ms']['median']:.2f} ms (budget {oh['ttft_budget_ms']} ms); "
                  f"{oh['requests_per_s']:.0f} streaming requests/s at concurrency {oh['concurrency']} "
                  f"(target {oh['rate_target_req_s']:.0f}), {oh['cpu_ms_per_request']:.2f} ms client CPU per request; "
                  f"meets targets: {oh['meets_targets']}"]
    if report["flags"]:
        flags = [f"- {f}" for f in report["flags"][:30]]
        if len(report["flags"]) > 30:
            flags.append(f"- ... {len(report['flags']) - 30} more in the JSON report")
        parts += ["## Flags", "\n".join(flags)]
    if report["notes"]:
        parts += ["## Notes", "\n".join(f"- {n}" for n in report["notes"])]
    parts += ["## Definitions", "\n".join(f"- **{k}**: {v}" for k, v in report["definitions"].items())]
    return "\n\n".join(parts) + "\n"


# ---------- plots ----------

def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _cdf(ax, values, label) -> None:
    import numpy as np

    v = np.sort(np.asarray(values, dtype=float))
    if v.size:
        ax.step(v * 1e3, np.arange(1, v.size + 1) / v.size, where="post", label=label)


def plots(report: dict) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in report["records"] if not r["warmup"] and r["ok"]]
    by_group: dict[str, list[dict]] = {}
    for r in recs:
        by_group.setdefault(r["group"], []).append(r)
    out = []
    if recs:
        for key, title in (("ttft_s", "TTFT CDF"), ("itl_s", "ITL CDF (per token)")):
            fig, ax = plt.subplots(figsize=(6, 3.5))
            for name, rs in by_group.items():
                vals = [g for r in rs for g in r["metrics"].get("itl_s", [])] if key == "itl_s" else \
                    [r["metrics"][key] for r in rs if r["metrics"].get(key) is not None]
                _cdf(ax, vals, name)
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of requests" if key == "ttft_s" else "fraction of tokens")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if len(by_group) <= 12:
                ax.legend(fontsize=7)
            out.append((title, _png(fig)))
    conc = [g for g in report["groups"] if "concurrency" in g["params"] and g["throughput"].get("mean_tok_s")]
    if conc:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [g["params"]["concurrency"] for g in conc]
        ax.plot(xs, [g["throughput"]["mean_tok_s"] for g in conc], "o-", label="mean")
        ax.plot(xs, [g["throughput"].get("peak_tok_s") or float("nan") for g in conc], "s--", label="peak (best 1 s)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.set_title("Throughput vs concurrency")
        ax.grid(alpha=0.3)
        ax.legend()
        out.append(("Throughput vs concurrency", _png(fig)))
    cache_groups = [g for g in report["groups"] if "prompt_words" in g["params"] and "ttft_s" in g["metrics"]]
    if cache_groups:
        import numpy as np

        lengths = sorted({g["params"]["prompt_words"] for g in cache_groups})
        states = ["cold", "warm", "shared-prefix"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        width = 0.8 / len(states)
        for i, state in enumerate(states):
            ys = []
            for length in lengths:
                g = next((g for g in cache_groups if g["cache_state"] == state and g["params"]["prompt_words"] == length), None)
                ys.append(g["metrics"]["ttft_s"]["median"] * 1e3 if g else float("nan"))
            ax.bar(np.arange(len(lengths)) + i * width, ys, width, label=state)
        ax.set_xticks(np.arange(len(lengths)) + width, [str(x) for x in lengths])
        ax.set_xlabel("prompt length (words)")
        ax.set_ylabel("median TTFT (ms)")
        ax.set_title("Cold vs warm vs shared-prefix TTFT")
        ax.legend()
        out.append(("Cold vs warm TTFT", _png(fig)))
    timeline = [r for r in report["records"] if r["t_sent_s"]][:MAX_TIMELINE_REQUESTS]
    if timeline:
        t0 = min(r["t_sent_s"] for r in timeline)
        fig, ax = plt.subplots(figsize=(7, max(2.5, min(8, len(timeline) * 0.03))))
        for i, r in enumerate(timeline):
            start = r["t_sent_s"] - t0
            end = start + (r["done_s"] or 0.0)
            color = "0.6" if r["warmup"] else ("tab:blue" if r["ok"] else "tab:red")
            ax.hlines(i, start, end, color=color, lw=1)
            if r["chunk_times_s"]:
                ax.plot(start + r["chunk_times_s"][0], i, "|", color="k", ms=3)
        ax.set_xlabel("s since the first request (| = first token; grey = warm-up, red = failed)")
        ax.set_ylabel("request")
        ax.set_title("Request timeline")
        out.append(("Request timeline", _png(fig)))
    return out


def html_report(report: dict) -> str:
    """The interactive, self-contained page (html_page.py)."""
    tables = [("Results", group_rows(report)), ("Cache effect", cache_rows(report)),
              ("Images", multimodal_rows(report.get("multimodal"))),
              ("Where the time went", attribution_rows(report)), ("Tasks", task_rows(report))]
    sections = []
    if report.get("replay"):
        sections.append(("Replay", replay_mod.markdown(report["replay"])))
    if report.get("capacity"):
        sections.append(("Capacity", capacity_mod.markdown(report["capacity"])))
    if report.get("cost"):
        sections.append(("Cost", cost_mod.markdown(report["cost"])))
    if report.get("conversation"):
        from sudu.bench.conversation import markdown

        sections.append(("Conversation", markdown(report["conversation"])))
    return html_page.report_page(report, tables, sections)


def write_report(report: dict, out_dir: str, with_html: bool = True) -> dict:
    """Writes <suite>-<time>.json, .md and (unless with_html is False) .html; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(out_dir, f"{report['suite']}-{stamp}")
    paths = {"json": base + ".json", "markdown": base + ".md"}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1, default=str)
    text = markdown_summary(report)
    if with_html:  # the Markdown report's plots: PNG files beside it (they take a few seconds, as the page does)
        images = []
        for i, (name, png) in enumerate(plots(report)):
            path = f"{base}-plot{i + 1}.png"
            with open(path, "wb") as f:
                f.write(base64.b64decode(png))
            images.append(f"![{name}]({os.path.basename(path)})")
        if images:
            text += "\n## Plots\n\n" + "\n\n".join(images) + "\n"
    with open(paths["markdown"], "w") as f:
        f.write(text)
    if with_html:
        paths["html"] = base + ".html"
        with open(paths["html"], "w") as f:
            f.write(html_report(report))
    return paths
