"""sudu bench determinism against the toy model behind the fake server: a deterministic server scores 100%
in every condition; a server whose answer changes under load, with the cached prefix, or only in a logprob
is caught in exactly those conditions, with the first divergence at the token where the toy changes it;
bad flags give one line and a non-zero exit."""
import argparse
import glob
import json
import re

import pytest

from sudu import cli as sudu_cli
from sudu.bench import cli as bench_cli
from sudu.bench.determinism import Answer, first_divergence
from sudu.bench.fake_determinism import ToyLM
from sudu.bench.fake_server import FakeServer

DIVERGE_AT = 5


def run_bench(toy: ToyLM, *flags: str, tmp_path) -> dict:
    with FakeServer(toy) as srv:
        parser = argparse.ArgumentParser(prog="sudu")
        bench_cli.register_cli(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["bench", "determinism", "--url", srv.url, "--prompts", "2", "--max-tokens", "10",
                                  "--warmup", "0", "--no-progress", "--out", str(tmp_path), *flags])
        assert args.func(args) == 0
    (path,) = glob.glob(str(tmp_path / "determinism-*.json"))
    assert glob.glob(str(tmp_path / "determinism-*.md"))
    return json.load(open(path))


def shares(report: dict) -> dict:
    return {c: s["share"] for c, s in report["determinism"]["summary"]["conditions"].items()}


def test_deterministic_server_is_100_percent(tmp_path):
    toy = ToyLM(perturb=None, diverge_at=DIVERGE_AT, hold_s=0.2)
    rep = run_bench(toy, "--concurrency", "2,3", "--logprobs", tmp_path=tmp_path)
    conds = rep["determinism"]["summary"]["conditions"]
    assert list(conds) == ["alone (reference)", "repeat", "load c=2", "load c=3", "prefix"]
    assert all(s["share"] == 1.0 and s["compared"] == 4 for c, s in conds.items() if c != "alone (reference)")
    assert rep["determinism"]["summary"]["share"] == 1.0
    # 2 prompts x (greedy, seeded); seeded requests carry a temperature and their own fixed seed
    refs = [r for r in rep["runs"] if r["condition"] == "alone (reference)"]
    assert [r["mode"] for r in refs] == ["greedy", "seeded", "greedy", "seeded"]
    seeded = [b for b in toy.bodies if b.get("temperature", 0) > 0]
    assert seeded and all("seed" in b for b in seeded)
    # the cache state of every run, as the server reported it: the reference cold, the repeat warm
    assert all(r["cached_tokens"] == 0 for r in refs)
    assert all(r["cached_tokens"] > 0 for r in rep["runs"] if r["condition"] == "repeat")
    # the load conditions really ran beside other requests: c-1 other prompts per run
    load_bodies = [b for b in toy.bodies if b["max_tokens"] == 20]  # twice the target's answer
    assert len(load_bodies) == 4 * (1 + 2) and len({json.dumps(b["messages"]) for b in load_bodies}) == 12


def test_divergence_under_load_is_found_at_its_token(tmp_path):
    rep = run_bench(ToyLM(perturb="load", diverge_at=DIVERGE_AT, hold_s=0.2), "--concurrency", "2,4", "--logprobs",
                    tmp_path=tmp_path)
    s = shares(rep)
    assert s["repeat"] == 1.0 and s["prefix"] == 1.0
    assert s["load c=2"] == 0.0 and s["load c=4"] == 0.0
    bad = [r for r in rep["runs"] if r["identical"] is False]
    assert len(bad) == 8
    for r in bad:
        d = r["divergence"]
        assert (d["kind"], d["token_index"], d["token_index_source"]) == ("token", DIVERGE_AT, "logprobs")
        ref = next(x for x in rep["runs"] if x["request"] == r["request"] and x["condition"] == "alone (reference)")
        assert r["tokens"][:DIVERGE_AT] == ref["tokens"][:DIVERGE_AT] and r["tokens"][DIVERGE_AT] != ref["tokens"][DIVERGE_AT]
    md = open(glob.glob(str(tmp_path / "determinism-*.md"))[0]).read()
    assert f"token {DIVERGE_AT} (logprobs)" in md


def test_cache_dependence_without_logprobs_gives_the_character_place(tmp_path):
    rep = run_bench(ToyLM(perturb="cache", diverge_at=DIVERGE_AT, hold_s=0.05), "--concurrency", "2",
                    "--modes", "greedy", tmp_path=tmp_path)
    s = shares(rep)
    # every run after the reference finds a cached prefix; the prefix run's cached part differs from its twin's
    assert s == {"alone (reference)": None, "repeat": 0.0, "load c=2": 0.0, "prefix": 0.0}
    for r in rep["runs"]:
        if r["condition"] == "alone (reference)":
            continue
        ref = next(x for x in rep["runs"] if x["request"] == r["request"] and x["condition"] == "alone (reference)")
        if r["condition"] == "prefix":
            ref = {"text": r["twin_repeat"]["text"]}
            assert 0 < r["cached_tokens"] < r["twin_repeat"]["cached_tokens"]
        d = r["divergence"]
        words = re.findall(r" \S+", ref["text"])
        assert d["kind"] == "text" and d["token_index"] is None  # the fake model has no tokenizer to recount with
        c = d["char_index"]  # the first different character: in the word the toy changed first
        assert len("".join(words[:DIVERGE_AT])) <= c
        if r["condition"] != "prefix":
            # against the unperturbed reference the changed word always differs; the prefix run's twin is itself
            # perturbed (another cached length), and two perturbed variants may pick the same word there
            assert c < len("".join(words[:DIVERGE_AT + 1]))
        assert r["text"][:c] == ref["text"][:c] and r["text"][c] != ref["text"][c]


def test_logprob_only_difference_is_reported_apart(tmp_path):
    rep = run_bench(ToyLM(perturb="logprobs", diverge_at=DIVERGE_AT, hold_s=0.2), "--concurrency", "2",
                    "--modes", "greedy", "--logprobs", tmp_path=tmp_path)
    load = rep["determinism"]["summary"]["conditions"]["load c=2"]
    assert load["share"] == 0.0 and load["logprob_only_divergences"] == 2 and load["token_divergences"] == 0
    r = next(r for r in rep["runs"] if r["condition"] == "load c=2")
    assert r["divergence"]["kind"] == "logprob" and r["divergence"]["token_index"] == DIVERGE_AT


def test_completions_api(tmp_path):
    toy = ToyLM(perturb=None, hold_s=0.05)
    rep = run_bench(toy, "--api", "completions", "--concurrency", "2", "--logprobs", "--prompts", "1", tmp_path=tmp_path)
    assert rep["determinism"]["summary"]["share"] == 1.0
    assert all("prompt" in b and "messages" not in b for b in toy.bodies)
    assert all(r["tokens"] for r in rep["runs"])


def test_first_divergence_by_text_counts_tokens_with_a_tokenizer():
    ref, run = Answer(True, text="one two three four"), Answer(True, text="one two thrice four")
    d = first_divergence(ref, run, lambda s: len(s.split()))
    assert d["char_index"] == len("one two thr") and d["token_index"] == 2  # "three" is token 2
    d = first_divergence(ref, Answer(True, text="one two three\nfour"), lambda s: len(s.split()))
    assert d["char_index"] == len("one two three") and d["token_index"] == 3
    assert first_divergence(ref, Answer(True, text="one two three four"), None) is None


@pytest.mark.parametrize("flags,message", [
    (["--concurrency", "1"], "--concurrency levels must be >= 2"),
    (["--modes", "greedy,hot"], "--modes"),
    (["--prefix-fraction", "1.5"], "--prefix-fraction"),
    (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
    (["--temperature", "0"], "--temperature"),
    (["--url", "http://127.0.0.1:9"], "cannot reach"),
])
def test_bad_input_is_one_line_and_nonzero(flags, message, capsys):
    url = [] if "--url" in flags else ["--url", "http://127.0.0.1:9"]
    assert sudu_cli.main(["bench", "determinism", "--no-progress", *url, *flags]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


def test_a_local_server_that_never_gets_healthy_is_stopped(tmp_path, monkeypatch):
    """No --url and a server that stays unhealthy past --server-timeout: one-line error, and the process
    bench started is not left running (it was, when the wait gave up before start() returned)."""
    import subprocess
    import sys

    from sudu.bench import local_server

    monkeypatch.setattr(local_server, "serve_command",
                        lambda port, model, extra="": [sys.executable, "-c", "import time; time.sleep(60)"])
    procs = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(local_server.subprocess, "Popen", lambda *a, **kw: procs.append(real_popen(*a, **kw)) or procs[-1])
    assert sudu_cli.main(["bench", "determinism", "--no-progress", "--server-timeout", "1", "--out", str(tmp_path)]) == 1
    assert procs and procs[0].poll() is not None
