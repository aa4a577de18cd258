"""Speculative decoding behind one interface for the engine's step (Speculator), the per-sequence draft
length (SpecController) and the per-drafter defaults.

Speculator is all the engine sees: `prepare` before the forward pass (the drafter's prompt work, draft tokens
for decoding sequences, their KV slots), `verify` after it (k + 1 logit rows -> the tokens to append),
`release` when a sequence ends. Speculation pauses while the batch is larger than `speculative_max_batch`,
where verifying drafts costs more than it saves. Below it, a free drafter's (n-gram) proposals are cut to the
tokens that pay for their verification rows, from the measured cost of a row and each sequence's measured
acceptance (spec/cost.py); a drafter that pays per token (a draft model, MTP) gets SpecController's adaptive
length (grow after a full accept, shrink to what was accepted after a rejection).
"""
from __future__ import annotations

import torch

from sudu.engine.block_manager import BlockManager
from sudu.engine.placement import KERNEL_FORMATS
from sudu.engine.scheduler import ScheduledSeq
from sudu.engine.sequence import Sequence
from sudu.engine.spec import cost as draft_cost
from sudu.engine.spec.draft_model import DraftModelDrafter
from sudu.engine.spec.mtp import MTPDrafter
from sudu.engine.spec.ngram import NgramDrafter
from sudu.engine.spec.verify import Draft, verify_draft
from sudu.errors import SuduError
from sudu.layers.attention import SMALL_Q
from sudu.layers.sampler import (
    SampledToken,
    SamplingRow,
)
from sudu.structured.masks import cut_draft


class SpecController:
    """Per-sequence adaptive draft length and the batch-size switch."""

    def __init__(self, max_tokens: int, max_batch: int):
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.k: dict[int, int] = {}

    def active(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def draft_len(self, seq: Sequence) -> int:
        room = seq.max_total_tokens - seq.num_tokens - 1  # the target always adds one token of its own
        return max(0, min(self.k.get(seq.seq_id, self.max_tokens), room))

    def update(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        k = self.k.get(seq.seq_id, self.max_tokens)
        self.k[seq.seq_id] = min(self.max_tokens, k + 1) if num_accepted == num_drafted else max(1, num_accepted + 1)

    def release(self, seq: Sequence) -> None:
        self.k.pop(seq.seq_id, None)


# Draft lengths when num_speculative_tokens = 0: n-gram drafts cost nothing, so the most a verification
# takes; a draft model pays a step per draft token, so the length that measured best on free generation
# (docs/benchmarks.md, "Speculative decoding": draft length, default draft lengths).
# An MTP layer is trained to draft one token; chained drafts read its own output, so fewer of them hold
# (SGLang's recommended DeepSeek-V3 setting drafts 3).
DEFAULT_DRAFT_LEN = {"ngram": 7, "draft": 4, "mtp": 3}


# Batch sizes above which speculation pauses when speculative_max_batch = 0. n-gram lookup: at 8 decoding
# streams its verification rows cost about what they gain, and the default-on table lost there in the
# free-generation, chat and JSON workloads; at 4 and below it gains or breaks even (docs/benchmarks.md,
# "n-gram on by default"). A draft model or MTP: break-even or better at 8.
DEFAULT_MAX_BATCH = {"ngram": 4, "draft": 8, "mtp": 8}


def resolve_drafter(config, device, weight_format: str) -> str:
    """--speculative auto -> ngram where greedy speculation is lossless and free to draft: the CPU engine
    on its quantized kernels (native, int8, int4), whose rows compute the same at any batch size; else none.
    Any other value stands."""
    if config.speculative != "auto":
        return config.speculative
    return "ngram" if device.type == "cpu" and weight_format in KERNEL_FORMATS else "none"


def drafter_kind(config) -> str:
    """ngram, draft or mtp: the key of the per-drafter defaults."""
    return config.speculative.split(":")[0]


def draft_len(config) -> int:
    """The most draft tokens per sequence per step: the setting, or the drafter's default."""
    return config.num_speculative_tokens or DEFAULT_DRAFT_LEN[drafter_kind(config)]


def build_drafter(spec: str, engine, ckpt=None):
    if spec == "ngram":
        return NgramDrafter()
    if spec == "mtp":
        return MTPDrafter(ckpt, engine)
    if spec.startswith("draft:") and spec[6:]:
        return DraftModelDrafter(spec[6:], engine.tokenizer, engine.model_config, engine.config,
                                 engine.runner.num_blocks * engine.config.block_size)
    raise SuduError(f"unknown --speculative {spec!r}; use ngram, draft:MODEL or mtp")


class Speculator:
    """Speculative decoding behind one interface for the engine's step."""

    def __init__(self, config, engine, ckpt=None, greedy_only: bool = False):
        """config.speculative: a drafter (resolved: not auto). greedy_only: draft for greedy requests only
        (the default, auto: a sampled request keeps plain decoding's random draws, so a seed reproduces what
        it did without speculation)."""
        self.drafter = build_drafter(config.speculative, engine, ckpt)
        self.controller = SpecController(draft_len(config),
                                         config.speculative_max_batch or DEFAULT_MAX_BATCH[drafter_kind(config)])
        self.greedy_only = greedy_only
        # free drafts are cut to what pays for its rows (spec/cost.py); others get the adaptive length
        self.cost_aware = getattr(self.drafter, "free", False)
        self.step_cost = draft_cost.StepCost()
        self.acceptance = draft_cost.Acceptance()
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def prepare(self, scheduled: list[ScheduledSeq], block_manager: BlockManager, num_running: int) -> dict[int, Draft]:
        """Before the forward pass: the drafter computes the prompts completing in this step (so its work
        counts toward their TTFT), and decoding sequences get draft tokens to verify in the same pass, in
        the spare token budget (each then runs 1 + k tokens). Returns seq_id -> draft."""
        finishing = [s.seq for s in scheduled if s.samples and s.seq.num_output_tokens == 0]
        if finishing:
            self.drafter.prefill(finishing)
        # decoding: every new token is an output token (one sampled, or a few a grammar forced: drafts go after them)
        decoding = [s for s in scheduled if s.samples and 0 < s.num_new_tokens <= s.seq.num_output_tokens
                    and (s.seq.params.greedy or not self.greedy_only)]
        if not decoding or not self.controller.active(num_running):
            return {}
        rows = sum(s.num_new_tokens for s in scheduled)
        spare = self.max_num_batched_tokens - rows
        ks = []
        for s in decoding:
            # the step stays in the few-new-token attention path (row numbers independent of the step's size)
            k = max(0, min(self.controller.draft_len(s.seq), spare, SMALL_Q - s.num_new_tokens))
            spare -= k
            ks.append(k)
        proposals = self.drafter.propose([s.seq for s in decoding], ks)
        for i, (s, d) in enumerate(zip(decoding, proposals)):
            if s.seq.grammar is not None:  # structured output: cut at the first token the grammar rejects
                proposals[i] = d.head(cut_draft(s.seq.grammar, d.token_ids))
        if self.cost_aware:
            keep = draft_cost.keep_lengths([len(d.token_ids) for d in proposals],
                                           [self.acceptance.rate(s.seq.seq_id) for s in decoding],
                                           self.step_cost.fit(), rows, len(decoding))
            proposals = [d.head(k) for d, k in zip(proposals, keep)]
        drafts = {}
        for s, d in zip(decoding, proposals):
            n = s.num_new_tokens + len(d.token_ids)
            if d.token_ids and block_manager.can_allocate(s.seq, n):
                block_manager.allocate(s.seq, n)
                s.num_new_tokens = n
                s.draft_token_ids = d.token_ids
                drafts[s.seq.seq_id] = d
        return drafts

    def step_done(self, rows: int, seconds: float) -> None:
        """A decode step's rows (drafts included) and wall time: the cost of a verification row."""
        if self.cost_aware:
            self.step_cost.observe(rows, seconds)

    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor | None) -> None:
        """After the target's forward pass: its hidden states, for a drafter that reads them (MTP)."""
        if getattr(self.drafter, "wants_hidden", False) and hidden is not None:
            self.drafter.observe(scheduled, hidden)

    def verify(self, seq: Sequence, logits: torch.Tensor, draft: Draft, generator: torch.Generator,
               metrics) -> list[SampledToken]:
        """After the forward pass: the accepted drafts plus the target's own token (with logprobs when
        asked for), counted in the request's metrics and the engine-wide totals."""
        row = SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator)
        accepted = verify_draft(logits, draft, row, generator)
        num_drafted, num_accepted = len(draft.token_ids), len(accepted) - 1
        metrics.num_draft_tokens += num_drafted
        metrics.num_accepted_tokens += num_accepted
        metrics.num_spec_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.controller.update(seq, num_drafted, num_accepted)
        if self.cost_aware:
            self.acceptance.update(seq.seq_id, num_drafted, num_accepted)
        raw = torch.log_softmax(logits, -1) if seq.params.logprobs is not None else None
        tokens = []
        for i, token in enumerate(accepted):
            tok = SampledToken(token)
            if raw is not None:
                tok.logprob = float(raw[i, token])
                if seq.params.logprobs:
                    top = torch.topk(raw[i], seq.params.logprobs)
                    tok.top = list(zip(top.indices.tolist(), top.values.tolist()))
            tokens.append(tok)
        return tokens

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)
        self.controller.release(seq)
        self.acceptance.release(seq.seq_id)
