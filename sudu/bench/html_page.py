"""The HTML report of sudu bench: one self-contained page that works offline (plotly.js inlined from the
plotly wheel, no other asset, no network request). A headline card (the run's key figures with their 95%
CIs and the cache state), interactive charts (charts.py: zoom, hover, toggle series), the tables of the
Markdown report, flags, definitions and the environment. `compare_page` is the A/B view of `sudu bench
compare`: every ratio B/A with its CI and the verdict per metric."""
from __future__ import annotations

import html
import json

import plotly.io as pio
from plotly.offline import get_plotlyjs

from sudu.bench import charts

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f5f6f8;color:#1d2330}
main{max-width:1200px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.sub{color:#5b6475;font-size:13px}
.card{background:#fff;border-radius:10px;box-shadow:0 1px 3px rgba(0,0,0,.08);padding:16px 20px;margin:14px 0}
.headline{display:grid;grid-template-columns:repeat(auto-fill,minmax(210px,1fr));gap:12px}
.fig{border-left:3px solid #3b6fd8;padding:4px 10px}
.fig .label{font-size:12px;color:#5b6475;text-transform:uppercase;letter-spacing:.03em}
.fig .value{font-size:24px;font-weight:600;margin:2px 0}
.fig .ci{font-size:12px;color:#5b6475}
.badge{display:inline-block;border-radius:10px;padding:1px 8px;font-size:12px;background:#e8eefb;color:#2a4f9e;margin-right:4px}
.badge.warn{background:#fdecea;color:#a1261b}.badge.good{background:#e6f4ea;color:#1e6b34}
table{border-collapse:collapse;font-size:12.5px;width:100%;background:#fff}
td,th{border-bottom:1px solid #e3e6ec;padding:4px 8px;text-align:right}th{background:#fafbfc}
td:first-child,th:first-child{text-align:left}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:14px}
pre{background:#fff;padding:12px;overflow:auto;font-size:11.5px;border-radius:8px}
details summary{cursor:pointer;color:#2a4f9e}
.better{color:#1e6b34;font-weight:600}.worse{color:#a1261b;font-weight:600}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _figure(key: str, label: str, value: str, ci: str = "") -> str:
    return (f"<div class='fig' data-key='{_e(key)}'><div class='label'>{_e(label)}</div>"
            f"<div class='value'>{_e(value)}</div><div class='ci'>{_e(ci)}</div></div>")


def _ci(s: dict | None, scale: float, unit: str, digits: int = 1) -> str:
    if not s or s.get("ci_low") is None:
        return (s or {}).get("note") or ""
    return f"95% CI {s['ci_low'] * scale:.{digits}f}-{s['ci_high'] * scale:.{digits}f} {unit} (n={s['n']})"


def headline(report: dict) -> list[str]:
    """The headline figures: over all groups' requests where one figure sums up the run."""
    out = []
    groups = report["groups"]
    main = max(groups, key=lambda g: g["n_ok"], default=None) if groups else None
    if main:
        m = main["metrics"]
        for key, label, scale, unit in (("ttft_s", "TTFT mean", 1e3, "ms"), ("tpot_s", "TPOT mean", 1e3, "ms"),
                                        ("output_speed_tok_s", "output speed", 1, "tok/s"),
                                        ("ttft_reasoning_s", "first reasoning token", 1e3, "ms"),
                                        ("ttft_answer_s", "first answer token", 1e3, "ms")):
            s = m.get(key)
            if s and s.get("mean") is not None:
                out.append(_figure(key, f"{label} ({main['name']})", f"{s['mean'] * scale:.1f} {unit}",
                                   _ci(s, scale, unit) + f"; p99 {s['p99'] * scale:.1f}"))
        thr = main["throughput"]
        if thr.get("mean_tok_s"):
            ps = thr.get("per_second_summary") or {}
            out.append(_figure("throughput", f"throughput ({main['name']})", f"{thr['mean_tok_s']:.1f} tok/s",
                               _ci(ps, 1, "tok/s") or f"window {thr['window_s']:.1f} s"))
        if main.get("goodput"):
            gp = main["goodput"]
            out.append(_figure("goodput", "goodput", f"{gp['goodput_req_s'] or 0:.2f} req/s",
                               f"{100 * (gp['fraction'] or 0):.0f}% of requests meet the SLOs"))
    states = sorted({g["cache_state"] for g in groups})
    recs = [r for r in report["records"] if not r["warmup"] and r["ok"]]
    prompt = sum((r.get("usage") or {}).get("prompt_tokens") or 0 for r in recs)
    cached = sum(r["metrics"].get("cached_tokens") or 0 for r in recs)
    reported = any(r["metrics"].get("cached_tokens") is not None for r in recs)
    out.append(_figure("cache", "cache state", ", ".join(states) or "-",
                       (f"{100 * cached / prompt:.1f}% of prompt tokens served from cache" if reported and prompt
                        else "server reports no cached tokens")
                       + (f"; {sum(g['cache_contradictions'] for g in groups)} contradictions" if groups else "")))
    rp = report.get("replay")
    if rp and rp.get("reached_hit_rate") is not None:
        out.append(_figure("replay_hit", "replay hit rate", f"{100 * rp['reached_hit_rate']:.1f}%",
                           f"ideal {100 * (rp['ideal_hit_rate'] or 0):.1f}% ({rp['hit_rate_gap_points']:+.1f} points); "
                           f"{len(rp['dependency_violations'])} dependency violations"))
    cap = report.get("capacity")
    if cap:
        unit = "concurrent" if cap["mode"] == "concurrency" else "req/s"
        value = "none" if cap["answer"] is None else f"{cap['answer']:g} {unit}"
        ok = sum(r["passed"] for r in cap["confirmations"])
        out.append(_figure("capacity", "capacity at the SLO", value,
                           f"{ok}/{len(cap['confirmations'])} confirmations passed; goodput "
                           f"{cap.get('goodput_req_s', 0):.2f} req/s"))
    cost = report.get("cost")
    if cost and cost.get("tokens"):
        t = cost["tokens"]
        pr = t["per_request"]
        out.append(_figure("cost_per_request", f"cost per request ({cost['prices']['name']})",
                           f"{pr['mean']:.6f} {cost['currency']}",
                           _ci(pr, 1, cost["currency"], 6) + f"; hits saved {100 * (t['saved_share'] or 0):.1f}%"))
        if t["per_session"]["n"] or t["per_task"]["n"]:
            u = t["per_session"] if t["per_session"]["n"] else t["per_task"]
            label = "session" if t["per_session"]["n"] else "task run"
            out.append(_figure("cost_per_unit", f"cost per {label}", f"{u['mean']:.6f} {cost['currency']}",
                               _ci(u, 1, cost["currency"], 6)))
    if cost and cost.get("machine"):
        mc = cost["machine"]
        out.append(_figure("machine_cost", "machine cost per request", f"{mc['per_request'] or 0:.6f} {cost['currency']}",
                           f"{cost['machine_per_hour']:g}/h over {mc['window_s']:.1f} s"))
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{_e(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _charts_html(figs: list) -> str:
    divs = []
    for i, fig in enumerate(figs):
        divs.append("<div class='card chart'>" + pio.to_html(
            fig, full_html=False, include_plotlyjs=False, div_id=f"chart{i}",
            config={"displaylogo": False, "responsive": True}) + "</div>")
    return "<div class='charts'>" + "".join(divs) + "</div>"


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head><body><main>{body}</main></body></html>")


def report_page(report: dict, tables: list[tuple[str, tuple[list[str], list[list[str]]]]], sections: list[tuple[str, str]]) -> str:
    """The run's page. `tables`: (heading, (header, rows)) from report.py; `sections`: (heading, Markdown-ish
    text) shown as preformatted text (conversation, replay, capacity, cost summaries)."""
    t = report["target"]
    title = f"sudu bench {report['suite']}" + (" (PARTIAL)" if report["partial"] else "")
    badges = [f"<span class='badge'>{_e(report['suite'])}</span>", f"<span class='badge'>{_e(t.get('model'))}</span>"]
    if report["partial"]:
        badges.append("<span class='badge warn'>partial: interrupted</span>")
    badges.append(f"<span class='badge {'warn' if report['flags'] else 'good'}'>{len(report['flags'])} flags</span>")
    parts = [f"<h1>{_e(title)}</h1><div class='sub'>{''.join(badges)} target {_e(t.get('url'))}, started "
             f"{_e(report['started_at'])}, schema {_e(report['schema'])}</div>",
             "<div class='card headline' id='headline'>" + "".join(headline(report)) + "</div>"]
    figs = charts.report_charts(report)
    if figs:
        parts += ["<h2>Charts</h2>", _charts_html(figs)]
    for heading, (header, rows) in tables:
        if rows:
            parts += [f"<h2>{_e(heading)}</h2><div class='card'>", _table(header, rows), "</div>"]
    for heading, text in sections:
        if text:
            parts += [f"<h2>{_e(heading)}</h2><div class='card'><pre>{_e(text)}</pre></div>"]
    if report["flags"]:
        parts += ["<h2>Flags</h2><div class='card'><ul>"] + [f"<li>{_e(f)}</li>" for f in report["flags"]] + ["</ul></div>"]
    if report["notes"]:
        parts += ["<h2>Notes</h2><div class='card'><ul>"] + [f"<li>{_e(n)}</li>" for n in report["notes"]] + ["</ul></div>"]
    parts += ["<h2>Definitions</h2><div class='card'><dl>"]
    parts += [f"<dt><b>{_e(k)}</b></dt><dd>{_e(v)}</dd>" for k, v in report["definitions"].items()]
    parts += ["</dl></div><details><summary>Environment, server and configuration</summary><pre>",
              _e(json.dumps({"environment": report["environment"], "server_info": report["server_info"],
                             "client_overhead": report["client_overhead"], "config": report["config"]},
                            indent=2, default=str)), "</pre></details>"]
    return page(title, "".join(parts))


def compare_page(a: dict, b: dict, path_a: str, path_b: str, rows: list[dict], rates: list[dict],
                 diffs: list[str]) -> str:
    """The A/B view: the two runs, a forest plot of every B/A ratio with its CI, and the verdict table."""
    def run_line(label, rep, path):
        return (f"<div class='fig' data-key='run_{label}'><div class='label'>{label}</div><div class='value'>"
                f"{_e(rep['target'].get('model'))}</div><div class='ci'>{_e(path)} ({_e(rep['suite'])}, "
                f"{_e(rep['target'].get('url'))}{', PARTIAL' if rep.get('partial') else ''})</div></div>")

    better = sum(r["verdict"] == "B better" for r in rows)
    worse = sum(r["verdict"] == "B worse" for r in rows)
    parts = ["<h1>sudu bench compare: B / A</h1>",
             "<div class='card headline' id='headline'>" + run_line("A", a, path_a) + run_line("B", b, path_b)
             + _figure("verdicts", "verdicts", f"{better} better, {worse} worse",
                       f"{len(rows) - better - worse} not significant or too few samples") + "</div>"]
    if diffs:
        parts.append("<div class='card'><b>FORCED comparison of different work:</b><ul>"
                     + "".join(f"<li>{_e(d)}</li>" for d in diffs) + "</ul></div>")
    fig = charts.ratio_forest(rows)
    if fig is not None:
        parts += ["<h2>Ratios B/A with 95% CIs</h2>", _charts_html([fig])]
    header = ["group", "cache", "metric", "mean A", "mean B", "B/A", "95% CI", "verdict"]
    body = []
    for r in rows:
        ci = "-" if r["ci_low"] is None else f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
        cls = {"B better": "better", "B worse": "worse"}.get(r["verdict"], "")
        body.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in (
            r["group"], r["cache_state"], r["metric"], "-" if r["mean_a"] is None else f"{r['mean_a']:.4g}",
            "-" if r["mean_b"] is None else f"{r['mean_b']:.4g}", "-" if r["ratio"] is None else f"{r['ratio']:.3f}", ci))
            + f"<td class='{cls}'>{_e(r['verdict'])}</td></tr>")
    parts.append("<h2>Per metric</h2><div class='card'><table><thead><tr>" + "".join(f"<th>{h}</th>" for h in header)
                 + "</tr></thead><tbody>" + "".join(body) + "</tbody></table></div>")
    if rates:
        parts.append("<h2>Task pass rates</h2><div class='card'>" + _table(
            ["task", "metric", "A", "B", "B - A", "verdict"],
            [[r["task"], r["metric"], f"{r['rate_a']:.2f}", f"{r['rate_b']:.2f}", f"{r['difference']:+.2f}", r["verdict"]]
             for r in rates]) + "</div>")
    return page("sudu bench compare", "".join(parts))
