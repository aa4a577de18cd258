"""ModelRunner: owns the network and the KV pool, and turns a scheduled batch into one forward pass.

It flattens every scheduled sequence's new tokens into one batch, maps positions to pool slots through
the block tables, runs the model, and returns logits only for the rows that need a next token.
"""
from __future__ import annotations

import logging

import torch

from sudu.config import EngineConfig, default_num_threads
from sudu.errors import SuduError
from sudu.layers.attention import build_metadata
from sudu.layers.kv_cache import kv_bytes_per_token as kv_cache_bytes
from sudu.layers.kv_cache import make_kv_cache
from sudu.models import build_model
from sudu.models.config import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
    return c.num_hidden_layers * kv_cache_bytes(kv_cache_dtype, c.num_key_value_heads, c.head_dim, dtype)


def load_network(model_cfg: ModelConfig, tensors, dtype: torch.dtype) -> torch.nn.Module:
    """Build the network without initialising its weights, then take the checkpoint's tensors."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    state = {name: t.to(dtype) for name, t in tensors}
    if model_cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if model_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SuduError(
            f"checkpoint does not match the {model_cfg.architecture} network: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
        )
    return model.eval()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module, max_model_len: int):
        self.config = config
        self.model_cfg = model_cfg
        self.model = model
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.block_size
        self.sliding_window = model_cfg.sliding_window if "sliding_attention" in model_cfg.layer_types else None
        torch.set_num_threads(config.num_threads or default_num_threads())
        self.num_blocks = self._num_blocks(max_model_len)
        num_slots = self.num_blocks * self.block_size
        self.kv_caches = [
            make_kv_cache(config.kv_cache_dtype, num_slots, model_cfg.num_key_value_heads, model_cfg.head_dim,
                          self.dtype)
            for _ in range(model_cfg.num_hidden_layers)
        ]

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_cfg, self.dtype, self.config.kv_cache_dtype)

    def _num_blocks(self, max_model_len: int) -> int:
        budget = self.config.kv_cache_memory
        if budget is None:
            budget = min(DEFAULT_KV_CACHE_CAP_BYTES, available_memory_bytes() // 4)
            # no use holding more than every running sequence at full length
            budget = min(budget, self.config.max_num_seqs * max_model_len * self.kv_bytes_per_token())
        num_blocks = budget // (self.kv_bytes_per_token() * self.block_size)
        if num_blocks < 2:
            raise SuduError(f"kv_cache_memory={budget} bytes holds fewer than 2 blocks of {self.block_size} tokens")
        return int(num_blocks)

    @torch.inference_mode()
    def execute(self, scheduled) -> torch.Tensor:
        """scheduled: list of ScheduledSeq. Returns float32 logits of the rows each sequence needs
        (ScheduledSeq.num_logit_rows), concatenated in order."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        ctx_slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        row = 0
        for s in scheduled:
            seq = s.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
            ids.extend(seq.token_ids[start:end - len(s.draft_token_ids)])
            ids.extend(s.draft_token_ids)
            positions.extend(range(start, end))
            q_lens.append(s.num_new_tokens)
            table = torch.tensor(seq.block_table, dtype=torch.long)
            pos = torch.arange(end)
            ctx_slots.append(table[pos // bs] * bs + pos % bs)
            row += s.num_new_tokens
            sample_rows.extend(range(row - s.num_logit_rows, row))
        meta = build_metadata(q_lens, ctx_slots, self.kv_caches, self.sliding_window)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta)
        if not sample_rows:
            return hidden.new_zeros(0, self.model_cfg.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[sample_rows]).float()
