"""What the server needs from an engine, as a `typing.Protocol`: `AsyncLLMEngine` is the implementation,
the tests' scripted fake is another. Requests are checked once (`check_request`, in a worker thread) and
the CheckedRequest is what `generate` takes. An engine may also offer `try_admit(request_id, request,
priority) -> engine.wait_predictor.WaitPrediction` (admission by predicted wait: server/admission.py);
one without it admits by `is_full` alone. An engine serving a vision-language model also has `image_processor`
(media/: its images' preprocessing and placeholder) and takes `check_request(ids, params, images)`; one without
the attribute takes no images (server/media_input.py answers 400)."""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from sudu.engine.outputs import RequestOutput
from sudu.engine.request import CheckedRequest
from sudu.sampling import SamplingParams


class ServingTokenizer(Protocol):
    max_token_chars: int  # upper bound on the characters one token covers

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]: ...

    template_source: str  # the chat template (tool-call syntax is read from it)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    max_tokens: int | None = None, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ServingEngine(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: ServingTokenizer
    grammar_backend: object | None  # sudu.structured.backend.GrammarBackend; None: no constrained output

    async def start(self) -> None: ...

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting; in-flight requests finish within timeout_s or end with an error output."""

    async def wait_failed(self) -> str:
        """Return the reason once the engine cannot continue (every stream has then failed)."""

    def is_full(self) -> bool: ...

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """Raise RequestTooLongError / ValueError for a request that can never run. Thread-safe."""

    def generate(self, request_id: str, request: CheckedRequest, priority: int = 0
                 ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...
