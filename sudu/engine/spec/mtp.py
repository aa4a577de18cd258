"""MTPDrafter: drafts with the multi-token-prediction layer a DeepSeek-V3 checkpoint carries
(`--speculative mtp`; the network is models/mtp.py). Verification is the other drafters' (lossless).

The layer's position j reads (target hidden state h_j, token t_{j+1}) and predicts t_{j+2}. So the
drafter keeps, per target sequence:
- the target's hidden states of positions it has not consumed yet (`observe`, after every target forward
  pass: the runner keeps them when a drafter asks);
- a shadow sequence in its own one-layer KV pool whose token j is the target's t_{j+1}, computed up to
  `synced` positions from true target hidden states.

`propose` first catches the shadow up to the target (every position whose hidden state and next token
are known: the whole prompt on the first call, then 1 + the accepted drafts per step, in one batched
forward pass), which yields the first draft; each further draft is one more step of the layer that reads
its own previous output in place of the target hidden state not computed yet. Draft positions are
recomputed from true hidden states at the next call.

A prompt served from the target's prefix cache has no hidden states for its cached part; the layer reads
zeros there. That lowers acceptance on such prompts, never correctness.
"""
from __future__ import annotations

import dataclasses

import torch

from sudu.engine.block_manager import BlockManager
from sudu.engine.model_runner import ModelRunner, kv_bytes_per_token
from sudu.engine.network import quantize_model
from sudu.engine.placement import resolve_dtype
from sudu.engine.scheduler import ScheduledSeq
from sudu.engine.sequence import Sequence
from sudu.engine.spec.verify import Draft, target_distribution
from sudu.quant.formats import FORMATS
from sudu.layers.sampler import SamplingRow, argmax_rows
from sudu.models.mtp import load_mtp_network


def _one_layer(cfg):
    """The drafter pool's view of the model config: the MTP layer alone (of the kind of the last layer)."""
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=cfg.layer_types[-1:],
                               moe_layers=cfg.moe_layers[-1:] if cfg.moe_layers is not None else None)


class MTPDrafter:
    wants_hidden = True  # the engine hands it the target's hidden states after each forward pass

    def __init__(self, ckpt, engine):
        config = engine.config
        dtype = resolve_dtype(config)
        net = load_mtp_network(ckpt, engine.runner.model, dtype)
        if engine.quantization in FORMATS:  # the layer's linears in the target's format (the head stays shared)
            quantize_model(net.layer, None, engine.quantization)
        elif engine.quantization == "native":  # the drafter's own layer (from float tensors here): int8
            quantize_model(net.layer, None, "int8")
        for module in net.modules():
            if hasattr(module, "fuse_projections"):
                module.fuse_projections()
        model_cfg = _one_layer(ckpt.config)
        target_tokens = engine.runner.num_blocks * config.block_size
        pool_bytes = (target_tokens + 64 * config.block_size) * kv_bytes_per_token(model_cfg, dtype)
        cfg = dataclasses.replace(config, kv_cache_memory=pool_bytes, kv_cache_dtype=str(dtype).removeprefix("torch."))
        self.runner = ModelRunner(cfg, model_cfg, net, engine.max_model_len)
        self.runner.keep_hidden = True
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self.budget = config.max_num_batched_tokens
        self.vocab_size = ckpt.config.vocab_size
        engine.runner.keep_hidden = True
        self.hidden: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (first position, [rows, hidden])
        self.shadows: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (shadow, positions synced)
        self.generator = torch.Generator().manual_seed(config.seed + 1)
        self.num_draft_steps = 0

    # ---- the target's hidden states ---------------------------------------------------------------
    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """After a target forward pass: keep each sequence's new hidden rows (positions from its
        num_computed_tokens on; a recomputed position replaces the row kept for it)."""
        row = 0
        for s in scheduled:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            rows = hidden[row:row + n]
            row += n
            kept = self.hidden.get(s.seq.seq_id)
            if kept is not None and kept[0] <= start <= kept[0] + kept[1].shape[0]:
                first, old = kept
                self.hidden[s.seq.seq_id] = (first, torch.cat([old[:start - first], rows]))
            else:  # a copy: the step's hidden states are not kept whole
                self.hidden[s.seq.seq_id] = (start, rows.clone())

    def _hidden_rows(self, seq: Sequence, begin: int, end: int, width: int) -> torch.Tensor:
        """The target hidden states of positions begin..end-1 (zeros where none was computed)."""
        first, rows = self.hidden.get(seq.seq_id, (end, None))
        out = torch.zeros(end - begin, width, dtype=self.runner.dtype)
        lo, hi = max(begin, first), min(end, first + (rows.shape[0] if rows is not None else 0))
        if lo < hi:
            out[lo - begin:hi - begin] = rows[lo - first:hi - first]
        return out

    # ---- drafting ---------------------------------------------------------------------------------
    def _shadow(self, seq: Sequence) -> tuple[Sequence, int]:
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            sh = Sequence(seq.request_id, seq.index, [], 0, seq.params, 0, 0.0, max_total_tokens=seq.max_total_tokens)
            entry = (sh, 0)
        sh, synced = entry
        sh.num_computed_tokens = min(sh.num_computed_tokens, synced)  # drop the draft positions
        self.block_manager.trim(sh, max(sh.num_computed_tokens, 1))
        return sh, synced

    def _run(self, batch: list[ScheduledSeq], hidden_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass of the layer: (logits, output hidden) of each sequence's last row."""
        logits = self.runner.execute(batch, hidden_in)[:, : self.vocab_size]
        ends = torch.tensor([s.num_new_tokens for s in batch]).cumsum(0) - 1
        self.num_draft_steps += 1
        return logits, self.runner.last_hidden[ends]

    def _catch_up(self, seqs: list[Sequence]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Compute every shadow up to its target's computed positions; returns seq index -> (logits row,
        output row) at the last one. Sequences whose shadow cannot get blocks are left out."""
        bm, width = self.block_manager, self.runner.model.config.hidden_size
        work = []  # (index, shadow, positions to compute, their hidden rows)
        for i, seq in enumerate(seqs):
            sh, synced = self._shadow(seq)
            valid = seq.num_computed_tokens  # positions with a target hidden state; t_{valid} is known
            sh.token_ids = list(seq.token_ids[1:valid + 1])
            sh.num_prompt_tokens = len(sh.token_ids)
            n = valid - sh.num_computed_tokens
            if n <= 0 or not bm.can_allocate(sh, n):
                continue
            bm.allocate(sh, n)
            work.append((i, sh, n, self._hidden_rows(seq, sh.num_computed_tokens, valid, width)))
            self.shadows[seq.seq_id] = (sh, valid)
            self.hidden.pop(seq.seq_id, None)  # consumed: the next rows start at position `valid`
        out = {}
        # short catch-ups (the usual 1 + accepted drafts) share a pass; a prompt goes in chunks
        packed, size = [], 0
        for item in work + [None]:
            if item is None or (packed and size + item[2] > self.budget):
                if packed:
                    batch = [ScheduledSeq(sh, n) for _, sh, n, _ in packed]
                    logits, last = self._run(batch, torch.cat([h for *_, h in packed]))
                    for j, (i, sh, n, _) in enumerate(packed):
                        sh.num_computed_tokens += n
                        out[i] = (logits[j], last[j])
                packed, size = [], 0
            if item is None:
                break
            i, sh, n, rows = item
            while n > self.budget:  # a long prompt: all but its last chunk alone
                self.runner.execute([ScheduledSeq(sh, self.budget)], rows[:self.budget])
                sh.num_computed_tokens += self.budget
                n, rows = n - self.budget, rows[self.budget:]
            packed.append((i, sh, n, rows))
            size += n
        return out

    def _pick(self, seq: Sequence, logits: torch.Tensor, drafted: list[int], probs: list) -> int:
        if seq.params.greedy:
            return int(argmax_rows(logits[None])[0])
        row = SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids + drafted, None)
        q = target_distribution(logits, row)
        probs.append(q)
        return int(torch.multinomial(q, 1, generator=self.generator))

    def propose(self, seqs: list[Sequence], ks: list[int]):
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        wanted = [i for i, k in enumerate(ks) if k > 0]
        first = self._catch_up([seqs[i] for i in wanted])
        live = {}  # seq index -> output row feeding the next draft
        for j, i in enumerate(wanted):
            if j in first:
                logits, last = first[j]
                tokens[i].append(self._pick(seqs[i], logits, tokens[i], probs[i]))
                live[i] = last
        bm = self.block_manager
        for r in range(1, max(ks, default=0)):
            step = [i for i in live if ks[i] > r]
            batch, inputs = [], []
            for i in step:
                sh, _ = self.shadows[seqs[i].seq_id]
                if not bm.can_allocate(sh, 1):
                    continue
                sh.token_ids.append(tokens[i][-1])
                bm.allocate(sh, 1)
                batch.append((i, sh))
                inputs.append(live[i])
            if not batch:
                break
            logits, last = self._run([ScheduledSeq(sh, 1) for _, sh in batch], torch.stack(inputs))
            live = {}
            for j, (i, sh) in enumerate(batch):
                sh.num_computed_tokens += 1
                tokens[i].append(self._pick(seqs[i], logits[j], tokens[i], probs[i]))
                live[i] = last[j]
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def prefill(self, seqs: list[Sequence]) -> None:
        """Nothing before the target's pass: the prompt's hidden states come out of it, and the first
        propose consumes them (one layer's worth of work, in the first speculative step)."""

    def release(self, seq: Sequence) -> None:
        self.hidden.pop(seq.seq_id, None)
        entry = self.shadows.pop(seq.seq_id, None)
        if entry is not None:
            self.block_manager.free_sequence(entry[0])
