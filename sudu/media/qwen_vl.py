"""Qwen2-VL / Qwen2.5-VL image preprocessing, as the family's image processor defines it: the image resized
(bicubic) to the nearest size whose sides are multiples of patch_size x merge_size with its pixel count within
[min_pixels, max_pixels] (smart_resize), scaled to [0, 1], normalized by the CLIP mean and std, and cut into
(patches, channels x temporal_patch_size x patch_size x patch_size) rows, merge_size x merge_size groups of
patches adjacent (the order the vision tower's patch merger reads). A still image is its own frame repeated
temporal_patch_size times. In the prompt, each image is `<|vision_start|><|image_pad|><|vision_end|>` with the
pad token repeated once per merged patch (grid_t x grid_h x grid_w / merge_size^2)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from sudu.media.image import ImageInput, MediaError, expand_placeholders

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of factor, scaled to keep the pixel count within the bounds and the
    aspect ratio as close as it can."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f} is over "
                         f"{MAX_ASPECT_RATIO}", "undecodable")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLProcessor:
    image_token_id: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    placeholder: str = PLACEHOLDER

    @classmethod
    def from_config(cls, preprocessor: dict, image_token_id: int, vision: dict) -> "QwenVLProcessor":
        """From preprocessor_config.json (min/max_pixels, or the newer size.shortest_edge/longest_edge) and the
        vision tower's config (its patch, temporal patch and merge sizes win where both name them)."""
        size = preprocessor.get("size") or {}
        return cls(
            image_token_id=image_token_id,
            patch_size=vision.get("patch_size", preprocessor.get("patch_size", 14)),
            temporal_patch_size=vision.get("temporal_patch_size", preprocessor.get("temporal_patch_size", 2)),
            merge_size=vision.get("spatial_merge_size", preprocessor.get("merge_size", 2)),
            min_pixels=preprocessor.get("min_pixels") or size.get("shortest_edge") or 56 * 56,
            max_pixels=preprocessor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280,
            rescale_factor=preprocessor.get("rescale_factor", 1 / 255),
            image_mean=tuple(preprocessor.get("image_mean", CLIP_MEAN)),
            image_std=tuple(preprocessor.get("image_std", CLIP_STD)),
        )

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.merge_size ** 2)

    def preprocess(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """An RGB image -> (pixel patches float32 [patches, C * T * P * P], (grid_t, grid_h, grid_w))."""
        height, width = self.resized_size(*image.size)
        image = image.resize((width, height), Image.Resampling.BICUBIC)
        pixels = np.asarray(image).transpose(2, 0, 1)  # C, H, W
        pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        c = pixels.shape[0]
        grid_h, grid_w = height // p, width // p
        patches = pixels.reshape(c, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        return np.ascontiguousarray(patches.reshape(grid_h * grid_w, c * t * p * p)), (1, grid_h, grid_w)

    def image_input(self, image: Image.Image, content_hash: bytes) -> ImageInput:
        pixels, grid = self.preprocess(image)
        return ImageInput(content_hash, torch.from_numpy(pixels), grid, num_tokens=self.num_tokens(grid))

    def expand(self, token_ids: list[int], images: list[ImageInput]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with each image's one pad token repeated for its image tokens (image.expand_placeholders)."""
        return expand_placeholders(token_ids, images, self.image_token_id)
