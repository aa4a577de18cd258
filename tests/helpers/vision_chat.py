"""Chat requests with images against a live server, for both vision families' server tests: the user turn with
image parts, the prompt sudu renders for it (each image part a placeholder line before the text), and the call."""
from __future__ import annotations

import base64

import httpx

from tests.helpers.tiny_vlm import png_bytes

MAX_TOKENS = 8
QUESTION = "Describe it."


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def user_turn(*images, text=QUESTION) -> dict:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in images),
                                        {"type": "text", "text": text}]}


def rendered(turns: list[tuple[str, str, int]], placeholder: str) -> str:
    """The prompt sudu renders for (role, text, images) turns, each image part `placeholder` on a line of its own
    before the text (what the family's processor expands)."""
    out = ""
    for role, text, images in turns:
        out += f"<|im_start|>{role}\n" + "\n".join([placeholder] * images + [text]) + "<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


def chat(server, messages, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
