"""sudu bench against sudu's own server on a tiny model, through the embedded-default path (no --url:
bench starts `sudu serve`, waits for /health, runs, stops it): cold requests observe 0 cached tokens,
warm and shared-prefix ones observe them, and no cache state is flagged; the report carries sudu's
timing breakdown."""
from tests.helpers.bench_cli import read_report, run_cli


def test_cache_states_observed_on_sudu_serve(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["llama"])
    code = run_cli(["cache", "--model", model, "--lengths", "60", "-n", "3", "--max-tokens", "4",
                    "--out", str(tmp_path), "--no-html", "--server-timeout", "300"])
    assert code == 0
    _, rep = read_report(tmp_path, "cache")
    groups = {g["cache_state"]: g for g in rep["groups"]}
    assert groups["cold"]["observed_cache"]["mean_cached_tokens"] == 0
    assert groups["warm"]["observed_cache"]["mean_cached_tokens"] >= 48
    assert groups["shared-prefix"]["observed_cache"]["mean_cached_tokens"] >= 16
    # a random tiny model emits byte fragments, so re-encoding its text may not give its token count back:
    # only cache-state flags matter here
    assert not [f for f in rep["flags"] if "cache" in f or "cached" in f]
    records = [r for r in rep["records"] if not r["warmup"]]
    # the server's prefill is a real span inside what the client saw: request sent -> finish chunk
    assert records and all(r["sudu"] and 0 < r["sudu"]["prefill_s"] < r["finish_s"] for r in records)
