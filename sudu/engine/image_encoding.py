"""Images encoded a tower stage at a time between steps, so that decoding streams keep their inter-token
latency while a new request's image is encoded.

Every image that a queued or running sequence still has to compute, and that the encoder cache does not hold,
gets a job: the model's `encode_stages` (layers/vision.py), advanced one stage (a tower block's attention, or
its MLP) at a time, oldest job first. Before each step the engine gives the jobs an allowance of time: while
sequences decode, what a prompt chunk gets beside them (`--max-itl-factor` - 1 decode steps, the scheduler's
ChunkBudget), at least one stage so that an encoding always advances; while nothing decodes, all the time they
need (no stream's latency to keep, so the image is ready for the step that reads it). A prompt chunk stops
before an image whose embeddings are not ready (the scheduler asks `ready`); the text before it goes on.

The stages are the very computation of one call (`encode_images` runs them back to back), so an image's
embeddings are the same bits however its encoding was spread over steps.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

from sudu.layers.vision import EncodeStages
from sudu.media.image import ImageInput


class EncoderCache:
    """Image embeddings by content hash, least recently used evicted past max_bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0
        self.encode_s = 0.0  # seconds spent in the vision tower

    def get(self, key: bytes) -> torch.Tensor | None:
        embeds = self.entries.get(key)
        if embeds is not None:
            self.entries.move_to_end(key)
        return embeds

    def put(self, key: bytes, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes or key in self.entries:
            return
        self.entries[key] = embeds
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()

    def stats(self) -> dict:
        return {"encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses,
                "encoder_cache_bytes": self.num_bytes, "encoder_seconds": self.encode_s}


def pending_images(seq) -> list[ImageInput]:
    """The images of seq whose tokens it has not all computed yet."""
    return [image for image in seq.images if image.offset + image.num_tokens > seq.num_computed_tokens]


class ImageEncoder:
    def __init__(self, model: torch.nn.Module, cache: EncoderCache, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.cache = cache
        self.device, self.dtype = device, dtype
        self.jobs: OrderedDict[bytes, EncodeStages] = OrderedDict()
        # finished embeddings, kept until a step reads them: the cache may not hold them (full, or size 0)
        self.done: dict[bytes, torch.Tensor] = {}
        self.stages_run = 0  # tower stages run in jobs (evidence that the encoding was spread)

    def ready(self, image: ImageInput) -> bool:
        return image.content_hash in self.done or image.content_hash in self.cache.entries

    def finished(self, key: bytes) -> torch.Tensor | None:
        """A finished job's embeddings (the caller reads the cache first)."""
        return self.done.get(key)

    def release(self, key: bytes) -> None:
        """A step has read the image to its end: its embeddings need not be held beyond the cache."""
        self.done.pop(key, None)

    def start(self, sequences) -> None:
        """A job for every image of these sequences that is still to compute and neither ready nor started;
        jobs and held embeddings that none of them needs any more (aborted requests) are dropped."""
        needed = {}
        for seq in sequences:
            for image in pending_images(seq):
                needed.setdefault(image.content_hash, image)
        for key in [k for k in self.jobs if k not in needed]:
            del self.jobs[key]
        for key in [k for k in self.done if k not in needed]:
            del self.done[key]
        for key, image in needed.items():
            if key not in self.jobs and not self.ready(image):
                pixels = image.pixel_values.to(self.device, self.dtype)
                self.jobs[key] = self.model.encode_stages(pixels, [image.grid_thw])

    def advance(self, allowance_s: float | None) -> None:
        """Run the jobs' stages, oldest job first, until allowance_s has passed (at least one stage), or
        every job has finished (allowance_s None)."""
        start = time.perf_counter()
        while self.jobs:
            key, stages = next(iter(self.jobs.items()))
            try:
                next(stages)
                self.stages_run += 1
            except StopIteration as finished:
                del self.jobs[key]
                self.done[key] = finished.value
            if allowance_s is not None and time.perf_counter() - start >= allowance_s:
                break
        self.cache.encode_s += time.perf_counter() - start


def encode_allowance(scheduler) -> float | None:
    """Seconds of encoding before this step: None (no limit) while nothing decodes or before a decode-only
    step has been timed; otherwise the time a prompt chunk may add to a decode step."""
    budget = scheduler.chunk_budget
    decoding = sum(1 for s in scheduler.running if s.num_uncomputed_tokens == 1)
    if not decoding or budget.decode_s is None:
        return None
    return max(budget.itl_factor - 1.0, 0.0) * budget.decode_step_s(decoding)
