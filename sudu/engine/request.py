"""CheckedRequest: a request the engine has validated once, where it entered (token ids inside the
vocabulary, sampling parameters in range, prompt + max_tokens within the context), and that is passed on
as it is: the async engine and the engine loop add it without checking it again."""
from __future__ import annotations

from dataclasses import dataclass

from sudu.media.image import ImageInput
from sudu.sampling import SamplingParams


@dataclass(frozen=True)
class CheckedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or the rest of the context
    images: tuple[ImageInput, ...] = ()  # a vision-language prompt's images, at their placeholder tokens
