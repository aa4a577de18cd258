"""Which image preprocessing a model takes: one per vision-language family, from the checkpoint's config and its
preprocessor_config.json; None for a text-only model."""
from __future__ import annotations

from sudu.media.gemma3_vl import Gemma3Processor
from sudu.media.qwen_vl import QwenVLProcessor
from sudu.model_config import ModelConfig


def image_processor(cfg: ModelConfig, preprocessor: dict | None) -> QwenVLProcessor | Gemma3Processor | None:
    if cfg.vision_config is None:
        return None
    if cfg.architecture == "qwen2_5_vl":
        return QwenVLProcessor.from_config(preprocessor or {}, cfg.image_token_id, cfg.vision_config)
    if cfg.architecture == "gemma3_vl":
        return Gemma3Processor.from_config(preprocessor or {}, cfg.image_token_id, cfg.vision_config,
                                           cfg.mm_tokens_per_image)
    return None
