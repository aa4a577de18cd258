"""LLM: the offline API. Give it prompts (text or token ids) and SamplingParams; it runs the engine
until every request is done and returns one result per prompt, in order."""
from __future__ import annotations

from dataclasses import dataclass, field

from sudu.config import EngineConfig
from sudu.engine.llm_engine import LLMEngine
from sudu.engine.outputs import RequestMetrics, TokenLogprob
from sudu.sampling import SamplingParams


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int
    metrics: RequestMetrics
    num_cached_tokens_disk: int = 0  # of num_cached_tokens, loaded from the disk tier

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    def __init__(self, model: str | None = None, progress: bool = True, **config):
        if model is not None:
            config["model"] = model
        self.engine = LLMEngine(EngineConfig(**config), progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
    ) -> list[GenerationResult]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            self._counter += 1
            rid = f"offline-{self._counter}"
            self.engine.add_request(rid, prompt, p, priority=priorities[i] if priorities else 0)
            ids.append(rid)
        results: dict[str, GenerationResult] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results.get(out.request_id)
                if res is None:
                    res = results[out.request_id] = GenerationResult(
                        out.request_id, out.prompt_token_ids, [], out.num_cached_tokens, out.metrics
                    )
                for o in out.outputs:
                    while len(res.outputs) <= o.index:
                        res.outputs.append(Completion(len(res.outputs)))
                    c = res.outputs[o.index]
                    c.text += o.text
                    c.token_ids += o.token_ids
                    if o.logprobs is not None:
                        c.logprobs = (c.logprobs or []) + o.logprobs
                    c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
                res.num_cached_tokens = out.num_cached_tokens
                res.num_cached_tokens_disk = out.num_cached_tokens_disk
                res.metrics = out.metrics
        return [results[rid] for rid in ids]

    def close(self) -> None:
        """Finish the context cache's queued disk writes (see LLMEngine.close)."""
        self.engine.close()
