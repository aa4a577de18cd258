"""The draft-model drafter: a smaller model with the same tokenizer, with its own KV pool and a shadow
sequence per target sequence that is rolled back to the tokens the target kept. Its prompt is computed in the
step that completes the target's prompt (so it counts toward time to first token, as the target's does), and
its output head covers only the most frequent token ids (`speculative_draft_vocab`, in the spirit of
FR-Spec): on a large vocabulary the head is a large share of a small model's bytes per step."""
from __future__ import annotations

import torch

from sudu.engine.block_manager import BlockManager
from sudu.engine.model_runner import ModelRunner, kv_bytes_per_token
from sudu.engine.network import prepare_network
from sudu.engine.placement import resolve_dtype
from sudu.engine.scheduler import ScheduledSeq
from sudu.engine.sequence import Sequence
from sudu.engine.spec.verify import Draft, target_distribution
from sudu.errors import SuduError
from sudu.layers.linear import QuantizedLinear
from sudu.layers.sampler import (
    SamplingRow,
    argmax_rows,
)
from sudu.weights.loader import load_checkpoint


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

    if not isinstance(head, QuantizedLinear) or head.fmt == fmt:
        return head
    return QuantizedLinear.from_float(fmt, head.dequantized_weight(torch.float32), head.bias, head.group_size)


class DraftModelDrafter:
    """A small model proposing tokens autoregressively for a larger one with the same tokenizer."""

    def __init__(self, model: str, target_tokenizer, target_config, engine_config, target_pool_tokens: int):
        import dataclasses


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
