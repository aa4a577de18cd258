"""The CUDA path's step: a scheduled batch as block tables on the device, attention through the paged kernel
(paged_attention.py), and decode steps replayed from CUDA graphs.

Eager steps (prefill and mixed chunks, speculative verification, decode batches above the largest captured
size): block tables, lengths and slot mappings are built on the host and copied over once.

Decode steps (one new token and one logit row per sequence, nothing else asked of the network) replay a graph
captured at load for the next padded batch size (GRAPH_SIZES, up to cuda_graph_max_batch): the step's ids,
positions, slot mappings, block tables and lengths are written in place into static device buffers that the
graph reads, and its logits come out in a static buffer. A padding row is a one-position sequence in the
scratch block (one block past the last the block manager hands out, in every pool), so it writes and reads
nothing a real sequence owns. A network whose forward cannot be captured (a data-dependent shape, e.g. routed
experts) is reported once and runs eager.

On the CPU (SUDU_CUDA_PATH_ON_CPU=1, the kernels in Triton's interpreter) the same static-buffer path runs
without capture: a dry run of this module's padding, buffers and metadata for machines without a GPU.
"""
from __future__ import annotations

import itertools
import logging
import os

import numpy as np
import torch

from sudu.cuda import triton_available
from sudu.cuda.paged_attention import PagedBatch
from sudu.layers.attention import AttentionMetadata, AttentionView

log = logging.getLogger(__name__)

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def cuda_path_on_cpu() -> bool:
    """The dry run: the CUDA path's kernels and step on a CPU device (Triton's interpreter)."""
    return os.environ.get("SUDU_CUDA_PATH_ON_CPU", "0") == "1"


def uses_cuda_path(device: torch.device, model_cfg) -> bool:
    """Whether the engine's steps run through this module: on CUDA where Triton is importable (else PyTorch's
    SDPA over gathered keys), or in the dry run. Latent attention (deepseek2) has its own pool layout
    (layers/mla.py) and keeps its path."""
    if model_cfg.kv_lora_rank or not triton_available():
        return False
    return device.type == "cuda" or cuda_path_on_cpu()


def graph_sizes(max_batch: int, max_num_seqs: int) -> list[int]:
    """The padded batch sizes captured: GRAPH_SIZES up to the first that holds min(max_batch, max_num_seqs)."""
    limit = min(max_batch, max_num_seqs)
    if limit <= 0:
        return []
    sizes = []
    for size in GRAPH_SIZES:
        sizes.append(size)
        if size >= limit:
            break
    return sizes


def block_tables(tables: list[list[int | None]], width: int) -> torch.Tensor:
    """int32 [B, width], -1 where a sequence has no block (past its end, or a ring's released block). Built
    through NumPy in a fixed number of calls: this runs every step, over every block of every sequence."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    total = int(lens.sum())
    try:  # a full pool's tables hold ints only
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=total)
    except TypeError:  # a ring's released blocks are None
        flat = np.fromiter((-1 if b is None else b for b in itertools.chain.from_iterable(tables)), dtype=np.int32,
                           count=total)
    out = np.full((len(tables), width), -1, dtype=np.int32)
    out[np.arange(width) < lens[:, None]] = flat
    return torch.from_numpy(out)


def new_token_slots(tables: torch.Tensor, starts: list[int], ends: list[int], block_size: int) -> torch.Tensor:
    """The pool slots (int64) of each sequence's positions starts[i]..ends[i]-1 through its row of `tables`
    (a host tensor from block_tables), flat."""
    first = np.asarray(starts, dtype=np.int64)
    n = np.asarray(ends, dtype=np.int64) - first
    which = np.repeat(np.arange(len(n)), n)
    pos = np.repeat(first - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
    return torch.from_numpy(tables.numpy()[which, pos // block_size].astype(np.int64) * block_size + pos % block_size)


class CudaStep:
    """Runs the model runner's steps on the CUDA path. `scratch_blocks`: (the full pool's scratch block, the
    ring pool's or None)."""

    def __init__(self, model, kv_caches: list, block_size: int, device: torch.device, sliding_window: int | None,
                 ring: bool, scratch_blocks: tuple[int, int | None], max_model_len: int, max_graph_batch: int,
                 max_num_seqs: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.window = sliding_window or 0
        self.ring = ring
        self.scratch_full, self.scratch_ring = scratch_blocks
        self.width = -(-max_model_len // block_size) + 1
        self.sizes = graph_sizes(max_graph_batch, max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.replays = 0  # decode steps that took the static path (counted for tests and the profile)
        if self.sizes:
            self._allocate_static(self.sizes[-1])
            if device.type == "cuda":
                self._capture_all()

    # -- eager steps -----------------------------------------------------------------------------------

    def metadata(self, scheduled, q_lens: list[int], ends: list[int]) -> AttentionMetadata:
        """The step's attention metadata, built on the host (the runner copies it over once)."""
        starts = [e - q for e, q in zip(ends, q_lens)]
        bs = self.block_size
        width = max(-(-e // bs) for e in ends)
        query_start = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor(ends, dtype=torch.int32)
        full_bt = block_tables([s.seq.block_table for s in scheduled], width)
        full = AttentionView(new_token_slots(full_bt, starts, ends, bs),
                             paged=PagedBatch(full_bt, seq_lens, query_start, max(q_lens), bs))
        sliding = None
        if self.window:
            if self.ring:
                ring_bt = block_tables([s.seq.sliding_block_table for s in scheduled], width)
                sliding = AttentionView(new_token_slots(ring_bt, starts, ends, bs),
                                        paged=PagedBatch(ring_bt, seq_lens, query_start, max(q_lens), bs, self.window))
            else:
                sliding = AttentionView(full.slot_mapping, paged=PagedBatch(full_bt, seq_lens, query_start, max(q_lens),
                                                                            bs, self.window))
        return AttentionMetadata(full, sliding, self.kv_caches)

    # -- decode steps from static buffers --------------------------------------------------------------

    def decode(self, scheduled, ids: list[int], positions: list[int]) -> torch.Tensor | None:
        """[B, vocab] float32 logits of a decode step through the static buffers (a graph's replay on CUDA),
        or None when the step is not one (then it runs eager)."""
        b = len(scheduled)
        if not self.sizes or b > self.sizes[-1]:
            return None
        if any(s.num_new_tokens != 1 or s.num_logit_rows != 1 for s in scheduled):
            return None
        size = next(s for s in self.sizes if s >= b)
        self._fill(scheduled, ids, positions, size)
        graph, out = self.graphs.get(size, (None, None))
        if graph is not None:
            graph.replay()
        else:
            out = self._forward(size)
        self.replays += 1
        return out[:b]

    def _allocate_static(self, n: int) -> None:
        """The graphs' inputs: one int64 [5, n] buffer (ids, positions, lengths, slots, ring slots) and one int32
        [tables, n, width] buffer of block tables, each mirrored on the host (pinned on CUDA), so that a step's
        inputs go over in two copies."""
        dev, pin = self.device, self.device.type == "cuda"
        self.rows = torch.zeros(5, n, dtype=torch.long, device=dev)
        self.rows_host = torch.zeros(5, n, dtype=torch.long, pin_memory=pin)
        self.ids, self.positions, self.seq_lens, self.full_slots, self.ring_slots = self.rows
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one new token per sequence
        tables = 2 if self.ring else 1
        self.tables = torch.full((tables, n, self.width), -1, dtype=torch.int32, device=dev)
        self.tables_host = torch.full((tables, n, self.width), -1, dtype=torch.int32, pin_memory=pin)
        self.full_bt, self.ring_bt = self.tables[0], self.tables[1] if self.ring else None
        bs = self.block_size
        ring_slot = self.scratch_ring * bs if self.ring else 0
        # a padding row: token 0 at position 0, one position long, in the scratch block
        self.padding = np.array([0, 0, 1, self.scratch_full * bs, ring_slot], dtype=np.int64)[:, None]
        self.padding_blocks = np.array([self.scratch_full, self.scratch_ring or 0][:tables], dtype=np.int32)[:, None]
        self._pad_rows(0, n)
        self._send(n)

    def _pad_rows(self, lo: int, hi: int) -> None:
        """Host rows lo..hi-1 as padding (one position in the scratch block)."""
        self.rows_host.numpy()[:, lo:hi] = self.padding
        self.tables_host.numpy()[:, lo:hi, 0] = self.padding_blocks

    def _send(self, size: int) -> None:
        """The host buffers' first `size` rows to the device. Asynchronous from pinned memory: the host side is
        next written by the next step's _fill, after this step's sampler has waited for its ids, which come
        after this copy on the stream."""
        self.rows.copy_(self.rows_host, non_blocking=True)
        self.tables[:, :size].copy_(self.tables_host[:, :size], non_blocking=True)

    def _static_metadata(self, n: int) -> AttentionMetadata:
        """Metadata over the first n rows of the static buffers (views: a replay sees what _fill wrote)."""
        bs, qs, lens = self.block_size, self.query_start[:n + 1], self.seq_lens[:n]
        full = AttentionView(self.full_slots[:n], paged=PagedBatch(self.full_bt[:n], lens, qs, 1, bs))
        sliding = None
        if self.window:
            slots, bt = (self.ring_slots[:n], self.ring_bt[:n]) if self.ring else (self.full_slots[:n], self.full_bt[:n])
            sliding = AttentionView(slots, paged=PagedBatch(bt, lens, qs, 1, bs, self.window))
        return AttentionMetadata(full, sliding, self.kv_caches)

    def _forward(self, n: int) -> torch.Tensor:
        hidden = self.model(self.ids[:n], self.positions[:n], self._static_metadata(n))
        return self.model.compute_logits(hidden).float()

    def _fill(self, scheduled, ids: list[int], positions: list[int], size: int) -> None:
        """The step's rows into the static buffers, rows past the batch as padding."""
        b, bs = len(scheduled), self.block_size
        ends = [p + 1 for p in positions]
        width = max(-(-e // bs) for e in ends)
        rows, tables = self.rows_host.numpy(), self.tables_host.numpy()
        rows[0, :b], rows[1, :b], rows[2, :b] = ids, positions, ends
        full_bt = block_tables([s.seq.block_table for s in scheduled], width)
        rows[3, :b] = new_token_slots(full_bt, positions, ends, bs).numpy()
        tables[0, :b, :width] = full_bt.numpy()
        if self.ring:
            ring_bt = block_tables([s.seq.sliding_block_table for s in scheduled], width)
            rows[4, :b] = new_token_slots(ring_bt, positions, ends, bs).numpy()
            tables[1, :b, :width] = ring_bt.numpy()
        self._pad_rows(b, size)
        self._send(size)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """One graph per padded size, largest first, sharing one memory pool (only one replays at a time)."""
        pool = torch.cuda.graph_pool_handle()
        try:
            for size in reversed(self.sizes):
                self._pad_rows(0, size)
                self._send(size)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # compiles the Triton kernels and settles the allocator outside capture
                        self._forward(size)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size)
                self.graphs[size] = (graph, out)
        except Exception as exc:  # noqa: BLE001 -- a forward that cannot be captured runs eager
            log.warning("CUDA graphs off, decode steps run eager: capture failed (%s: %s)", type(exc).__name__, exc)
            self.graphs.clear()
            self.sizes = []
            torch.cuda.synchronize(self.device)
        else:
            log.info("CUDA graphs captured for decode batches of %s sequences", ", ".join(map(str, self.sizes)))
