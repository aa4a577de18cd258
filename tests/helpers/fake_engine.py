"""A fake engine for the server's tests: the ServingEngine interface with scripted outputs over a byte-level
tokenizer, so the HTTP edge is tested without a model."""
from __future__ import annotations

import asyncio
import threading
import time

from sudu.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from sudu.engine.request import CheckedRequest
from sudu.errors import EngineFailedError, RequestTooLongError

BLOCK_SIZE = 16


class ByteTokenizer:
    eos_token_ids = [0]
    bos_token = None
    vocab_size = 256
    max_token_chars = 1

    def __init__(self):
        self.encoded_chars = 0  # characters tokenized so far: shows what was refused before tokenizing
        self.hold: threading.Event | None = None

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        self.encoded_chars += len(text)
        if self.hold is not None and "hold" in text:  # a slow tokenization, released by the test
            self.hold.wait(30)
        ids = list(text.encode())
        if max_tokens is not None and len(ids) > max_tokens:
            raise RequestTooLongError(f"the prompt has {len(ids)} tokens, more than {max_tokens}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    template_source = "{{ messages }}"  # renders no tools: the server uses its fallback (sudu/tools/messages.py)

    def encode_chat(self, messages, add_generation_prompt: bool = True, max_tokens: int | None = None,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""), max_tokens=max_tokens)


class FakeEngine:
    """Answers each prompt with its own bytes, one token per step of `step_s`; KV blocks are counted like
    the real pool (ceil(tokens / 16) per choice), so leaks show in stats()."""

    def __init__(self, max_queue_len: int = 256, step_s: float = 0.002, total_blocks: int = 4096,
                 max_model_len: int = 512):
        self.model_name = "fake-model"
        self.tokenizer = ByteTokenizer()
        self.grammar_backend = None
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.step_s = step_s
        self.total_blocks = total_blocks
        self.blocks: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.started = False
        self.stopping = False
        self.shutdown_deadline: float | None = None
        self.fail_check_for: str | None = None  # prompt text that makes check_request crash (-> 500)
        self.full = False
        self.num_checks = 0
        self.failure: str | None = None

    async def start(self) -> None:
        self.started = True
        self.loop = asyncio.get_running_loop()
        self.failed = asyncio.Event()

    def is_full(self) -> bool:
        return self.full or len(self.blocks) >= self.max_queue_len

    async def wait_failed(self) -> str:
        await self.failed.wait()
        return self.failure

    def fail(self, reason: str) -> None:
        """What AsyncLLMEngine does when it cannot continue (from any thread)."""

        def on_loop() -> None:
            self.failure = reason
            self.failed.set()

        self.loop.call_soon_threadsafe(on_loop)

    def check_request(self, prompt_token_ids: list[int], params) -> CheckedRequest:
        if max(prompt_token_ids) >= self.tokenizer.vocab_size:
            raise ValueError(f"token id {max(prompt_token_ids)} is outside the vocabulary")
        num_prompt_tokens = len(prompt_token_ids)
        if self.fail_check_for is not None and num_prompt_tokens == len(self.fail_check_for):
            raise RuntimeError("injected failure")
        if num_prompt_tokens >= self.max_model_len or num_prompt_tokens + (params.max_tokens or 0) > self.max_model_len:
            raise RequestTooLongError(f"{num_prompt_tokens} prompt tokens + {params.max_tokens} max_tokens > "
                                      f"{self.max_model_len} (the context)")
        self.num_checks += 1
        return CheckedRequest(prompt_token_ids, params, params.max_tokens or self.max_model_len - num_prompt_tokens)

    def stats(self) -> dict:
        used = sum(self.blocks.values())
        return {"num_running": len(self.blocks), "num_waiting": 0, "kv_cache_usage": used / self.total_blocks,
                "prefix_cache_queries": 10, "prefix_cache_hits": 4, "num_preemptions": 0,
                "num_free_blocks": self.total_blocks - used, "num_total_blocks": self.total_blocks}

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        self.blocks.pop(request_id, None)

    async def shutdown(self, timeout_s: float) -> None:
        self.stopping = True
        self.shutdown_deadline = time.perf_counter() + timeout_s
        while self.blocks and time.perf_counter() < self.shutdown_deadline + 1:
            await asyncio.sleep(0.005)

    async def generate(self, request_id, request: CheckedRequest, priority: int = 0):
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        prompt_token_ids, params, max_tokens = request.prompt_token_ids, request.params, request.max_tokens
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.blocks[request_id] = -(-len(prompt_token_ids) // BLOCK_SIZE) * params.n
        try:
            metrics.first_scheduled_time = time.perf_counter()
            produced = 0
            while True:
                await asyncio.sleep(self.step_s)
                if self.failure is not None:
                    raise EngineFailedError(self.failure)
                if request_id not in self.blocks:
                    return
                if self.shutdown_deadline is not None and time.perf_counter() > self.shutdown_deadline:
                    metrics.finished_time = time.perf_counter()
                    yield RequestOutput(request_id, prompt_token_ids, [
                        CompletionOutput(i, "", [], finish_reason="abort", num_output_tokens=produced)
                        for i in range(params.n)], True, 0, metrics, error="aborted: server shutting down")
                    return
                token = prompt_token_ids[produced % len(prompt_token_ids)]
                produced += 1
                if metrics.first_token_time is None:
                    metrics.first_token_time = time.perf_counter()
                done = produced >= max_tokens
                if done:
                    metrics.finished_time = time.perf_counter()
                self.blocks[request_id] = -(-(len(prompt_token_ids) + produced) // BLOCK_SIZE) * params.n
                logprobs = None
                if params.logprobs is not None:
                    logprobs = [TokenLogprob(token, chr(token), -0.5,
                                             [(token, chr(token), -0.5)][: params.logprobs])]
                yield RequestOutput(
                    request_id, prompt_token_ids,
                    [CompletionOutput(i, chr(token), [token], logprobs, "length" if done else None,
                                      num_output_tokens=produced) for i in range(params.n)],
                    done, 0, metrics,
                )
                if done:
                    return
        finally:
            self.blocks.pop(request_id, None)
