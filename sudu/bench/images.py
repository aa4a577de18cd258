"""The images sudu bench sends: generated with Pillow at set sizes, deterministic from a seed, and salted per
request where a fresh image is wanted. A picture of a given size and seed is always the same screenshot-like
scene (gradient background, coloured boxes, text lines, a little noise, so that resizing and PNG decoding do
real work); the salt changes a strip of pixels in its corner, so two salts give two different images (two
content hashes, two encoder-cache keys) of the same cost."""
from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from sudu.errors import SuduError

SALT_PIXELS = 16  # the corner strip the salt writes: 16 pixels x 3 channels = the 48 bytes of two digests


@dataclass(frozen=True)
class BenchImage:
    width: int
    height: int
    png: bytes
    digest: str  # sha256 of the PNG bytes, first 16 hex: what the report records of the image

    @property
    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode()

    def record(self) -> dict:
        return {"width": self.width, "height": self.height, "png_bytes": len(self.png), "sha256_16": self.digest}


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """`448x448,1024x768` -> [(448, 448), (1024, 768)] (width x height)."""
    sizes = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        w, sep, h = part.lower().partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or not (16 <= int(w) <= 8192 and 16 <= int(h) <= 8192):
            raise SuduError(f"bad image size {part!r}: expected WIDTHxHEIGHT, each 16..8192 (e.g. 448x448)")
        sizes.append((int(w), int(h)))
    if not sizes:
        raise SuduError("give at least one image size (e.g. --sizes 448x448,1024x768)")
    return sizes


@lru_cache(maxsize=8)
def _scene(width: int, height: int, seed: int) -> np.ndarray:
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, width, height])
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    tint = rng.uniform(0, 255, 3)
    base = np.stack([x * 180 / width + tint[0] * 0.3, y * 180 / height + tint[1] * 0.3,
                     (x + y) * 90 / (width + height) + tint[2] * 0.3], -1)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(12):  # windows and panels
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1, y1 = min(width, x0 + rng.integers(width // 16, width // 3)), min(height, y0 + rng.integers(height // 16, height // 3))
        draw.rectangle([int(x0), int(y0), int(x1), int(y1)], fill=tuple(int(c) for c in rng.integers(0, 256, 3)),
                       outline=(0, 0, 0))
    for row in range(8, height - 12, max(14, height // 24)):  # lines of "text"
        draw.text((8, row), f"line {row}: value={int(rng.integers(0, 10**6))} ok", fill=(20, 20, 20))
    pixels = np.asarray(img, dtype=np.int16) + rng.normal(0, 6, (height, width, 3)).astype(np.int16)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def make_image(width: int, height: int, seed: int = 0, salt: str | None = None) -> BenchImage:
    """The scene of (width, height, seed); with `salt`, its corner strip set from the salt's digest (a different
    image per salt, the same for the same salt)."""
    from PIL import Image

    pixels = _scene(width, height, seed)
    if salt is not None:
        pixels = pixels.copy()
        digest = hashlib.sha256(salt.encode()).digest() + hashlib.sha256(b"2" + salt.encode()).digest()[:16]
        strip = np.frombuffer(digest, dtype=np.uint8).reshape(SALT_PIXELS, 3)
        n = min(SALT_PIXELS, width)
        pixels[0, :n] = strip[:n]
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG", compress_level=1)
    png = out.getvalue()
    return BenchImage(width, height, png, hashlib.sha256(png).hexdigest()[:16])
