"""The n-gram drafter: prompt lookup. Finds the latest earlier occurrence of the sequence's last n tokens
(n from max_n down to min_n, searching prompt and output) and proposes what followed it. No model."""
from __future__ import annotations

from sudu.engine.sequence import Sequence
from sudu.engine.spec.verify import Draft


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
