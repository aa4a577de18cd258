"""What the Messages and Responses translations cost per request, next to chat completions on the same
conversation: the whole server edge in process (ASGI, no sockets), with the default model's real
tokenizer and chat template, in front of an engine that answers at once with a fixed tool-call answer of
`--answer-tokens` tokens, one per step (so the per-piece rendering of each API is in the figure too).
The APIs alternate request by request, so each ratio is measured side by side in one run. Target: under
1 ms per request more than chat completions. Also times the translation functions alone.

    python benchmarks/agent_api_overhead.py [--model qwen2.5-coder-0.5b-instruct] [--rounds 300]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from sudu.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sudu.engine.request import CheckedRequest
from sudu.server import api_messages, api_responses
from sudu.server.app import build_app
from sudu.weights.catalog import resolve_model_path
from sudu.weights.gguf import open_gguf
from sudu.tokenizer import Tokenizer

ANSWER = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/main.py", "start": 1, "end": 80}}\n</tool_call>'
SYSTEM = "You are a coding agent. Use the tools to inspect and change the repository. " * 8
TASK = "The tests in tests/test_parser.py fail since the last commit. Find out why and fix it."
TOOL = {"name": "read_file", "description": "Read lines of a file",
        "schema": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                                    "end": {"type": "integer"}}, "required": ["path"]}}


class InstantEngine:
    """Answers every request with ANSWER's tokens at once, one output per token (no model)."""

    def __init__(self, tokenizer: Tokenizer, answer_tokens: int):
        self.model_name = "bench"
        self.tokenizer = tokenizer
        self.grammar_backend = None
        self.max_model_len = 32768
        ids = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.answer = (ids * (answer_tokens // len(ids) + 1))[:answer_tokens] if answer_tokens > len(ids) else ids
        self.pieces = [tokenizer.decode(self.answer[: i + 1])[len(tokenizer.decode(self.answer[:i])):]
                       for i in range(len(self.answer))]

    async def start(self) -> None:
        self._never = asyncio.Event()

    async def shutdown(self, timeout_s: float) -> None:
        pass

    async def wait_failed(self) -> str:
        await self._never.wait()
        return ""

    def is_full(self) -> bool:
        return False

    def check_request(self, prompt_token_ids, params) -> CheckedRequest:
        return CheckedRequest(prompt_token_ids, params, params.max_tokens or 256)

    async def generate(self, request_id, request, priority: int = 0):
        metrics = RequestMetrics(arrival_time=time.perf_counter(), first_scheduled_time=time.perf_counter())
        n = len(self.answer)
        for i, (token, text) in enumerate(zip(self.answer, self.pieces)):
            done = i == n - 1
            if i == 0:
                metrics.first_token_time = time.perf_counter()
            if done:
                metrics.finished_time = time.perf_counter()
            yield RequestOutput(request_id, request.prompt_token_ids,
                                [CompletionOutput(0, text, [token], None, "stop" if done else None,
                                                  num_output_tokens=i + 1)], done, 0, metrics)

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict:
        return {}


def bodies(stream: bool) -> dict[str, tuple[str, dict]]:
    chat_tool = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                                  "parameters": TOOL["schema"]}}
    return {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": TASK}],
                                         "tools": [chat_tool], "max_tokens": 256, "stream": stream}),
        "messages": ("/v1/messages", {"system": SYSTEM, "messages": [{"role": "user", "content": TASK}],
                                      "tools": [{"name": TOOL["name"], "description": TOOL["description"],
                                                 "input_schema": TOOL["schema"]}],
                                      "max_tokens": 256, "stream": stream}),
        "responses": ("/v1/responses", {"instructions": SYSTEM, "input": TASK, "store": False,
                                        "tools": [{"type": "function", "name": TOOL["name"],
                                                   "description": TOOL["description"], "parameters": TOOL["schema"]}],
                                        "max_output_tokens": 256, "stream": stream}),
    }


async def run(engine: InstantEngine, rounds: int) -> dict[tuple[str, bool], list[float]]:
    app = build_app(engine)
    times: dict[tuple[str, bool], list[float]] = {}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            for stream in (False, True):
                cases = list(bodies(stream).items())
                for r in range(rounds + 10):  # the first 10 rounds warm up
                    for name, (path, body) in cases[r % 3:] + cases[:r % 3]:  # rotate the order each round
                        t0 = time.perf_counter()
                        response = await client.post(path, json=body)
                        elapsed = time.perf_counter() - t0
                        assert response.status_code == 200, response.text
                        assert "read_file" in response.text
                        if r >= 10:
                            times.setdefault((name, stream), []).append(elapsed * 1000)
    return times


def translation_us(n: int = 2000) -> dict[str, float]:
    """The translation functions alone (body already validated), microseconds per call."""
    msg = api_messages.MessagesRequest.model_validate(bodies(False)["messages"][1])
    resp = api_responses.ResponsesRequest.model_validate(bodies(False)["responses"][1])
    out = {}
    for name, fn in (("messages", lambda: api_messages.to_chat_request(msg)),
                     ("responses", lambda: api_responses.to_chat_request(resp, []))):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--answer-tokens", type=int, default=64)
    args = p.parse_args()
    path = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_gguf(open_gguf(path)) if str(path).endswith(".gguf") else Tokenizer.from_dir(path)
    engine = InstantEngine(tokenizer, args.answer_tokens)
    print(f"model {args.model}: answer {len(engine.answer)} tokens, {args.rounds} rounds per API, in process")
    times = asyncio.run(run(engine, args.rounds))
    print(f"{'API':<10} {'stream':<7} {'median ms':>10} {'p90 ms':>8} {'vs chat (ms)':>13} {'ratio':>6}")
    for stream in (False, True):
        chat = statistics.median(times[("chat", stream)])
        for name in ("chat", "messages", "responses"):
            t = times[(name, stream)]
            med, p90 = statistics.median(t), statistics.quantiles(t, n=10)[-1]
            print(f"{name:<10} {str(stream):<7} {med:>10.3f} {p90:>8.3f} {med - chat:>+13.3f} {med / chat:>6.3f}")
    for name, us in translation_us().items():
        print(f"translation alone, {name}: {us:.1f} us per request")


if __name__ == "__main__":
    main()
