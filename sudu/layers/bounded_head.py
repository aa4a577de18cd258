"""Greedy rows' logits from a 4-bit shadow of an 8-bit output head, the head's own values where it matters.

A greedy row needs only its argmax, and the output head is a decode step's largest single read (the 0.5B's
Q8_0 head is 145 of its ~400 MB a token). For steps of a few rows, all greedy (`serves`), the bounded
head reads a 4-bit shadow of the head instead (sudu's int4 tiles, 0.625 bytes a weight against Q8_0's
1.06), bounds how far each shadow logit can be from the head's own, and runs the head's own kernel on only
the tiles whose interval reaches the best lower bound. Those tiles' logits are the whole head's, bit for bit
(a tile's outputs do not depend on the call that computes it); every other logit is -inf. So the argmax,
ties included, is the whole head's, and so is every greedy token and every greedy verification of drafts.
Rows that need more than the argmax (sampling, logprobs, penalties, a grammar) run the whole head.

The bound. xh is the row as the kernels quantize it (q8_0), w_j the head's row j, s_j the shadow's, r_j = w_j
- s_j. Both kernels compute their dot products with xh, so head_j - shadow_j = r_j . xh, up to the two
kernels' float rounding. Final hidden states lie mostly in a few directions: U [K, k] holds the top k (the
principal directions of the final hidden states of a calibration text, computed at load), P = U U^T, and
    r_j . xh = (U^T r_j) . (U^T xh) + (r_j - P r_j) . (xh - P xh)
The first term is computed: C_j = U^T r_j is kept, k floats a row. The second is at most
|r_j - P r_j| |xh - P xh| (Cauchy-Schwarz). The rounding is at most sl_j |xh| (`rounding_slack`: both
kernels' products and sums, from the row's largest weight, with a factor 2 to spare). The constants are
computed in double and rounded up. kernels/bounded_head.cpp finds the tiles in two stages: every row with
|C_j| |z| in place of C_j . z (three floats a row), then C_j . z for the rows that stage keeps.

Where the bound is loose (a flat distribution, a hidden state far from U), the candidate tiles grow; past
MAX_TILE_FRACTION of the head the step runs the whole head instead. Measured: docs/cpu_speed.md.
"""
from __future__ import annotations

import logging
import math

import torch

from sudu import kernels
from sudu.host.huge_pages import move_to_huge_pages
from sudu.host.memory import release_freed_memory
from sudu.layers.gguf_native import segments
from sudu.layers.linear import QuantizedLinear
from sudu.quant.formats import TILE_BLOCK_BYTES, TILE_ROWS, dequantize_torch, pack, quantize_int4
from sudu.sampling import SamplingParams

log = logging.getLogger(__name__)

RANK = 16  # principal directions of the hidden states that C corrects for
SLICE_ROWS = 2048  # head rows dequantized at a time while building (its float64 temporaries: ~15 MB each)
MIN_VOCAB = 4096  # smaller heads are not worth a shadow
# 8-bit heads (Q8_0, int8): the 1.5B's Q6_K head (6.56 bits) ran 0.981 and 1.025 of the whole head's steps
# at batch 1 and 2, its shadow saving too few bytes (docs/cpu_speed.md)
MIN_BYTES_PER_WEIGHT = 1.0
# more candidate tiles than this: the whole head instead (the shadow reads 0.59 of the head's bytes, and the
# candidate tiles, in short runs, cost a little more than their share of it)
MAX_TILE_FRACTION = 0.25
# steps of more logit rows run the whole head: the 4-bit kernel computes more per byte than the 8-bit one,
# and at 8 rows the shadow took longer than the head it replaces (docs/cpu_speed.md)
MAX_ROWS = 4


def serves(scheduled) -> bool:
    """Whether a step's logit rows are few enough and all want only their argmax (engine/model_runner.py)."""
    rows = 0
    for s in scheduled:
        if s.num_logit_rows:
            if not argmax_only(s.seq.params):
                return False
            rows += s.num_logit_rows
    return rows <= MAX_ROWS


def argmax_only(p: SamplingParams) -> bool:
    """Whether a request's tokens depend on nothing but its logits' argmax: greedy, without logprobs,
    penalties or a grammar (layers/sampler.py, engine/spec/verify.py verify_draft)."""
    return (p.greedy and p.logprobs is None and p.grammar is None and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty)


def rounding_slack(k: int) -> float:
    """sl_j / (row j's largest weight): a bound on both kernels' float rounding per unit of |xh|, for rows of
    k columns, with a factor 2 to spare. Per 32-block the int8 kernel sums one term (d_w d_x S), the int4
    kernel two (s d_x S, m x_sum); their magnitudes sum to at most |w|max |xh|_1 and 3 |w|max |xh|_1, each
    term is rounded at most 3 times and a sum of n terms adds n - 1 roundings; |xh|_1 <= sqrt(k) |xh|."""
    u, nb = 2.0 ** -24, k // 32
    return 2.0 * (3 * (2 * nb + 3) + (nb + 3)) * math.sqrt(k) * u


def _round_up(t: torch.Tensor) -> torch.Tensor:
    """float64 -> the float32 values not below it."""
    f = t.float()
    return torch.where(f.double() < t, torch.nextafter(f, torch.tensor(math.inf)), f)


class BoundedHead:
    def __init__(self, head: QuantizedLinear, hidden: torch.Tensor, rank: int = RANK):
        """head: an output head in 8-bit tiles (int8, or native with one segment), no bias; hidden: final
        hidden states of a calibration text [n, K], whose principal directions U is built from."""
        self.head, self._ext = head, kernels.load()
        V, K = self.vocab, self.width = head.out_features, head.in_features
        xh = self._ext.q8_0_values(hidden.float().contiguous()).double()
        rank = min(rank, xh.shape[0], K)
        self.U = torch.linalg.svd(xh, full_matrices=False)[2][:rank].T.contiguous().float()  # [K, k]
        u = self.U.double()
        self.C = torch.empty(V, rank)
        consts = torch.empty(3, V, dtype=torch.float64)
        shadow = torch.empty(-(-V // TILE_ROWS), K // 32, TILE_BLOCK_BYTES["int4"], dtype=torch.uint8)
        slack = rounding_slack(K)
        for n0 in range(0, V, SLICE_ROWS):
            n1 = min(V, n0 + SLICE_ROWS)
            w = head._slice_dequantized(n0, n1)
            q, s, m = quantize_int4(w)
            shadow[n0 // TILE_ROWS:-(-n1 // TILE_ROWS)] = pack("int4", q, s, m, 32)
            s4 = dequantize_torch("int4", q, s, m, 32)
            r = w.double() - s4.double()
            c = r @ u
            self.C[n0:n1] = c.float()
            consts[0, n0:n1] = c.norm(dim=1)
            consts[1, n0:n1] = (r - c @ u.T).norm(dim=1)
            consts[2, n0:n1] = slack * torch.maximum(w.abs().amax(1), s4.abs().amax(1)).double()
        # C's float32 rounding: |C_j . z| is bounded through |C_j| (stage 1) and computed from the rounded C_j
        # (stage 2), whose difference is within the slack's factor 2
        self.consts = _round_up(consts).contiguous()
        self.shadow = QuantizedLinear("int4", shadow, None, None, None, K, out_features=V)
        self.max_tiles = max(1, int(MAX_TILE_FRACTION * -(-V // TILE_ROWS)))
        self.calls = self.whole_head = self.tiles_read = 0
        self.huge_pages: torch.Tensor | None = None  # the shadow's huge-page mapping, where build made one

    def shadow_bytes(self) -> int:
        """What the bounded head keeps besides the head: the shadow's tiles, C, the constants and U."""
        return sum(t.numel() * t.element_size() for t in (self.shadow.qweight, self.C, self.consts, self.U))

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits of rows x [M, K] (float32, contiguous) for their argmax: the head's own values in the
        candidate tiles, -inf elsewhere. None where the bound leaves too many tiles (or x is not finite): the
        caller runs the whole head."""
        self.calls += 1
        x = x.float().contiguous()
        approx = self._ext.qlinear(x, self.shadow.qweight, None)
        idx = self._ext.head_candidates(x, approx, self.U, self.C, self.consts, self.vocab, self.max_tiles)
        if not idx.numel():
            self.whole_head += 1
            return None
        self.tiles_read += idx.numel()
        y = self._ext.qlinear_tiles(x, self.head.qweight, idx)
        cols = (idx[:, None] * TILE_ROWS + torch.arange(TILE_ROWS)).reshape(-1)
        out = torch.full((x.shape[0], self.vocab), -math.inf)
        if int(cols[-1]) >= self.vocab:  # the last tile's padding rows
            keep = cols < self.vocab
            cols, y = cols[keep], y[:, keep]
        out.index_copy_(1, cols, y)
        return out


def eligible(model: torch.nn.Module) -> bool:
    """Whether model's logits are its lm_head's outputs alone, and that head is one the bounded head serves:
    8-bit tiles of a single format, no bias, a vocabulary large enough to pay for a shadow."""
    head = getattr(model, "lm_head", None)
    if not getattr(model, "PLAIN_HEAD", False) or not isinstance(head, QuantizedLinear) or kernels.load() is None:
        return False
    if head.bias is not None or head.out_features < MIN_VOCAB or head.in_features % 32:
        return False
    if head.fmt == "native" and len(segments(head.qweight)) != 1:
        return False
    return head.fmt != "int4" and head.weight_bytes() >= MIN_BYTES_PER_WEIGHT * head.out_features * head.in_features


def build(model: torch.nn.Module, hidden_of) -> BoundedHead | None:
    """A BoundedHead for model's output head where `eligible`, else None. hidden_of(): the final hidden states
    of a calibration text [n, K]."""
    if not eligible(model):
        return None
    bounded = BoundedHead(model.lm_head, hidden_of())
    # the shadow streams every greedy step, as the weights do: into huge pages like them
    bounded.huge_pages = move_to_huge_pages(bounded.shadow)[1]
    release_freed_memory()  # the build's temporaries (the calibration pass, the dequantized slices)
    log.info("greedy rows read a 4-bit shadow of the output head (%.0f MB besides its %.0f MB), then only the "
             "head's tiles that can hold their argmax", bounded.shadow_bytes() / 1e6, model.lm_head.weight_bytes() / 1e6)
    return bounded
