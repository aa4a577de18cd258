"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`), as a translation at
the edge: the body becomes a chat completions request (`to_chat_request`) and runs the one chat path
(requests.prepare_chat); the answer's events (answer_events.py) come back as output items, whole or as
the API's SSE events (each with its `sequence_number`).

Translation: `instructions` -> a system message first; `input` as a string -> one user message; as
items: messages (string or `input_text` / `output_text` parts) keep their role, `function_call` items
-> the tool calls of an assistant turn (joined to the assistant message just before them), and
`function_call_output` items -> tool messages; `reasoning` items are dropped (thinking templates drop
past reasoning themselves). `tools` of type function -> chat tools, `tool_choice` as in chat,
`max_output_tokens` -> max_tokens, `text.format` -> response_format (json_schema through the grammar
engine), `reasoning.effort` "none" / "minimal" -> the template's `enable_thinking: false`, any other
effort -> true. `store` (default true) keeps the conversation, answer included, in the response store
(response_store.py); `previous_response_id` continues it with only the new items, as OpenAI's API does
(the earlier `instructions` are not carried over). A message's `input_image` parts (image_url: a data: or an
allowed http(s) URL) -> chat image_url parts (vision-language models: server/media_input.py). Refused with a
400: file and audio inputs, images given by file id, tools other than functions, `background`, `conversation`, `item_reference` items. An unknown or expired
`previous_response_id` is a 404."""
from __future__ import annotations

import json
import time
import uuid
from functools import partial
from typing import Annotated, AsyncIterator, Literal, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from sudu.server import protocol as P
from sudu.server.answer_events import (
    AnswerEvents,
    ContentDelta,
    Reasoning,
    ToolCallArgsDelta,
    ToolCallStart,
    answer_steps,
)
from sudu.server.errors import APIError, failed_call, invalid
from sudu.server.requests import prepare_chat
from sudu.server.response_store import ResponseStore
from sudu.server.responses import Call
from sudu.server.streaming import sse, unless_disconnected


class TextPart(P.RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImagePart(P.RequestModel):
    type: Literal["input_image"]
    image_url: str | None = Field(None, description="A data: URL, or an http(s) URL from --allowed-media-domains.")
    file_id: str | None = None
    detail: str | None = None


class MediaPart(P.RequestModel):
    type: Literal["input_file", "input_audio"]


class RefusalPart(P.RequestModel):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[Union[TextPart, ImagePart, MediaPart, RefusalPart], Field(discriminator="type")]


class MessageItem(P.RequestModel):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[Part], Field(max_length=P.MAX_CONTENT_PARTS)]


class FunctionCallItem(P.RequestModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str
    arguments: str


class FunctionCallOutputItem(P.RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | Annotated[list[Part], Field(max_length=P.MAX_CONTENT_PARTS)]


class ReasoningItem(P.RequestModel):
    type: Literal["reasoning"]


class ItemReference(P.RequestModel):
    type: Literal["item_reference"]
    id: str


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem, ItemReference]


class Tool(P.RequestModel):
    type: str = Field(description="Only \"function\" tools are served.")
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(P.RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(P.RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(P.RequestModel):
    format: TextFormat | None = None


class ReasoningConfig(P.RequestModel):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(P.RequestModel):
    model: str | None = Field(None, description="Served model id; omitted -> the served model.")
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=P.MAX_MESSAGES)]
    instructions: str | None = None
    tools: Annotated[list[Tool], Field(max_length=P.MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict | None = None
    user: str | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="sudu extension.")
    top_k: int = Field(0, ge=-1, le=1 << 31, description="sudu extension.")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1,
                          description="sudu extension: scheduling priority; lower is served first.")
    chat_template_kwargs: dict | None = Field(None, description="sudu extension: extra chat template variables.")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type in ("input_image", "input_file", "input_audio"):
            raise invalid(f"{part.type} is not supported here: only message content takes images", f"{where}.{j}")
        parts.append(part.refusal if part.type == "refusal" else part.text)
    return "\n".join(parts)


def _content(content, where: str) -> str | list[dict]:
    """A message's content: its text, or with input_image parts chat content parts (text and image_url)."""
    if isinstance(content, str) or not any(part.type == "input_image" for part in content):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if part.type == "input_image":
            if not part.image_url:
                raise invalid("input_image needs an image_url (file ids are not supported)", f"{where}.{j}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        elif part.type in ("input_file", "input_audio"):
            raise invalid(f"{part.type} is not supported: this server's model takes text and images", f"{where}.{j}")
        else:
            parts.append({"type": "text", "text": part.refusal if part.type == "refusal" else part.text})
    return parts


def input_messages(body: ResponsesRequest) -> list[dict]:
    """This turn's input items as chat messages (see the module docstring)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _content(item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"{where}.output")})
        elif isinstance(item, ItemReference):
            raise invalid("item_reference items are not supported; send the items themselves or use "
                          "previous_response_id", where)
    return out


def to_chat_request(body: ResponsesRequest, history: list[dict]) -> tuple[P.ChatCompletionRequest, list[dict]]:
    """The chat completions request that answers `body` after the stored `history`, and the conversation to
    store (history + this turn's input, without the instructions)."""
    if body.background:
        raise invalid("background responses are not supported", "background")
    if body.conversation is not None:
        raise invalid("conversation objects are not supported; use previous_response_id", "conversation")
    conversation = history + input_messages(body)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else []) \
        + conversation
    if not messages:
        raise invalid("the conversation is empty", "input")
    chat: dict = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
                  "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                  "priority": body.priority, "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.type != "function" or not tool.name:
                raise invalid(f"tool type {tool.type!r} is not supported; this server runs function tools "
                              f"(with a name) only", f"tools.{i}")
            function = {"name": tool.name}
            for key in ("description", "parameters", "strict"):
                if getattr(tool, key) is not None:
                    function[key] = getattr(tool, key)
            tools.append({"type": "function", "function": function})
        chat["tools"] = tools
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning is not None and body.reasoning.effort is not None:
        kwargs["enable_thinking"] = body.reasoning.effort not in ("none", "minimal")
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    try:
        return P.ChatCompletionRequest.model_validate(chat), conversation
    except ValidationError as exc:
        error = exc.errors()[0]
        param = {"response_format": "text.format", "max_tokens": "max_output_tokens"}.get(
            str(error.get("loc", ("",))[0]), ".".join(str(p) for p in error.get("loc", ())))
        raise invalid(str(error.get("msg")), param) from None


# ---- answers


class _Items:
    """Events -> output items: consecutive events of one kind extend the open item, another kind closes it
    and opens the next. Returns the stream's events (without sequence numbers) for each change; `items` is
    the whole answer's output, so a stream and a single body are built by the same steps."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: str | None = None  # "reasoning" | "message" | "function_call"
        self.calls: list[dict] = []  # the answer's calls as chat tool calls (for the store)

    def events(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, Reasoning):
                self._ensure(out, "reasoning")
                part = self.items[-1]["content"][0]
                part["text"] += e.text
                out.append(self._ev("response.reasoning_text.delta", content_index=0, delta=e.text))
            elif isinstance(e, ContentDelta):
                self._ensure(out, "message")
                self.items[-1]["content"][0]["text"] += e.text
                out.append(self._ev("response.output_text.delta", content_index=0, delta=e.text, logprobs=[]))
            elif isinstance(e, ToolCallStart):
                self._close(out)
                self._open = "function_call"
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": e.id, "name": e.name,
                        "arguments": "", "status": "in_progress"}
                self.items.append(item)
                out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                            "item": dict(item)})
            elif isinstance(e, ToolCallArgsDelta):
                self.items[-1]["arguments"] += e.text
                out.append(self._ev("response.function_call_arguments.delta", delta=e.text))
        return out

    def close(self) -> list[dict]:
        out: list[dict] = []
        self._close(out)
        return out

    def _ev(self, type_: str, **fields) -> dict:
        return {"type": type_, "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, **fields}

    def _ensure(self, out: list, kind: str) -> None:
        if self._open == kind:
            return
        self._close(out)
        self._open = kind
        if kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                    "item": {**item, "content": []}})
        out.append(self._ev("response.content_part.added", content_index=0, part=dict(item["content"][0])))

    def _close(self, out: list) -> None:
        if self._open is None:
            return
        item = self.items[-1]
        if self._open == "function_call":
            out.append(self._ev("response.function_call_arguments.done", arguments=item["arguments"],
                                name=item["name"]))
            self.calls.append({"id": item["call_id"], "type": "function",
                               "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}})
        else:
            part = item["content"][0]
            if self._open == "reasoning":
                out.append(self._ev("response.reasoning_text.done", content_index=0, text=part["text"]))
            else:
                out.append(self._ev("response.output_text.done", content_index=0, text=part["text"], logprobs=[]))
            out.append(self._ev("response.content_part.done", content_index=0, part=dict(part)))
        item["status"] = "completed"
        out.append({"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item})
        self._open = None

    def assistant_message(self) -> dict:
        """The answer as the chat message a continued conversation renders."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        message: dict = {"role": "assistant", "content": text}
        if self.calls:
            message["tool_calls"] = self.calls
        return message


class ResponseCall:
    """One /v1/responses call: the chat path's Call (its accounting and metrics), rendered as a response."""

    def __init__(self, call: Call, body: ResponsesRequest, conversation: list[dict], store: ResponseStore):
        self.call, self.body, self.conversation, self.store = call, body, conversation, store
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.answer = AnswerEvents(call.tool_format, call.reasoning, call.reasoning_open, call.tool_schemas)
        self.items = _Items()
        self._sequence = 0

    async def _events(self) -> AsyncIterator[list[dict]]:
        async for typed, c in answer_steps(self.call, self.answer):
            events = self.items.events(typed)
            if c.finish_reason is not None:
                events += self.items.close()
            if events:
                yield events

    def _usage(self) -> dict:
        call = self.call
        prompt, output = sum(len(j.prompt_ids) for j in call.jobs), sum(call.num_tokens)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": sum(call.num_cached)},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": self.answer.reasoning_tokens},
                "total_tokens": prompt + output}

    def _response(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        body = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.call.model, "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text is not None and body.text.format is not None else {"type": "text"}},
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "truncation": "disabled", "user": body.user,
            "usage": self._usage() if status in ("completed", "incomplete", "failed") else None,
        }

    def _finished(self) -> dict:
        status = "incomplete" if self.call.finish_reasons[0] == "length" else "completed"
        response = self._response(status, self.items.items)
        if self.body.store:
            self.store.put(self.id, self.conversation + [self.items.assistant_message()], response)
        return response

    async def single(self) -> JSONResponse:
        async for _ in self._events():
            pass
        return JSONResponse(self._finished())

    def _sse(self, event: dict) -> bytes:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return f"event: {event['type']}\ndata: ".encode() + json.dumps(
            event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    async def stream(self) -> AsyncIterator[bytes]:
        call = self.call
        yield self._sse({"type": "response.created", "response": self._response("in_progress", [])})
        yield self._sse({"type": "response.in_progress", "response": self._response("in_progress", [])})
        try:
            async for events in self._events():
                for event in events:
                    yield self._sse(event)
            response = self._finished()
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield self._sse({"type": kind, "response": response})
        except Exception as exc:  # noqa: BLE001 -- a stream ends with an error event, never cut short
            err = failed_call(exc, call.is_draining())
            call.metrics.count_error(err)
            error = {"code": err.code or err.type, "message": err.message}
            yield self._sse({"type": "response.failed", "response": self._response("failed", self.items.items, error)})


# OpenAPI links: a response's id continues the conversation (documentation, and the stateful fuzz test's path)
_RESPONSE_LINKS = {
    "continue": {"operationId": "create_response", "requestBody": {
        "previous_response_id": "$response.body#/id", "input": "Go on.", "max_output_tokens": 4}},
    "retrieve": {"operationId": "get_response", "parameters": {"path.response_id": "$response.body#/id"}},
}


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"No stored response with id {response_id!r} (unknown, expired or evicted)",
                    type="invalid_request_error", param=param, code="previous_response_not_found"
                    if param else "response_not_found")


def responses_routes(state, admit, store: ResponseStore | None = None) -> APIRouter:
    """state: the app's ServerState; admit: the chat routes' admission (routes.py); store: where `store: true`
    keeps responses (a default-sized ResponseStore when None)."""
    router = APIRouter(prefix="/v1")
    draining = lambda: state.draining  # noqa: E731
    store = store if store is not None else ResponseStore()

    @router.post("/responses", operation_id="create_response", tags=["responses"],
                 summary="OpenAI's Responses API (docs/agent_apis.md)",
                 responses={200: {"links": _RESPONSE_LINKS},
                            **{s: {"model": P.ErrorResponse} for s in (400, 401, 404, 413, 429, 500, 503)}})
    async def create_response(body: ResponsesRequest, request: Request):
        received_at = time.perf_counter()
        history: list[dict] = []
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = stored.messages
        chat, conversation = to_chat_request(body, history)
        prepared, model = await admit(state, chat, partial(prepare_chat, media=state.media))
        call = ResponseCall(Call(state.engine, state.metrics, prepared, model, "response", received_at, draining),
                            body, conversation, store)
        if body.stream:
            return sse(call.stream())
        return await unless_disconnected(request, call.single(), draining)

    @router.get("/responses/{response_id}", operation_id="get_response", tags=["responses"],
                summary="A stored response")
    async def get_response(response_id: str):
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id, None)
        return stored.body

    @router.delete("/responses/{response_id}", operation_id="delete_response", tags=["responses"],
                   summary="Forget a stored response")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise _not_found(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
