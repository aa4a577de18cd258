"""Session traces for `sudu bench replay`: loading the two formats (sudu's JSONL and Mooncake's), checking
them (one clear error per bad line), the dependency graph, the trace's ideal prefix-cache hit rate, and a
synthetic agent-session trace generator. The format is documented in docs/bench.md ("Trace format").

sudu JSONL, one request per line (an optional first line `{"sudu_trace": 1, "block_size": 512}` sets the
block size; default 512 tokens, Mooncake's):
  id            optional, unique; default "<session>/<turn>" or the line number
  session       optional; requests of one session form a chain: each starts after the previous one of its
                session answered, plus its `tool_wait_s` (unless `after` names another request)
  turn          optional, informative
  at_s          arrival offset of a request that depends on nothing (default 0)
  after         id of an earlier request this one starts after (its response, plus tool_wait_s)
  tool_wait_s   seconds between that response and this request (an agent's tool call)
  input_length  prompt tokens;  hash_ids: one id per block of block_size tokens (the last may be partial):
                equal ids = equal token blocks, and a block's id stands for its whole prefix
  output_length tokens to generate
  messages      optional: a real conversation, sent instead of a synthesized prompt
  prompt        optional: the rendered prompt text (`sudu serve --record-trace --record-text`), sent as is
Mooncake's format: {"timestamp": ms, "input_length", "output_length", "hash_ids"}, 512-token blocks, each
request independent."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

from sudu.errors import SuduError

DEFAULT_BLOCK_SIZE = 512


@dataclass
class TraceRequest:
    index: int
    id: str
    session: str
    turn: int | None
    at_s: float | None  # arrival offset (roots); None: after its dependency
    after: int | None  # index of the request it waits for
    tool_wait_s: float
    input_length: int
    hash_ids: list[int]
    output_length: int
    messages: list[dict] | None = None
    prompt: str | None = None  # the rendered prompt (traces recorded with --record-text)


@dataclass
class Trace:
    path: str
    format: str  # "sudu" | "mooncake"
    block_size: int
    requests: list[TraceRequest] = field(default_factory=list)

    @property
    def sessions(self) -> list[str]:
        return list(dict.fromkeys(r.session for r in self.requests))


def _num(obj: dict, key: str, where: str, kind=float, default=None, minimum=0):
    value = obj.get(key, default)
    if value is None:
        raise SuduError(f"{where}: missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise SuduError(f"{where}: {key!r} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if value < minimum:
        raise SuduError(f"{where}: {key!r} must be >= {minimum}, got {value!r}")
    return kind(value)


def load_trace(path: str, max_requests: int | None = None) -> Trace:
    """Read and check a trace; SuduError (one line, with the line number) on anything malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SuduError(f"cannot read trace {path}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    rows: list[tuple[int, dict]] = []
    block_size, fmt = DEFAULT_BLOCK_SIZE, None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise SuduError(f"trace {path} line {n}: not JSON ({line.strip()[:60]!r})") from None
        if not isinstance(obj, dict):
            raise SuduError(f"trace {path} line {n}: expected a JSON object")
        if "sudu_trace" in obj:
            if rows:
                raise SuduError(f"trace {path} line {n}: the sudu_trace header must be the first line")
            block_size = _num(obj, "block_size", f"trace {path} line {n}", int, DEFAULT_BLOCK_SIZE, 1)
            fmt = "sudu"
            continue
        rows.append((n, obj))
        if max_requests is not None and len(rows) >= max_requests:
            break
    if not rows:
        raise SuduError(f"trace {path} has no requests")
    if fmt is None:
        first = rows[0][1]
        fmt = "mooncake" if "timestamp" in first and not {"at_s", "session", "after"} & set(first) else "sudu"
    trace = Trace(path, fmt, block_size)
    ids: dict[str, int] = {}
    last_of_session: dict[str, int] = {}
    for i, (n, obj) in enumerate(rows):
        where = f"trace {path} line {n}"
        input_length = _num(obj, "input_length", where, int, None, 1)
        output_length = _num(obj, "output_length", where, int, None, 1)
        hash_ids = obj.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise SuduError(f"{where}: 'hash_ids' must be a list of integers")
        need = math.ceil(input_length / block_size)
        if len(hash_ids) != need:
            raise SuduError(f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; "
                            f"{block_size}-token blocks need {need}")
        if fmt == "mooncake":
            at = _num(obj, "timestamp", where) / 1000.0
            trace.requests.append(TraceRequest(i, str(obj.get("id", n)), f"r{i}", None, at, None, 0.0, input_length,
                                               hash_ids, output_length))
            continue
        session = str(obj.get("session", f"r{i}"))
        turn = obj.get("turn")
        rid = str(obj.get("id") or (f"{session}/{turn}" if turn is not None and "session" in obj else n))
        if rid in ids:
            raise SuduError(f"{where}: duplicate id {rid!r}")
        after = None
        if obj.get("after") is not None:
            if str(obj["after"]) not in ids:
                raise SuduError(f"{where}: 'after' names {obj['after']!r}, which is not an earlier request's id")
            after = ids[str(obj["after"])]
        elif "at_s" not in obj and session in last_of_session:
            after = last_of_session[session]
        at = _num(obj, "at_s", where, float, 0.0) if after is None else None
        wait = _num(obj, "tool_wait_s", where, float, 0.0)
        messages = obj.get("messages") if isinstance(obj.get("messages"), list) else None
        prompt = obj.get("prompt") if isinstance(obj.get("prompt"), str) else None
        trace.requests.append(TraceRequest(i, rid, session, turn if isinstance(turn, int) else None, at, after, wait,
                                           input_length, hash_ids, output_length, messages, prompt))
        ids[rid] = i
        last_of_session[session] = i
    return trace


def _shared_blocks(root: dict, hash_ids: list[int]) -> int:
    node, shared = root, 0
    for h in hash_ids:
        node = node.get(h)
        if node is None:
            break
        shared += 1
    return shared


def _insert(root: dict, hash_ids: list[int]) -> None:
    node = root
    for h in hash_ids:
        node = node.setdefault(h, {})


def ideal_cached_tokens(trace: Trace, order: list[int] | None = None) -> dict[int, int]:
    """Per request index: the tokens an unbounded prefix cache that has seen every request before it (in
    `order`, default the trace's) could serve: the leading blocks whose id prefix an earlier one had."""
    root: dict = {}
    out = {}
    for i in (range(len(trace.requests)) if order is None else order):
        r = trace.requests[i]
        out[i] = min(_shared_blocks(root, r.hash_ids) * trace.block_size, r.input_length)
        _insert(root, r.hash_ids)
    return out


def ideal_cached_tokens_timed(trace: Trace, sent_s: dict[int, float], ready_s: dict[int, float]) -> dict[int, int]:
    """Per request index sent at sent_s[i]: the tokens an unbounded prefix cache could serve when it holds
    the blocks of every request whose prompt had been processed (ready_s: its first token) before i was
    sent. Requests without a ready time (failed) never fill the cache."""
    root: dict = {}
    pending = sorted((t, i) for i, t in ready_s.items() if t is not None)
    k, out = 0, {}
    for i in sorted(sent_s, key=lambda j: sent_s[j]):
        while k < len(pending) and pending[k][0] <= sent_s[i]:
            _insert(root, trace.requests[pending[k][1]].hash_ids)
            k += 1
        r = trace.requests[i]
        out[i] = min(_shared_blocks(root, r.hash_ids) * trace.block_size, r.input_length)
    return out


def ideal_hit_rate(trace: Trace, order: list[int] | None = None) -> float:
    """Cached share of prompt tokens an unbounded prefix cache would reach, requests sent in `order`."""
    cached = ideal_cached_tokens(trace, order)
    total = sum(trace.requests[i].input_length for i in cached)
    return sum(cached.values()) / total if total else 0.0


def synthetic_sessions(sessions: int = 20, turns: int = 8, teams: int = 4, block_size: int = 64,
                       system_blocks: int = 4, blocks_per_turn: int = 2, output_length: int = 16,
                       tool_wait_s: float = 1.0, arrival_gap_s: float = 0.5, seed: int = 0) -> list[dict]:
    """An agent-session trace: each session belongs to a team sharing `system_blocks` blocks of system
    prompt and tools; every turn resends the whole history, adds `blocks_per_turn` blocks (the previous
    answer and a tool's output) and ends in a partial block (the new request), waits an exponential tool
    time (mean tool_wait_s) after the previous answer. Sessions arrive `arrival_gap_s` apart."""
    rng = random.Random(seed)
    ids = iter(range(10**9))
    team_blocks = [[next(ids) for _ in range(system_blocks)] for _ in range(teams)]
    out: list[dict] = [{"sudu_trace": 1, "block_size": block_size}]
    for s in range(sessions):
        history = list(team_blocks[s % teams])
        for t in range(1, turns + 1):
            if t > 1:
                history += [next(ids) for _ in range(blocks_per_turn)]
            tail = rng.randint(block_size // 4, block_size - 1)
            row = {"session": f"s{s}", "turn": t, "input_length": len(history) * block_size + tail,
                   "hash_ids": history + [next(ids)], "output_length": output_length}
            if t == 1:
                row["at_s"] = round(s * arrival_gap_s, 3)
            else:
                row["tool_wait_s"] = round(rng.expovariate(1.0 / tool_wait_s), 3) if tool_wait_s > 0 else 0.0
            out.append(row)
    return out


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
