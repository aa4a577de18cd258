"""Sampler: logits of the rows that need a token -> chosen tokens (+ logprobs).

Order of operations per row: repetition / frequency / presence penalties, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> a draw from that row's own generator, so a seeded request
gets the same tokens whatever else shares its batch. Reported logprobs are those of the model's raw
distribution (before penalties and temperature), as vLLM reports them by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sudu import kernels
from sudu.sampling import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # None -> the sampler's shared generator
    seed: int | None = None  # what layers/device_sampler.py draws from (it has no per-row generators)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token_id, logprob), best first


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of [R, V] logits, as torch.argmax(dim=-1) (the first among equals; NaN counts as
    largest). The native kernel is vectorized; torch's CPU argmax is a scalar loop."""
    ext = kernels.load() if logits.is_cpu else None
    if ext is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous() and logits.shape[1]:
        return ext.argmax_rows(logits)
    return logits.argmax(-1)


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.output_token_ids:
        counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=logits.numel())
        counts = counts[: logits.numel()].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf."""
    logits = logits / p.scaled_temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the line stays)
        drop = probs.cumsum(-1) - probs > p.top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self.shared_generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """logits: [len(rows), V] on any device. Off the CPU, greedy rows take their argmax there (only the
        ids come back); a sampled row comes to the host alone, so draws use the same CPU generators either
        way; penalties and logprobs bring the whole batch to the host."""
        logits = logits.float()
        wants_logprobs = any(r.params.logprobs is not None for r in rows)
        needs_penalty = any(
            r.params.repetition_penalty != 1.0 or r.params.frequency_penalty or r.params.presence_penalty
            for r in rows
        )
        if not logits.is_cpu and (wants_logprobs or needs_penalty):
            logits = logits.cpu()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        if needs_penalty:
            logits = logits.clone()
        greedy_ids = None
        out: list[SampledToken] = []
        for i, row in enumerate(rows):
            p = row.params
            row_logits = apply_penalties(logits[i], row) if needs_penalty else logits[i]
            if p.greedy:
                if greedy_ids is None and not needs_penalty:
                    greedy_ids = argmax_rows(logits).tolist()
                token = greedy_ids[i] if greedy_ids is not None else int(argmax_rows(row_logits[None])[0])
            else:
                probs = filter_logits(row_logits.cpu(), p).softmax(-1)
                gen = row.generator or self.shared_generator
                token = int(torch.multinomial(probs, 1, generator=gen))
            sampled = SampledToken(token)
            if p.logprobs is not None:
                lp = raw_logprobs[i]
                sampled.logprob = float(lp[token])
                if p.logprobs > 0:
                    top = torch.topk(lp, p.logprobs)
                    sampled.top = list(zip(top.indices.tolist(), top.values.tolist()))
            out.append(sampled)
        return out
