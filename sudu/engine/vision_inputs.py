"""A vision-language model's part of each step: the embeddings of the images whose tokens the step runs (from the
encoder cache, keyed by the image's content hash, or encoded now, one call to the vision tower per image, before
the forward pass that reads them), the rows those embeddings replace, every row's position (multimodal rotary
for Qwen2.5-VL, plain for Gemma 3), and for a model whose image tokens attend to each other both ways (Gemma 3)
each image's span of positions, which the attention metadata widens those rows' masks to and the scheduler keeps
whole within a chunk. An image's embeddings are computed whole, whatever chunk of its tokens a step runs, so
chunking and caching leave the numbers unchanged."""
from __future__ import annotations

import time

import torch

from sudu.engine.image_encoding import EncoderCache, ImageEncoder, encode_allowance
from sudu.media.image import ImageInput


def check_images(token_ids: list[int], images, image_token_id: int | None, has_vision: bool) -> None:
    """ValueError unless the model takes images and each image's run of placeholder tokens is in the prompt."""
    if not has_vision:
        raise ValueError("this model takes no images (it has no vision encoder)")
    for image in images:
        run = token_ids[image.offset:image.offset + image.num_tokens]
        if image.num_tokens < 1 or len(run) != image.num_tokens or any(t != image_token_id for t in run):
            raise ValueError(f"the prompt has no run of {image.num_tokens} image tokens at {image.offset}")


def step_range(s) -> tuple[int, int]:
    """The prompt positions a scheduled sequence runs this step."""
    start = s.seq.num_computed_tokens
    return start, start + s.num_new_tokens


def overlaps(image: ImageInput, start: int, end: int) -> bool:
    return image.offset < end and image.offset + image.num_tokens > start


class VisionInputs:
    def __init__(self, model: torch.nn.Module, cache_bytes: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.cache = EncoderCache(cache_bytes)
        self.encoder = ImageEncoder(model, self.cache, device, dtype)  # images encoded ahead, between steps
        self.mrope = getattr(model, "POSITION_AXES", 1) == 3
        self.bidirectional = getattr(model, "BIDIRECTIONAL_IMAGES", False)

    def attach(self, seq, images: tuple[ImageInput, ...]) -> None:
        """A new sequence's images, the multimodal rotary positions of its prompt, and the spans a prompt chunk
        must not end inside."""
        seq.images = images
        if images and self.mrope:
            seq.mrope = self.model.prompt_positions(seq.num_prompt_tokens, images)
        if self.bidirectional:
            seq.image_spans = tuple((image.offset, image.offset + image.num_tokens) for image in images)

    def image_spans(self, scheduled) -> list[list[tuple[int, int]]] | None:
        """Per scheduled sequence, the spans of its images with tokens in this step whose tokens attend both
        ways; None when no sequence has one."""
        if not self.bidirectional:
            return None
        out = []
        for s in scheduled:
            start, end = step_range(s)
            out.append([(a, b) for a, b in s.seq.image_spans if a < end and b > start])
        return out if any(out) else None

    def embeddings(self, scheduled, device: torch.device, dtype: torch.dtype) -> dict[bytes, torch.Tensor]:
        """content hash -> [num_tokens, hidden] for every image with tokens in this step."""
        needed: dict[bytes, ImageInput] = {}
        for s in scheduled:
            start, end = step_range(s)
            for image in s.seq.images:
                if overlaps(image, start, end):
                    needed.setdefault(image.content_hash, image)
        out, missing = {}, []
        for key, image in needed.items():
            embeds = self.cache.get(key)
            if embeds is None:
                missing.append(image)
            else:
                out[key] = embeds
        self.cache.hits += len(out)
        self.cache.misses += len(missing)
        for image in missing:  # one call per image: its embeddings never depend on what else is encoded with it
            embeds = self.encoder.finished(image.content_hash)  # encoded ahead, between steps
            if embeds is None:
                t0 = time.perf_counter()
                embeds = self.model.encode_images(image.pixel_values.to(device, dtype), [image.grid_thw])
                self.cache.encode_s += time.perf_counter() - t0
            out[image.content_hash] = embeds
            self.cache.put(image.content_hash, embeds)
        for s in scheduled:  # an image read to its end this step is held by the cache alone from now on
            start, end = step_range(s)
            for image in s.seq.images:
                if overlaps(image, start, end) and image.offset + image.num_tokens <= end:
                    self.encoder.release(image.content_hash)
        return out

    def encode_ahead(self, scheduler) -> None:
        """Before a step: start encoding the images of queued and running sequences that are not ready, and
        run their tower blocks for this step's allowance (image_encoding.py)."""
        self.encoder.start(scheduler.running + scheduler.waiting)
        if self.encoder.jobs:
            self.encoder.advance(encode_allowance(scheduler))

    def image_rows(self, scheduled, embeddings: dict[bytes, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's flat batch that are image tokens, their embeddings), or None."""
        rows, parts, base = [], [], 0
        for s in scheduled:
            start, end = step_range(s)
            for image in s.seq.images:
                if overlaps(image, start, end):
                    lo, hi = max(start, image.offset), min(end, image.offset + image.num_tokens)
                    rows.append(torch.arange(base + lo - start, base + hi - start))
                    parts.append(embeddings[image.content_hash][lo - image.offset:hi - image.offset])
            base += s.num_new_tokens
        if not rows:
            return None
        return torch.cat(rows), torch.cat(parts)

    def positions(self, scheduled) -> torch.Tensor:
        """Every row's (temporal, height, width) position: [3, rows]. Text rows past the prompt's images are
        shifted as the prompt's last image left them; a sequence without images has plain positions. A model
        without multimodal rotary: every row's plain position [rows]."""
        if not self.mrope:
            return torch.cat([torch.arange(*step_range(s)) for s in scheduled])
        parts = []
        for s in scheduled:
            start, end = step_range(s)
            if s.seq.mrope is None:
                parts.append(torch.arange(start, end).expand(3, end - start))
                continue
            table, shift = s.seq.mrope
            n = table.shape[1]
            if start < n:
                parts.append(table[:, start:min(end, n)])
            if end > n:
                later = torch.arange(max(start, n), end) + shift
                parts.append(later.expand(3, later.shape[0]))
        return torch.cat(parts, dim=1)
