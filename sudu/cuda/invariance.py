"""Whether greedy speculative decoding is lossless on this device, measured on the engine's own network.

Verification is lossless when a token's logits computed inside a verification run (1 + k tokens in one
forward) equal, bit for bit, the logits the same token gets when decoded on its own, and when decoded among
other sequences: then accepting drafts changes nothing. The CPU kernels guarantee it by construction. On CUDA
the paged attention and the int8 / int4 kernels are built for it, but cuBLAS (bfloat16 weights) and PyTorch's
reductions choose their algorithms by shape, so the engine measures it at load, on the GPU, format and dtype it
will run, before it allows `--speculative` there (check_speculation).
"""
from __future__ import annotations

import logging
import random

import torch

from sudu.cuda.paged_attention import PagedBatch
from sudu.cuda.step import block_tables, new_token_slots
from sudu.errors import SuduError
from sudu.layers.attention import AttentionMetadata, AttentionView

log = logging.getLogger(__name__)


def verification_matches_decoding(runner, k: int = 5, prompt_len: int = 40, others: int = 7,
                                  seed: int = 0) -> tuple[bool, str]:
    """On runner's network and pools (before any request: the probe writes blocks the block manager has not
    handed out): k tokens after a random prompt, verified in one forward, against the same tokens decoded one
    by one, alone and among `others` sequences decoding beside it. Returns (every row equal bit for bit, a
    one-line account)."""
    model, bs, dev = runner.model, runner.block_size, runner.device
    per_seq = -(-(prompt_len + k) // bs)
    blocks = runner.num_blocks if runner.sliding_blocks is None else min(runner.num_blocks,
                                                                         runner.sliding_blocks.num_blocks)
    others = min(others, blocks // per_seq - 1)
    if others < 0:
        raise SuduError(f"the KV pool ({blocks} blocks) is too small for the speculation check")
    window = runner.sliding_window or 0
    rng = random.Random(seed)
    vocab = runner.model_cfg.vocab_size

    def forward(seq_ids: list[list[int]], starts: list[int], seqs: list[int]) -> torch.Tensor:
        """Sequences `seqs` (sequence q owns blocks q * per_seq ...) get seq_ids[i] from position starts[i];
        the logits of every new token."""
        q_lens = [len(t) for t in seq_ids]
        bt = block_tables([[q * per_seq + j for j in range(per_seq)] for q in seqs], per_seq)
        ends = [s + n for s, n in zip(starts, q_lens)]
        pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])
        slots = new_token_slots(bt, starts, ends, bs)
        qs = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        lens = torch.tensor(ends, dtype=torch.int32)
        full = AttentionView(slots, paged=PagedBatch(bt, lens, qs, max(q_lens), bs))
        sliding = AttentionView(slots, paged=PagedBatch(bt, lens, qs, max(q_lens), bs, window)) if window else None
        meta = AttentionMetadata(full, sliding, runner.kv_caches).to(dev)
        ids = torch.tensor([t for ts in seq_ids for t in ts], device=dev)
        with torch.inference_mode():
            return model.compute_logits(model(ids, pos.to(dev), meta)).float()

    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(others + 1)]
    forward(prompts, [0] * len(prompts), list(range(len(prompts))))
    tokens = [rng.randrange(vocab) for _ in range(k)]
    verified = forward([tokens], [prompt_len], [0])
    alone = torch.cat([forward([[t]], [prompt_len + j], [0]) for j, t in enumerate(tokens)])
    among = torch.cat([forward([[t]] + [[tokens[0]]] * others, [prompt_len + j] + [prompt_len] * others,
                               list(range(others + 1)))[:1] for j, t in enumerate(tokens)])
    parts, ok = [], True
    for label, other in (("decoded alone", alone), (f"decoded among {others} others", among)):
        same = sum(torch.equal(verified[j], other[j]) for j in range(k))
        ok &= same == k
        parts.append(f"{same}/{k} rows equal to the same tokens {label} (largest difference "
                     f"{(verified - other).abs().max().item():.3g})")
    return ok, f"tokens verified {k} at a time: " + "; ".join(parts)


def check_speculation(runner) -> None:
    """Raise unless greedy verification is lossless on runner's device (module docstring); log the account."""
    if runner.cuda_step is None:
        raise SuduError(f"--speculative on {runner.device} needs the CUDA path's kernels (triton is not installed)")
    ok, account = verification_matches_decoding(runner)
    if not ok:
        raise SuduError(f"--speculative on {runner.device} would not be lossless with these weights: {account}; "
                        "use --quantization int8 or int4, or --speculative none")
    log.info("speculation on %s is lossless here: %s", runner.device, account)
