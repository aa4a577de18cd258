"""Images in chat requests, at the edge: each OpenAI `image_url` part is fetched (media/fetch.py: data: URLs, or
http(s) from --allowed-media-domains only), decoded and checked against the byte and pixel limits
(media/image.py), preprocessed for the served model (its image processor), and replaced in the message by the
model's placeholder text, which the chat template renders like any text and the processor then expands into one
token per image embedding. The Messages and Responses APIs turn their image blocks into such parts first. Each
refusal is an APIError with the status its MediaError names, answered in the asking API's own shape."""
from __future__ import annotations

from dataclasses import dataclass, field

from sudu.media.fetch import fetch_url
from sudu.media.image import ImageInput, MediaError, content_hash, decode_image
from sudu.media.limits import ImageLimits
from sudu.server.errors import APIError

IMAGE_PART = "image_url"


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()  # hosts (and their subdomains) images may be fetched from; none: data: only
    limits: ImageLimits = field(default_factory=ImageLimits)


def media_error(exc: MediaError, param: str) -> APIError:
    return APIError(exc.status, str(exc), type="invalid_request_error", param=param, code=exc.kind)


def count_images(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == IMAGE_PART)


def first_image(messages: list[dict]) -> str:
    """Where the first image part is, as a param path."""
    return next(f"messages.{i}.content.{j}.image_url" for i, m in enumerate(messages)
                if isinstance(m.get("content"), list)
                for j, part in enumerate(m["content"]) if isinstance(part, dict) and part.get("type") == IMAGE_PART)


def take_images(messages: list[dict], processor, policy: MediaPolicy) -> tuple[list[dict], list[ImageInput]]:
    """The messages with every image part replaced by a text part holding the processor's placeholder, and the
    images preprocessed, in prompt order. Raises APIError (the image's own MediaError status) on a model
    without vision, too many images, a forbidden URL, too many bytes or pixels, or bytes that are no image."""
    total = count_images(messages)
    if not total:
        return messages, []
    if processor is None:
        raise media_error(MediaError("this model takes text only: it has no vision encoder for images", "no_vision"),
                          first_image(messages))
    if total > policy.limits.max_images:
        raise media_error(MediaError(f"the request has {total} images; the limit is {policy.limits.max_images}",
                                     "too_many"), "messages")
    images, out = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != IMAGE_PART:
                parts.append(part)
                continue
            where = f"messages.{i}.content.{j}.image_url"
            try:
                data = fetch_url(part[IMAGE_PART]["url"], policy.allowed_domains, policy.limits.max_bytes)
                image = decode_image(data, policy.limits)
                images.append(processor.image_input(image, content_hash(data)))
            except MediaError as exc:
                raise media_error(exc, where) from None
            parts.append({"type": "text", "text": processor.placeholder})
        out.append(dict(message, content=parts))
    return out, images
