"""OpenAI chat messages and tools -> what a jinja chat template takes, and the checks on them.

Templates with tool syntax (Qwen 2.5, Llama 3.1, Hermes) render `tools`, assistant `tool_calls` and
`role: "tool"` messages themselves; `template_messages` only reshapes the OpenAI fields the way
Hugging Face templates expect (arguments as a dict, tool messages with the function's `name`).

Templates without tool syntax (`supports_tools` is False: Gemma's, sudu's ChatML default) get
`fallback_messages`, which writes the tool conversation as plain text in the Hermes syntax that
`parser.py` reads back:
- the tool list, as JSON lines inside `<tools></tools>`, and the instruction to answer with
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` go into the system message: after the
  client's own system text when there is one (the order Qwen's template uses), else as a new one;
- an assistant message's tool calls become `<tool_call>` blocks after its text;
- tool results become a user message of `<tool_response>\\n...\\n</tool_response>` blocks, one per
  result, consecutive results (and a user message right after them) merged into one turn, so a
  template that insists on user/assistant alternation still accepts the conversation.
"""
from __future__ import annotations

import json
import re

from sudu.tokenizer import render_content

_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TOOL_CHOICES = ("none", "auto", "required")

_FALLBACK_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def _arguments(value, where: str) -> dict:
    """A tool call's arguments as a dict; clients send a JSON string (OpenAI's shape) or, some, a dict."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string holding a JSON object")
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}): {value[:200]!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where} must be a JSON object, not {type(parsed).__name__}: {value[:200]!r}")
    return parsed


def _call_names(messages: list[dict]) -> dict[str, str]:
    """tool_call_id -> function name, over every assistant message's tool calls."""
    names = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                names[call.get("id")] = call["function"].get("name")
    return names


def template_messages(messages: list[dict]) -> list[dict]:
    """Copies of the messages (already passed by `check_tool_messages`) shaped for Hugging Face chat
    templates: each tool call's `function.arguments` parsed into a dict (templates render
    `arguments | tojson`), each tool message given the `name` of the function it answers when the
    client left it out."""
    names = _call_names(messages)
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = []
            for j, call in enumerate(message["tool_calls"]):
                function = dict(call["function"])
                function["arguments"] = _arguments(function.get("arguments"),
                                                   f"messages[{i}].tool_calls[{j}].function.arguments")
                calls.append(dict(call, function=function))
            message["tool_calls"] = calls
        elif message.get("role") == "tool" and not message.get("name"):
            name = names.get(message.get("tool_call_id"))
            if name:
                message["name"] = name
        out.append(message)
    return out


def supports_tools(template_source: str | None) -> bool:
    """Whether a chat template renders tools and tool calls itself."""
    return bool(template_source) and "tools" in template_source and "tool_call" in template_source


def _tool_call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation as plain user/assistant/system messages for a template without tool syntax
    (see the module docstring)."""
    out: list[dict] = []
    tool_turn = False  # the last message in `out` is a user turn holding tool responses
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{render_content(message.get('content'))}\n</tool_response>"
            if tool_turn:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            tool_turn = True
            continue
        if role == "user" and tool_turn:
            out[-1]["content"] += "\n\n" + render_content(message.get("content"))
            tool_turn = False
            continue
        tool_turn = False
        message = dict(message)
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_tool_call_text(call["function"]["name"],
                                      _arguments(call["function"].get("arguments"),
                                                 f"messages[{i}].tool_calls[{j}].function.arguments"))
                      for j, call in enumerate(message.pop("tool_calls"))]
            text = render_content(message.get("content")).strip()
            message["content"] = "\n".join(([text] if text else []) + blocks)
        out.append(message)
    if tools:
        instructions = _FALLBACK_INSTRUCTIONS.format(
            tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if out and out[0].get("role") in ("system", "developer"):
            system = render_content(out[0].get("content"))
            out[0] = dict(out[0], role="system", content=f"{system}\n\n{instructions}" if system else instructions)
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def check_tools(tools) -> None:
    """Raises ValueError, with a message for the client, unless `tools` is a list of OpenAI function
    tools with valid, distinct names."""
    if tools is None:
        return
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}} objects")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"{where}: only {{\"type\": \"function\"}} tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', not {name!r}")
        if name in seen:
            raise ValueError(f"{where}: the function name {name!r} is used by an earlier tool too")
        seen.add(name)
        if "description" in function and not isinstance(function["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        if "strict" in function and not isinstance(function["strict"], (bool, type(None))):
            raise ValueError(f"{where}.function.strict must be true or false")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ValueError(f"{where}.function.parameters must be a JSON schema object")
            if parameters and parameters.get("type") != "object":
                raise ValueError(f"{where}.function.parameters must be a JSON schema of \"type\": \"object\", "
                                 f"not {parameters.get('type')!r}")


def _tool_names(tools) -> list[str]:
    return [tool["function"]["name"] for tool in tools or []]


def check_tool_choice(tool_choice, tools) -> None:
    """Raises ValueError unless tool_choice is "none", "auto", "required" or names a function among
    the (already checked) tools; "required" and a named function need tools."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice \"required\" needs tools")
        return
    if isinstance(tool_choice, str):
        raise ValueError(f"tool_choice must be one of {', '.join(map(repr, _TOOL_CHOICES))} or "
                         f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, not {tool_choice!r}")
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ValueError("tool_choice as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
    function = tool_choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("tool_choice.function.name must be a string")
    name = function["name"]
    if not tools:
        raise ValueError(f"tool_choice names the function {name!r} but the request has no tools")
    if name not in _tool_names(tools):
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                         f"({', '.join(_tool_names(tools))})")


def check_tool_messages(messages: list[dict]) -> None:
    """Raises ValueError unless every assistant tool call has an id and a function name and every
    tool message answers (by tool_call_id) a call of an earlier assistant message."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                if not isinstance(call, dict) or not isinstance(call.get("id"), str):
                    raise ValueError(f"{where} must be an object with a string id")
                if call.get("type", "function") != "function":
                    raise ValueError(f"{where}.type must be \"function\"")
                function = call.get("function")
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ValueError(f"{where}.function must be an object with a string name")
                _arguments(function.get("arguments"), f"{where}.function.arguments")
                call_ids.add(call["id"])
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ValueError(f"messages[{i}]: a tool message needs the tool_call_id it answers")
            if call_id not in call_ids:
                raise ValueError(f"messages[{i}]: tool_call_id {call_id!r} matches no tool call of an "
                                 f"earlier assistant message")
