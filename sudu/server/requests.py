"""From a validated request body to engine work: the prompt (chat messages through the model's template,
or completion prompts) becomes token ids, the sampling parameters are built, and the engine checks
each request once. All of it is CPU work that grows with the input, so the routes run `prepare_chat` /
`prepare_completion` in the worker pool (limits.py), never on the event loop, and pass the
`PreparedCall` on unchanged.

Cheap bounds come first: prompts x n against the choice limit, and the prompt's characters against
what `max_model_len` tokens can cover, so an oversized prompt is refused before it is tokenized."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from sudu.engine.request import CheckedRequest
from sudu.errors import RequestTooLongError, SuduError
from sudu.media.image import MediaError
from sudu.sampling import SamplingParams
from sudu.server import protocol as P
from sudu.server.engine_protocol import ServingEngine
from sudu.server.constraints import auto_tool_grammar, output_grammar, tool_grammar
from sudu.server.errors import invalid
from sudu.server.media_input import MediaPolicy, media_error, take_images
from sudu.server.reasoning import opens_reasoning, reasoning_template
from sudu.structured.grammars import GrammarError
from sudu.tools import messages as tool_messages
from sudu.tools.parser import detect_format

_PROMPT_TAIL_TOKENS = 8  # enough of a rendered prompt to see whether it ends with an open <think>
_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                      "pad_token"})
GREEDY_TEMPERATURE = 1e-5  # below this, temperature is treated as 0 (logits / ~0 overflow)
MAX_CHOICES_PER_REQUEST = 256  # prompts x n of one /v1/completions call


@dataclass
class Job:
    """One engine request of a call (a completions call with several prompts has several)."""

    request_id: str
    request: CheckedRequest
    priority: int

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids


@dataclass
class PreparedCall:
    jobs: list[Job]
    n: int
    logprobs: int | None  # None: no logprobs; k: the sampled token's and k alternatives
    echo: list[str] | None = None  # completions with echo: each prompt's text
    tool_format: str | None = None  # chat with tools: the tool-call syntax to parse out of the answers
    reasoning: bool = False  # chat on a template with thinking: split <think> text from the answer
    reasoning_open: bool = False  # the rendered prompt ends inside an open <think> block (DeepSeek-R1 style)
    # tool_choice auto: name -> parameter schema of each tool, for bare JSON calls (sudu/tools/bare_calls.py)
    tool_schemas: dict[str, dict] | None = None


def prepare_chat(engine: ServingEngine, body: P.ChatCompletionRequest, media: MediaPolicy = MediaPolicy()
                 ) -> PreparedCall:
    """media: where images may come from and how large they may be (server/media_input.py)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs requires logprobs=true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens, logprobs)
    _check_chars(engine, sum(_content_chars(m.content) for m in body.messages), "messages")
    processor = getattr(engine, "image_processor", None)
    messages, images = take_images([m.model_dump(exclude_none=True) for m in body.messages], processor, media)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None
    template = engine.tokenizer.template_source
    if tools is not None:
        _user_check("tools", tool_messages.check_tools, tools)
    _user_check("tool_choice", tool_messages.check_tool_choice, _tool_choice(body), tools or [])
    _user_check("messages", tool_messages.check_tool_messages, messages)
    messages = _user_check("messages", tool_messages.template_messages, messages)
    fmt = detect_format(template)
    grammar, grammar_param = output_grammar(body)
    forced = tool_grammar(body, fmt, engine.grammar_backend)
    if forced is not None:
        if grammar is not None:
            raise invalid(f"tool_choice {_tool_choice(body)!r} already constrains the output; drop {grammar_param}",
                          grammar_param)
        grammar, grammar_param = forced, "tool_choice"
    elif grammar is None and body.tools:
        lazy = auto_tool_grammar(body, fmt, engine.grammar_backend)
        if lazy is not None:
            grammar, grammar_param = lazy, "tools"
    if grammar is not None:
        params.grammar = grammar
    if tools and not tool_messages.supports_tools(template):
        messages, tools = tool_messages.fallback_messages(messages, tools), None
    template_kwargs = _template_kwargs(body)
    try:
        ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=True, max_tokens=engine.max_model_len,
                                           tools=tools, template_kwargs=template_kwargs)
    except RequestTooLongError as exc:
        raise invalid(str(exc), "messages", code="context_length_exceeded") from exc
    except Exception as exc:  # noqa: BLE001 -- templates reject message orders with raise_exception()
        raise invalid(f"The chat template rejected the messages: {exc}", "messages") from exc
    if not ids:
        raise invalid("The rendered prompt is empty", "messages")
    placed = ()
    if images:
        try:
            ids, placed = processor.expand(ids, images)
        except MediaError as exc:
            raise media_error(exc, "messages") from None
    jobs = _checked_jobs(engine, "chatcmpl", [ids], params, body.priority, "messages", grammar_param, placed)
    parse_tools = bool(body.tools) and _tool_choice(body) != "none"
    thinking = reasoning_template(template)
    schemas = None
    if parse_tools and _tool_choice(body) == "auto":
        schemas = {t.function.name: t.function.parameters or {} for t in body.tools}
    return PreparedCall(jobs, body.n, logprobs, tool_format=fmt if parse_tools else None, reasoning=thinking,
                        reasoning_open=thinking and opens_reasoning(engine.tokenizer.decode(ids[-_PROMPT_TAIL_TOKENS:])),
                        tool_schemas=schemas)


def _template_kwargs(body: P.ChatCompletionRequest) -> dict | None:
    """chat_template_kwargs, with the top-level enable_thinking merged in; names the template call itself
    sets are refused."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.enable_thinking is not None:
        kwargs["enable_thinking"] = body.enable_thinking
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    return kwargs or None


def _tool_choice(body: P.ChatCompletionRequest):
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _user_check(param: str, check, *args):
    """check(*args), its ValueError a 400 on param."""
    try:
        return check(*args)
    except ValueError as exc:
        raise invalid(str(exc), param) from None


def prepare_completion(engine: ServingEngine, body: P.CompletionRequest) -> PreparedCall:
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if len(prompts) * body.n > MAX_CHOICES_PER_REQUEST:
        raise invalid(f"{len(prompts)} prompts x n={body.n} exceeds {MAX_CHOICES_PER_REQUEST} choices", "prompt")
    params = sampling_params(body, body.max_tokens, body.logprobs)
    params.grammar, grammar_param = output_grammar(body)
    token_lists = []
    for p in prompts:
        if isinstance(p, str):
            _check_chars(engine, len(p), "prompt")
            try:
                ids = engine.tokenizer.encode(p, add_special_tokens=True, max_tokens=engine.max_model_len)
            except RequestTooLongError as exc:
                raise invalid(str(exc), "prompt", code="context_length_exceeded") from exc
        else:
            ids = list(p)
        if not ids:
            raise invalid("The prompt encodes to no tokens", "prompt")
        token_lists.append(ids)
    jobs = _checked_jobs(engine, "cmpl", token_lists, params, body.priority, "prompt", grammar_param)
    echo = [engine.tokenizer.decode(ids) for ids in token_lists] if body.echo else None
    return PreparedCall(jobs, body.n, body.logprobs, echo)


def sampling_params(body: P._SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    try:
        return SamplingParams(
            n=body.n,
            temperature=0.0 if body.temperature < GREEDY_TEMPERATURE else body.temperature,
            top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, seed=body.seed, max_tokens=max_tokens, stop=list(stop),
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=logprobs,
        )
    except ValueError as exc:
        message = str(exc)
        raise invalid(message, message.split(" ", 1)[0]) from exc


def _content_chars(content: P.MessageContent | None) -> int:
    if content is None:
        return 0
    return len(content) if isinstance(content, str) else sum(len(getattr(part, "text", "")) for part in content)


def _check_chars(engine: ServingEngine, num_chars: int, param: str) -> None:
    """Refuse, without tokenizing, a prompt longer than the context could hold even at the tokenizer's
    longest token per position."""
    limit = engine.max_model_len * engine.tokenizer.max_token_chars
    if num_chars > limit:
        raise invalid(f"The prompt has {num_chars} characters; this model's context of {engine.max_model_len} "
                      f"tokens covers at most {limit}", param, code="context_length_exceeded")


def _checked_jobs(engine: ServingEngine, id_prefix: str, prompts: list[list[int]], params: SamplingParams,
                  priority: int, prompt_param: str, grammar_param: str | None = None, images: tuple = ()
                  ) -> list[Job]:
    """One engine request per prompt, each checked once (length against the context, token ids against
    the vocabulary, the output grammar against the tokenizer) before anything is queued. images: the one
    prompt's images, at their placeholder tokens."""
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    jobs = []
    for i, ids in enumerate(prompts):
        try:
            checked = engine.check_request(ids, params, images) if images else engine.check_request(ids, params)
        except RequestTooLongError as exc:
            raise invalid(str(exc), prompt_param, code="context_length_exceeded") from exc
        except GrammarError as exc:
            raise invalid(str(exc), grammar_param) from exc
        except (SuduError, ValueError) as exc:
            raise invalid(str(exc), prompt_param) from exc
        jobs.append(Job(request_id if len(prompts) == 1 else f"{request_id}-{i}", checked, priority))
    return jobs


