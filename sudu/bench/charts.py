"""The interactive charts of sudu bench's HTML report (plotly figures; html_page.py lays them out): TTFT and
ITL CDFs per workload point, throughput vs concurrency, cold vs warm TTFT, the request timeline, the
capacity search (p99 TTFT and ITL per level against the targets) and its Pareto curve, replay's
per-session timelines, the cost breakdown, and compare's forest plot of ratios."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

MAX_TIMELINE_REQUESTS = 400
LAYOUT = dict(template="plotly_white", height=360, margin=dict(l=60, r=20, t=50, b=50),
              legend=dict(font=dict(size=10)), hovermode="closest")


def _fig(title: str, x: str, y: str, **extra) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, **{**LAYOUT, **extra})
    return fig


def _cdf(fig: go.Figure, values, name: str) -> None:
    v = np.sort(np.asarray(values, dtype=float)) * 1e3
    if v.size:
        fig.add_trace(go.Scatter(x=v, y=np.arange(1, v.size + 1) / v.size, mode="lines", line_shape="hv", name=name,
                                 hovertemplate="%{x:.1f} ms: %{y:.0%}<extra>" + name + "</extra>"))


def latency_cdfs(report: dict) -> list[go.Figure]:
    recs = [r for r in report["records"] if not r["warmup"] and r["ok"]]
    by_group: dict[str, list[dict]] = {}
    for r in recs:
        by_group.setdefault(r["group"], []).append(r)
    if not recs:
        return []
    ttft = _fig("TTFT CDF", "ms", "fraction of requests")
    itl = _fig("ITL CDF (per token)", "ms", "fraction of tokens")
    for name, rs in by_group.items():
        _cdf(ttft, [r["metrics"]["ttft_s"] for r in rs if r["metrics"].get("ttft_s") is not None], name)
        _cdf(itl, [g for r in rs for g in r["metrics"].get("itl_s", [])], name)
    return [ttft, itl]


def throughput_vs_concurrency(report: dict) -> go.Figure | None:
    conc = [g for g in report["groups"] if "concurrency" in g["params"] and g["throughput"].get("mean_tok_s")
            and "capacity" not in report.get("suite", "")]
    if not conc:
        return None
    fig = _fig("Throughput vs concurrency", "concurrency", "output tok/s", xaxis_type="log")
    xs = [g["params"]["concurrency"] for g in conc]
    fig.add_trace(go.Scatter(x=xs, y=[g["throughput"]["mean_tok_s"] for g in conc], mode="lines+markers", name="mean"))
    fig.add_trace(go.Scatter(x=xs, y=[g["throughput"].get("peak_tok_s") for g in conc], mode="lines+markers",
                             name="peak (best 1 s)", line_dash="dash"))
    return fig


def cache_ttft(report: dict) -> go.Figure | None:
    groups = [g for g in report["groups"] if "prompt_words" in g["params"] and "ttft_s" in g["metrics"]]
    if not groups:
        return None
    fig = _fig("Cold vs warm vs shared-prefix TTFT", "prompt length (words)", "median TTFT (ms)", barmode="group")
    for state in ("cold", "warm", "shared-prefix"):
        gs = sorted((g for g in groups if g["cache_state"] == state), key=lambda g: g["params"]["prompt_words"])
        fig.add_trace(go.Bar(x=[str(g["params"]["prompt_words"]) for g in gs],
                             y=[g["metrics"]["ttft_s"]["median"] * 1e3 for g in gs], name=state))
    return fig


def request_timeline(report: dict) -> go.Figure | None:
    recs = [r for r in report["records"] if r["t_sent_s"]][:MAX_TIMELINE_REQUESTS]
    if not recs or report.get("replay"):
        return None
    t0 = min(r["t_sent_s"] for r in recs)
    fig = _fig("Request timeline (bar: sent -> done; marker: first token)", "s since the first request", "request")
    for label, pick, color in (("measured", lambda r: r["ok"] and not r["warmup"], "#3b6fd8"),
                               ("warm-up", lambda r: r["warmup"], "#9aa3b2"), ("failed", lambda r: not r["ok"], "#d9534f")):
        rs = [(i, r) for i, r in enumerate(recs) if pick(r)]
        if rs:
            fig.add_trace(go.Bar(y=[i for i, _ in rs], x=[r["done_s"] or 0 for _, r in rs],
                                 base=[r["t_sent_s"] - t0 for _, r in rs], orientation="h", name=label,
                                 marker_color=color, customdata=[r["group"] for _, r in rs],
                                 hovertemplate="request %{y} (%{customdata}): %{base:.2f} s + %{x:.3f} s<extra></extra>"))
    firsts = [(i, r["t_sent_s"] - t0 + r["chunk_times_s"][0]) for i, r in enumerate(recs) if r["chunk_times_s"]]
    if firsts:
        fig.add_trace(go.Scatter(x=[f for _, f in firsts], y=[i for i, _ in firsts], mode="markers", name="first token",
                                 marker=dict(symbol="line-ns-open", size=8, color="black")))
    return fig


def capacity_charts(report: dict) -> list[go.Figure]:
    cap = report.get("capacity")
    if not cap or not cap["probes"]:
        return []
    unit = "concurrency" if cap["mode"] == "concurrency" else "request rate (req/s)"
    fig = _fig("Capacity search: p99 latency per level", unit, "ms")
    probes = sorted(cap["probes"], key=lambda p: p["load"])
    for key, name, target in (("p99_ttft_s", "p99 TTFT", cap["targets"]["ttft_p99_s"]),
                              ("p99_itl_s", "p99 ITL", cap["targets"]["itl_p99_s"])):
        pts = [p for p in probes if p[key] is not None]
        fig.add_trace(go.Scatter(x=[p["load"] for p in pts], y=[p[key] * 1e3 for p in pts], mode="markers", name=name,
                                 customdata=[p["phase"] + (": meets" if p["passed"] else ": misses") for p in pts],
                                 hovertemplate="%{x:g}: %{y:.1f} ms (%{customdata})<extra>" + name + "</extra>"))
        if target is not None:
            fig.add_hline(y=target * 1e3, line_dash="dot", annotation_text=f"{name} target")
    if cap["answer"] is not None:
        fig.add_vline(x=cap["answer"], line_color="green", annotation_text=f"capacity {cap['answer']:g}")
    pareto = _fig("Per-user vs total output speed", "total output tok/s", "per-user output tok/s (median)")
    pts = [p for p in probes if p["total_tok_s"] and p["per_user_tok_s"]]
    pareto.add_trace(go.Scatter(x=[p["total_tok_s"] for p in pts], y=[p["per_user_tok_s"] for p in pts], mode="markers",
                                name="levels", text=[f"{p['load']:g} ({p['phase']})" for p in pts],
                                hovertemplate="%{text}: %{x:.1f} total, %{y:.1f} per user<extra></extra>"))
    front = cap.get("pareto") or []
    if front:
        pareto.add_trace(go.Scatter(x=[p["total_tok_s"] for p in front], y=[p["per_user_tok_s"] for p in front],
                                    mode="lines", name="Pareto front"))
    return [fig, pareto]


def replay_timeline(report: dict) -> go.Figure | None:
    """One row per session: each request as a bar (sent -> answered), tool waits as the gaps between."""
    rp = report.get("replay")
    if not rp or not rp.get("rows"):
        return None
    sessions = list(dict.fromkeys(r["session"] for r in rp["rows"]))[:60]
    rows = [r for r in rp["rows"] if r["session"] in sessions]
    fig = _fig("Replay: per-session timeline (bars: requests; gaps: tool waits)", "s since the replay started", "session",
               height=max(320, 18 * len(sessions) + 100))
    for ok, color, name in ((True, "#3b6fd8", "answered"), (False, "#d9534f", "failed")):
        rs = [r for r in rows if bool(r.get("ok")) == ok]
        if rs:
            fig.add_trace(go.Bar(y=[r["session"] for r in rs], x=[r["done_s"] - r["start_s"] for r in rs],
                                 base=[r["start_s"] for r in rs], orientation="h", name=name, marker_color=color,
                                 customdata=[[r["id"], r.get("cached_tokens"), r["input_length"], r["tool_wait_s"]] for r in rs],
                                 hovertemplate="%{customdata[0]}: %{base:.2f} s + %{x:.2f} s, cached %{customdata[1]} of "
                                 "%{customdata[2]} tokens, after a %{customdata[3]:.2f} s tool wait<extra></extra>"))
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(sessions)))
    return fig


def replay_hits(report: dict) -> go.Figure | None:
    rp = report.get("replay")
    if not rp or not rp.get("rows"):
        return None
    rows = sorted((r for r in rp["rows"] if r.get("ok")), key=lambda r: r["start_s"])
    fig = _fig("Replay: cached tokens per request, reached vs ideal", "request (in the order sent)", "tokens")
    fig.add_trace(go.Scatter(y=[r["ideal_cached_tokens"] for r in rows], mode="lines", name="ideal", line_shape="hv"))
    fig.add_trace(go.Scatter(y=[r.get("cached_tokens") for r in rows], mode="markers", name="reached (server)",
                             text=[r["id"] for r in rows]))
    return fig


def cost_breakdown(report: dict) -> go.Figure | None:
    c = report.get("cost")
    if not c or not c.get("tokens"):
        return None
    t = c["tokens"]
    fig = _fig(f"Cost ({c['currency']}): with cache hits vs all misses", "", c["currency"], barmode="stack")
    for key, name in (("input_miss", "input (miss)"), ("input_hit", "input (hit)"), ("output", "output")):
        fig.add_trace(go.Bar(x=["this run"], y=[t[key]], name=name))
    p = c["prices"]
    nocache_input = c["prompt_tokens"] * p["input_miss_per_mtok"] / 1e6
    fig.add_trace(go.Bar(x=["all misses"], y=[nocache_input], name="input (all misses)"))
    fig.add_trace(go.Bar(x=["all misses"], y=[t["output"]], name="output ", showlegend=False))
    return fig


def report_charts(report: dict) -> list[go.Figure]:
    figs = latency_cdfs(report)
    figs += [f for f in (throughput_vs_concurrency(report), cache_ttft(report), replay_timeline(report),
                         replay_hits(report), cost_breakdown(report)) if f is not None]
    figs += capacity_charts(report)
    tl = request_timeline(report)
    return figs + ([tl] if tl is not None else [])


def ratio_forest(rows: list[dict]) -> go.Figure | None:
    rs = [r for r in rows if r.get("ratio") is not None]
    if not rs:
        return None
    labels = [f"{r['group']} / {r['metric']}" for r in rs]
    colors = ["#1e6b34" if r["verdict"] == "B better" else "#a1261b" if r["verdict"] == "B worse" else "#7a8294" for r in rs]
    err_hi = [(r["ci_high"] - r["ratio"]) if r["ci_high"] is not None else 0 for r in rs]
    err_lo = [(r["ratio"] - r["ci_low"]) if r["ci_low"] is not None else 0 for r in rs]
    fig = _fig("B/A per metric (bars: 95% CI; grey: not significant)", "B / A", "", height=max(320, 26 * len(rs) + 120))
    fig.add_trace(go.Scatter(x=[r["ratio"] for r in rs], y=labels, mode="markers", marker=dict(color=colors, size=10),
                             error_x=dict(type="data", array=err_hi, arrayminus=err_lo), name="B/A",
                             customdata=[r["verdict"] for r in rs],
                             hovertemplate="%{y}: %{x:.3f} (%{customdata})<extra></extra>"))
    fig.add_vline(x=1.0, line_dash="dot")
    return fig
