"""EngineConfig: every engine knob in one place, with defaults that work. Each field is one CLI flag
of the same name (`--max-num-seqs` for max_num_seqs)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass

from sudu.model_config import rope_scaling_fields

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL  # catalog name, .gguf path or Hugging Face-style directory
    # where the network runs: auto (CUDA when torch sees a GPU, else the CPU) | cpu | cuda | cuda:N.
    # On CUDA the weights run in --dtype, or as int8 / int4 on Triton kernels; the GGUF files' native blocks,
    # draft models and MTP are CPU-only so far, n-gram speculation runs where checked lossless at load
    # (engine/placement.py)
    device: str = "auto"
    # compute dtype of activations and unquantized weights; auto: float32 on the CPU (the native kernels'
    # activations), bfloat16 on CUDA
    dtype: str = "auto"
    # weight format of the linear layers: auto | native | none | int8 | int4 (layers/linear.py). native: a
    # GGUF file's own blocks (layers/gguf_native.py); auto: native for checkpoints that come quantized (the
    # catalog's GGUFs), none (float) for float checkpoints
    quantization: str = "auto"
    # KV pool format: auto | float32 | float16 | bfloat16 | int8 (static per-channel scales calibrated at load:
    # layers/kv_cache.py). auto, on the CPU: int8 where a load-time check finds it changes no answers, else
    # float16 (bfloat16 if the model's K/V values are too large for it); elsewhere the compute dtype
    # (engine/kv_choice.py)
    kv_cache_dtype: str = "auto"
    # attention's arithmetic on the CPU: auto | float32 | bfloat16 (engine/attention_choice.py). bfloat16: the
    # products on AMX's bfloat16 tiles (queries, keys, weights and values rounded to bfloat16, float32 sums),
    # about 3x faster at depth; float32: float32 throughout. Either is one recipe for every row, so neither
    # changes an answer with batching, chunking or caching. auto: bfloat16 where the CPU has the tiles and
    # the KV pool is not float32 (a float32 pool asks for float32 numbers), else float32
    attention_arithmetic: str = "auto"
    block_size: int = 16  # tokens per KV block
    # models with sliding-window layers (gemma3): "ring" keeps only each sequence's window for those
    # layers (far less memory; no prefix cache for such models), "full" keeps every position (prefix cache on)
    sliding_window_kv: str = "ring"
    kv_cache_memory: int | None = None  # bytes for the KV pool; None -> a quarter of available RAM, at most 4 GiB
    # the pool's pages take memory as they are first written, so the resident set grows as the context cache
    # fills, up to kv_cache_memory. kv_prefault commits them all at load instead: the resident set is then
    # flat from the start (what a container's memory limit sees), at the price of the whole pool up front
    kv_prefault: bool = False
    max_model_len: int | None = None  # None -> the model's context length, at most 32768 (without --rope-scaling)
    # RoPE scaling replacing the model's own, a JSON object in Hugging Face's rope_scaling form: e.g.
    # '{"type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}' (Qwen2.5's model card: 128k);
    # also linear and llama3. The model's context becomes original x factor, and the default max_model_len
    # with it (model_config.py with_rope_scaling)
    rope_scaling: str | None = None
    max_num_seqs: int = 64  # sequences in the running batch
    # tokens per forward pass (prefill chunks + decodes): a prompt of up to this many tokens is one chunk,
    # its weights dequantized once (docs/cpu_speed.md "Prompt chunks of 2,048 tokens")
    max_num_batched_tokens: int = 2048
    # prompt tokens per step while others decode (bounds their ITL); 0 = auto: sized from measured step
    # times so a step carrying one prompt's chunk costs at most max_itl_factor x a decode-only step (the
    # allowance is per prompt in flight: engine/scheduler.py ChunkBudget)
    prefill_chunk_when_decoding: int = 0
    max_itl_factor: float = 2.0
    # admission (engine/wait_predictor.py): a request whose predicted time to first token is longer than
    # this many seconds is refused (the server answers 429 with Retry-After from the predicted drain time);
    # 0 = admit every request the queue has room for. The default suits interactive use: an answer that
    # starts later than this is better retried later or sent to another replica
    max_queue_wait: float = 5.0
    # waiting requests are ordered by priority (lower first), continuing sessions (prompt mostly cached)
    # half a level ahead of cold first turns; every priority_aging_s seconds of waiting counts as one level
    # more urgent, so no request starves (engine/schedule_policy.py)
    priority_aging_s: float = 2.0
    enable_prefix_caching: bool = True
    # the context cache's disk tier (cache/disk_store.py): blocks written through as they fill, found again
    # across requests, restarts and servers sharing the directory. Size: 0 = off (the default here and in
    # the Python API), auto = min(10 GiB, 20% of the free space) (`sudu serve`'s default), or bytes (8GiB)
    disk_cache_size: str = "0"
    disk_cache_dir: str | None = None  # None -> $SUDU_HOME/kvcache
    # auto | none | ngram | draft:MODEL | mtp (engine/spec/). auto: n-gram lookup for greedy requests
    # where it is lossless (the CPU kernels: native, int8 or int4 weights), else none
    speculative: str = "auto"
    # most draft tokens per sequence per step (adapted per sequence); 0 = the drafter's own default:
    # 7 for n-gram lookup (free to draft), 4 for a draft model (measured: docs/benchmarks.md)
    num_speculative_tokens: int = 0
    # speculation pauses while more sequences than this are decoding; 0 = the drafter's own default: 4 for
    # n-gram lookup, 8 for a draft model or MTP (measured: docs/benchmarks.md)
    speculative_max_batch: int = 0
    # draft model's output head: only the first N token ids (in BPE merge order, the most frequent) and the
    # special tokens; 0 = the whole vocabulary. Lossless either way (the target verifies every token).
    speculative_draft_vocab: int = 65536
    # output head of steps whose rows are all greedy: auto | full. auto, on the CPU with an 8-bit head: a 4-bit
    # shadow of it, then the head's own tiles that can hold each row's argmax (the same tokens; layers/bounded_head.py)
    greedy_head: str = "auto"
    # CUDA: decode steps of up to this many sequences replay graphs captured at load, one per padded batch
    # size (1, 2, 4, 8, ...: cuda/step.py); 0 = every step eager
    cuda_graph_max_batch: int = 64
    # outputs handed to a request's consumer once a choice has this many new tokens (the first token and
    # the finish never wait); 1 = every step's. Larger: fewer, burstier stream items, cheaper per token
    # through Ray Serve (engine/stream_interval.py, docs/cluster.md)
    stream_interval: int = 1
    # false (the default): a request's greedy and seeded output is a function of the request alone, whatever
    # shares its steps, however its prompt is chunked or cached (docs/exactness.md). true: long prompt chunks'
    # linears as bfloat16 GEMMs on AMX and their attention in bfloat16, faster prompts whose numbers depend on
    # the chunk's row count (the price and gain: docs/exactness.md); without AMX it changes nothing (the
    # integer kernel is the faster path there)
    fast_math: bool = False
    # vision-language models: bytes of image embeddings kept by content hash (engine/vision_inputs.py), so an
    # image sent again (the next turn of a conversation, the same screenshot) is not encoded again
    encoder_cache_memory: int = 256 << 20
    # a llama.cpp mmproj GGUF file: the vision tower of a GGUF language model (weights/mmproj.py; Gemma 3's)
    mmproj: str | None = None
    num_threads: int | None = None  # torch intra-op threads; None -> physical cores available
    seed: int = 0

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.prefill_chunk_when_decoding < 0:
            raise ValueError("prefill_chunk_when_decoding must be >= 0 (0 = auto)")
        if self.max_itl_factor <= 1.0:
            raise ValueError("max_itl_factor must be > 1")
        if self.max_queue_wait < 0:
            raise ValueError("max_queue_wait must be >= 0 (0 = no admission by predicted wait)")
        if self.priority_aging_s <= 0:
            raise ValueError("priority_aging_s must be > 0")
        if not 0 <= self.num_speculative_tokens <= 7:
            # k drafts + 1 verified rows must fit the native attention kernel (NATIVE_MAX_Q = 8), whose rows
            # do not depend on each other: what keeps greedy verification identical to plain decoding
            raise ValueError("num_speculative_tokens must be between 1 and 7 (0 = the drafter's default)")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1 (1 = every step's output at once)")
        if self.cuda_graph_max_batch < 0:
            raise ValueError("cuda_graph_max_batch must be >= 0 (0 = no CUDA graphs)")
        if self.speculative_max_batch < 0:
            raise ValueError("speculative_max_batch must be >= 0 (0 = the drafter's default)")
        if self.speculative_draft_vocab < 0:
            raise ValueError("speculative_draft_vocab must be >= 0 (0 = the whole vocabulary)")
        if self.quantization not in ("auto", "native", "none", "int8", "int4"):
            raise ValueError(f"quantization must be auto, native, none, int8 or int4, got {self.quantization!r}")
        if self.greedy_head not in ("auto", "full"):
            raise ValueError(f"greedy_head must be auto or full, got {self.greedy_head!r}")
        if self.sliding_window_kv not in ("ring", "full"):
            raise ValueError(f"sliding_window_kv must be ring or full, got {self.sliding_window_kv!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, float16, bfloat16 or int8, got {self.kv_cache_dtype!r}")
        if self.attention_arithmetic not in ("auto", "float32", "bfloat16"):
            raise ValueError("attention_arithmetic must be auto, float32 or bfloat16, "
                             f"got {self.attention_arithmetic!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if str(self.disk_cache_size).strip().lower() not in ("auto", "off"):
            try:
                if _parse_bytes(str(self.disk_cache_size)) < 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"disk_cache_size must be 0, auto or a size such as 8GiB, got {self.disk_cache_size!r}") from None
        if self.encoder_cache_memory < 0:
            raise ValueError("encoder_cache_memory must be >= 0 (0 = every image encoded each time it is sent)")
        if self.rope_scaling:
            rope_scaling_dict(self.rope_scaling)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


def rope_scaling_dict(text: str) -> dict:
    """--rope-scaling's JSON object, checked (ValueError with the reason)."""
    try:
        scaling = json.loads(text)
    except ValueError:
        raise ValueError(f"rope_scaling must be a JSON object such as '{{\"type\": \"yarn\", \"factor\": 4, "
                         f"\"original_max_position_embeddings\": 32768}}', got {text!r}") from None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a JSON object, got {text!r}")
    rope_scaling_fields(scaling)
    return scaling


def default_num_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field (`model` is positional in most commands, so callers may skip it)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if "bool" in kind:
            parse = _parse_bool
        elif f.name in ("kv_cache_memory", "encoder_cache_memory"):
            parse = _parse_bytes
        elif "int" in kind:
            parse = int
        elif "float" in kind:
            parse = float
        else:
            parse = str
        group.add_argument(flag, dest=f.name, type=parse, default=f.default, help=f"(default: {f.default})")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    values.update(overrides)
    cfg = EngineConfig(**values)
    cfg.validate()
    return cfg
