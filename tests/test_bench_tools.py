"""The tool_loop task against the fake server: tool calls assembled from streamed `delta.tool_calls`
(id and name first, arguments in pieces, two calls in one answer), executed by the bench, sent back as
`role: "tool"` messages with the assistant turn, until the model answers; the answer checked strictly
(a wrong city, a city named without the lookup, endless tool calls all fail); rounds and calls counted;
the request carries only standard OpenAI fields."""
import json

import pytest

from sudu.bench.fake_server import FakeServer, chat_script, tool_call_deltas
from sudu.bench.tasks import tool_loop
from tests.test_bench_cli import _report, run_cli

ORDER = "get_order"
CUSTOMER = "get_customer"


def _tables(body) -> tool_loop.Lookup:
    """The fixture the bench built for this request (the prompt names the order; seed 0 unless repeated)."""
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    for seed in range(8):
        lookup = tool_loop.Lookup(seed)
        if f"order {lookup.asked} " in user:
            return lookup
    raise AssertionError("no seed makes this prompt")


def _results(body) -> list[dict]:
    return [json.loads(m["content"]) for m in body["messages"] if m["role"] == "tool"]


def agent(mode: str):
    """A scripted model: calls get_order, then get_customer, then answers (by `mode`)."""
    def script(body):
        assert body["tools"] == tool_loop.TOOLS and body["stream"] is True
        lookup = _tables(body)
        results = _results(body)
        if mode == "loops":
            return _calls([(ORDER, json.dumps({"order_id": lookup.asked}))])
        if not results:
            if mode == "parallel":  # both calls in one answer: the second one's id guessed, so it errs
                return _calls([(ORDER, json.dumps({"order_id": lookup.asked})),
                               (CUSTOMER, json.dumps({"customer_id": "C-000"}))])
            if mode == "guess":
                return _text(f"{lookup.expected_city}")
            return _calls([(ORDER, json.dumps({"order_id": lookup.asked}))])
        if "city" not in results[-1]:
            return _calls([(CUSTOMER, json.dumps({"customer_id": results[0]["customer_id"]}))])
        city = results[-1]["city"]
        if mode == "wrong":
            other = next(c for c in tool_loop.CITIES if c != city)
            return _text(f"The order ships to {other}.")
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
    _, rep = _report(tmp_path, "tasks")
    return rep, requests


def test_tool_loop_passes_after_two_calls_and_sends_standard_messages(tmp_path):
    rep, requests = _run(tmp_path, "chain")
    run = rep["task_runs"][0]
    assert run["passed"] and run["passed_first"] and run["task_time_s"] > 0
    assert (run["calls"], run["tool_rounds"], run["tool_calls"]) == (3, 2, 2)
    lookup = tool_loop.Lookup(0)
    assert run["info"]["city"] == lookup.expected_city
    last = requests[-1]["messages"]
    assistant = [m for m in last if m["role"] == "assistant"]
    tools = [m for m in last if m["role"] == "tool"]
    # the streamed calls reassembled whole: id, name, arguments from pieces of 7 characters
    assert assistant[0]["tool_calls"] == [{"id": "call_0", "type": "function", "function": {
        "name": ORDER, "arguments": json.dumps({"order_id": lookup.asked})}}]
    assert assistant[0]["content"] is None
    assert [t["tool_call_id"] for t in tools] == ["call_0", "call_0"]
    assert json.loads(tools[1]["content"])["city"] == lookup.expected_city
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    groups = {g["name"]: g for g in rep["groups"]}
    assert groups["task tool_loop"]["n_requests"] == 1 and groups["task tool_loop"]["cache_state"] == "cold"
    assert groups["task tool_loop tool rounds"]["n_requests"] == 2
    assert groups["task tool_loop tool rounds"]["cache_state"] == "shared-prefix"
    summary = rep["tasks"][0]
    assert summary["tool_calls"] == 2 and summary["tool_rounds"] == 2 and summary["pass_at_1"] == 1.0
    calls = [r for r in rep["records"] if r["tool_calls"]]
    assert len(calls) == 2 and all(r["ok"] and r["finish_reason"] == "tool_calls" for r in calls)
    assert not [f for f in rep["flags"] if "failed" in f]


def test_parallel_calls_in_one_answer_each_get_a_result(tmp_path):
    rep, requests = _run(tmp_path, "parallel")
    run = rep["task_runs"][0]
    assert run["passed"] and (run["tool_rounds"], run["tool_calls"]) == (2, 3)
    second = requests[1]["messages"]
    assert [m.get("tool_call_id") for m in second if m["role"] == "tool"] == ["call_0", "call_1"]
    assert "error" in json.loads(second[-1]["content"])  # the guessed customer id: an error result, no crash


@pytest.mark.parametrize("mode, detail", [
    ("wrong", "expected the city"),
    ("guess", "without looking up"),
    ("loops", "no answer after 4 tool rounds"),
])
def test_tool_loop_fails_wrong_answers(tmp_path, mode, detail):
    rep, _ = _run(tmp_path, mode, "--attempts", "2")
    run = rep["task_runs"][0]
    assert not run["passed"] and run["task_time_s"] is None and detail in run["detail"]
    if mode == "loops":
        assert run["calls"] == 5 and run["tool_rounds"] == 4  # the loop is bounded; no retry after it
    else:
        assert "task tool_loop retries" in {g["name"] for g in rep["groups"]}


def test_tools_check_and_execute_deterministically():
    a, b = tool_loop.Lookup(3), tool_loop.Lookup(3)
    assert (a.orders, a.customers, a.asked) == (b.orders, b.customers, b.asked)
    assert tool_loop.Lookup(4).asked != a.asked or tool_loop.Lookup(4).customers != a.customers
    order = json.loads(a.run(ORDER, json.dumps({"order_id": str(a.asked)})))
    assert order["customer_id"] == a.expected_customer
    for name, args in [(ORDER, "{not json"), (ORDER, '{"order_id": 1}'), ("delete_all", "{}"), (CUSTOMER, "[]")]:
        assert "error" in json.loads(a.run(name, args))
    assert not a.check(a.expected_city).passed  # named before get_customer gave it
    a.run(CUSTOMER, json.dumps({"customer_id": a.expected_customer}))
    assert a.check(f"It ships to {a.expected_city.lower()}.").passed
    other = next(c for c in tool_loop.CITIES if c != a.expected_city)
    assert not a.check(f"{a.expected_city} or {other}").passed
    assert not a.check("I cannot tell.").passed
