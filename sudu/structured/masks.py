"""Constrained decoding inside the engine's step: token masks, drafts cut to the grammar, forced tokens.

- `GrammarMasks.start` runs right after scheduling: for every sequence of the batch that samples this
  step and carries a grammar, the rows of allowed tokens (one per logit row: the last token's, and one
  after each draft token, the draft consumed and rolled back) are computed by a worker thread while the
  forward pass runs, where the forward pass leaves a core free for it. Where it uses every core (torch's
  threads = the CPUs), a thread beside it only preempts one of its
  threads and the whole pass waits for that one, so the masks are computed right after the pass
  instead. `apply_masks` then sets every disallowed logit to -inf before sampling or draft verification.
  Unconstrained rows are untouched, so constrained and free requests share a batch.
- `cut_draft`: a speculative draft is cut at its first token the grammar rejects (verification would
  reject it anyway, and its KV slot would be wasted).
- `forced_tokens`: where the grammar allows exactly one token, that token is the only one sampling could
  choose (greedy or not), so it is appended without a model step; its KV is computed with the next
  token's, like a short prompt chunk.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from sudu import kernels
from sudu.layers.attention import SMALL_Q
from sudu.structured.backend import allowed_ids

# Forced tokens per step and sequence: with the token before them, a step stays in the few-new-token attention
# path (layers/attention.py SMALL_Q), where a row's numbers do not depend on how many tokens share its step,
# so greedy output is the same however steps are cut (with or without speculation).
MAX_FORCED_TOKENS = SMALL_Q - 1


class PendingMasks:
    """The masks of one step, being computed (a Future), or to compute when first asked (a function)."""

    def __init__(self, future: Future | Callable[[], dict]):
        self._future = future
        self._rows: dict[int, torch.Tensor | Exception] | None = None

    def rows(self, seq) -> torch.Tensor | Exception | None:
        """[k + 1, words] int32 bitmask rows, bit i of word i // 32 set where token i is allowed (None: the
        sequence is unconstrained; an exception: its grammar failed, which fails its request)."""
        if self._rows is None:
            self._rows = self._future.result() if isinstance(self._future, Future) else self._future()
        return self._rows.get(seq.seq_id)


class GrammarMasks:
    def __init__(self, vocab_size: int, overlap: bool | None = None):
        """overlap: compute masks during the forward pass (None: where a CPU core is left free for it)."""
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        if overlap is None:
            overlap = (os.cpu_count() or 1) > torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sudu-grammar") if overlap else None

    def start(self, scheduled) -> PendingMasks | None:
        """scheduled: the step's ScheduledSeq list, drafts already attached."""
        jobs = [(s.seq, list(s.draft_token_ids)) for s in scheduled if s.samples and s.seq.grammar is not None]
        if not jobs:
            return None
        if self._pool is None:
            return PendingMasks(lambda: self._compute(jobs))
        return PendingMasks(self._pool.submit(self._compute, jobs))

    def _compute(self, jobs) -> dict[int, torch.Tensor | Exception]:
        out: dict[int, torch.Tensor | Exception] = {}
        for seq, draft in jobs:
            try:
                out[seq.seq_id] = self._bitmask(seq.grammar, draft)
            except Exception as exc:  # noqa: BLE001 -- this request's own failure
                out[seq.seq_id] = exc
        return out

    def _bitmask(self, matcher, draft: list[int]) -> torch.Tensor:
        words = torch.zeros((len(draft) + 1, self._words), dtype=torch.int32)
        row_bytes = self._words * 4
        for i in range(len(draft) + 1):
            matcher.unsafe_compute_mask_ptr(words.data_ptr() + i * row_bytes, row_bytes)
            if i < len(draft) and not matcher.consume_token(draft[i]):
                raise RuntimeError(f"grammar error: {matcher.get_error()}")
        if draft and not matcher.rollback(len(draft)):
            raise RuntimeError(f"grammar error: {matcher.get_error()}")
        if matcher.is_error() or not bool(words[0].any()):
            raise RuntimeError(f"the grammar allows no next token: {matcher.get_error() or 'dead end'}")
        return words

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens to -inf, in place. logits [rows, vocab]; bitmask [rows, words] int32 as `rows()`
    gives it (the grammar's vocabulary is built at the logits' width, so every id has a bit)."""
    with torch.inference_mode():  # the runner's logits (and views of them) are inference tensors
        ext = kernels.load() if logits.is_cpu else None
        if ext is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            ext.apply_token_bitmask(logits, bitmask)
            return
        vocab = logits.shape[1]
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def cut_draft(matcher, token_ids: list[int]) -> int:
    """How many leading draft tokens the grammar accepts (the matcher's state is unchanged)."""
    return matcher.validate_tokens(token_ids) if token_ids else 0


def forced_tokens(matcher, vocab_size: int, eos_token_ids, limit: int) -> list[int]:
    """The tokens the grammar forces next, one by one while exactly one token is allowed (never an
    end-of-sequence token: finishing goes through the normal path). The matcher is left unchanged."""
    if not matcher.compute_ff_tokens():  # the common case, answered without a mask
        return []
    out: list[int] = []
    eos = set(eos_token_ids)
    limit = min(limit, MAX_FORCED_TOKENS)
    while len(out) < limit and not matcher.is_stopped():
        ids = allowed_ids(matcher.compute_bitmask(), vocab_size)
        if ids.size != 1 or int(ids[0]) in eos:
            break
        token = int(ids[0])
        if not matcher.consume_token(token):
            break
        out.append(token)
    if out:
        matcher.rollback(len(out))
    return out
