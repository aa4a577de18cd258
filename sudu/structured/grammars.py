"""From what a request asks for to one llguidance grammar (a string the backend compiles).

Every kind of constraint sudu takes ends up here: a JSON schema (`response_format` json_schema, or
json_object as the schema `{"type": "object"}`), a regular expression (`guided_regex`), a list of choices
(`guided_choice`), a Lark or GBNF grammar (`guided_grammar`), and the tool-call shape a `tool_choice` of
"required" or a named function demands. None of these functions checks that the grammar compiles:
`GrammarBackend.check` does, against the served tokenizer, and turns its error into the message a client
sees.

JSON is written compactly, with the separators of Python's `json.dumps` (", " and ": "): the form chat
templates render tool calls in (`tojson`), so constrained output stays in the text the model saw in
training, and without free whitespace, so a model cannot spend its budget on blank lines inside an
object."""
from __future__ import annotations

import json
import re

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Qwen 2.5 / Hermes: each call on its own lines between the template's tool-call tags
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


class GrammarError(ValueError):
    """A constraint that cannot be used: its message names the problem, for a 400."""


def json_schema_grammar(schema: dict | bool | None) -> str:
    """A grammar for one JSON value valid under `schema` (None: any JSON object)."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def regex_grammar(pattern: str) -> str:
    """Text that matches `pattern` from start to end (Rust regex syntax)."""
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices`."""
    if not choices:
        raise GrammarError("guided_choice needs at least one choice")
    return regex_grammar("|".join(re.escape(c) for c in choices))


def lark_grammar(text: str) -> str:
    """A grammar in llguidance's Lark dialect, or in llama.cpp's GBNF (recognised by its `::=` rules)."""
    if re.search(r"^\s*[\w-]+\s*::=", text, re.MULTILINE):
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # noqa: BLE001 -- the converter's own parse error, for the client
            raise GrammarError(f"invalid GBNF grammar: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def tool_call_schema(function: dict, fmt: str = "hermes") -> dict:
    """The JSON object a model writes to call `function`: its name as a constant, its arguments under its
    parameter schema (an object with no properties when the function takes none). Llama 3 templates call
    the arguments "parameters"."""
    params = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    key = "parameters" if fmt == "llama3" else "arguments"
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def tool_calls_grammar(functions: list[dict], parallel: bool, fmt: str = "hermes", tags_are_tokens: bool = False) -> str:
    """Output that is nothing but calls of `functions` (one, or one or more when `parallel`), each in the
    model's tool-call syntax. Used for tool_choice "required" (every tool) and a named function (that one).
    tags_are_tokens: the tokenizer has `<tool_call>` and `</tool_call>` as special tokens (Qwen 2.5), which
    the model writes as one token each; the grammar must then name the tokens, not their spelling."""
    if not functions:
        raise GrammarError("no tools to call")
    schemas = [tool_call_schema(f, fmt) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    if fmt == "llama3":
        call = body
        separator = '";" '
    else:
        if tags_are_tokens:
            call = f'{HERMES_OPEN} "\\n" {body} "\\n" {HERMES_CLOSE}'
        else:
            call = f'"{HERMES_OPEN}\\n" {body} "\\n{HERMES_CLOSE}"'
        separator = '"\\n" '
    calls = f"call ({separator}call)*" if parallel else "call"
    return llguidance.LLMatcher.grammar_from_lark(f"start: {calls}\ncall: {call}\n")


def lazy_tool_calls_grammar(functions: list[dict], open_token_id: int, close_token_id: int) -> str:
    """tool_choice "auto" on a model whose tool-call tags are single special tokens (Qwen 2.5's `<tool_call>`
    and `</tool_call>`): free text, any token but the opening tag, and from the moment the model writes the
    opening tag, a call of one of `functions` under its parameter schema, the closing tag, and free text
    again (any number of calls). Free text is not constrained at all (every token but the tag is allowed),
    so an answer without a call is exactly what the model would write without the grammar; a call's
    arguments always parse."""
    if not functions:
        raise GrammarError("no tools to call")
    schemas = [tool_call_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    return llguidance.LLMatcher.grammar_from_lark(
        f'start: free (<[{open_token_id}]> "\\n" {body} "\\n" <[{close_token_id}]> free)*\n'
        f"free: <[^{open_token_id}]>*\n")
