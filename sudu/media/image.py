"""An image from a request's bytes: decoded with Pillow under byte and pixel limits, converted to RGB, and named
by its content hash (what the encoder cache and the prefix cache's block ids key on). Every refusal is a
MediaError whose `kind` says which limit or check failed, so each API can answer in its own error shape."""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image, UnidentifiedImageError

from sudu.media.limits import ImageLimits

if TYPE_CHECKING:
    import torch


class MediaError(ValueError):
    """A refused image. kind: "undecodable", "too_large", "too_many", "forbidden_url", "fetch_failed",
    "no_vision", "placeholder_mismatch"; status: the HTTP status it maps to."""

    def __init__(self, message: str, kind: str, status: int = 400):
        super().__init__(message)
        self.kind = kind
        self.status = status


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, preprocessed: its content hash, its pixel patches and grid, and the run of
    placeholder tokens its embeddings replace (prompt positions offset .. offset + num_tokens - 1)."""

    content_hash: bytes
    pixel_values: torch.Tensor  # float32 [grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size^2]
    grid_thw: tuple[int, int, int]
    offset: int = 0
    num_tokens: int = 0


def content_hash(data: bytes) -> bytes:
    """The 16-byte identity of an image: blake2b of its encoded bytes."""
    return hashlib.blake2b(data, digest_size=16).digest()


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """The RGB image in `data`, or MediaError: too many bytes, too many pixels (read from the header, before
    any pixel is decoded), or not an image Pillow can read."""
    if len(data) > limits.max_bytes:
        raise MediaError(f"the image has {len(data)} bytes; the limit is {limits.max_bytes}", "too_large", 413)
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > limits.max_pixels:
            raise MediaError(f"the image is {width}x{height} = {width * height} pixels; the limit is "
                             f"{limits.max_pixels}", "too_large", 413)
        image.load()
        return image.convert("RGB")
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"the image cannot be decoded: {exc}", "undecodable") from None


def expand_placeholders(token_ids: list[int], images: list[ImageInput], image_token_id: int
                        ) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt with each image's one placeholder token repeated num_tokens times, and the images with their
    offsets in it. The rendered prompt must hold exactly one placeholder per image, in order."""
    at = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(at) != len(images):
        raise MediaError(f"the rendered prompt holds {len(at)} image placeholders for {len(images)} images "
                         "(the chat template or the text dropped or added one)", "placeholder_mismatch")
    out: list[int] = []
    placed = []
    start = 0
    for pos, image in zip(at, images):
        out.extend(token_ids[start:pos])
        placed.append(ImageInput(image.content_hash, image.pixel_values, image.grid_thw, len(out), image.num_tokens))
        out.extend([image_token_id] * image.num_tokens)
        start = pos + 1
    out.extend(token_ids[start:])
    return out, tuple(placed)
