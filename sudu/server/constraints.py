"""A request's output constraint, from its body: `response_format`, vLLM's `guided_*` extensions, and the
tool-call grammar that `tool_choice` "required" or a named function demands. The result is one grammar
string for `SamplingParams.grammar` (sudu/structured/grammars.py), or None. Whether it compiles is checked
against the served tokenizer in `prepare_*` (requests.py), where a failure becomes a 400 naming the field."""
from __future__ import annotations

import json

from sudu.server import protocol as P
from sudu.server.errors import invalid
from sudu.structured import grammars as G


def output_grammar(body: P._SamplingFields) -> tuple[str | None, str | None]:
    """(grammar, the field it came from) of response_format / guided_*; at most one may be set."""
    fields = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        fields.append("response_format")
    fields += [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
               if getattr(body, name) is not None]
    if len(fields) > 1:
        raise invalid(f"Give at most one output constraint; got {', '.join(fields)}", fields[1])
    if not fields:
        return None, None
    field = fields[0]
    try:
        if field == "response_format":
            if rf.type == "json_object":
                return G.json_schema_grammar(None), field
            if rf.json_schema is None:
                raise G.GrammarError("response_format json_schema needs a json_schema object")
            return G.json_schema_grammar(rf.json_schema.schema_), field
        if field == "guided_json":
            schema = body.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise G.GrammarError(f"guided_json is not valid JSON: {exc}") from None
            return G.json_schema_grammar(schema), field
        if field == "guided_regex":
            return G.regex_grammar(body.guided_regex), field
        if field == "guided_choice":
            return G.choice_grammar(body.guided_choice), field
        return G.lark_grammar(body.guided_grammar), field
    except G.GrammarError as exc:
        raise invalid(str(exc), field) from None


def tool_grammar(body: P.ChatCompletionRequest, fmt: str, backend) -> str | None:
    """The grammar that forces tool calls: every tool for "required", one for a named function. backend:
    the engine's GrammarBackend (it knows whether the tool-call tags are tokens), None for none."""
    choice = body.tool_choice
    if not body.tools or choice in (None, "auto", "none"):
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    if choice != "required":
        functions = [f for f in functions if f["name"] == choice.function.name]
    tags_are_tokens = backend is not None and backend.is_special_token(G.HERMES_OPEN) and \
        backend.is_special_token(G.HERMES_CLOSE)
    return G.tool_calls_grammar(functions, body.parallel_tool_calls and choice == "required", fmt, tags_are_tokens)


def auto_tool_grammar(body: P.ChatCompletionRequest, fmt: str, backend) -> str | None:
    """tool_choice "auto" (explicit or by default) with tools, on the Hermes syntax whose tags are special
    tokens: the lazy grammar that leaves free text alone and constrains a call once its tag is written
    (grammars.lazy_tool_calls_grammar). None where it does not apply, or where a tool's schema does not
    compile (the request then runs unconstrained, as before: auto must not refuse what it used to take)."""
    if not body.tools or body.tool_choice not in (None, "auto") or fmt != "hermes" or backend is None:
        return None
    open_id, close_id = backend.special_token_id(G.HERMES_OPEN), backend.special_token_id(G.HERMES_CLOSE)
    if open_id is None or close_id is None:
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    try:
        grammar = G.lazy_tool_calls_grammar(functions, open_id, close_id)
        backend.check(grammar)
    except (G.GrammarError, ValueError):
        return None
    return grammar
