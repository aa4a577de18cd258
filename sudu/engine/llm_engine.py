"""LLMEngine: add_request / step / abort over the scheduler, block manager, model runner and sampler.

Each step schedules a batch, runs one forward pass, samples the sequences whose chunk reached their
end, applies stop conditions, and returns one RequestOutput (deltas) per request that advanced.
A request with n > 1 is n sequences; the siblings of choice 0 are held back until its prompt is in
the prefix cache, so they share the prompt's full blocks instead of recomputing them.
"""
from __future__ import annotations

import logging
import time
import dataclasses
from dataclasses import dataclass, field

import torch

from sudu.config import EngineConfig, rope_scaling_dict
from sudu.cuda.invariance import check_speculation
from sudu.engine import kv_choice
from sudu.engine.model_runner import ModelRunner
from sudu.engine.network import prepare_network
from sudu.engine.placement import resolve_device, resolve_dtype
from sudu.engine.output import check_end, check_stop, split_stop_text, token_logprob
from sudu.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sudu.engine.request import CheckedRequest
from sudu.engine.scheduler import ScheduledSeq, Scheduler
from sudu.engine.sequence import Sequence, SequenceStatus
from sudu.errors import RequestTooLongError
from sudu.engine.block_manager import build_block_manager
from sudu.engine.memory import memory_report, prefault_kv
from sudu.host.memory import release_freed_memory, rss_bytes
from sudu.engine.spec.controller import Speculator, resolve_drafter
from sudu.engine.spec.verify import Draft
from sudu.engine.vision_inputs import check_images
from sudu.engine.wait_predictor import WaitModel
from sudu.layers.device_sampler import DeviceSampler
from sudu.media.processors import image_processor
from sudu.layers.sampler import SampledToken, Sampler, SamplingRow
from sudu.model_config import with_rope_scaling
from sudu.sampling import SamplingParams
from sudu.structured.backend import GrammarBackend
from sudu.structured.masks import GrammarMasks, PendingMasks, apply_masks, forced_tokens

log = logging.getLogger(__name__)

MAX_MODEL_LEN_CAP = 32768
KV_REPORT_TOKENS = 131072  # the startup line says what one context this long costs in the chosen KV format


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


@dataclass
class _Batch:
    """One step's scheduled work, between schedule and postprocess."""

    scheduled: list[ScheduledSeq]
    drafts: dict[int, Draft]  # seq_id -> the draft its scheduled tokens end with
    started_at: float
    num_decodes: int
    num_prefill_tokens: int
    masks: PendingMasks | None = None  # the constrained rows' token masks (sudu/structured/masks.py)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        from sudu.weights.loader import load_checkpoint

        config.validate()
        self.config = config
        ckpt = load_checkpoint(config.model, pull=True, progress=progress, mmproj=config.mmproj)
        if config.rope_scaling:
            ckpt.config = with_rope_scaling(ckpt.config, rope_scaling_dict(config.rope_scaling))
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model_path = ckpt.path
        self.image_processor = image_processor(ckpt.config, ckpt.preprocessor)  # None: a text-only model
        model, self.quantization = prepare_network(ckpt, config)
        # the default stops at MAX_MODEL_LEN_CAP, unless --rope-scaling asked for the longer context
        limit = ckpt.config.max_position_embeddings if config.rope_scaling else min(
            ckpt.config.max_position_embeddings, MAX_MODEL_LEN_CAP)
        self.max_model_len = min(config.max_model_len or limit, ckpt.config.max_position_embeddings)
        # --kv-cache-dtype auto measured into a concrete format: everything below sees that one
        config, self.kv_choice = kv_choice.resolve(config, model, self.tokenizer, resolve_device(config.device),
                                                   resolve_dtype(config), ckpt, self.quantization)
        self.config = config
        self.runner = ModelRunner(config, ckpt.config, model, self.max_model_len, self.tokenizer,
                                  self.kv_choice.ranges)
        self.block_manager = build_block_manager(config, ckpt, self.quantization, self.runner)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_when_decoding, config.max_itl_factor,
                                   config.priority_aging_s,
                                   self.runner.vision.encoder.ready if self.runner.vision is not None else None)
        self.wait_model = WaitModel(config.max_num_seqs, config.priority_aging_s,
                                    config.max_itl_factor if not config.prefill_chunk_when_decoding else 1.0)
        # the CPU keeps its per-request torch generators; elsewhere the batch is sampled where its logits are
        self.sampler = Sampler(config.seed) if self.runner.device.type == "cpu" else DeviceSampler(config.seed)
        self.sequence_seeds = torch.Generator().manual_seed(config.seed)  # for sequences without params.seed
        self.requests: dict[str, RequestState] = {}
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(ckpt.config.eos_token_id)
        self.grammar_backend = GrammarBackend(self.tokenizer, ckpt.config.vocab_size, sorted(self.eos_token_ids))
        # off the CPU the forward pass leaves the CPU's cores to the mask thread
        self.grammar_masks = GrammarMasks(ckpt.config.vocab_size, None if self.runner.device.type == "cpu" else True)
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens run through the model, all requests (prefix-cache evidence)
        self._failed_this_step: list[str] = []
        drafter = resolve_drafter(config, self.runner.device, self.quantization)
        on_device = self.runner.device.type != "cpu"
        if drafter != "none" and on_device:  # lossless there only where measured so (cuda/invariance.py)
            check_speculation(self.runner)
        # off the CPU only greedy requests are drafted for: a sampled verification draws with CPU generators
        self.speculator = (Speculator(dataclasses.replace(config, speculative=drafter), self, ckpt,
                                      greedy_only=config.speculative == "auto" or on_device)
                           if drafter != "none" else None)
        ckpt.release_pages()
        release_freed_memory()
        if config.kv_prefault:
            prefault_kv(self)
        self.memory = memory_report(self)
        gib = 1 << 30
        log.info(
            "engine ready: %s, max_model_len %d, %d KV blocks of %d tokens (%s; one %d-token context needs %.2f GiB of "
            "it), %s attention; memory: weights %.2f GiB (%.2f GiB in huge pages), KV pool %.2f GiB (%.2f GiB "
            "resident, the rest committed as it fills), process %.2f GiB resident",
            ckpt.path, self.max_model_len, self.runner.num_blocks, config.block_size, config.kv_cache_dtype,
            KV_REPORT_TOKENS, self.runner.kv_bytes_for_context(KV_REPORT_TOKENS) / gib,
            self.runner.attention_arithmetic,
            self.memory["memory_weights_bytes"] / gib, self.memory["memory_weights_huge_page_bytes"] / gib,
            self.memory["memory_kv_pool_bytes"] / gib,
            max(0, self.memory["memory_kv_resident_bytes"]) / gib, self.memory["memory_rss_bytes"] / gib,
        )
        pool_tokens = self.runner.num_blocks * config.block_size
        if pool_tokens < self.max_model_len:
            log.warning("the KV pool holds %d tokens, fewer than max_model_len %d: longer sequences are refused; "
                        "--kv-cache-memory %dMiB holds one whole context", pool_tokens, self.max_model_len,
                        -(-self.runner.kv_bytes_for_context(self.max_model_len) // (1 << 20)))

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

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, images: tuple = ()
                      ) -> CheckedRequest:
        """Raise RequestTooLongError / ValueError for a request that can never run; else the request
        with its token budget resolved, which add_request takes without checking it again. images: the
        prompt's images (media.image.ImageInput) at their runs of placeholder tokens."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if images:
            check_images(prompt_token_ids, images, self.model_config.image_token_id, self.runner.vision is not None)
        max_tokens = self.resolve_max_tokens(len(prompt_token_ids), params)
        if params.grammar is not None:
            self.grammar_backend.check(params.grammar)
        return CheckedRequest(list(prompt_token_ids), params, max_tokens, tuple(images))

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | CheckedRequest,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        queued_since: float | None = None,
    ) -> None:
        """queued_since: where the scheduler's aging starts when it is not the arrival (a request refused
        earlier and sent again after its Retry-After keeps its place: async_engine.try_admit)."""
        from sudu.tokenizer import IncrementalDetokenizer

        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(prompt, CheckedRequest):
            prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            prompt = self.check_request(prompt_ids, params or SamplingParams())
        prompt_ids, params, max_tokens = prompt.prompt_token_ids, prompt.params, prompt.max_tokens
        now = time.perf_counter() if arrival_time is None else arrival_time
        num_cached = self.block_manager.cached_prefix_tokens(prompt_ids, prompt.images)
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                request_id=request_id, index=index, token_ids=list(prompt_ids),
                num_prompt_tokens=len(prompt_ids), params=params, priority=priority,
                arrival_time=now if queued_since is None else queued_since,
                max_total_tokens=len(prompt_ids) + max_tokens, num_cached_at_arrival=num_cached,
            )
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed(params.seed + index)
                seq.seed = params.seed + index
            else:
                seq.seed = int(torch.randint(1 << 62, (), generator=self.sequence_seeds))
            if prompt.images:
                self.runner.vision.attach(seq, prompt.images)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            if params.grammar is not None:
                seq.grammar = self.grammar_backend.matcher(params.grammar)
            seq.held_back = index > 0
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = RequestState(request_id, prompt_ids, params, seqs, RequestMetrics(now))
        self.wait_model.on_add(request_id, self.scheduler, seqs[0], now)

    def abort(self, request_id: str, error: str | None = None) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        state.error = error
        self.wait_model.on_finish(request_id, state.seqs[0], "abort")
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
        """schedule -> run -> postprocess, nano-vllm's shape. A fault that belongs to one request (its
        forward pass run alone, its sampling row, its stop handling) fails that request only; a fault
        that cannot be pinned on a request escapes as an exception: the engine cannot continue."""
        touched: dict[str, RequestState] = {rid: s for rid, s in self.requests.items() if s.pending}
        batch = self._schedule()
        if batch is not None:
            logits = self._run(batch)
            self._postprocess(batch, logits, touched)
        for rid in self._failed_this_step:
            if rid in self.requests:
                touched[rid] = self.requests[rid]
        self._failed_this_step.clear()
        outputs = [self._make_output(state) for state in touched.values()]
        if batch is not None and not self.requests:
            # idle after work: the heap pages the burst's temporaries (prefill activations, dequantized
            # weight slices) freed go back to the system instead of staying resident until the next one
            release_freed_memory()
        return outputs

    def _schedule(self) -> _Batch | None:
        if self.runner.vision is not None:  # images encoded ahead of the steps that read them
            self.runner.vision.encode_ahead(self.scheduler)
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        # counted before drafts are added, so a speculative decode counts as a decode
        prefill_tokens = sum(s.num_new_tokens for s in scheduled if not (s.samples and s.num_new_tokens == 1))
        decodes = sum(1 for s in scheduled if s.samples and s.num_new_tokens == 1)
        now = time.perf_counter()
        for s in scheduled:
            m = self.requests[s.seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        drafts = {}
        if self.speculator is not None:
            drafts = self.speculator.prepare(scheduled, self.block_manager, len(self.scheduler.running))
        return _Batch(scheduled, drafts, start, decodes, prefill_tokens, self.grammar_masks.start(scheduled))

    def _run(self, batch: _Batch) -> torch.Tensor:
        """The batch's logit rows. If the forward pass fails, each sequence runs alone (its KV slots are
        rewritten with the same values): the ones that still fail are failed and leave the batch, the
        others continue. When every sequence fails, the fault is not theirs: it escapes."""
        try:
            logits = self.runner.execute(batch.scheduled)
            self.num_steps += 1
            if self.speculator is not None:
                self.speculator.observe(batch.scheduled, self.runner.last_hidden)
            return logits
        except Exception as exc:  # noqa: BLE001 -- isolated below, re-raised when it cannot be
            log.warning("forward pass failed (%s); running the batch's %d sequences one by one",
                        exc, len(batch.scheduled))
            batch_error = exc
        kept, rows = [], []
        for s in batch.scheduled:
            try:
                rows.append(self.runner.execute([s]))
                kept.append(s)
            except Exception as exc:  # noqa: BLE001 -- this sequence's own fault
                self.fail_request(s.seq.request_id, f"the forward pass failed on this request: {exc}")
        if not kept:
            raise batch_error
        batch.scheduled = kept
        self.num_steps += 1
        return torch.cat(rows)

    def _postprocess(self, batch: _Batch, logits: torch.Tensor, touched: dict[str, RequestState]) -> None:
        plain, plain_rows, speculated = [], [], []
        row = 0
        for s in batch.scheduled:
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
        plain_logits = logits[plain_rows] if plain else None
        if batch.masks is not None:
            plain_logits = self._constrain(batch.masks, plain, plain_logits, speculated)
        sampled = self._sample(plain, plain_logits) if plain else []
        now = time.perf_counter()
        for seq, tok in zip(plain, sampled):
            if tok is not None:
                self._guarded(seq, touched, lambda seq=seq, tok=tok: self._append_token(seq, tok), now)
        for s, seq_logits in speculated:
            draft = batch.drafts[s.seq.seq_id]
            self._guarded(s.seq, touched,
                          lambda s=s, seq_logits=seq_logits, draft=draft: self._accept_speculated(s, seq_logits, draft),
                          now)
        if batch.masks is not None:
            for seq in plain + [s.seq for s, _ in speculated]:
                if seq.grammar is not None and not seq.is_finished:
                    self._guarded(seq, touched, lambda seq=seq: self._append_forced(seq), now)
        elapsed = time.perf_counter() - batch.started_at
        self.scheduler.chunk_budget.observe(batch.num_decodes, batch.num_prefill_tokens, elapsed)
        self.wait_model.on_step(self.scheduler, batch.num_decodes, batch.num_prefill_tokens, elapsed)
        if self.speculator is not None and batch.num_decodes and not batch.num_prefill_tokens:
            self.speculator.step_done(sum(s.num_new_tokens for s in batch.scheduled), elapsed)

    def _constrain(self, masks: PendingMasks, plain: list[Sequence], plain_logits: torch.Tensor | None,
                   speculated: list) -> torch.Tensor | None:
        """Disallowed tokens to -inf in the constrained rows (a view for speculated sequences, so their
        verification sees it). A sequence whose grammar failed is failed and leaves the plain rows."""
        keep = []
        for i, seq in enumerate(plain):
            rows = masks.rows(seq)
            if isinstance(rows, Exception):
                self.fail_request(seq.request_id, f"structured output failed: {rows}")
                continue
            if rows is not None:
                apply_masks(plain_logits[i:i + 1], rows)
            keep.append(i)
        if len(keep) < len(plain):
            plain[:] = [plain[i] for i in keep]
            plain_logits = plain_logits[keep]
        for s, seq_logits in speculated:
            rows = masks.rows(s.seq)
            if isinstance(rows, Exception):
                self.fail_request(s.seq.request_id, f"structured output failed: {rows}")
            elif rows is not None:
                apply_masks(seq_logits, rows)
        return plain_logits

    def _append_forced(self, seq: Sequence) -> None:
        """Tokens the grammar forces, appended without a model step (not with logprobs: those need the
        model's distribution at each position)."""
        if seq.params.logprobs is not None:
            return
        room = seq.max_total_tokens - seq.num_tokens
        for token in forced_tokens(seq.grammar, self.grammar_backend.vocab_size, self.eos_token_ids, room):
            self._append_token(seq, SampledToken(token))
            if seq.is_finished:
                return

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SampledToken | None]:
        """One token per sequence; if the batched draw fails, row by row, and a row that fails alone
        fails its request (None in its place)."""
        rows = [SamplingRow(q.params, q.prompt_token_ids, q.output_token_ids, q.generator, q.seed) for q in seqs]
        try:
            return self.sampler(logits, rows)
        except Exception:  # noqa: BLE001 -- isolated below
            log.warning("sampling failed; sampling the batch's %d rows one by one", len(rows), exc_info=True)
        tokens: list[SampledToken | None] = []
        for i, (seq, row) in enumerate(zip(seqs, rows)):
            try:
                tokens.extend(self.sampler(logits[i:i + 1], [row]))
            except Exception as exc:  # noqa: BLE001 -- this request's own fault
                self.fail_request(seq.request_id, f"sampling failed on this request: {exc}")
                tokens.append(None)
        return tokens

    def _guarded(self, seq: Sequence, touched: dict[str, RequestState], append, now: float) -> None:
        """Append a sequence's new token(s); an exception there is the request's own fault and fails it."""
        if seq.is_finished:  # failed earlier in this step
            return
        state = self._first_token(seq, now)
        touched[seq.request_id] = state
        try:
            append()
        except Exception as exc:  # noqa: BLE001 -- fail this request, keep the others
            log.warning("request %s failed while its tokens were appended", seq.request_id, exc_info=True)
            self.fail_request(seq.request_id, f"internal error on this request: {type(exc).__name__}: {exc}")

    def fail_request(self, request_id: str, error: str) -> None:
        """Abort one request with an error; its output (finish_reason "abort", `error` set) goes out with
        this step's outputs."""
        self.abort(request_id, error=error)
        self._failed_this_step.append(request_id)

    def _first_token(self, seq: Sequence, now: float) -> RequestState:
        state = self.requests[seq.request_id]
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            self.wait_model.on_first_token(seq.request_id, now)
        if seq.index == 0 and seq.num_output_tokens == 0:
            for sibling in state.seqs[1:]:
                sibling.held_back = False
        return state

    def _accept_speculated(self, s, seq_logits: torch.Tensor, draft) -> None:
        seq = s.seq
        computed_before = seq.num_computed_tokens
        generator = seq.generator or self.sampler.shared_generator
        tokens = self.speculator.verify(seq, seq_logits, draft, generator, self.requests[seq.request_id].metrics)
        for tok in tokens:
            self._append_token(seq, tok)
            if seq.is_finished:
                return
        # the tokens before the draft (the last sampled one, and any a grammar forced after it) and the accepted
        # drafts now have valid KV; the rejected drafts' slots are dead
        seq.num_computed_tokens = computed_before + s.num_new_tokens - len(s.draft_token_ids) - 1 + len(tokens)
        self.block_manager.trim(seq, seq.num_tokens)
        self.block_manager.commit(seq)

    def _append_token(self, seq: Sequence, tok) -> None:
        token = tok.token_id
        if seq.grammar is not None and token not in self.eos_token_ids and not seq.grammar.consume_token(token):
            raise RuntimeError(f"token {token} breaks the grammar: {seq.grammar.get_error()}")
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        if seq.params.logprobs is not None:
            seq.new_logprobs.append(token_logprob(self.tokenizer.decode, token, tok.logprob, tok.top))
        stop = check_stop(token, seq.params, self.eos_token_ids)
        if stop is not None:
            return self._finish(seq, *stop)
        split = split_stop_text(seq.pending_text + seq.detokenizer.add([token]), seq.params.stop)
        seq.new_text += split.emit
        seq.pending_text = split.held
        if split.hit is not None:
            return self._finish(seq, "stop", split.hit, flush=False)
        end = check_end(seq.num_tokens, seq.max_total_tokens, seq.grammar is not None and seq.grammar.is_stopped())
        if end is not None:
            self._finish(seq, *end)

    def _finish(self, seq: Sequence, reason: str, stop_reason, flush: bool = True) -> None:
        if flush:
            seq.new_text += seq.pending_text + seq.detokenizer.flush()
        seq.pending_text = ""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        self.wait_model.on_finish(seq.request_id, seq, reason)
        self._release_spec(seq)

    def _release_spec(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.release(seq)

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
        self.grammar_masks.close()

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
            "spec_num_draft_tokens": self.speculator.num_draft_tokens if self.speculator else 0,
            "spec_num_accepted_tokens": self.speculator.num_accepted_tokens if self.speculator else 0,
            "memory_weights_bytes": self.memory["memory_weights_bytes"],
            "memory_weights_huge_page_bytes": self.memory["memory_weights_huge_page_bytes"],
            "memory_kv_pool_bytes": self.memory["memory_kv_pool_bytes"],
            "memory_rss_bytes": rss_bytes(),
            **(self.runner.vision.cache.stats() if self.runner.vision is not None else {}),
        }
