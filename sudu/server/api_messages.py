"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as a translation at
the edge: the body becomes a chat completions request (`to_chat_request`) and runs the one chat path
(requests.prepare_chat: one template call, one tool parser, one grammar compiler; the engine never knows
which API asked); the answer's events (answer_events.py) come back as Anthropic's content blocks, whole
or as its SSE event sequence. Errors under /v1/messages answer in Anthropic's shape (errors.py).

Translation: `system` -> a system message; a user turn's `tool_result` blocks -> tool messages (in
order, before the turn's text), `is_error` results prefixed "Error: "; an assistant turn's `tool_use`
blocks -> tool calls; earlier `thinking` blocks are dropped (thinking templates drop past reasoning
themselves); `tools[].input_schema` -> function parameters; `tool_choice` auto / any / tool / none ->
auto / required / the named function / none, `disable_parallel_tool_use` -> one call at most;
`thinking.type` enabled / disabled -> the template's `enable_thinking`; `stop_sequences` -> stop.
A user turn's image blocks (base64 or url sources) -> image_url parts in place among its text (served by
vision-language models: server/media_input.py). Refused with a 400: document blocks, images outside user turns,
server tools (a tool with a `type` other than "custom"). Usage: `input_tokens` are the prompt tokens the context cache did not
serve, `cache_read_input_tokens` the ones it did, `cache_creation_input_tokens` is 0 (sudu caches every
prompt without being asked)."""
from __future__ import annotations

import json
import time
import uuid
from functools import partial
from typing import Annotated, AsyncIterator, Literal, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from sudu.server import protocol as P
from sudu.server.answer_events import (
    AnswerEvents,
    ContentDelta,
    Reasoning,
    ToolCallArgsDelta,
    ToolCallStart,
    answer_steps,
)
from sudu.server.errors import failed_call, invalid
from sudu.server.requests import prepare_chat
from sudu.server.responses import Call
from sudu.server.streaming import sse, unless_disconnected


class TextBlock(P.RequestModel):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None


class ImageBlock(P.RequestModel):
    type: Literal["image"]
    source: dict


class DocumentBlock(P.RequestModel):
    type: Literal["document"]
    source: dict


class ToolUseBlock(P.RequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str
    input: dict


class ToolResultBlock(P.RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | Annotated[list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]],
                             Field(max_length=P.MAX_CONTENT_PARTS)] | None = None
    is_error: bool = False


class ThinkingBlock(P.RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(P.RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                               RedactedThinkingBlock], Field(discriminator="type")]


class InputMessage(P.RequestModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(max_length=P.MAX_CONTENT_PARTS)]


class ToolDefinition(P.RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict | None = Field(None, description="The JSON schema of the tool's input (type object).")
    type: str | None = Field(None, description="Only custom tools (omitted or \"custom\"); server tools are refused.")
    cache_control: dict | None = None


class ToolChoice(P.RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(P.RequestModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class _MessagesFields(P.RequestModel):
    model: str | None = Field(None, description="Served model id; omitted -> the served model.")
    messages: list[InputMessage] = Field(..., min_length=1, max_length=P.MAX_MESSAGES)
    system: str | Annotated[list[TextBlock], Field(max_length=P.MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=P.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict | None = Field(None, description="sudu extension: extra chat template variables.")


class MessagesRequest(_MessagesFields):
    max_tokens: int = Field(..., ge=1, description="Required, as in Anthropic's API.")
    stop_sequences: Annotated[list[P.StopString], Field(max_length=P.MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0, description="0 -> greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 31)
    metadata: dict | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="sudu extension.")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1,
                          description="sudu extension: scheduling priority; lower is served first.")


class CountTokensRequest(_MessagesFields):
    pass


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


_ERRORS = {status: {"model": AnthropicError} for status in (400, 401, 403, 404, 413, 429, 500, 503)}


def _text_of(blocks, where: str) -> str:
    """The text of a tool result's or the system's blocks; an image is refused."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise _refused_block(block.type, f"{where}.{j}")
        parts.append(block.text)
    return "\n".join(parts)


def _image_part(source: dict, where: str) -> dict:
    """An image block's source as a chat image_url part: base64 data as a data: URL, or its url."""
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source.get('media_type', '')};base64,{source['data']}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise invalid("an image source must be {type: base64, media_type, data} or {type: url, url}", where)


def _refused_block(kind: str, where: str):
    return invalid(f"{kind} blocks are not supported: this server's model takes text only", where)


def to_chat_messages(body: _MessagesFields) -> list[dict]:
    """The conversation as OpenAI chat messages (see the module docstring)."""
    out: list[dict] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts, calls, images = [], [], []  # images: (index in texts, an image_url part)
        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            kind = block.type
            if kind == "image" and message.role == "user":
                images.append((len(texts), _image_part(block.source, f"{where}.source")))
                continue
            if kind in ("image", "document"):
                raise _refused_block(kind, where)
            if kind == "text":
                texts.append(block.text)
            elif kind in ("thinking", "redacted_thinking"):
                if message.role != "assistant":
                    raise invalid(f"{kind} blocks belong to assistant turns", where)
            elif kind == "tool_use":
                if message.role != "assistant":
                    raise invalid("tool_use blocks belong to assistant turns", where)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            else:  # tool_result
                if message.role != "user":
                    raise invalid("tool_result blocks belong to user turns", where)
                result = _text_of(block.content, f"{where}.content")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
        if message.role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif images:
            parts = [{"type": "text", "text": t} for t in texts]
            for at, part in reversed(images):
                parts.insert(at, part)
            out.append({"role": "user", "content": parts})
        elif texts or not any(b.type == "tool_result" for b in message.content):
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def to_chat_request(body: _MessagesFields) -> P.ChatCompletionRequest:
    """The chat completions request that answers `body` (its errors are 400s naming Anthropic's fields)."""
    chat: dict = {"model": body.model, "messages": to_chat_messages(body)}
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise invalid(f"tool type {tool.type!r} is a server tool; this server runs custom tools only",
                              f"tools.{i}.type")
            function = {"name": tool.name, "parameters": tool.input_schema or {"type": "object", "properties": {}}}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        chat["tools"] = tools
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise invalid("tool_choice of type \"tool\" needs the tool's name", "tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    kwargs = dict(body.chat_template_kwargs or {})
    if body.thinking is not None:
        kwargs["enable_thinking"] = body.thinking.type == "enabled"
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                    seed=body.seed, priority=body.priority)
        if body.top_p is not None:
            chat["top_p"] = body.top_p
        if body.top_k is not None:
            chat["top_k"] = body.top_k
    try:
        return P.ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise invalid(f"{error.get('msg')}", ".".join(str(p) for p in error.get("loc", ()))) from None


# ---- answers


def _usage(call: Call, reasoning_tokens: int) -> dict:
    prompt = sum(len(j.prompt_ids) for j in call.jobs)
    cached = sum(call.num_cached)
    usage = {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
             "output_tokens": sum(call.num_tokens)}
    if call.reasoning:
        usage["output_tokens_details"] = {"thinking_tokens": reasoning_tokens}
    return usage


def _stop(call: Call, stop_sequences: list[str] | None, stop_reason, called: bool) -> tuple[str, str | None]:
    reason = call.finish_reasons[0]
    if reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class _Blocks:
    """Events -> content blocks: consecutive events of one kind extend the open block, another kind
    closes it and opens the next. Returns Anthropic's stream events for each change; `blocks` is the
    whole answer's content, so a stream and a single body are built by the same steps."""

    def __init__(self):
        self.blocks: list[dict] = []
        self._open: str | None = None  # "thinking" | "text" | a tool call's index
        self._args: dict[int, str] = {}

    def events(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, Reasoning):
                self._ensure(out, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.blocks[-1]["thinking"] += e.text
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, ContentDelta):
                self._ensure(out, "text", {"type": "text", "text": ""})
                self.blocks[-1]["text"] += e.text
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, ToolCallStart):
                self._close(out)
                self._open = e.index
                self._args[e.index] = ""
                block = {"type": "tool_use", "id": _tool_use_id(e.id), "name": e.name, "input": {}}
                self.blocks.append(block)
                out.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
            elif isinstance(e, ToolCallArgsDelta):
                self._args[e.index] += e.text
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        return out

    def close(self) -> list[dict]:
        out: list[dict] = []
        self._close(out)
        return out

    def _ensure(self, out: list, kind: str, block: dict) -> None:
        if self._open != kind:
            self._close(out)
            self._open = kind
            self.blocks.append(block)
            out.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self, out: list) -> None:
        if self._open is None:
            return
        if isinstance(self._open, int):
            try:
                self.blocks[-1]["input"] = json.loads(self._args[self._open] or "{}")
            except ValueError:  # a call announced, then malformed (sudu/tools/parser.py): its text went to content
                self.blocks[-1]["input"] = {}
        out.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        self._open = None


def _event(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(
        event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class MessageCall:
    """One /v1/messages call: the chat path's Call (its accounting and metrics), rendered as a message."""

    def __init__(self, call: Call, body: MessagesRequest):
        self.call, self.body = call, body
        self.id = "msg_" + uuid.uuid4().hex
        self.answer = AnswerEvents(call.tool_format, call.reasoning, call.reasoning_open, call.tool_schemas)
        self.blocks = _Blocks()
        self.stop_reason = None

    async def _events(self) -> AsyncIterator[list[dict]]:
        """Anthropic's content-block events, step by step, then the closing ones."""
        async for typed, c in answer_steps(self.call, self.answer):
            events = self.blocks.events(typed)
            if c.finish_reason is not None:
                self.stop_reason = c.stop_reason
                events += self.blocks.close()
            if events:
                yield events

    def _message(self, content: list[dict]) -> dict:
        stop_reason, stop_sequence = _stop(self.call, self.body.stop_sequences, self.stop_reason, self.answer.called)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.call.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": _usage(self.call, self.answer.reasoning_tokens)}

    async def single(self) -> JSONResponse:
        async for _ in self._events():
            pass
        return JSONResponse(self._message(self.blocks.blocks), headers={"request-id": self.id})

    async def stream(self) -> AsyncIterator[bytes]:
        call = self.call
        prompt = sum(len(j.prompt_ids) for j in call.jobs)
        start = {"id": self.id, "type": "message", "role": "assistant", "model": call.model, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                           "output_tokens": 0}}
        yield _event({"type": "message_start", "message": start})
        yield _event({"type": "ping"})
        try:
            async for events in self._events():
                for event in events:
                    yield _event(event)
            final = self._message([])
            yield _event({"type": "message_delta",
                          "delta": {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
                          "usage": final["usage"]})
            yield _event({"type": "message_stop"})
        except Exception as exc:  # noqa: BLE001 -- a stream ends with an error event, never cut short
            err = failed_call(exc, call.is_draining())
            call.metrics.count_error(err)
            yield _event(err.anthropic_body())


def messages_routes(state, admit) -> APIRouter:
    """state: the app's ServerState; admit: the chat routes' admission (routes.py), which checks the engine,
    the model and the queue and runs a prepare function in the worker pool."""
    router = APIRouter(prefix="/v1")
    draining = lambda: state.draining  # noqa: E731

    @router.post("/messages", operation_id="create_message", tags=["anthropic"],
                 summary="Anthropic's Messages API (docs/agent_apis.md)", responses=_ERRORS)
    async def create_message(body: MessagesRequest, request: Request):
        received_at = time.perf_counter()
        chat = to_chat_request(body)
        prepared, model = await admit(state, chat, partial(prepare_chat, media=state.media))
        call = MessageCall(Call(state.engine, state.metrics, prepared, model, "message", received_at, draining), body)
        if body.stream:
            return sse(call.stream())
        return await unless_disconnected(request, call.single(), draining)

    @router.post("/messages/count_tokens", operation_id="count_message_tokens", tags=["anthropic"],
                 summary="The prompt tokens a Messages request would take", responses=_ERRORS)
    async def count_tokens(body: CountTokensRequest):
        count, _ = await admit(state, to_chat_request(body), partial(_count, media=state.media), generates=False)
        return {"input_tokens": count}

    return router


def _count(engine, chat: P.ChatCompletionRequest, media) -> int:
    """The prompt's tokens, rendered and checked exactly as a generation would be."""
    return len(prepare_chat(engine, chat, media).jobs[0].prompt_ids)
