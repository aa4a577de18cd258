"""Gemma 3 image preprocessing, as the family's image processor defines it by default: the image resized
(bilinear) to the vision tower's fixed size (896 x 896 for the released 4B-27B models, whatever the aspect ratio),
scaled to [0, 1] and normalized by mean and std 0.5, kept as one [channels, height, width] array. Pan-and-scan
(extra crops of a wide image) is off by default in the released checkpoints and is not done here.

In the prompt, each image is the processor's sequence: a blank line, `<start_of_image>`, mm_tokens_per_image
`<image_soft_token>` placeholders, `<end_of_image>`, a blank line. The placeholder text carries one soft token
(special tokens tokenize apart from their neighbours, so the text around it tokenizes as the processor's
expanded text does) and expand() repeats it mm_tokens_per_image times."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from sudu.media.image import ImageInput, expand_placeholders

log = logging.getLogger(__name__)

BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
PLACEHOLDER = f"\n\n{BOI_TOKEN}{IMAGE_TOKEN}{EOI_TOKEN}\n\n"
HALF = (0.5, 0.5, 0.5)
# PIL's resampling filters by the numbers preprocessor_config.json stores
RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
            3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


@dataclass(frozen=True)
class Gemma3Processor:
    image_token_id: int
    tokens_per_image: int = 256
    patch_size: int = 14
    height: int = 896
    width: int = 896
    resample: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF
    placeholder: str = PLACEHOLDER

    @classmethod
    def from_config(cls, preprocessor: dict, image_token_id: int, vision: dict, tokens_per_image: int
                    ) -> "Gemma3Processor":
        """From preprocessor_config.json and the vision tower's config (its image_size wins: the tower's
        position embeddings fix the size it reads)."""
        if preprocessor.get("do_pan_and_scan"):
            log.warning("preprocessor_config.json turns pan-and-scan on; sudu resizes each image whole instead")
        side = vision.get("image_size", 896)
        return cls(
            image_token_id=image_token_id,
            tokens_per_image=tokens_per_image,
            patch_size=vision.get("patch_size", 14),
            height=side,
            width=side,
            resample=int(preprocessor.get("resample", 2)),
            rescale_factor=preprocessor.get("rescale_factor", 1 / 255),
            image_mean=tuple(preprocessor.get("image_mean", HALF)),
            image_std=tuple(preprocessor.get("image_std", HALF)),
        )

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """An RGB image -> float32 [3, height, width]."""
        image = image.resize((self.width, self.height), RESAMPLE.get(self.resample, Image.Resampling.BILINEAR))
        pixels = np.asarray(image).transpose(2, 0, 1)  # C, H, W
        pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
        return np.ascontiguousarray((pixels - mean) / std)

    def image_input(self, image: Image.Image, content_hash: bytes) -> ImageInput:
        grid = (1, self.height // self.patch_size, self.width // self.patch_size)
        return ImageInput(content_hash, torch.from_numpy(self.preprocess(image)), grid,
                          num_tokens=self.tokens_per_image)

    def expand(self, token_ids: list[int], images: list[ImageInput]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with each image's one soft token repeated for its image tokens (image.expand_placeholders)."""
        return expand_placeholders(token_ids, images, self.image_token_id)
