"""One sequence's state: its tokens, how many of them have KV in the pool, its block table, and the
text it has produced so far (with stop strings held back until they can no longer match)."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from sudu.engine.outputs import TokenLogprob
from sudu.engine.schedule_policy import is_continuing, order_key
from sudu.sampling import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # choice index within its request
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    params: SamplingParams
    priority: int
    arrival_time: float
    max_total_tokens: int  # prompt + the most tokens it may generate
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    sliding_block_table: list[int | None] = field(default_factory=list)  # sliding-window layers' blocks
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at first admission
    num_cached_tokens_disk: int = 0  # of those, loaded from the disk tier
    block_hashes: list[bytes] = field(default_factory=list)  # ids of its leading full blocks (memo)
    disk_hit_tokens: int = 0  # tokens the latest prefix match loaded from disk
    disk_load_s: float = 0.0  # seconds spent loading its blocks from disk
    generator: torch.Generator | None = None
    seed: int = 0  # the device sampler's draws are a function of it and the draw index (layers/device_sampler.py)
    grammar: object = None  # its llguidance matcher when params.grammar is set (sudu/structured/)
    # text bookkeeping (engine side)
    detokenizer: object = None
    pending_text: str = ""  # decoded but held back: could still be the start of a stop string
    new_text: str = ""  # ready to emit at the next output
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    held_back: bool = False  # n > 1 siblings wait until the first choice's prompt is in the cache
    num_cached_at_arrival: int = 0  # prompt tokens the context cache held when it arrived (an estimate)
    images: tuple = ()  # the prompt's images (media.image.ImageInput), in prompt order
    # multimodal rotary: (positions [3, num_prompt_tokens], the shift of every later token's position)
    mrope: tuple | None = None
    # position spans [a, b) of images whose tokens attend to each other both ways (Gemma 3): a prompt chunk
    # never ends inside one (scheduler.py keep_images_whole)
    image_spans: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def continuing(self) -> bool:
        """A continuing session's turn: most of its prompt was cached when it arrived."""
        return is_continuing(self.num_cached_at_arrival, self.num_prompt_tokens)

    def order_key(self, now: float, aging_s: float) -> tuple:
        """Smaller goes first: priority (lower value = more urgent) with its class and aging
        (engine/schedule_policy.py), then arrival."""
        return order_key(self.priority, self.continuing, self.arrival_time, self.seq_id, now, aging_s)
