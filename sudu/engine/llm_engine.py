"""LLMEngine: add_request / step / abort over the scheduler, block manager, model runner and sampler.

Each step schedules a batch, runs one forward pass, samples the sequences whose chunk reached their
end, applies stop conditions, and returns one RequestOutput (deltas) per request that advanced.
A request with n > 1 is n sequences; the siblings of choice 0 are held back until its prompt is in
the prefix cache, so they share the prompt's full blocks instead of recomputing them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from sudu.config import EngineConfig
from sudu.cache.context import build_block_manager
from sudu.engine.model_runner import ModelRunner, prepare_network
from sudu.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from sudu.engine.scheduler import Scheduler
from sudu.engine.sequence import Sequence, SequenceStatus
from sudu.errors import RequestTooLongError
from sudu.engine.speculative import SpecController, build_drafter, draft_len, verify_draft
from sudu.layers.sampler import SampledToken, Sampler, SamplingRow
from sudu.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_MODEL_LEN_CAP = 32768


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    error: str | None = None
    pending: list[CompletionOutput] = field(default_factory=list)  # outputs produced outside step()

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        from sudu.weights.loader import load_checkpoint

        config.validate()
        self.config = config
        ckpt = load_checkpoint(config.model, pull=True, progress=progress)
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model_path = ckpt.path
        model, self.quantization = prepare_network(ckpt, config)
        limit = min(ckpt.config.max_position_embeddings, MAX_MODEL_LEN_CAP)
        self.max_model_len = min(config.max_model_len or limit, ckpt.config.max_position_embeddings)
        self.runner = ModelRunner(config, ckpt.config, model, self.max_model_len, self.tokenizer)
        self.block_manager = build_block_manager(config, ckpt, self.quantization, self.runner)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_when_decoding, config.max_itl_factor)
        self.sampler = Sampler(config.seed)
        self.requests: dict[str, RequestState] = {}
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(ckpt.config.eos_token_id)
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens run through the model, all requests (prefix-cache evidence)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafter = None
        if config.speculative != "none":
            self.drafter = build_drafter(config.speculative, self)
            self.spec_controller = SpecController(draft_len(config), config.speculative_max_batch)
        log.info(
            "engine ready: %s, max_model_len %d, %d KV blocks of %d tokens",
            ckpt.path, self.max_model_len, self.runner.num_blocks, config.block_size,
        )

    # ---- admission ----------------------------------------------------------------------------
    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The number of tokens this request may generate; raises if it can never fit."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        pool_tokens = self.runner.num_blocks * self.config.block_size  # the global layers' pool bounds a sequence
        limit = min(self.max_model_len, pool_tokens)
        if num_prompt_tokens >= limit:
            raise RequestTooLongError(
                f"the prompt has {num_prompt_tokens} tokens; this model's context is {limit} tokens "
                f"(max_model_len {self.max_model_len}, KV pool {pool_tokens}), leaving no room to generate"
            )
        if params.max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + params.max_tokens > limit:
            raise RequestTooLongError(
                f"{num_prompt_tokens} prompt tokens + {params.max_tokens} max_tokens = "
                f"{num_prompt_tokens + params.max_tokens} > {limit}, the most this engine can hold for one sequence"
            )
        return params.max_tokens

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        params.validate()
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return self.resolve_max_tokens(len(prompt_token_ids), params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        from sudu.tokenizer import IncrementalDetokenizer

        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self.check_request(prompt_ids, params)
        now = time.perf_counter() if arrival_time is None else arrival_time
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                request_id=request_id, index=index, token_ids=list(prompt_ids),
                num_prompt_tokens=len(prompt_ids), params=params, priority=priority,
                arrival_time=now, max_total_tokens=len(prompt_ids) + max_tokens,
            )
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed(params.seed + index)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            seq.held_back = index > 0
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = RequestState(request_id, prompt_ids, params, seqs, RequestMetrics(now))

    def abort(self, request_id: str, error: str | None = None) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        state.error = error
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                self._release_spec(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
                state.pending.append(self._take_delta(seq))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {rid: s for rid, s in self.requests.items() if s.pending}
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return [self._make_output(state) for state in touched.values()]
        prefill_tokens = [s.num_new_tokens for s in scheduled if not (s.samples and s.num_new_tokens == 1)]
        decodes = len(scheduled) - len(prefill_tokens)
        now = time.perf_counter()
        for s in scheduled:
            m = self.requests[s.seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        drafts = {}
        if self.drafter is not None:
            # prompts completing in this step: the drafter's own prompt work goes into this step (TTFT)
            finishing = [s.seq for s in scheduled if s.samples and s.seq.num_output_tokens == 0]
            if finishing:
                self.drafter.prefill(finishing)
            drafts = self._draft(scheduled)
        logits = self.runner.execute(scheduled)
        self.num_steps += 1
        plain, plain_rows, speculated = [], [], []
        row = 0
        for s in scheduled:
            if s.samples:
                if s.draft_token_ids:
                    speculated.append((s, logits[row:row + s.num_logit_rows]))
                else:
                    plain.append(s.seq)
                    plain_rows.append(row)
                row += s.num_logit_rows
            self.num_computed_tokens += s.num_new_tokens
            if not s.draft_token_ids:
                s.seq.num_computed_tokens += s.num_new_tokens
                self.block_manager.commit(s.seq)
        rows = [SamplingRow(q.params, q.prompt_token_ids, q.output_token_ids, q.generator) for q in plain]
        sampled = self.sampler(logits[plain_rows], rows) if plain else []
        now = time.perf_counter()
        for seq, tok in zip(plain, sampled):
            state = self._first_token(seq, now)
            self._append_token(seq, tok)
            touched[seq.request_id] = state
        for s, seq_logits in speculated:
            state = self._first_token(s.seq, now)
            self._accept_speculated(s, seq_logits, drafts[s.seq.seq_id], state)
            touched[s.seq.request_id] = state
        # (drafts are added after the counts above, so a speculative decode counts as a decode)
        self.scheduler.chunk_budget.observe(decodes, sum(prefill_tokens), time.perf_counter() - start)
        return [self._make_output(state) for state in touched.values()]

    def _first_token(self, seq: Sequence, now: float) -> RequestState:
        state = self.requests[seq.request_id]
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        if seq.index == 0 and seq.num_output_tokens == 0:
            for sibling in state.seqs[1:]:
                sibling.held_back = False
        return state

    def _draft(self, scheduled: list) -> dict:
        """Give decoding sequences draft tokens to verify in this step's forward pass."""
        decoding = [s for s in scheduled if s.samples and s.num_new_tokens == 1 and s.seq.num_output_tokens > 0]
        if not decoding or not self.spec_controller.active(len(self.scheduler.running)):
            return {}
        spare = self.config.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
        ks = []
        for s in decoding:
            k = min(self.spec_controller.draft_len(s.seq), max(spare, 0))
            spare -= k
            ks.append(k)
        proposals = self.drafter.propose([s.seq for s in decoding], ks)
        drafts = {}
        for s, d in zip(decoding, proposals):
            if d.token_ids and self.block_manager.can_allocate(s.seq, 1 + len(d.token_ids)):
                self.block_manager.allocate(s.seq, 1 + len(d.token_ids))
                s.num_new_tokens = 1 + len(d.token_ids)
                s.draft_token_ids = d.token_ids
                drafts[s.seq.seq_id] = d
        return drafts

    def _accept_speculated(self, s, seq_logits: torch.Tensor, draft, state: RequestState) -> None:
        seq = s.seq
        row = SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator)
        accepted = verify_draft(seq_logits, draft, row, seq.generator or self.sampler.shared_generator)
        num_drafted, num_accepted = len(draft.token_ids), len(accepted) - 1
        m = state.metrics
        m.num_draft_tokens += num_drafted
        m.num_accepted_tokens += num_accepted
        m.num_spec_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.spec_controller.update(seq, num_drafted, num_accepted)
        computed_before = seq.num_computed_tokens
        raw = torch.log_softmax(seq_logits, -1) if seq.params.logprobs is not None else None
        for i, token in enumerate(accepted):
            tok = SampledToken(token)
            if raw is not None:
                tok.logprob = float(raw[i, token])
                if seq.params.logprobs:
                    top = torch.topk(raw[i], seq.params.logprobs)
                    tok.top = list(zip(top.indices.tolist(), top.values.tolist()))
            self._append_token(seq, tok)
            if seq.is_finished:
                return
        # the last token and the accepted drafts now have valid KV; the rejected drafts' slots are dead
        seq.num_computed_tokens = computed_before + len(accepted)
        self.block_manager.trim(seq, seq.num_tokens)
        self.block_manager.commit(seq)

    def _append_token(self, seq: Sequence, tok) -> None:
        p = seq.params
        token = tok.token_id
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        if p.logprobs is not None:
            decode = self.tokenizer.decode
            seq.new_logprobs.append(TokenLogprob(
                token, decode([token], skip_special_tokens=False), tok.logprob,
                [(t, decode([t], skip_special_tokens=False), lp) for t, lp in (tok.top or [])],
            ))
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return self._finish(seq, "stop", token)
        text = seq.pending_text + seq.detokenizer.add([token])
        seq.pending_text = ""
        if p.stop:
            hit = min(((text.find(s), s) for s in p.stop if s in text), default=None)
            if hit is not None:
                seq.new_text += text[: hit[0]]
                return self._finish(seq, "stop", hit[1], flush=False)
            hold = _stop_prefix_len(text, p.stop)
            seq.new_text += text[: len(text) - hold]
            seq.pending_text = text[len(text) - hold:]
        else:
            seq.new_text += text
        if seq.num_tokens >= seq.max_total_tokens:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason, flush: bool = True) -> None:
        if flush:
            seq.new_text += seq.pending_text + seq.detokenizer.flush()
        seq.pending_text = ""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        self._release_spec(seq)

    def _release_spec(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)
            self.spec_controller.release(seq)

    def _take_delta(self, seq: Sequence) -> CompletionOutput:
        out = CompletionOutput(
            index=seq.index, text=seq.new_text, token_ids=seq.new_token_ids,
            logprobs=seq.new_logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            num_output_tokens=seq.num_output_tokens,
        )
        seq.new_text, seq.new_token_ids, seq.new_logprobs = "", [], []
        return out

    def _make_output(self, state: RequestState) -> RequestOutput:
        outputs = state.pending
        state.pending = []
        for seq in state.seqs:
            if seq.new_token_ids:  # every finish except abort comes with the token that caused it
                outputs.append(self._take_delta(seq))
        finished = state.finished
        if finished:
            state.metrics.finished_time = time.perf_counter()
            del self.requests[state.request_id]
        first = state.seqs[0]
        state.metrics.disk_load_s = first.disk_load_s
        return RequestOutput(
            request_id=state.request_id, prompt_token_ids=state.prompt_token_ids, outputs=outputs,
            finished=finished, num_cached_tokens=first.num_cached_tokens or 0,
            metrics=state.metrics, error=state.error, num_cached_tokens_disk=first.num_cached_tokens_disk,
        )

    def close(self) -> None:
        """Let the context cache's disk writer finish what it has queued (blocks still in RAM are on disk
        already or were dropped: they are written through as they fill)."""
        self.block_manager.close()

    # ---- introspection ------------------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "prefix_cache_queries": bm.stats.queries,
            "prefix_cache_hits": bm.stats.hits,
            "prefix_cache_hits_disk": bm.stats.disk_hits,
            **bm.disk_stats(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
        }


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is the start of some stop string (held back)."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
