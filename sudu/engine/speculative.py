"""Speculative decoding: drafters that propose tokens cheaply, and the lossless check of those tokens
against the target model's distribution.

Drafters:
- NgramDrafter: prompt lookup. Finds the latest earlier occurrence of the sequence's last n tokens
  (n from max_n down to min_n, searching prompt and output) and proposes what followed it. No model.
- MTPDrafter (engine/mtp_drafter.py): the multi-token-prediction layer a DeepSeek-V3 checkpoint carries,
  reading the target's hidden states.
- DraftModelDrafter: a smaller model with the same tokenizer, with its own KV pool and a shadow sequence
  per target sequence that is rolled back to the tokens the target kept. Its prompt is computed in the
  step that completes the target's prompt (so it counts toward time to first token, as the target's
  does), and its output head covers only the most frequent token ids (`speculative_draft_vocab`, in the
  spirit of FR-Spec): on a 150K vocabulary the head is ~40% of a 0.5B model's bytes per step.

Verification (verify_draft): greedy accepts a draft token while it equals the target's argmax, then
appends the target's own token, so the output is identical to plain greedy decoding. With temperature
it is exact rejection sampling: accept d with probability min(1, p(d)/q(d)), otherwise draw from the
normalised max(0, p - q); after all drafts pass, draw a bonus token from p. (An n-gram draft is a point
mass, q = one-hot.) p is the distribution plain sampling would use: penalties, temperature, top-k,
top-p and min-p applied, so the sampled output keeps exactly that distribution.

Speculator is all the engine sees: `prepare` before the forward pass (the drafter's prompt work, draft
tokens for decoding sequences, their KV slots), `verify` after it (k + 1 logit rows -> the tokens to
append), `release` when a sequence ends. Speculation pauses while the batch is larger than
`speculative_max_batch`, where verifying drafts costs more than it saves. Below it, a free drafter's
(n-gram) proposals are cut to the tokens that pay for their verification rows, from the measured cost of
a row and each sequence's measured acceptance (engine/draft_cost.py); a drafter that pays per token (a
draft model, MTP) gets SpecController's adaptive length (grow after a full accept, shrink to what was
accepted after a rejection).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sudu.engine import draft_cost
from sudu.engine.block_manager import BlockManager
from sudu.engine.placement import KERNEL_FORMATS
from sudu.engine.scheduler import ScheduledSeq
from sudu.engine.sequence import Sequence
from sudu.errors import SuduError
from sudu.layers.attention import SMALL_Q
from sudu.layers.sampler import SampledToken, SamplingRow, apply_penalties, argmax_rows, filter_logits
from sudu.structured.masks import cut_draft


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len, vocab] draft distribution; None -> point masses (n-gram)

    def head(self, k: int) -> Draft:
        """The first k tokens."""
        return Draft(self.token_ids[:k], self.probs[:k] if self.probs is not None else None)


def _needs_penalties(row: SamplingRow) -> bool:
    p = row.params
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def target_distribution(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The distribution plain sampling draws from for this row (temperature > 0)."""
    if _needs_penalties(row):
        logits = apply_penalties(logits.clone(), row)
    return filter_logits(logits, row.params).softmax(-1)


def verify_draft(logits: torch.Tensor, draft: Draft, row: SamplingRow, generator: torch.Generator) -> list[int]:
    """logits: [len(draft) + 1, vocab] target logits at the last token and at each draft token.
    Returns the accepted draft prefix followed by one token chosen by the target."""
    m = len(draft.token_ids)
    history = list(row.output_token_ids)
    out: list[int] = []
    for i in range(m + 1):
        cur = SamplingRow(row.params, row.prompt_token_ids, history, None)
        if row.params.greedy:
            lg = apply_penalties(logits[i].clone(), cur) if _needs_penalties(cur) else logits[i]
            token = int(argmax_rows(lg[None])[0])
            out.append(token)
            if i < m and token == draft.token_ids[i]:
                history.append(token)
                continue
            return out
        p = target_distribution(logits[i], cur)
        if i == m:
            out.append(int(torch.multinomial(p, 1, generator=generator)))
            return out
        d = draft.token_ids[i]
        if draft.probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft.probs[i]
        accept_prob = min(1.0, float(p[d]) / max(float(q[d]), 1e-30))
        if float(torch.rand((), generator=generator)) < accept_prob:
            out.append(d)
            history.append(d)
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    return out


class NgramDrafter:
    """Prompt-lookup drafting. Each sequence keeps an index from n-gram to the position right after its
    latest occurrence, updated incrementally as tokens arrive."""

    free = True  # proposing costs no model work: only verification rows cost

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[int, tuple[int, dict]] = {}  # seq_id -> (tokens indexed so far, n-gram -> next pos)

    def _update(self, seq: Sequence) -> dict:
        indexed, table = self.index.get(seq.seq_id, (0, {}))
        toks = seq.token_ids
        # index n-grams ending before the last token, so a lookup of the tail never finds itself
        for end in range(max(indexed, 1), len(toks)):
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    table[tuple(toks[end - n:end])] = end
        self.index[seq.seq_id] = (max(indexed, len(toks)), table)
        return table

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks):
            table = self._update(seq)
            toks = seq.token_ids
            proposal: list[int] = []
            for n in range(self.max_n, self.min_n - 1, -1):
                if len(toks) < n:
                    continue
                nxt = table.get(tuple(toks[-n:]))
                if nxt is not None:
                    proposal = toks[nxt:nxt + k]
                    break
            drafts.append(Draft(proposal))
        return drafts

    def prefill(self, seqs: list[Sequence]) -> None:
        """Nothing to compute ahead: the index is built on the first lookup."""

    def release(self, seq: Sequence) -> None:
        self.index.pop(seq.seq_id, None)


def draft_vocabulary(tokenizer, vocab_size: int, keep: int) -> torch.Tensor | None:
    """Token ids the draft head keeps: the first `keep` ids and every special/added token (ids from the
    tokenizer's base vocabulary up). Byte-level BPE vocabularies are numbered in merge order, i.e. roughly by
    frequency in the tokenizer's training text, so the first ids cover almost every token a model emits.
    None: keep them all."""
    base = tokenizer.backend.get_vocab_size(with_added_tokens=False)
    if keep <= 0 or keep >= base:
        return None
    return torch.cat([torch.arange(keep), torch.arange(base, vocab_size)])


def head_rows(head: torch.nn.Module, rows: torch.Tensor) -> torch.nn.Module:
    """An output head computing only the given rows (token ids) of `head`."""
    from sudu.layers.linear import QuantizedLinear

    if isinstance(head, QuantizedLinear):
        return head.select_rows(rows)
    new = torch.nn.Linear(head.in_features, rows.numel(), bias=head.bias is not None, dtype=head.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(head.weight[rows])
        if head.bias is not None:
            new.bias.copy_(head.bias[rows])
    return new.eval().requires_grad_(False)


# A quantized draft model's output head runs int4 whatever the target's head runs (the target's is its file's
# 8-bit or 6-bit head under native, int8 under int8; the draft only proposes, so its head's precision moves acceptance, never
# output). The int4 head drafted faster at about the same acceptance (docs/benchmarks.md, "the draft
# model's head in int4").
DRAFT_HEAD_FORMAT = "int4"


def requantized(head: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A quantized head in format fmt (from its own dequantized weights); other heads as they are."""
    from sudu.layers.linear import QuantizedLinear

    if not isinstance(head, QuantizedLinear) or head.fmt == fmt:
        return head
    return QuantizedLinear.from_float(fmt, head.dequantized_weight(torch.float32), head.bias, head.group_size)


class DraftModelDrafter:
    """A small model proposing tokens autoregressively for a larger one with the same tokenizer."""

    def __init__(self, model: str, target_tokenizer, target_config, engine_config, target_pool_tokens: int):
        import dataclasses

        from sudu.engine.model_runner import ModelRunner, kv_bytes_per_token, prepare_network
        from sudu.engine.placement import resolve_dtype
        from sudu.weights.loader import load_checkpoint

        ckpt = load_checkpoint(model, pull=True, progress=True)
        if ckpt.tokenizer.backend.get_vocab() != target_tokenizer.backend.get_vocab():
            raise SuduError(f"draft model {model!r} has a different tokenizer from the target; "
                            "speculative decoding needs identical vocabularies")
        self.vocab_size = target_config.vocab_size
        dtype = resolve_dtype(engine_config)
        net, fmt = prepare_network(ckpt, engine_config)
        self.keep = draft_vocabulary(ckpt.tokenizer, min(ckpt.config.vocab_size, self.vocab_size),
                                     engine_config.speculative_draft_vocab)
        if self.keep is not None:
            net.lm_head = head_rows(net.lm_head, self.keep)
        if fmt != "none":
            net.lm_head = requantized(net.lm_head, DRAFT_HEAD_FORMAT)
        max_len = min(ckpt.config.max_position_embeddings, target_config.max_position_embeddings)
        # room to shadow every token the target's pool can hold, plus the drafts in flight
        pool_bytes = (target_pool_tokens + 64 * engine_config.block_size) * kv_bytes_per_token(ckpt.config, dtype, engine_config.kv_cache_dtype)
        cfg = dataclasses.replace(engine_config, model=model, kv_cache_memory=pool_bytes)
        self.runner = ModelRunner(cfg, ckpt.config, net, max_len, ckpt.tokenizer)
        # prefix caching for the prompts only (prefill commits them; drafts are never committed)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size,
                                          enable_prefix_caching=engine_config.enable_prefix_caching,
                                          sliding=self.runner.sliding_blocks)
        self.shadows: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (shadow, target length at last sync)
        self.generator = torch.Generator().manual_seed(engine_config.seed + 1)
        self.num_draft_steps = 0

    def _sync(self, seq: Sequence) -> Sequence:
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            sh = Sequence(seq.request_id, seq.index, list(seq.token_ids), seq.num_prompt_tokens, seq.params,
                          0, 0.0, max_total_tokens=seq.max_total_tokens)
        else:
            sh, synced = entry
            # the shadow holds the target's tokens as of the last sync plus its own drafts; keep the KV
            # of whatever the target kept
            common = synced
            limit = min(len(sh.token_ids), len(seq.token_ids))
            while common < limit and sh.token_ids[common] == seq.token_ids[common]:
                common += 1
            sh.num_computed_tokens = min(sh.num_computed_tokens, common)
            sh.token_ids = list(seq.token_ids)
            self.block_manager.trim(sh, max(sh.num_computed_tokens, 1))
        self.shadows[seq.seq_id] = (sh, len(seq.token_ids))
        return sh

    def prefill(self, seqs: list[Sequence]) -> None:
        """Compute the draft model's KV of these sequences' prompts. Called in the step that completes the
        target's prompt, so the draft's prompt work lands in time to first token (as the target's does)
        instead of in the first speculative step. Chunks of max_num_batched_tokens; a sequence that does
        not fit the pool now is caught up by propose later."""
        budget = self.runner.config.max_num_batched_tokens
        bm = self.block_manager
        for seq in seqs:
            sh = self._sync(seq)
            if not sh.block_table:
                bm.match_prefix(sh)  # a prompt seen before: its draft KV is still in the pool
            while sh.num_uncomputed_tokens > 0:
                n = min(sh.num_uncomputed_tokens, budget)
                if not bm.can_allocate(sh, n):
                    break
                bm.allocate(sh, n)
                self.runner.execute([ScheduledSeq(sh, n)])
                sh.num_computed_tokens += n
                bm.commit(sh)

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft head logits [rows, head] over the whole vocabulary (ids outside the draft head at -inf)."""
        if self.keep is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.keep] = logits
        return full

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        bm = self.block_manager
        shadows, budgets = [], []
        for seq, k in zip(seqs, ks):
            sh = self._sync(seq)
            if k > 0 and bm.can_allocate(sh, sh.num_uncomputed_tokens + k - 1):
                bm.allocate(sh, sh.num_uncomputed_tokens + k - 1)
            else:
                k = 0
            shadows.append(sh)
            budgets.append(k)
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for r in range(max(budgets, default=0)):
            live = [i for i, k in enumerate(budgets) if k > r]
            batch = [ScheduledSeq(shadows[i], shadows[i].num_uncomputed_tokens) for i in live]
            head = self.runner.execute(batch)  # [live, draft head rows]
            if self.keep is None:
                head = head[:, : self.vocab_size]
            self.num_draft_steps += 1
            greedy = [shadows[i].params.greedy for i in live]
            full = None if all(greedy) else self._full_vocab(head)
            # each row's top token id (greedy drafts need no full-vocabulary logits)
            top = argmax_rows(head)
            ids = self.keep[top] if self.keep is not None else top
            for j, i in enumerate(live):
                sh = shadows[i]
                sh.num_computed_tokens = sh.num_tokens
                if greedy[j]:
                    token = int(ids[j])
                else:
                    row = SamplingRow(sh.params, sh.prompt_token_ids, sh.output_token_ids, None)
                    q = target_distribution(full[j], row)
                    token = int(torch.multinomial(q, 1, generator=self.generator))
                    probs[i].append(q)
                sh.token_ids.append(token)
                tokens[i].append(token)
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def release(self, seq: Sequence) -> None:
        entry = self.shadows.pop(seq.seq_id, None)
        if entry is not None:
            self.block_manager.free_sequence(entry[0])


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


def resolve(config, device, weight_format: str) -> str:
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
        from sudu.engine.mtp_drafter import MTPDrafter

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
        # free drafts are cut to what pays for its rows (draft_cost.py); others get the adaptive length
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
