"""The wire format of sudu's OpenAI-compatible API: pydantic models of the request bodies (they are the
published OpenAPI schema, and their bounds are the first line of input validation) and of the response
bodies (documentation only: the routes build plain dicts, which is faster per stream chunk).

Unknown request fields are ignored, as OpenAI clients send extras. Bounds that belong to sampling
itself are checked again by `SamplingParams`; the ones here make bad input a 400 before any work."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # choices per request; each choice holds its own KV blocks while it runs
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# Bounds on list fields: every one is scanned per request or per step, and the body-size limit alone
# would let a single request hold hundreds of thousands of entries.
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_PROMPTS = 256  # = the most choices of one call
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_CALLS = 128  # per assistant message
MAX_CHOICES = 1024  # guided_choice
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=_INT64_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]


class RequestModel(BaseModel):
    # extra="ignore": OpenAI clients send fields sudu does not implement (logit_bias, tools, ...);
    # allow_inf_nan=False: NaN/inf never reach sampling
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class JSONSchemaFormat(RequestModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema", description="The JSON schema; omitted -> any JSON object.")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(RequestModel):
    include_usage: bool = Field(False, description="Send a final chunk with usage (and choices: []).")
    continuous_usage_stats: bool = Field(
        False, description="sudu extension (vLLM's name): running usage on every content chunk."
    )


class _SamplingFields(RequestModel):
    """Fields shared by chat and text completions."""

    model: str | None = Field(None, description="Served model id; omitted -> the served model.")
    max_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    temperature: float = Field(1.0, ge=0.0, description="0 (or below 1e-5) -> greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N, description=f"Choices per request, at most {MAX_N}.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"A stop string or up to {MAX_STOP_STRINGS}; never included in the output."
    )
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # sudu extensions (vLLM uses the same names)
    top_k: int = Field(0, ge=-1, le=1 << 31, description="sudu extension: keep the k most likely tokens; 0 or -1 -> off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="sudu extension: drop tokens below min_p * p(best).")
    repetition_penalty: float = Field(
        1.0, ge=0.01, le=100.0, description="sudu extension: divide logits of seen tokens (>1 discourages repeats)."
    )
    ignore_eos: bool = Field(False, description="sudu extension: keep generating past end-of-sequence tokens.")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description=f"sudu extension: up to {MAX_STOP_TOKEN_IDS} token ids that end a choice."
    )
    priority: int = Field(
        0, ge=-(2**31), le=2**31 - 1, description="sudu extension: scheduling priority; lower is served first."
    )
    # structured output (docs/structured_output.md): at most one of these per request
    response_format: ResponseFormat | None = Field(
        None, description="{type: text | json_object | json_schema}; json_* constrain every token to valid JSON.")
    guided_json: dict | bool | str | None = Field(None, description="sudu extension (vLLM's name): a JSON schema.")
    guided_regex: str | None = Field(None, description="sudu extension: the output matches this regex (Rust syntax).")
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="sudu extension: the output is exactly one of these strings.")
    guided_grammar: str | None = Field(
        None, description="sudu extension: a Lark grammar (llguidance's dialect) or a GBNF grammar (rules with ::=).")


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str = Field(description="A data: URL (base64), or an http(s) URL from --allowed-media-domains.")
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]
MessageContent = Union[str, Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]]


class FunctionCall(RequestModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON object, in a string (OpenAI's shape).")


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None = Field(
        None, description="A string or an array of text and image_url parts (images: vision-language models).")
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = Field(
        None, description="An assistant turn's calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON schema of the arguments; omitted -> no arguments.")
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without.")
    parallel_tool_calls: bool = Field(True, description="Whether one answer may hold several calls.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Preferred over max_tokens when both are set.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Needs logprobs=true.")
    chat_template_kwargs: dict | None = Field(
        None, description="sudu extension (vLLM's name): extra variables for the chat template, e.g. "
                          "{\"enable_thinking\": false}.")
    enable_thinking: bool | None = Field(
        None, description="sudu extension: the template's thinking switch (Qwen3); same as chat_template_kwargs.")


PromptInput = Union[
    Annotated[str, Field(min_length=1)],
    Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of token-id lists."
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Top alternatives per token.")
    echo: bool = Field(False, description="Prepend the prompt text to each choice's text.")


# ---- responses (documentation of the shapes the routes return) ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    prompt_cache_hit_tokens: int = Field(description="DeepSeek-style: prompt tokens served from the prefix cache.")
    prompt_cache_miss_tokens: int = Field(description="DeepSeek-style: prompt tokens computed by prefill.")


class SuduTiming(BaseModel):
    """sudu's per-request timing extension (engine-side seconds)."""

    queue_s: float = Field(description="Arrival in the engine -> first scheduled.")
    prefill_s: float = Field(description="First scheduled -> first token.")
    decode_s: float = Field(description="First token -> finished.")
    ttft_s: float = Field(description="Arrival in the engine -> first token.")
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache (RAM and disk).")
    cached_tokens_disk: int = Field(0, description="Of cached_tokens, loaded from the context cache's disk tier.")
    disk_load_s: float = Field(0.0, description="Seconds spent loading (and checking) those blocks from disk.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    sudu: SuduTiming


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    sudu: SuduTiming


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sudu"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
