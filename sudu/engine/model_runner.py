"""ModelRunner: owns the network and the KV pool, and turns a scheduled batch into one forward pass.

It flattens every scheduled sequence's new tokens into one batch, maps positions to pool slots through
the block tables, runs the model, and returns logits only for the rows that need a next token.
"""
from __future__ import annotations

import logging

import torch

from sudu.config import EngineConfig, default_num_threads
from sudu.cuda.step import CudaStep, uses_cuda_path
from sudu.engine import attention_choice
from sudu.engine.kv_calibration import calibrate_int8_kv, set_int8_ranges
from sudu.engine.text_eval import final_hidden
from sudu.engine.block_manager import SlidingWindowBlocks
from sudu.engine.placement import resolve_device, resolve_dtype
from sudu.engine.vision_inputs import VisionInputs
from sudu.errors import SuduError
from sudu.layers.attention import build_metadata
from sudu.layers import bounded_head, linear
from sudu.layers.linear import prefill_attention_dtype
from sudu.layers.kv_cache import calibration_ids
from sudu.layers.kv_cache import layer_kv_bytes_per_token
from sudu.layers.kv_cache import make_kv_cache
from sudu.model_config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_CAP_BYTES = 4 << 30


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_bytes_per_token(model_cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of KV one token takes across all layers."""
    c = model_cfg
    heads, k_dim, v_dim = c.kv_cache_shape()
    return c.num_hidden_layers * layer_kv_bytes_per_token(kv_cache_dtype, heads, k_dim, dtype, v_dim)


def context_slots(tables: list[list[int]], ends: list[int], block_size: int) -> list[torch.Tensor]:
    """Per sequence, the pool slots of its positions 0..ends[i]-1 through its block table, computed for
    the whole batch in a fixed number of tensor ops (this runs every step)."""
    if len(tables) == 1:
        pos = torch.arange(ends[0])
        return [torch.tensor(tables[0])[pos // block_size] * block_size + pos % block_size]
    flat = torch.tensor([b for t in tables for b in t])
    n = torch.tensor(ends)
    table_start = torch.tensor([0] + [len(t) for t in tables[:-1]]).cumsum(0)
    seq_start = torch.cat([torch.zeros(1, dtype=torch.long), n[:-1].cumsum(0)])
    which = torch.repeat_interleave(torch.arange(len(ends)), n)
    pos = torch.arange(int(n.sum())) - seq_start[which]
    slots = flat[table_start[which] + pos // block_size] * block_size + pos % block_size
    return list(torch.split(slots, ends))


def flat_batch(scheduled) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The step's new tokens flat: (ids, positions, new tokens per sequence, positions per sequence after the
    step, rows whose logits are needed)."""
    ids: list[int] = []
    positions: list[int] = []
    q_lens: list[int] = []
    ends: list[int] = []
    sample_rows: list[int] = []
    row = 0
    for s in scheduled:
        seq = s.seq
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
        ids.extend(seq.token_ids[start:end - len(s.draft_token_ids)])
        ids.extend(s.draft_token_ids)
        positions.extend(range(start, end))
        q_lens.append(s.num_new_tokens)
        ends.append(end)
        row += s.num_new_tokens
        sample_rows.extend(range(row - s.num_logit_rows, row))
    return ids, positions, q_lens, ends, sample_rows


def images_whole(model_cfg: ModelConfig, config: EngineConfig, cuda_path: bool) -> None:
    """SuduError unless a model whose image tokens attend both ways can run here: a step must hold a whole
    image (the scheduler never ends a chunk inside one; a sliding window's ring is sized by the step), and the
    CUDA path's kernel has no such mask."""
    if cuda_path:
        raise SuduError(f"{model_cfg.architecture}'s images attend both ways, which the CUDA path's attention does "
                        "not do yet; serve it with --device cpu")
    if config.max_num_batched_tokens < model_cfg.mm_tokens_per_image:
        raise SuduError(f"max_num_batched_tokens={config.max_num_batched_tokens} is below one image's "
                        f"{model_cfg.mm_tokens_per_image} tokens, which one step must hold")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module, max_model_len: int,
                 tokenizer=None, kv_ranges: list | None = None):
        """tokenizer: the checkpoint's, for the calibration pass that sets int8 KV scales (required with
        kv_cache_dtype int8; layers/kv_cache.py calibration_ids). kv_ranges: that pass's per-layer (k_max,
        v_max) when it has run already (engine/kv_choice.py)."""
        self.config = config
        self.model_cfg = model_cfg
        self.model = model
        self.dtype = resolve_dtype(config)
        self.device = resolve_device(config.device)
        self.block_size = config.block_size
        # (PREFILL_DTYPE, PREFILL_MIN_ROWS) of every step: the integer kernel at every row count, or with
        # --fast-math GEMMs for long prompt chunks (layers/linear.py fast_prefill)
        self.prefill_path = linear.fast_prefill(config.fast_math and self.device.type == "cpu")
        # with --fast-math, prompt chunks' attention in bfloat16 where their linears run as bfloat16 GEMMs
        with linear.prefill_path_as(self.prefill_path[1], self.prefill_path[0]):
            self.prefill_sdpa_dtype = prefill_attention_dtype(model) if self.device.type == "cpu" else None
        # a vision-language network's images: encoder cache, image rows, multimodal positions
        self.vision = (VisionInputs(model, config.encoder_cache_memory, self.device, self.dtype)
                       if hasattr(model, "encode_images") else None)
        self.keep_hidden = False  # set by a drafter that reads the target's hidden states (MTP)
        self.last_hidden: torch.Tensor | None = None
        self.sliding_window = model_cfg.sliding_window if "sliding_attention" in model_cfg.layer_types else None
        torch.set_num_threads(config.num_threads or default_num_threads())
        sliding_layers = [i for i in range(model_cfg.num_hidden_layers) if model_cfg.is_sliding(i)]
        use_ring = bool(self.sliding_window) and config.sliding_window_kv == "ring"
        ring_layers = set(sliding_layers) if use_ring else set()
        self.ring_layers = ring_layers  # layers whose KV lives in the sliding pool (SlidingWindowBlocks)
        kv_heads, k_dim, v_dim = model_cfg.kv_cache_shape()  # multi-head latent attention: one latent entry
        layer_bytes = layer_kv_bytes_per_token(config.kv_cache_dtype, kv_heads, k_dim, self.dtype, v_dim)
        budget = self._kv_budget_bytes(max_model_len)
        self.sliding_blocks = None
        if ring_layers:
            ring_len = SlidingWindowBlocks.ring_len(self.block_size, self.sliding_window, config.max_num_batched_tokens)
            ring_bytes_per_block = len(ring_layers) * layer_bytes * self.block_size
            # enough rings for every running sequence, but never more than half the budget
            num_ring_blocks = min(config.max_num_seqs * ring_len, budget // 2 // ring_bytes_per_block)
            budget -= num_ring_blocks * ring_bytes_per_block
            self.sliding_blocks = SlidingWindowBlocks(num_ring_blocks, self.block_size, self.sliding_window,
                                                      config.max_num_batched_tokens)
        global_bytes_per_token = (model_cfg.num_hidden_layers - len(ring_layers)) * layer_bytes
        self.num_blocks = int(budget // (global_bytes_per_token * self.block_size))
        if self.num_blocks < 2 or (self.sliding_blocks is not None and self.sliding_blocks.num_blocks < 2):
            raise SuduError(f"kv_cache_memory={self._kv_budget_bytes(max_model_len)} bytes holds fewer than "
                            f"2 blocks of {self.block_size} tokens")
        cuda_path = uses_cuda_path(self.device, model_cfg)
        if self.vision is not None and self.vision.bidirectional:
            images_whole(model_cfg, config, cuda_path)
        scratch = int(cuda_path)  # the CUDA path's padding rows write one block past the last (cuda/step.py)
        self.kv_caches = []
        for i in range(model_cfg.num_hidden_layers):
            blocks = self.sliding_blocks.num_blocks if i in ring_layers else self.num_blocks
            self.kv_caches.append(make_kv_cache(config.kv_cache_dtype, (blocks + scratch) * self.block_size,
                                                kv_heads, k_dim, self.dtype, self.device, v_dim))
        self.attention_arithmetic = attention_choice.resolve(config.attention_arithmetic, self.device,
                                                             self.kv_caches[0].k.dtype, k_dim, v_dim or k_dim)
        attention_choice.apply(self.kv_caches, self.attention_arithmetic)
        if config.kv_cache_dtype == "int8" and kv_ranges is not None:
            set_int8_ranges(self.kv_caches, kv_ranges)
        elif config.kv_cache_dtype == "int8":
            ids = calibration_ids(tokenizer, model_cfg) if tokenizer is not None else []
            log.info("calibrating the int8 KV scales on %d tokens", len(ids))
            calibrate_int8_kv(model, self.kv_caches, ids)
        # steps whose rows all want their argmax alone read a shadow of the head (layers/bounded_head.py)
        self.bounded_head = None
        if config.greedy_head == "auto" and not cuda_path and tokenizer is not None:
            self.bounded_head = bounded_head.build(model, lambda: final_hidden(model, calibration_ids(tokenizer, model_cfg)))
        self.cuda_step = None
        if cuda_path:
            self.cuda_step = CudaStep(
                model, self.kv_caches, self.block_size, self.device, self.sliding_window, bool(ring_layers),
                (self.num_blocks, self.sliding_blocks.num_blocks if ring_layers else None), max_model_len,
                config.cuda_graph_max_batch, config.max_num_seqs)

    def kv_bytes_per_token(self) -> int:
        """Bytes one more token of context costs a sequence (every layer keeping every position)."""
        return kv_bytes_per_token(self.model_cfg, self.dtype, self.config.kv_cache_dtype)

    def kv_bytes_for_context(self, tokens: int) -> int:
        """KV bytes one sequence of `tokens` tokens holds: every position in the global layers, at most its
        window in the sliding layers kept as rings."""
        heads, k_dim, v_dim = self.model_cfg.kv_cache_shape()
        layer = layer_kv_bytes_per_token(self.config.kv_cache_dtype, heads, k_dim, self.dtype, v_dim)
        ring = len(self.ring_layers)
        window = min(tokens, self.sliding_window or tokens)
        return layer * ((self.model_cfg.num_hidden_layers - ring) * tokens + ring * window)

    def _kv_budget_bytes(self, max_model_len: int) -> int:
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":  # the weights are on the GPU already: half of what it has left
                budget = torch.cuda.mem_get_info(self.device)[0] // 2
            else:
                budget = min(DEFAULT_KV_CACHE_CAP_BYTES, available_memory_bytes() // 4)
            # no use holding more than every running sequence at full length
            budget = min(budget, self.config.max_num_seqs * max_model_len * self.kv_bytes_per_token())
        return budget

    @torch.inference_mode()
    def execute(self, scheduled, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """scheduled: list of ScheduledSeq. Returns float32 logits of the rows each sequence needs
        (ScheduledSeq.num_logit_rows), concatenated in order, on the engine's device (the sampler brings
        to the host only what it needs). hidden_in: a drafting network's second input, a row per new token.
        With keep_hidden set, the step's final hidden states [new tokens, hidden] stay in last_hidden."""
        ids, positions, q_lens, ends, sample_rows = flat_batch(scheduled)
        if self.cuda_step is not None:
            if hidden_in is None and not self.keep_hidden and self.vision is None:
                logits = self.cuda_step.decode(scheduled, ids, positions)
                if logits is not None:
                    return logits
            meta = self.cuda_step.metadata(scheduled, q_lens, ends)
        else:
            meta = self._metadata(scheduled, q_lens, ends)
        ids_t = torch.tensor(ids)
        inputs = {}
        if self.vision is not None:  # images encoded (or found in the encoder cache) before the pass that reads them
            positions_t = self.vision.positions(scheduled)
            image_rows = self.vision.image_rows(scheduled, self.vision.embeddings(scheduled, self.device, self.dtype))
            if image_rows is not None:
                inputs["image_rows"] = tuple(t.to(self.device) for t in image_rows)
        else:
            positions_t = torch.tensor(positions)
        if self.device.type != "cpu":  # one copy of the step's metadata
            meta = meta.to(self.device)
            ids_t, positions_t = ids_t.to(self.device), positions_t.to(self.device)
        with linear.prefill_path_as(self.prefill_path[1], self.prefill_path[0]):
            hidden = (self.model(ids_t, positions_t, meta, **inputs) if hidden_in is None
                      else self.model(ids_t, positions_t, meta, hidden_in))
        if self.keep_hidden:
            self.last_hidden = hidden
        if not sample_rows:
            return hidden.new_zeros(0, self.model_cfg.vocab_size, dtype=torch.float32)
        rows = hidden[sample_rows]
        if self.bounded_head is not None and bounded_head.serves(scheduled):
            logits = self.bounded_head.logits(rows)
            if logits is not None:
                return logits
        return self.model.compute_logits(rows).float()

    def _metadata(self, scheduled, q_lens: list[int], ends: list[int]):
        """The step's attention metadata for the CPU path (and CUDA without Triton): per-sequence key slots."""
        bs = self.block_size
        sliding_keys = None
        if self.sliding_blocks is not None:
            window = self.sliding_window
            sliding_keys = []
            for s in scheduled:
                start = s.seq.num_computed_tokens
                first = max(0, start + 1 - window)  # the earliest key the first new token can see
                sliding_keys.append((first, self.sliding_blocks.slots(s.seq, first, start + s.num_new_tokens)))
        ctx_slots = context_slots([s.seq.block_table for s in scheduled], ends, bs)
        sdpa_dtype = self.prefill_sdpa_dtype if sum(q_lens) >= self.prefill_path[1] else None
        spans = self.vision.image_spans(scheduled) if self.vision is not None else None
        return build_metadata(q_lens, ctx_slots, self.kv_caches, self.sliding_window, sliding_keys, sdpa_dtype,
                              spans)
