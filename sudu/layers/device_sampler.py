"""DeviceSampler: the whole batch's tokens chosen on the logits' device, so only token ids come back.

Same call and semantics as layers/sampler.py `Sampler` (penalties -> greedy argmax, or temperature ->
top-k -> top-p -> min-p -> a draw; logprobs of the raw distribution, top alternatives best first), and the
same token sets kept by each filter, but as batched tensor ops with each row's parameters in [R] tensors:
the host builds those (and the penalties' flat (row, token) index tensors) from the rows and copies them
over, and one device -> host transfer brings back the chosen ids, with their logprobs and top alternatives
packed alongside when some row asked for them.

Draws are Gumbel-max over a counter-based generator: each token's uniform is a pure function of (the
row's seed, its draw index = the number of tokens it has output, the token id), a 32-bit integer hash
computed with int64 tensor ops whose every intermediate stays below 2^63, so the bits are the same on the
CPU and on CUDA. A seeded request therefore gets the same tokens run to run, whatever shares its batch and
in whatever row order; those tokens are not the ones the CPU `Sampler` draws for the same seed (that one
uses torch's CPU generators). A row without a seed (SamplingRow.seed None) gets a fresh one from
`shared_generator` at each call; the engine gives every sequence a fixed seed for its life instead.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from sudu.layers.sampler import SampledToken, SamplingRow, argmax_rows

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), c < 2^32, in 16-bit halves: each product stays below 2^48."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (lowbias32's shift-multiply rounds) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0xD35A2D97)
    return x ^ (x >> 15)


def uniforms(seeds: torch.Tensor, draws: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] float32 uniforms in (0, 1), a pure function of (seed, draw index, token id).

    seeds: [R] int64 in [0, 2^64) as two's complement; draws: [R] int64 in [0, 2^32). Each row's key is
    injected twice: one round over (key ^ token) alone would give two rows whose keys differ only in the low
    bits permutations of the same values."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key_a = mix32(mix32(mix32(lo ^ 0x9E3779B9) ^ hi) ^ draws)
    key_b = mix32(key_a ^ 0x85EBCA6B)
    tokens = torch.arange(vocab_size, device=seeds.device)
    bits = mix32(mix32(tokens ^ key_a[:, None]) ^ key_b[:, None])
    # odd multiples of 2^-24: 24 bits, exact in float32, never 0 or 1
    return ((bits >> 9) * 2 + 1).float() * 2.0 ** -24


@dataclass
class BatchParams:
    """One call's per-row parameters, on the logits' device. `sampled` holds the non-greedy rows' indices in
    the batch, and temperature .. draws are those rows'; the penalty pairs index the whole batch."""
    sampled: torch.Tensor  # [S] int64
    temperature: torch.Tensor  # [S, 1]
    top_k: torch.Tensor  # [S, 1] int64, 1-based; only read where has_top_k
    has_top_k: torch.Tensor  # [S, 1] bool
    top_p: torch.Tensor  # [S, 1]
    min_p: torch.Tensor  # [S, 1]
    seeds: torch.Tensor  # [S] int64
    draws: torch.Tensor  # [S] int64
    repetition_rows: torch.Tensor  # [N] int64: (row, token) pairs of each penalized row's seen set
    repetition_tokens: torch.Tensor
    repetition_penalty: torch.Tensor  # [N]
    count_rows: torch.Tensor  # [M] int64: (row, token, count) of each penalized row's output tokens
    count_tokens: torch.Tensor
    count_penalty: torch.Tensor  # [M]: frequency * count + presence
    max_top_k: int  # host-side shape decisions, so nothing on the device is read back to take them
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool


def batch_params(rows: list[SamplingRow], vocab_size: int, device: torch.device,
                 generator: torch.Generator) -> BatchParams:
    """The rows' parameters as tensors on `device`: built on the host, one int64 and one float32 copy."""
    ints = {name: [] for name in ("sampled", "top_k", "has_top_k", "seeds", "draws", "repetition_rows",
                                  "repetition_tokens", "count_rows", "count_tokens", "counts")}
    floats = {name: [] for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency",
                                    "presence")}
    for i, r in enumerate(rows):
        p = r.params
        if not p.greedy:
            has_k = 0 < p.top_k < vocab_size
            seed = r.seed if r.seed is not None else int(torch.randint(1 << 62, (), generator=generator))
            seed %= 1 << 64
            ints["sampled"].append(i)
            ints["top_k"].append(p.top_k if has_k else 1)
            ints["has_top_k"].append(int(has_k))
            ints["seeds"].append(seed - (1 << 64) if seed >= 1 << 63 else seed)  # as int64's two's complement
            ints["draws"].append(len(r.output_token_ids) & _MASK32)
            floats["temperature"].append(p.scaled_temperature)
            floats["top_p"].append(p.top_p)
            floats["min_p"].append(p.min_p)
        if p.repetition_penalty != 1.0:
            seen = sorted(set(r.prompt_token_ids) | set(r.output_token_ids))
            ints["repetition_rows"] += [i] * len(seen)
            ints["repetition_tokens"] += seen
            floats["repetition_penalty"] += [p.repetition_penalty] * len(seen)
        if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
            counts = collections.Counter(r.output_token_ids)
            ints["count_rows"] += [i] * len(counts)
            ints["count_tokens"] += counts.keys()
            ints["counts"] += counts.values()
            floats["frequency"] += [p.frequency_penalty] * len(counts)
            floats["presence"] += [p.presence_penalty] * len(counts)
    int_t = dict(zip(ints, _to_device(ints, torch.long, device)))
    float_t = dict(zip(floats, _to_device(floats, torch.float32, device)))
    sampled = [rows[i].params for i in ints["sampled"]]
    max_top_k = max((k for k, has in zip(ints["top_k"], ints["has_top_k"]) if has), default=0)
    return BatchParams(
        sampled=int_t["sampled"], temperature=float_t["temperature"][:, None], top_k=int_t["top_k"][:, None],
        has_top_k=int_t["has_top_k"][:, None].bool(), top_p=float_t["top_p"][:, None],
        min_p=float_t["min_p"][:, None], seeds=int_t["seeds"], draws=int_t["draws"],
        repetition_rows=int_t["repetition_rows"], repetition_tokens=int_t["repetition_tokens"],
        repetition_penalty=float_t["repetition_penalty"],
        count_rows=int_t["count_rows"], count_tokens=int_t["count_tokens"],
        # sampler.py's arithmetic, to the bit: frequency * count + presence * (count > 0)
        count_penalty=float_t["frequency"] * int_t["counts"].float() + float_t["presence"],
        max_top_k=max_top_k, any_top_k=max_top_k > 0,
        any_top_p=any(p.top_p < 1.0 for p in sampled), any_min_p=any(p.min_p > 0.0 for p in sampled),
    )


def _to_device(lists: dict[str, list], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The named lists as views of one tensor, copied to `device` in one transfer."""
    flat = torch.tensor([v for x in lists.values() for v in x], dtype=dtype).to(device, non_blocking=True)
    return flat.split([len(x) for x in lists.values()])


def penalize(logits: torch.Tensor, bp: BatchParams) -> torch.Tensor:
    """Repetition, then frequency / presence penalties, in place on float32 [R, V] logits."""
    if bp.repetition_rows.numel():
        vals = logits[bp.repetition_rows, bp.repetition_tokens]
        logits[bp.repetition_rows, bp.repetition_tokens] = torch.where(
            vals > 0, vals / bp.repetition_penalty, vals * bp.repetition_penalty)
    if bp.count_rows.numel():
        logits[bp.count_rows, bp.count_tokens] = logits[bp.count_rows, bp.count_tokens] - bp.count_penalty
    return logits


def filter_batch(logits: torch.Tensor, bp: BatchParams) -> torch.Tensor:
    """The sampled rows' ([S, V], penalized) temperature-scaled logits with everything outside each row's
    top-k / top-p / min-p set to -inf: the token sets sampler.py's filter_logits keeps."""
    x = logits / bp.temperature
    if bp.any_top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
    if bp.any_top_k:
        kth_source = sorted_x if bp.any_top_p else torch.topk(x, bp.max_top_k, dim=-1).values
        kth = kth_source.gather(1, bp.top_k - 1).masked_fill(~bp.has_top_k, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
        if bp.any_top_p:
            # the dropped tokens are the sorted tail, so this is the top-k-filtered row sorted
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if bp.any_top_p:
        probs = sorted_x.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the line stays); a row at
        # top_p 1 keeps all, whatever the float cumsum's last bits
        drop_sorted = (probs.cumsum(-1) - probs > bp.top_p) & (bp.top_p < 1.0)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if bp.any_min_p:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < bp.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


def keep_mask(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[S, V] bool: the tokens each sampled row (in batch order) can be drawn from."""
    bp = batch_params(rows, logits.shape[-1], logits.device, torch.Generator())
    penalized = penalize(logits.float().clone(), bp)
    return filter_batch(penalized.index_select(0, bp.sampled), bp) > float("-inf")


class DeviceSampler:
    def __init__(self, seed: int = 0):
        # seeds for rows that come without one; also what speculative verification draws with on the CPU
        self.shared_generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """logits: [len(rows), V] on any device; everything runs there, one transfer brings the result."""
        if not rows:
            return []
        raw = logits.float()
        num_rows, vocab_size = raw.shape
        bp = batch_params(rows, vocab_size, raw.device, self.shared_generator)
        penalized = raw
        if bp.repetition_rows.numel() or bp.count_rows.numel():
            penalized = penalize(raw.clone(), bp)
        num_sampled = bp.sampled.numel()
        if num_sampled < num_rows:
            tokens = argmax_rows(penalized.contiguous())
        if num_sampled:
            subset = penalized if num_sampled == num_rows else penalized.index_select(0, bp.sampled)
            x = filter_batch(subset, bp)
            # Gumbel-max: argmax of log p - log(-log u) draws from softmax(x); log p is x less a per-row constant
            drawn = torch.argmax(x - torch.log(-torch.log(uniforms(bp.seeds, bp.draws, vocab_size))), dim=-1)
            # a row that allows no token has nothing to draw (the CPU sampler's multinomial raises there): -1,
            # raised on the host once the ids are back, so the engine fails that request alone
            drawn = torch.where(torch.isneginf(x.amax(dim=-1)), -1, drawn)
            tokens = drawn if num_sampled == num_rows else tokens.index_copy(0, bp.sampled, drawn)
        want = [r.params.logprobs for r in rows]
        if all(k is None for k in want):
            return [SampledToken(t) for t in _checked(tokens.tolist())]
        max_top = max(k or 0 for k in want)
        logprobs = torch.log_softmax(raw, dim=-1)
        # float64 holds token ids and float32 logprobs exactly, so one tensor carries both
        # a -1 (no token allowed) gathers row 0's entry: an index out of range is a device-side assert on CUDA
        parts = [tokens[:, None].double(), logprobs.gather(1, tokens.clamp_min(0)[:, None]).double()]
        if max_top:
            top = torch.topk(logprobs, max_top, dim=-1)
            parts += [top.indices.double(), top.values.double()]
        packed = torch.cat(parts, dim=1).tolist()
        _checked([int(row[0]) for row in packed])
        out = []
        for k, row in zip(want, packed):
            sampled = SampledToken(int(row[0]))
            if k is not None:
                sampled.logprob = row[1]
                if k:
                    sampled.top = [(int(i), v) for i, v in zip(row[2:2 + k], row[2 + max_top:2 + max_top + k])]
            out.append(sampled)
        return out


def _checked(tokens: list[int]) -> list[int]:
    if any(t < 0 for t in tokens):
        raise ValueError("no token can be sampled: every token's logit is -inf after the filters")
    return tokens
