"""A minimal streaming client that shares no code with sudu bench, to check its decode speed against:
per request, (last content chunk - first content chunk) / (usage.completion_tokens - 1), over
sequential cold requests (a fresh salt in the system message), median over the requests.

    python benchmarks/independent_client.py http://127.0.0.1:8000/v1 MODEL [-n 10] [--max-tokens 128]
"""
import argparse
import json
import statistics
import time
import uuid

import httpx


def cold_chat_events(client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int):
    """(arrival time, whether it carries content, usage or None) per SSE event of a streamed greedy chat
    request behind a fresh salt (cold for every server), its fixed length (ignore_eos) and its usage asked for."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": uuid.uuid4().hex}, {"role": "user", "content": prompt}]}
    with client.stream("POST", f"{base}/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            content = any((c.get("delta") or {}).get("content") for c in event.get("choices") or [])
            yield time.perf_counter(), content, event.get("usage")


def one_request(client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int) -> float | None:
    first = last = tokens = None
    for now, content, usage in cold_chat_events(client, base, model, prompt, max_tokens):
        if content:
            first = first or now
            last = now
        if usage:
            tokens = usage["completion_tokens"]
    if first is None or not tokens or tokens < 2 or last == first:
        return None
    return (tokens - 1) / (last - first)


def time_to_first_token(client: httpx.Client, base: str, model: str, prompt: str) -> tuple[float, int] | None:
    """(request sent -> first content chunk in seconds, usage.prompt_tokens) of a one-token cold request."""
    first = prompt_tokens = None
    start = time.perf_counter()
    for now, content, usage in cold_chat_events(client, base, model, prompt, 1):
        if content and first is None:
            first = now
        if usage:
            prompt_tokens = usage["prompt_tokens"]
    return (first - start, prompt_tokens) if first is not None and prompt_tokens else None


def decode_speeds(base: str, model: str, prompts: list[str], max_tokens: int, warm: bool = True) -> list[float]:
    # a new connection per request: llama-server's build here drops a kept-alive connection's next request
    with httpx.Client(timeout=600, headers={"Connection": "close"}) as client:
        if warm:
            one_request(client, base, model, prompts[0], 8)
        speeds = [one_request(client, base, model, p, max_tokens) for p in prompts]
    return [s for s in speeds if s is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("model")
    parser.add_argument("-n", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = [f"Write a Python function number {i} that does something useful, with tests." for i in range(args.n)]
    try:
        speeds = decode_speeds(args.base, args.model, prompts, args.max_tokens)
    except httpx.HTTPError as exc:
        raise SystemExit(f"independent_client: {args.base}: {exc}")
    if not speeds:
        raise SystemExit(f"independent_client: no request to {args.base} streamed two or more tokens "
                         "(is the server ready, and the model name right?)")
    print(f"median decode speed {statistics.median(speeds):.2f} tok/s over {len(speeds)} requests")


if __name__ == "__main__":
    main()
