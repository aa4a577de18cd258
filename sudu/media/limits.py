"""The limits on a request's images, with their defaults (no imports: `sudu serve`'s flags read them at start)."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_IMAGE_BYTES = 10 << 20
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGES = 16  # per request


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height of the decoded image
    max_images: int = DEFAULT_MAX_IMAGES  # per request
