"""The structured suite against the fake server: every request carries `response_format` json_schema
with its schema, every answer is validated with jsonschema; a server that follows the schemas gets 100%,
one that breaks them (a bound, an enum, a missing field, prose around the JSON, a cut answer) is counted
and flagged; greedy unless --temperature; bad flags and a missing jsonschema are one-line errors."""
import json
import sys

import pytest

from sudu.bench import structured
from sudu.bench.fake_server import FakeServer, chat_script
from sudu.errors import SuduError
from tests.helpers.bench_cli import read_report, run_cli

VALID = {
    "person": {"name": "Ana", "age": 31, "languages": ["Python", "Go"], "remote": True},
    "order": {"order_id": 4821, "customer": {"name": "Bo", "country": "SE"},
              "items": [{"sku": "KET-001", "quantity": 2, "unit_price": 19.5}], "status": "shipped"},
    "weather": {"city": "Oslo", "temperature_c": -3.5, "conditions": "snow",
                "forecast": [{"day": "Mon", "high_c": -1, "low_c": -8}]},
    "event": {"title": "Python meetup", "date": "2025-04-12", "location": {"venue": "The Loft", "lat": 53.35,
              "lon": -6.26}, "attendees": ["Dara"], "online": False},
    "review": {"product": "Headphones", "rating": 2, "sentiment": "negative", "pros": ["cheap"], "cons": []},
    "service_config": {"service": "web-api", "replicas": 3, "environment": "prod", "ports": [8080],
                       "resources": {"cpu_cores": 0.5, "memory_mb": 512}},
}

BROKEN = {  # one way each schema can be broken by a server that does not enforce it
    "person": lambda v: {**v, "age": 130},
    "order": lambda v: {**v, "items": [{**v["items"][0], "sku": "ket-1"}]},
    "weather": lambda v: {**v, "conditions": "windy"},
    "event": lambda v: {k: x for k, x in v.items() if k != "online"},
    "review": lambda v: {**v, "verdict": "meh"},
    "service_config": lambda v: {**v, "resources": {"cpu_cores": 0, "memory_mb": 512}},
}


def _schema_of(body) -> str:
    rf = body["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["strict"] is True
    name = rf["json_schema"]["name"]
    assert rf["json_schema"]["schema"] == structured.SCHEMAS[name]
    return name


def server_script(broken: set[str] = frozenset(), prose: bool = False, cut: bool = False):
    def script(body):
        if "response_format" not in body:  # warm-up and probe requests
            return chat_script([(0.001, "ok")], usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6})
        name = _schema_of(body)
        value = BROKEN[name](VALID[name]) if name in broken else VALID[name]
        text = json.dumps(value)
        if prose:
            text = "Here it is:\n```json\n" + text + "\n```"
        if cut:
            text = text[: len(text) // 2]
        pieces = [(0.001, text[i:i + 6]) for i in range(0, len(text), 6)]
        usage = {"prompt_tokens": 30, "completion_tokens": len(pieces), "total_tokens": 30 + len(pieces)}
        return chat_script(pieces, usage=usage)
    return script


def _run(tmp_path, script, *flags):
    with FakeServer(script) as srv:
        run_cli(["structured", "--url", srv.url, "--out", str(tmp_path), "--no-html", "--warmup", "1", *flags])
        requests = list(srv.requests)
    return read_report(tmp_path, "structured")[1], requests


def test_valid_answers_are_100_percent(tmp_path, capsys):
    rep, requests = _run(tmp_path, server_script(), "-n", "14", "--concurrency", "3")
    s = rep["structured"]
    assert (s["n"], s["valid"], s["validity_rate"]) == (14, 14, 1.0)
    assert set(s["schemas"]) == set(structured.SCHEMAS) and s["schemas"]["person"]["n"] == 3
    sent = [b for b in requests if "response_format" in b]
    assert len(sent) == 14 and all(b["temperature"] == 0.0 and "seed" not in b for b in sent)
    assert len({b["messages"][-1]["content"] for b in sent}) == 14  # schema x prompt pairs, no repeats
    g = rep["groups"][0]
    assert g["name"] == "structured" and g["n_ok"] == 14 and g["throughput"]["mean_tok_s"] > 0
    assert rep["config"]["sampling"] == {"temperature": 0.0} and not rep["flags"]
    assert "| all | 14/14 | 100.0% |" in capsys.readouterr().out


@pytest.mark.parametrize("schema", list(structured.SCHEMAS))
def test_each_broken_schema_is_caught(tmp_path, schema):
    rep, _ = _run(tmp_path, server_script(broken={schema}), "-n", "6")
    s = rep["structured"]
    assert s["valid"] == 5 and s["schemas"][schema]["valid"] == 0 and s["schemas"][schema]["first_error"]
    assert any(f.startswith("structured: 1 of 6 answers not valid") for f in rep["flags"])


@pytest.mark.parametrize("kind", ["prose", "cut"])
def test_prose_or_cut_json_is_not_valid(tmp_path, kind):
    rep, _ = _run(tmp_path, server_script(**{kind: True}), "-n", "3", "--schemas", "order,event")
    s = rep["structured"]
    assert s["valid"] == 0 and s["first_error"].startswith("not JSON")
    assert set(s["schemas"]) == {"order", "event"}


def test_sampled_requests_carry_a_seed(tmp_path):
    rep, requests = _run(tmp_path, server_script(), "-n", "4", "--temperature", "0.7", "--seed", "10")
    sent = [b for b in requests if "response_format" in b]
    assert [b["seed"] for b in sent] == [10, 11, 12, 13] and all(b["temperature"] == 0.7 for b in sent)
    assert rep["config"]["sampling"] == {"temperature": 0.7}


def test_schemas_are_valid_and_the_examples_match():
    checks = structured.make_validators(list(structured.SCHEMAS))
    for name, value in VALID.items():
        assert checks[name](value) is None, name
        assert checks[name](BROKEN[name](value)), name
    assert set(structured.PROMPTS) == set(structured.SCHEMAS)


@pytest.mark.parametrize("flags, words", [
    (["--schemas", "person,nope"], "unknown schema(s) nope"),
    (["--concurrency", "0"], "--concurrency"),
    (["--temperature", "-1"], "--temperature"),
])
def test_bad_flags_are_one_line_errors(tmp_path, flags, words):
    with pytest.raises(SuduError, match=words.replace("(", r"\(").replace(")", r"\)")):
        run_cli(["structured", "--url", "http://127.0.0.1:9/v1", "--out", str(tmp_path), *flags])


def test_missing_jsonschema_is_a_clear_error(tmp_path, monkeypatch):
    for mod in [m for m in sys.modules if m == "jsonschema" or m.startswith("jsonschema.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(SuduError, match="pip install jsonschema"):
        run_cli(["structured", "--url", "http://127.0.0.1:9/v1", "--out", str(tmp_path)])
