"""Continuous batching with chunked prefill.

Each step fills a token budget (max_num_batched_tokens): first the running sequences, oldest first
(a decode costs one token, an unfinished prefill takes the next chunk that fits), then waiting
sequences in priority order (engine/schedule_policy.py: explicit priority, continuing sessions before
cold first turns, aging so none starves), each starting with whatever the prefix cache already holds. Prefill chunks
and decodes go into one forward pass, so a long prompt advances a chunk at a time while the other
streams keep decoding. When the pool runs out of blocks the least urgent running sequence (worst
priority, newest) is preempted: its blocks are freed and it is recomputed later (its full blocks are
likely still in the prefix cache).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from sudu.engine.block_manager import BlockManager
from sudu.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens after the last one

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so this step yields its next token(s)."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids) == self.seq.num_tokens

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits this sequence needs: the last token's, plus one per draft token to verify."""
        return 1 + len(self.draft_token_ids) if self.samples else 0


def keep_images_whole(seq: Sequence, n: int) -> int:
    """The chunk of n new tokens moved so it does not end inside one of seq's image spans (whose tokens attend
    to each other both ways, so an image's rows must all be computed in the step that computes its last one):
    cut back to the image's start, or where the chunk starts inside the image (its start) or a cached prefix
    ended inside it, carried on to the image's end, over the step's budget if need be (at most an image)."""
    start = seq.num_computed_tokens
    end = start + n
    for a, b in seq.image_spans:
        if a < end < b:
            end = a if a > start else b
    return end - start


def stop_before_unready(seq: Sequence, n: int, ready) -> int:
    """The chunk of n new tokens cut back to the first image it reaches whose embeddings are not ready yet
    (engine/image_encoding.py encodes them between steps): the text before the image goes on; a chunk that
    would start inside such an image waits (0)."""
    start = seq.num_computed_tokens
    end = start + n
    for image in seq.images:
        if image.offset < end and image.offset + image.num_tokens > start and not ready(image):
            end = min(end, max(image.offset, start))
    return end - start


class ChunkBudget:
    """Prompt tokens per step while other sequences decode (long/short mixing): a long prompt advances a
    chunk at a time so it cannot stretch the decoders' inter-token latency (ITL).

    fixed > 0: that many tokens. fixed == 0 ("auto"): sized from measured step times, so that a step
    carrying one prompt's chunk costs about `itl_factor` times a decode-only step: each decoder's ITL stays
    within that factor of its undisturbed value on any machine and model. The allowance is per prompt in
    flight (waiting to start or partly computed): P prompts together may stretch a step to
    1 + (itl_factor - 1) * P decode steps, so a queue drains as fast as each of its prompts would alone
    among the decoders. Sharing one allowance among the queue instead (or per decoder) keeps the steps
    small while many prompts wait: every step then re-reads the weights for a few rows, and the queued
    requests, which have no token yet, wait longer than any decoder's stretched ITL (measured:
    docs/benchmarks.md). Exponential moving averages feed it: the decode-only step time and its batch size,
    and the extra seconds per row in mixed steps (which grows with the prompt's context, as its attention
    does). A mixed step's rows beyond the timed decode-only batch (more decoders than then, and the prompt
    tokens) are charged that per-row cost, so the undisturbed step of a batch that grew while prompts
    were being computed, with no decode-only step in between (a burst), is not underestimated."""

    INITIAL = 16  # tokens, from the first decode-only step until the first mixed step has been timed
    UNMEASURED = 48  # tokens per step (times the queue pressure) before any decode-only step
    FLOOR = 4

    def __init__(self, fixed: int, ceiling: int, itl_factor: float = 2.0, alpha: float = 0.3):
        self.fixed = fixed
        self.ceiling = ceiling
        self.itl_factor = itl_factor
        self.alpha = alpha
        self.decode_s: float | None = None
        self.decode_rows: float | None = None  # decoders in the timed decode-only steps
        self.per_token_s: float | None = None

    def decode_step_s(self, num_decoding: int) -> float:
        """The estimated decode-only step time with num_decoding decoders."""
        extra_rows = max(num_decoding - self.decode_rows, 0.0)
        return self.decode_s + extra_rows * (self.per_token_s or 0.0)

    def tokens(self, num_decoding: int = 1, num_prefilling: int = 1) -> int:
        """The budget for a step with num_decoding decoders and num_prefilling sequences whose prompt is
        still (partly) to compute, admitted or waiting."""
        if self.fixed:
            return min(self.fixed, self.ceiling)
        pressure = max(1, num_prefilling)
        if self.decode_s is None:
            # no decode-only step yet: prompts have been queued since the start (a batch), so there is no
            # undisturbed ITL to protect; a fixed chunk per prompt in flight
            return max(self.FLOOR, min(int(self.UNMEASURED * pressure), self.ceiling))
        if self.per_token_s is None:
            return min(self.INITIAL * pressure, self.ceiling)
        n = int((self.itl_factor - 1.0) * pressure * self.decode_step_s(num_decoding) / max(self.per_token_s, 1e-9))
        return max(self.FLOOR, min(n, self.ceiling))

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """One step's wall time, with how many sequences decoded and how many prompt tokens it computed."""
        if num_decodes == 0:
            return  # prefill-only steps say nothing about anyone's ITL
        if num_prefill_tokens == 0:
            self.decode_s = self._ema(self.decode_s, seconds)
            self.decode_rows = self._ema(self.decode_rows, float(num_decodes))
        elif self.decode_s is not None:
            extra = max(seconds - self.decode_s, 0.0)
            rows = num_prefill_tokens + max(num_decodes - self.decode_rows, 0.0)
            self.per_token_s = self._ema(self.per_token_s, extra / rows)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_when_decoding: int = 0, itl_factor: float = 2.0, aging_s: float = 2.0,
                 image_ready=None):
        """image_ready(image) -> bool: whether an image's embeddings are ready (a vision model's engine);
        a prompt chunk stops before one that is not."""
        self.block_manager = block_manager
        self.image_ready = image_ready
        self.aging_s = aging_s
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_budget = ChunkBudget(prefill_chunk_when_decoding, max_num_batched_tokens, itl_factor)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.num_preemptions += 1

    def _fit_images(self, seq: Sequence, n: int) -> int:
        """The chunk of n new tokens fitted to seq's images: never ending inside one whose tokens attend both
        ways, never reaching one whose embeddings are not ready."""
        n = keep_images_whole(seq, n) if n else 0
        if seq.images and self.image_ready is not None:
            n = stop_before_unready(seq, n, self.image_ready)
        return n

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        bm = self.block_manager

        now = time.perf_counter()  # the clock of the sequences' arrival times
        key = lambda s: s.order_key(now, self.aging_s)  # noqa: E731
        self.running.sort(key=key)
        num_decoding = sum(1 for s in self.running if s.num_uncomputed_tokens == 1)
        num_prefilling = len(self.running) - num_decoding + sum(1 for s in self.waiting if not s.held_back)
        prefill_budget = self.chunk_budget.tokens(num_decoding, num_prefilling) if num_decoding else budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 1:
                n = self._fit_images(seq, min(n, prefill_budget))
                prefill_budget -= n
            elif seq.images:
                n = self._fit_images(seq, n)
            if n == 0:  # no prompt budget left, or its next image is still being encoded
                i += 1
                continue
            while not bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            bm.allocate(seq, n)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        self.waiting.sort(key=key)
        admitted = []
        for seq in self.waiting:
            if budget <= 0 or len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            if seq.held_back:
                continue
            if prefill_budget <= 0:
                break
            cached = bm.match_prefix(seq)
            n = self._fit_images(seq, min(seq.num_uncomputed_tokens, budget, prefill_budget))
            if n == 0:  # its image is still being encoded: the others may start meanwhile
                bm.free_sequence(seq)
                continue
            if not bm.can_allocate(seq, n):
                bm.free_sequence(seq)  # first come, first served: nobody overtakes it
                break
            if seq.num_cached_tokens is None:  # first admission (not a re-admission after preemption)
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
                seq.num_cached_tokens_disk = min(seq.disk_hit_tokens, seq.num_cached_tokens)
                bm.stats.queries += seq.num_prompt_tokens
                bm.stats.hits += seq.num_cached_tokens
                bm.stats.disk_hits += seq.num_cached_tokens_disk
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            prefill_budget -= n
        for seq in admitted:
            self.waiting.remove(seq)
            self.running.append(seq)
        return scheduled

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.remove(seq)
