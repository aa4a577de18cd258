"""Where the cores go while one stream decodes: `sudu serve` (plain, or with --replicas) is started, and
for a few greedy streams of fixed length the client reports tokens per second after the first and the
CPU each process took (percent of one core), plus, for a Ray replica, each of its threads. An engine
whose compute threads sit well under 100% of a core while they decode is waiting, not computing: that
is how the replica's second OpenMP team and its nice-15 threads showed up (docs/cluster.md).
Then per stream: wakeups per second over all threads, and how often the two busiest (the engine's) were
preempted.
With --renice N the streams alternate between two priorities: every thread of the server's process tree
(the ingress, Ray's processes, the replica's own threads) but the engine's two compute threads at nice 0,
then at nice N, and the two medians are compared (root only: the priority is raised back between streams).

    flock /tmp/sudu-bench.lock python -m benchmarks.cluster_cpu [--serve-args "--replicas 1"] [--streams 4] [--renice 19]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from sudu.bench.local_server import free_port, serve_command, stop_server, wait_for_health


def cpu_seconds() -> dict[int, tuple[float, str]]:
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            t = p.cpu_times()
            out[p.pid] = (t.user + t.system, " ".join(p.info["cmdline"] or [p.info["name"]])[:80])
        except (psutil.Error, OSError):
            pass
    return out


def replica_thread_seconds() -> dict[int, tuple[float, str]]:
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        if "ServeReplica" not in " ".join(p.info["cmdline"] or []):
            continue
        try:
            for t in p.threads():
                try:
                    name = open(f"/proc/{p.pid}/task/{t.id}/comm").read().strip()
                except OSError:
                    name = "?"
                out[t.id] = (t.user_time + t.system_time, f"replica {p.pid} thread {name}")
        except (psutil.Error, OSError):
            pass
    return out


def thread_counters() -> dict[tuple[int, int], tuple[int, int, float]]:
    """(pid, tid) -> (voluntary, involuntary) context switches and CPU seconds so far, of every thread. On a
    machine whose cores the engine keeps busy, every wakeup lands on a core one of its threads was running
    on: a thread's voluntary switches count how often it went to sleep (and so woke), the engine threads'
    involuntary ones how often they were preempted."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in psutil.pids():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/task/{tid}/status") if ":" in line)
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            except OSError:
                continue
            utime, stime = stat[stat.rindex(")") + 2:].split()[11:13]  # fields 14 and 15 of proc(5)
            out[(pid, int(tid))] = (int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]),
                                    (int(utime) + int(stime)) / tick)
    return out


def busiest_threads(before: dict, after: dict, keys, n: int = 2) -> list:
    """The n of keys (thread_counters keys) that used the most CPU from before to after (a thread born in
    between counts from zero)."""
    return sorted(keys, key=lambda k: after[k][2] - before.get(k, (0, 0, 0.0))[2], reverse=True)[:n]


def report_switches(before: dict, after: dict, wall: float) -> None:
    """Wakeups per second over every thread, and the preemptions of the two busiest threads (the engine's)."""
    common = [k for k in after if k in before]
    wakeups = sum(after[k][0] - before[k][0] for k in common)
    busiest = busiest_threads(before, after, common)
    preempted = ", ".join(f"{(after[k][1] - before[k][1]) / wall:.0f}" for k in busiest)
    print(f"  wakeups (voluntary switches, all threads): {wakeups / wall:.0f}/s; the two busiest threads "
          f"preempted {preempted}/s")


def report(before: dict, after: dict, wall: float, label: str, top: int) -> None:
    rows = sorted(((c - before.get(k, (0.0, ""))[0], k, name) for k, (c, name) in after.items()), reverse=True)
    print(f"  {label} ({wall:.1f} s):")
    for used, key, name in rows[:top]:
        if used / wall >= 0.005:
            print(f"    {100 * used / wall:6.1f}% of a core  {key:>7}  {name}")


def renice_all_but_engine(server_pid: int, engine: set[int], nice: int) -> int:
    """Every thread of the server's process tree except `engine` (thread ids) to `nice`; returns how many."""
    n = 0
    root = psutil.Process(server_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            if tid in engine:
                continue
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                n += 1
            except OSError:
                pass
    return n


def stream(url: str, model: str, prompt: str, tokens: int) -> tuple[int, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    first = last = None
    usage = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"]["completion_tokens"]
                continue
            last = time.perf_counter()
            first = first or last
    return usage, (last - first) if first and last else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: sudu serve's default model")
    p.add_argument("--serve-args", default="--replicas 1", help="extra `sudu serve` flags ('' for plain)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--top", type=int, default=8, help="processes (threads) listed per stream")
    p.add_argument("--renice", type=int, default=None, metavar="N",
                   help="alternate the streams between nice 0 and nice N for every thread but the engine's two")
    args = p.parse_args()
    if args.renice is not None and os.geteuid() != 0:
        sys.exit("cluster_cpu: --renice needs root (each stream at nice 0 raises the threads' priority back)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = f"--disk-cache-size 0 --speculative none --num-threads {args.threads} {args.serve_args}"
    if "--replicas" in args.serve_args and "--replica-cpus" not in args.serve_args:
        extra += f" --replica-cpus {args.threads}"
    log = tempfile.NamedTemporaryFile(prefix="cluster-cpu-", suffix=".log", delete=False)
    proc = subprocess.Popen(serve_command(port, args.model, extra), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_health(proc, url, 900, log.name)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm = thread_counters()
        stream(url, model, "warm up", 64)
        after = thread_counters()
        engine = {tid for _, tid in busiest_threads(warm, after, after)}
        print(f"sudu serve {extra}")
        speeds: dict[int, list[float]] = {}
        for i in range(args.streams):
            nice = 0 if args.renice is None or i % 2 == 0 else args.renice
            if args.renice is not None:
                n = renice_all_but_engine(proc.pid, engine, nice)
                print(f"nice {nice} for {n} threads (the engine's {sorted(engine)} stay at 0)")
            procs, threads, counters = cpu_seconds(), replica_thread_seconds(), thread_counters()
            t0 = time.perf_counter()
            tokens, decode_s = stream(url, model, f"{i}: write a long story about a lighthouse keeper", args.tokens)
            wall = time.perf_counter() - t0
            if tokens < 2 or decode_s <= 0:
                sys.exit(f"cluster_cpu: stream {i + 1} returned {tokens} tokens; nothing to time (log: {log.name})")
            speeds.setdefault(nice, []).append((tokens - 1) / decode_s)
            print(f"stream {i + 1}: {tokens} tokens, {(tokens - 1) / decode_s:.1f} tok/s after the first")
            report(procs, cpu_seconds(), wall, "processes", args.top)
            if threads:
                report(threads, replica_thread_seconds(), wall, "the replica's threads", args.top)
            report_switches(counters, thread_counters(), wall)
        if args.renice is not None and len(speeds) == 2:
            med = {k: statistics.median(v) for k, v in speeds.items()}
            print(f"median tok/s: nice 0 {med[0]:.1f}, nice {args.renice} {med[args.renice]:.1f} "
                  f"({med[args.renice] / med[0]:.3f}x, {len(speeds[0])} and {len(speeds[args.renice])} streams)")
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
