"""sudu bench end to end against the fake server: every suite writes JSON/Markdown/HTML reports with
the definitions; tasks pass only with checked answers (every call counted); cache contradictions and
token-count gaps are flagged; Ctrl-C leaves a partial report; compare gives ratios with CIs and refuses
mismatched cache states; the embedded-default path starts, waits for and stops a server."""
import argparse
import re
import sys
import time

import pytest

from sudu.bench import cli as bench_cli
from sudu.bench import local_server, suites, tokens
from sudu.bench.fake_server import FakeServer, chat_script
from sudu.errors import SuduError
from tests.helpers.code_answers import GOOD_PALINDROME, GOOD_SQL, GOOD_SVG, needs_sandbox
from tests.helpers.bench_cli import read_report, run_cli


def _answer(body) -> str:
    msgs = body["messages"]
    prompt = next(m["content"] for m in msgs if m["role"] == "user")
    retry = any(m["role"] == "assistant" for m in msgs)
    if "north vault" in prompt:
        return re.search(r"north vault is (\d+)", prompt).group(1)
    if "longest_palindrome" in prompt:
        return GOOD_PALINDROME
    if "SQLite" in prompt:
        return GOOD_SQL
    if "SVG" in prompt:  # wrong first (no text element), right after the checker's feedback
        return GOOD_SVG if retry else GOOD_SVG.replace(">sudu<", "><")
    if "asyncio" in prompt:
        return "I would rather not."  # never passes
    return "The sky is blue because of Rayleigh scattering of sunlight by air molecules."


_SEEN_PREFIXES = set()  # a toy prefix cache: the first message counts as cached once seen


def script(body):
    text = _answer(body)
    words = re.findall(r"\S+\s*", text)
    pieces = [(0.002 + 0.0005 * i, w) for i, w in enumerate(words)]
    first = body["messages"][0]["content"]
    warm = first in _SEEN_PREFIXES
    _SEEN_PREFIXES.add(first)
    usage = {"prompt_tokens": 40, "completion_tokens": len(words), "total_tokens": 40 + len(words),
             "prompt_tokens_details": {"cached_tokens": 32 if warm else 0}}
    running = [1] * len(pieces) if body["stream_options"].get("continuous_usage_stats") else None
    return chat_script(pieces, usage=usage, model=body["model"], continuous_usage_tokens=running,
                       sudu={"queue_s": 0.0, "prefill_s": 0.001, "decode_s": 0.0005 * len(words), "cached_tokens": 0})


@pytest.fixture(scope="module")
def server():
    with FakeServer(script) as srv:
        yield srv


def test_single_writes_reports(server, tmp_path, capsys):
    assert run_cli(["single", "--url", server.url, "-n", "12", "--out", str(tmp_path), "--warmup", "1"]) == 0
    path, rep = read_report(tmp_path, "single")
    assert rep["schema"] == "sudu-bench/1" and not rep["partial"]
    assert set(rep["definitions"]) >= {"ttft_s", "tpot_s", "itl_s", "e2e_s", "throughput_tok_s", "cache_state"}
    assert rep["server_info"]["models"]["data"][0]["id"] == "fake" and rep["target"]["model"] == "fake"
    # 1 warm-up, 1 probe for per-chunk usage (excluded too), 12 measured
    assert len(rep["records"]) == 14 and sum(r["warmup"] for r in rep["records"]) == 2
    assert rep["groups"][0]["chunk_token_source"] == {"server:usage": 12}
    assert any("per-chunk token counts from the server" in n for n in rep["notes"])
    assert rep["config"]["sampling"] == {"temperature": 0.0}
    assert rep["groups"][0]["params"]["prompt_set"].startswith("chat-code@")
    sent = [next(m["content"] for m in body["messages"] if m["role"] == "user") for body in server.requests[-12:]]
    assert len(set(sent)) == 12  # varied prompts, not one question repeated
    g = rep["groups"][0]
    assert g["cache_state"] == "cold" and g["n_requests"] == 12 and g["metrics"]["ttft_s"]["ci_low"] is not None
    assert "attribution" in g and rep["environment"]["python"]
    assert rep["token_recount"].startswith("not recounted")
    html = open(path.replace(".json", ".html")).read()
    # interactive charts with plotly.js inlined: no script or style loaded from anywhere
    assert html.count("Plotly.newPlot") >= 3 and "<script src" not in html and "id='headline'" in html
    md = open(path.replace(".json", ".md")).read()
    pngs = re.findall(r"!\[[^]]+\]\(([^)]+\.png)\)", md)
    assert len(pngs) >= 3 and all((tmp_path / p).stat().st_size > 1000 for p in pngs)
    out = capsys.readouterr().out
    assert "| single | cold |" in out and "## Definitions" in out


def test_throughput_sweep_and_goodput(server, tmp_path):
    run_cli(["throughput", "--url", server.url, "--concurrency", "1,4", "--rate", "200", "-n", "12",
             "--slo", "ttft=1s,tpot=1s", "--out", str(tmp_path), "--no-html"])
    _, rep = read_report(tmp_path, "throughput")
    names = [g["name"] for g in rep["groups"]]
    assert names == ["concurrency=1", "concurrency=4", "rate=200"]
    for g in rep["groups"]:
        assert g["n_ok"] == 12 and g["throughput"]["mean_tok_s"] > 0
        assert g["goodput"]["good_requests"] == 12
    assert rep["groups"][2]["params"]["arrival"] == "poisson"


def _max_in_flight(records) -> int:
    events = sorted([(r["t_sent_s"], 1) for r in records] + [(r["t_sent_s"] + r["done_s"], -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_concurrency_limits_hold(server, tmp_path):
    run_cli(["throughput", "--url", server.url, "--concurrency", "3", "--rate", "500", "--max-concurrency", "2",
             "-n", "15", "--warmup", "0", "--out", str(tmp_path), "--no-html"])
    _, rep = read_report(tmp_path, "throughput")
    for name, limit in (("concurrency=3", 3), ("rate=500", 2)):
        recs = [r for r in rep["records"] if r["group"] == name]
        assert len(recs) == 15 and _max_in_flight(recs) <= limit
    assert rep["groups"][1]["params"]["max_concurrency"] == 2


def test_cache_suite_flags_contradictions(server, tmp_path):
    # the fake server reports 32 cached tokens when it has seen the first message before: the salt keeps
    # cold prompts at 0, warm and shared-prefix ones hit: no contradiction
    run_cli(["cache", "--url", server.url, "--lengths", "50", "-n", "2", "--out", str(tmp_path), "--no-html"])
    _, rep = read_report(tmp_path, "cache")
    assert [g["cache_state"] for g in rep["groups"]] == ["cold", "warm", "shared-prefix"]
    assert rep["groups"][1]["observed_cache"]["mean_cached_tokens"] == 32
    assert rep["flags"] == []


def test_cache_contradiction_flagged(tmp_path):
    def liar(body):
        usage = {"prompt_tokens": 400, "completion_tokens": 1, "total_tokens": 401, "prompt_cache_hit_tokens": 384}
        return chat_script([(0.001, "x")], usage=usage)

    with FakeServer(liar) as srv:
        run_cli(["single", "--url", srv.url, "-n", "2", "--warmup", "0", "--out", str(tmp_path), "--no-html"])
    _, rep = read_report(tmp_path, "single")
    assert len(rep["flags"]) == 2 and "declared cold but 384 cached tokens" in rep["flags"][0]


@needs_sandbox
def test_tasks_are_checked_and_every_call_counted(server, tmp_path):
    run_cli(["tasks", "--url", server.url, "--out", str(tmp_path), "--context-len", "1024", "--no-html"])
    _, rep = read_report(tmp_path, "tasks")
    by_task = {t["task"]: t for t in rep["task_runs"]}
    for name in ("retrieval", "palindrome", "sql"):
        assert by_task[name]["passed"] and by_task[name]["calls"] == 1 and by_task[name]["task_time_s"] > 0
    assert by_task["svg"]["passed"] and by_task["svg"]["calls"] == 2
    assert by_task["async_refactor"]["passed"] is False and by_task["async_refactor"]["task_time_s"] is None
    assert by_task["async_refactor"]["calls"] == 3
    svg_records = [r for r in rep["records"] if r["task"] == "svg"]
    assert [(r["group"], r["cache_state"]) for r in svg_records] == [("task svg", "cold"),
                                                                    ("task svg retries", "shared-prefix")]
    groups = {g["name"]: g for g in rep["groups"]}
    # first attempts and retries are reported apart: the cold group holds only first attempts
    assert groups["task svg"]["n_requests"] == 1 and groups["task svg retries"]["n_requests"] == 1
    assert groups["task async_refactor retries"]["n_requests"] == 2 and "task sql retries" not in groups
    assert groups["task svg retries"]["observed_cache"]["mean_cached_tokens"] == 32  # the fake server's reuse
    assert not [f for f in rep["flags"] if "declared" in f]
    summary = {t["task"]: t for t in rep["tasks"]}
    assert summary["svg"]["pass_at_1"] == 0.0 and summary["svg"]["pass_rate"] == 1.0
    assert summary["sql"]["pass_at_1"] == 1.0 and summary["sql"]["first_attempt_task_time_s"]["n"] == 1
    assert rep["config"]["context_len_used"] == 1024


def test_interrupt_writes_partial_report(server, tmp_path, monkeypatch):
    real_send = suites.send
    calls = {"n": 0}

    async def flaky_send(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return await real_send(*a, **kw)

    monkeypatch.setattr(suites, "send", flaky_send)
    with pytest.raises(KeyboardInterrupt):
        run_cli(["single", "--url", server.url, "-n", "10", "--warmup", "0", "--out", str(tmp_path), "--no-html"])
    _, rep = read_report(tmp_path, "single")
    assert rep["partial"] is True and len(rep["records"]) == 4
    assert any("interrupted" in n for n in rep["notes"])


def test_compare_two_real_reports(server, tmp_path, capsys):
    for name in ("a", "b"):
        run_cli(["single", "--url", server.url, "-n", "10", "--out", str(tmp_path / name), "--no-html"])
    pa, pb = read_report(tmp_path / "a")[0], read_report(tmp_path / "b")[0]
    assert run_cli(["compare", pa, pb]) == 0
    out = capsys.readouterr().out
    assert "| single | cold | ttft_s |" in out and "FORCED" not in out


def test_bad_flags_are_one_line_errors(server, tmp_path):
    for argv in (["throughput", "--concurrency", "", "--rate", ""], ["tasks", "--tasks", "chess"],
                 ["throughput", "--slo", "speed=3"], ["single", "-n", "0"]):
        with pytest.raises(SuduError):
            run_cli(argv + ["--url", server.url, "--out", str(tmp_path)])


def test_unreachable_server_is_a_one_line_error(tmp_path):
    with pytest.raises(SuduError, match="cannot reach"):
        run_cli(["single", "--url", "http://127.0.0.1:1", "--model", "m", "--out", str(tmp_path)])


def test_failed_requests_are_flagged(tmp_path):
    from sudu.bench.fake_server import ScriptedResponse

    with FakeServer(lambda body: ScriptedResponse(status=429, body=b'{"error": {"message": "queue full"}}')) as srv:
        run_cli(["single", "--url", srv.url, "-n", "3", "--warmup", "0", "--out", str(tmp_path), "--no-html"])
    _, rep = read_report(tmp_path, "single")
    assert rep["groups"][0]["n_ok"] == 0
    assert rep["flags"] == ["single: 3 of 3 requests failed (HTTP 429: {\"error\": {\"message\": \"queue full\"}})"]


def test_embedded_default_starts_waits_and_stops_a_server(tmp_path, monkeypatch):
    """No --url: a server process is started on a free port, /health is awaited, the suite runs against
    it and the process is stopped. (The fake server stands in for `sudu serve` here.)"""
    started = []

    def fake_serve(port, model, extra=""):
        started.append(port)
        return [sys.executable, "-m", "sudu.bench.fake_server", "--port", str(port)]

    monkeypatch.setattr(local_server, "serve_command", fake_serve)
    procs = []
    real_popen = local_server.subprocess.Popen

    def popen(*a, **kw):
        procs.append(real_popen(*a, **kw))
        return procs[-1]

    monkeypatch.setattr(local_server.subprocess, "Popen", popen)
    t0 = time.perf_counter()
    run_cli(["single", "-n", "2", "--warmup", "0", "--out", str(tmp_path), "--no-html"])
    wall_s = time.perf_counter() - t0
    _, rep = read_report(tmp_path, "single")
    assert rep["target"]["url"] == f"http://127.0.0.1:{started[0]}/v1"
    # the wait for /health is a real span of the run: the process needs time to start answering
    assert 0 < rep["target"]["local_server"]["ready_after_s"] < wall_s
    assert procs[0].poll() is not None  # stopped


def test_embedded_default_reports_a_server_that_dies(tmp_path, monkeypatch):
    monkeypatch.setattr(local_server, "serve_command",
                        lambda port, model, extra="": [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"])
    with pytest.raises(SuduError, match="exited with code 3"):
        run_cli(["single", "-n", "2", "--out", str(tmp_path), "--no-html"])


def test_per_chunk_usage_probe_and_fallback(tmp_path):
    """A server that rejects continuous_usage_stats is not asked again: usage is apportioned over the
    chunks (sum = usage) and the report says so; a server whose per-chunk counts contradict its usage is
    flagged, one whose counts agree is not."""
    def strict(body):
        if body["stream_options"].get("continuous_usage_stats"):
            from sudu.bench.fake_server import ScriptedResponse

            return ScriptedResponse(status=400, body=b'{"error": {"message": "unknown field continuous_usage_stats"}}')
        return chat_script([(0.001, "ab"), (0.002, "cdef")], usage={"prompt_tokens": 3, "completion_tokens": 5,
                                                                    "total_tokens": 8})

    with FakeServer(strict) as srv:
        run_cli(["single", "--url", srv.url, "-n", "3", "--warmup", "0", "--out", str(tmp_path / "a"), "--no-html"])
    _, rep = read_report(tmp_path / "a", "single")
    assert any("rejected stream_options.continuous_usage_stats" in n for n in rep["notes"])
    measured = [r for r in rep["records"] if not r["warmup"]]
    assert all("continuous_usage_stats" not in srv.requests[i + 1]["stream_options"] for i in range(3))
    assert all(r["ok"] and sum(r["chunk_tokens"]) == 5 and r["token_source"] == "usage apportioned by characters"
               for r in measured)
    assert rep["flags"] == []

    def liar(body):
        return chat_script([(0.001, "ab"), (0.002, "cd")], continuous_usage_tokens=[1, 1],
                           usage={"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12})

    with FakeServer(liar) as srv:
        run_cli(["single", "--url", srv.url, "-n", "2", "--warmup", "0", "--out", str(tmp_path / "b"), "--no-html"])
    _, rep = read_report(tmp_path / "b", "single")
    assert len(rep["flags"]) == 2 and "per-chunk counts sum to 2, usage says 9" in rep["flags"][0]


def test_recount_gap_is_a_note_when_the_server_counts_per_chunk(server, tmp_path, monkeypatch):
    """Repetitive text re-tokenizes into fewer tokens than were generated: with the server's per-chunk
    counts adding up to usage that is not a flag (the figures do not rest on the recount); without
    them it is."""
    monkeypatch.setattr(tokens, "load_token_counter", lambda model: (lambda text: max(1, len(text.split()) // 2),
                                                                      "recounted (test)"))
    run_cli(["single", "--url", server.url, "-n", "2", "--warmup", "0", "--out", str(tmp_path / "a"), "--no-html"])
    _, rep = read_report(tmp_path / "a", "single")
    assert rep["flags"] == [] and any("re-tokenizes differently" in n for n in rep["notes"])
    run_cli(["single", "--url", server.url, "-n", "2", "--warmup", "0", "--chunk-usage", "off",
             "--out", str(tmp_path / "b"), "--no-html"])
    _, rep = read_report(tmp_path / "b", "single")
    assert len(rep["flags"]) == 2 and "tokenizer counts" in rep["flags"][0]


def test_code_tasks_refused_for_remote_endpoints_and_without_sandbox(tmp_path, monkeypatch):
    from sudu.bench.tasks import sandbox

    argv = ["tasks", "--url", "http://10.1.2.3:8000", "--model", "m", "--out", str(tmp_path)]
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: None)  # the remote check, with or without bwrap here
    with pytest.raises(SuduError, match="not a loopback address.*--allow-remote-code"):
        run_cli(argv + ["--tasks", "palindrome,sql"])
    for tasks, allow in ((["sql"], False), (["palindrome", "sql"], True)):  # no code tasks, or the flag: accepted
        bench_cli.check_code_tasks(argparse.Namespace(task_list=tasks, url="http://10.1.2.3:8000",
                                                      allow_remote_code=allow))
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: "bubblewrap (bwrap) is not installed")
    with pytest.raises(SuduError, match="without a sandbox: bubblewrap"):
        run_cli(["tasks", "--url", "http://127.0.0.1:1", "--model", "m", "--tasks", "async_refactor",
                 "--out", str(tmp_path)])
