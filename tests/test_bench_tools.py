"""The tool_loop task against the fake server: tool calls assembled from streamed `delta.tool_calls`
(id and name first, arguments in pieces, two calls in one answer), executed by the bench, sent back as
`role: "tool"` messages with the assistant turn, until the model answers; the tool fields of each call
by --tool-choice (forced: required and one call, then no tools; auto: the tools every call); the answer
checked strictly (a wrong city, a city named without the lookup, endless tool calls all fail); rounds
and calls counted; only standard OpenAI fields are sent."""
import json

import pytest

from sudu.bench.fake_server import FakeServer, chat_script, tool_call_deltas
from sudu.bench.tasks import tool_loop
from tests.helpers.bench_cli import read_report, run_cli

ORDER = "get_order"


def _lookup(body) -> tool_loop.Lookup:
    """The table the bench built for this request (the prompt names the order; seed 0 unless repeated)."""
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    for seed in range(8):
        lookup = tool_loop.Lookup(seed)
        if f"order {lookup.asked} " in user:
            return lookup
    raise AssertionError("no seed makes this prompt")


def agent(mode: str):
    """A scripted model: calls get_order (in pieces), then answers from the result (by `mode`)."""
    def script(body):
        assert body["stream"] is True
        lookup = _lookup(body)
        results = [json.loads(m["content"]) for m in body["messages"] if m["role"] == "tool"]
        call = (ORDER, json.dumps({"order_id": lookup.asked}))
        if mode == "loops":
            return _calls([call])
        if not results:
            if mode == "parallel":  # two calls in one answer, the second for an order that does not exist
                return _calls([call, (ORDER, json.dumps({"order_id": 1}))])
            if mode == "guess":
                return _text(lookup.expected_city)
            return _calls([call])
        city = results[0]["ship_to_city"]
        if mode == "wrong":
            city = next(c for c in tool_loop.CITIES if c != city)
        return _text(f"The order ships to {city}.")
    return script


def _usage(n):
    return {"prompt_tokens": 50, "completion_tokens": n, "total_tokens": 50 + n}


def _calls(calls):
    deltas = tool_call_deltas(calls)
    return chat_script([(0.001, d) for d in deltas], usage=_usage(len(deltas)), finish_reason="tool_calls")


def _text(text):
    words = text.split(" ")
    pieces = [(0.001, w + (" " if i < len(words) - 1 else "")) for i, w in enumerate(words)]
    return chat_script(pieces, usage=_usage(len(pieces)))


def _run(tmp_path, mode, *flags):
    with FakeServer(agent(mode)) as srv:
        run_cli(["tasks", "--url", srv.url, "--tasks", "tool_loop", "--out", str(tmp_path), "--no-html",
                 "--warmup", "0", "--chunk-usage", "off", *flags])
        requests = list(srv.requests)
    _, rep = read_report(tmp_path, "tasks")
    return rep, requests


def test_forced_tool_loop_calls_once_then_answers_without_tools(tmp_path):
    rep, requests = _run(tmp_path, "chain")
    run = rep["task_runs"][0]
    assert run["passed"] and run["passed_first"] and run["task_time_s"] > 0
    assert (run["calls"], run["tool_rounds"], run["tool_calls"]) == (2, 1, 1)
    lookup = tool_loop.Lookup(0)
    assert run["info"]["city"] == lookup.expected_city
    first, second = requests
    assert first["tools"] == tool_loop.TOOLS and first["tool_choice"] == "required"
    assert first["parallel_tool_calls"] is False
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(second)  # answer from the result
    msgs = second["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[0]["content"].endswith(tool_loop.SYSTEM) and msgs[0]["content"] != tool_loop.SYSTEM  # salted
    # the streamed call reassembled whole: id, name, arguments from pieces of 7 characters
    assert msgs[2] == {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function",
                       "function": {"name": ORDER, "arguments": json.dumps({"order_id": lookup.asked})}}]}
    assert msgs[3]["tool_call_id"] == "call_0"
    assert json.loads(msgs[3]["content"])["ship_to_city"] == lookup.expected_city
    groups = {g["name"]: g for g in rep["groups"]}
    assert groups["task tool_loop"]["n_requests"] == 1 and groups["task tool_loop"]["cache_state"] == "cold"
    assert groups["task tool_loop tool rounds"]["n_requests"] == 1
    assert groups["task tool_loop tool rounds"]["cache_state"] == "shared-prefix"
    summary = rep["tasks"][0]
    assert summary["tool_calls"] == 1 and summary["tool_rounds"] == 1 and summary["pass_at_1"] == 1.0
    calls = [r for r in rep["records"] if r["tool_calls"]]
    assert len(calls) == 1 and calls[0]["ok"] and calls[0]["finish_reason"] == "tool_calls"
    assert rep["config"]["tool_choice"] == "forced" and not [f for f in rep["flags"] if "failed" in f]


def test_auto_sends_the_tools_every_call_and_runs_parallel_calls(tmp_path):
    rep, requests = _run(tmp_path, "parallel", "--tool-choice", "auto")
    run = rep["task_runs"][0]
    assert run["passed"] and (run["calls"], run["tool_rounds"], run["tool_calls"]) == (2, 1, 2)
    assert all(b["tools"] == tool_loop.TOOLS and "tool_choice" not in b for b in requests)
    second = requests[1]["messages"]
    assert [m.get("tool_call_id") for m in second if m["role"] == "tool"] == ["call_0", "call_1"]
    assert "error" in json.loads(second[-1]["content"])  # the order that does not exist: an error result


@pytest.mark.parametrize("mode, flags, detail", [
    ("wrong", [], "does not name the city"),
    ("guess", ["--tool-choice", "auto"], "without looking up"),
    ("loops", ["--tool-choice", "auto"], "no answer after 4 tool rounds"),
])
def test_tool_loop_fails_wrong_answers(tmp_path, mode, flags, detail):
    rep, _ = _run(tmp_path, mode, "--attempts", "2", *flags)
    run = rep["task_runs"][0]
    assert not run["passed"] and run["task_time_s"] is None and detail in run["detail"]
    if mode == "loops":
        assert run["calls"] == 5 and run["tool_rounds"] == 4  # the loop is bounded; no retry after it
    else:
        assert "task tool_loop retries" in {g["name"] for g in rep["groups"]}


def test_tool_executes_and_checks_deterministically():
    a, b = tool_loop.Lookup(3), tool_loop.Lookup(3)
    assert (a.orders, a.asked) == (b.orders, b.asked)
    assert (tool_loop.Lookup(4).orders, tool_loop.Lookup(4).asked) != (a.orders, a.asked)
    for name, args in [(ORDER, "{not json"), (ORDER, '{"order_id": 1}'), ("delete_all", "{}"), (ORDER, "[]")]:
        assert "error" in json.loads(a.run(name, args))
    assert not a.check(a.expected_city).passed  # named before get_order gave it
    assert json.loads(a.run(ORDER, json.dumps({"order_id": str(a.asked)})))["ship_to_city"] == a.expected_city
    assert a.check(f"It ships to {a.expected_city.lower()}.").passed
    other = next(c for c in tool_loop.CITIES if c != a.expected_city)
    assert not a.check(f"{a.expected_city} or {other}").passed
    verdict = a.check("I cannot tell.")
    assert not verdict.passed and a.expected_city not in verdict.detail  # the verdict goes back to the model
