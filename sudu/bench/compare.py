"""`sudu bench compare A.json B.json`: for every workload point, the ratio B/A of each metric's mean
with a bootstrap 95% CI (resampled as the report's own CIs are: requests, whole requests for ITL, time
blocks for throughput) and a verdict; "not significant" when the CI contains 1; for tasks, the pass
rates and their difference.

Two reports are put side by side only when they measured the same work in the same cache state. It is
refused when the suite, model, prompt set, max_tokens, ignore_eos or sampling differ, when a workload
point is on one side only, when declared cache states differ, or when either report has a flagged cache
contradiction. `--force` compares anyway, and the output then opens with what differed."""
from __future__ import annotations

import json

import numpy as np

from sudu.bench.html_page import compare_page
from sudu.bench.metrics import SCHEMA
from sudu.bench.stats import MIN_SAMPLES_FOR_CI, TOO_FEW, ratio_ci, resampled_means
from sudu.errors import SuduError

# the run settings that change the work itself: a difference makes the two figures incomparable
SAME_WORK = ("max_tokens", "output_len", "input_words", "lengths", "ignore_eos", "sampling", "tasks", "attempts",
             "context_len_used", "retrieval_fraction", "schemas", "tool_choice")

# metric -> True when higher is better
METRICS = {
    "ttft_s": False,
    "tpot_s": False,
    "output_speed_tok_s": True,
    "e2e_s": False,
    "itl_s": False,
    "throughput_tok_s": True,
    "task_time_s": False,
}


def load(path: str) -> dict:
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise SuduError(f"cannot read report {path}: {exc}") from None
    if report.get("schema") != SCHEMA:
        raise SuduError(f"{path} is not a {SCHEMA} report (schema {report.get('schema')!r})")
    return report


def samples(report: dict, group: str, metric: str) -> tuple[list, str]:
    """(samples, resampling kind) of one metric of one workload point."""
    if metric == "throughput_tok_s":
        g = next(g for g in report["groups"] if g["name"] == group)
        return g["throughput"].get("per_second_tok") or [], "block"
    if metric == "task_time_s":
        task = group.removeprefix("task ")
        return [r["task_time_s"] for r in report.get("task_runs", []) if r["task"] == task and r["passed"]], "iid"
    recs = [r for r in report["records"] if r["group"] == group and not r["warmup"] and r["ok"]]
    if metric == "itl_s":
        return [r["metrics"].get("itl_s", []) for r in recs if r["metrics"].get("itl_s")], "cluster"
    return [r["metrics"][metric] for r in recs if r["metrics"].get(metric) is not None], "iid"


def _pooled_mean(xs: list, kind: str) -> float | None:
    flat = [v for x in xs for v in x] if kind == "cluster" else xs
    return sum(flat) / len(flat) if flat else None


def differences(a: dict, b: dict) -> list[str]:
    """Everything that makes A and B different work, or figures that cannot be trusted side by side."""
    out = []
    if a.get("suite") != b.get("suite"):
        out.append(f"suite: A is {a.get('suite')}, B is {b.get('suite')}")
    if (a.get("target") or {}).get("model") != (b.get("target") or {}).get("model"):
        out.append(f"model: A is {a['target'].get('model')!r}, B is {b['target'].get('model')!r}")
    ca, cb = a.get("config") or {}, b.get("config") or {}
    for key in SAME_WORK:
        if ca.get(key) != cb.get(key):
            out.append(f"{key}: A is {ca.get(key)!r}, B is {cb.get(key)!r}")
    groups_a = {g["name"]: g for g in a["groups"]}
    groups_b = {g["name"]: g for g in b["groups"]}
    for name in groups_a.keys() - groups_b.keys():
        out.append(f"workload point {name!r} is in A only")
    for name in groups_b.keys() - groups_a.keys():
        out.append(f"workload point {name!r} is in B only")
    for name in groups_a.keys() & groups_b.keys():
        ga, gb = groups_a[name], groups_b[name]
        if ga["cache_state"] != gb["cache_state"]:
            out.append(f"{name}: cache state A is {ga['cache_state']}, B is {gb['cache_state']}")
        pa, pb = (ga.get("params") or {}).get("prompt_set"), (gb.get("params") or {}).get("prompt_set")
        if pa != pb:
            out.append(f"{name}: prompt set A is {pa!r}, B is {pb!r}")
    for label, rep in (("A", a), ("B", b)):
        bad = [g["name"] for g in rep["groups"] if g.get("cache_contradictions")]
        if bad:
            out.append(f"{label} has flagged cache contradictions in {', '.join(sorted(bad))}")
    return sorted(set(out), key=out.index)


def compare(a: dict, b: dict, seed: int = 0, force: bool = False) -> tuple[list[dict], list[str]]:
    """(rows, what differed). Rows: group, metric, mean_a, mean_b, ratio (B/A) with CI, verdict.
    SuduError when the reports differ (unless `force`) or share no workload point."""
    diffs = differences(a, b)
    if diffs and not force:
        raise SuduError("refusing to compare different work side by side (--force to compare anyway): "
                        + "; ".join(diffs))
    groups_a = {g["name"]: g for g in a["groups"]}
    common = [g["name"] for g in b["groups"] if g["name"] in groups_a]
    if not common:
        raise SuduError("the two reports share no workload point (group names differ); nothing to compare")
    rows = []
    for name in common:
        for metric, higher_better in METRICS.items():
            (xa, kind), (xb, _) = samples(a, name, metric), samples(b, name, metric)
            if not xa and not xb:
                continue
            r = ratio_ci(xa, xb, seed=seed, kind=kind)
            if r.ratio is None or r.significant is None:
                verdict = r.note
            elif not r.significant:
                verdict = "not significant (CI contains 1)"
            else:
                better = (r.ratio > 1) == higher_better
                verdict = "B better" if better else "B worse"
            rows.append({
                "group": name,
                "cache_state": groups_a[name]["cache_state"],
                "metric": metric,
                "mean_a": _pooled_mean(xa, kind),
                "mean_b": _pooled_mean(xb, kind),
                **r.to_dict(),
                "verdict": verdict,
            })
    return rows, diffs


def pass_rates(a: dict, b: dict, seed: int = 0) -> list[dict]:
    """Per task in both reports: pass@1 (first answer passes) and pass within the attempts, A and B, and
    B - A with a bootstrap 95% CI (runs resampled)."""
    out = []
    tasks_b = {t["task"] for t in b.get("task_runs", [])}
    for task in dict.fromkeys(t["task"] for t in a.get("task_runs", [])):
        if task not in tasks_b:
            continue
        for label, key in (("pass@1", "passed_first"), ("pass", "passed")):
            xa = np.asarray([float(bool(r.get(key))) for r in a["task_runs"] if r["task"] == task])
            xb = np.asarray([float(bool(r.get(key))) for r in b["task_runs"] if r["task"] == task])
            row = {"task": task, "metric": label, "rate_a": float(xa.mean()), "rate_b": float(xb.mean()),
                   "n_a": int(xa.size), "n_b": int(xb.size), "difference": float(xb.mean() - xa.mean()),
                   "ci_low": None, "ci_high": None}
            if min(xa.size, xb.size) < MIN_SAMPLES_FOR_CI:
                row["verdict"] = f"{TOO_FEW} for a 95% CI (n={min(xa.size, xb.size)} < {MIN_SAMPLES_FOR_CI})"
            else:
                rng = np.random.default_rng(seed)
                d = resampled_means(xb, "iid", rng) - resampled_means(xa, "iid", rng)
                row["ci_low"], row["ci_high"] = (float(x) for x in np.quantile(d, [0.025, 0.975]))
                row["verdict"] = ("not significant (CI contains 0)" if row["ci_low"] <= 0 <= row["ci_high"]
                                  else "B better" if row["difference"] > 0 else "B worse")
            out.append(row)
    return out


def format_rows(rows: list[dict]) -> str:
    def f(v, spec="{:.4g}"):
        return "-" if v is None else spec.format(v)

    header = ["group", "cache", "metric", "mean A", "mean B", "B/A", "95% CI", "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        ci = "-" if r["ci_low"] is None else f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
        lines.append("| " + " | ".join([r["group"], r["cache_state"], r["metric"], f(r["mean_a"]), f(r["mean_b"]),
                                         f(r["ratio"], "{:.3f}"), ci, r["verdict"]]) + " |")
    return "\n".join(lines)


def format_pass_rates(rows: list[dict]) -> str:
    lines = ["| task | metric | A | B | B - A | 95% CI | verdict |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = "-" if r["ci_low"] is None else f"[{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]"
        lines.append(f"| {r['task']} | {r['metric']} | {r['rate_a']:.2f} (n={r['n_a']}) | {r['rate_b']:.2f} "
                     f"(n={r['n_b']}) | {r['difference']:+.2f} | {ci} | {r['verdict']} |")
    return "\n".join(lines)


def run_compare(path_a: str, path_b: str, seed: int = 0, force: bool = False, html_path: str | None = None) -> int:
    a, b = load(path_a), load(path_b)
    rows, diffs = compare(a, b, seed, force)
    if diffs:
        print("FORCED comparison of different work; what differed:\n" + "\n".join(f"- {d}" for d in diffs))
    for label, rep, path in (("A", a, path_a), ("B", b, path_b)):
        print(f"{label}: {path} ({rep['suite']}, {rep['target'].get('model')} at {rep['target'].get('url')}"
              + (", PARTIAL" if rep.get("partial") else "") + ")")
    print(format_rows(rows))
    rates = pass_rates(a, b, seed)
    if rates:
        print("\nTask pass rates\n" + format_pass_rates(rates))
    if html_path:
        try:
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(compare_page(a, b, path_a, path_b, rows, rates, diffs))
        except OSError as exc:
            raise SuduError(f"cannot write {html_path}: {exc.strerror}") from None
        print(f"A/B view: {html_path}")
    return 0
