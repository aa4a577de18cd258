"""`sudu bench compare A.json B.json`: for every workload point present in both reports, the ratio
B/A of each metric's mean with a bootstrap 95% CI and a verdict; "not significant" when the CI
contains 1. Points whose declared cache states differ are never put side by side: the comparison is
refused."""
from __future__ import annotations

import json

from sudu.bench.metrics import SCHEMA
from sudu.bench.stats import ratio_ci
from sudu.errors import SuduError

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


def samples(report: dict, group: str, metric: str) -> list[float]:
    if metric == "throughput_tok_s":
        g = next(g for g in report["groups"] if g["name"] == group)
        return g["throughput"].get("per_second_tok") or []
    if metric == "task_time_s":
        task = group.removeprefix("task ")
        return [r["task_time_s"] for r in report.get("task_runs", []) if r["task"] == task and r["passed"]]
    recs = [r for r in report["records"] if r["group"] == group and not r["warmup"] and r["ok"]]
    if metric == "itl_s":
        return [g for r in recs for g in r["metrics"].get("itl_s", [])]
    return [r["metrics"][metric] for r in recs if r["metrics"].get(metric) is not None]


def compare(a: dict, b: dict, seed: int = 0) -> list[dict]:
    """Rows: group, metric, mean_a, mean_b, ratio (B/A) with CI, verdict. SuduError on a cache-state
    mismatch or when the reports share no workload point."""
    groups_a = {g["name"]: g for g in a["groups"]}
    groups_b = {g["name"]: g for g in b["groups"]}
    common = [name for name in groups_a if name in groups_b]
    if not common:
        raise SuduError("the two reports share no workload point (group names differ); nothing to compare")
    mismatched = [f"{n}: A is {groups_a[n]['cache_state']}, B is {groups_b[n]['cache_state']}"
                  for n in common if groups_a[n]["cache_state"] != groups_b[n]["cache_state"]]
    if mismatched:
        raise SuduError("refusing to compare different cache states side by side: " + "; ".join(mismatched))
    rows = []
    for name in common:
        for metric, higher_better in METRICS.items():
            xa, xb = samples(a, name, metric), samples(b, name, metric)
            if not xa and not xb:
                continue
            r = ratio_ci(xa, xb, seed=seed)
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
                "mean_a": sum(xa) / len(xa) if xa else None,
                "mean_b": sum(xb) / len(xb) if xb else None,
                **r.to_dict(),
                "verdict": verdict,
            })
    return rows


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


def run_compare(path_a: str, path_b: str, seed: int = 0) -> int:
    a, b = load(path_a), load(path_b)
    for label, rep, path in (("A", a, path_a), ("B", b, path_b)):
        print(f"{label}: {path} ({rep['suite']}, {rep['target'].get('model')} at {rep['target'].get('url')}"
              + (", PARTIAL" if rep.get("partial") else "") + ")")
    print(format_rows(compare(a, b, seed)))
    return 0
