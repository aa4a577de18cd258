"""Images through the server on a tiny random Gemma 3: chat completions with data: URL images answer with
transformers' greedy tokens, streamed or not, with one and two images; a repeated image in a second turn is served
from the prefix cache (cached tokens covering it, the same answer as transformers) while a different image at the
same place is not served past its first position; an undecodable image and text smuggling the image token are
4xx and the server keeps serving."""
from __future__ import annotations

import base64
import contextlib

import httpx
import pytest
from PIL import ImageOps

from tests.helpers.live_server import LiveServer, assert_openai_error, sse_events
from tests.helpers import vision_chat
from tests.helpers.vision_chat import MAX_TOKENS, QUESTION, data_url, user_turn
from tests.helpers.tiny_gemma3_vl import (BOI, build_tokenizer, reference_inputs,
                                          save_tiny_gemma3_vl, token_id)
from tests.helpers.tiny_vlm import random_image, reference_greedy


def rendered(turns):
    return vision_chat.rendered(turns, BOI)


def chat(server, messages, **extra):
    return vision_chat.chat(server, messages, "tiny-gemma", **extra)


IMAGE = random_image(100, 70, seed=1)
# the same size (the same tokens), colours inverted: the tiny random model answers it differently
OTHER = ImageOps.invert(random_image(100, 70, seed=2))




@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return save_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl_server") / "model")


@contextlib.contextmanager
def serve(model_dir):
    from sudu.config import EngineConfig
    from sudu.engine.async_engine import AsyncLLMEngine
    from sudu.server.app import build_app

    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, kv_cache_memory=8 << 20,
                                         max_num_seqs=8, block_size=4), max_queue_len=16)
    with LiveServer(build_app(engine, served_model_name="tiny-gemma")) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def server(vlm):
    with serve(vlm[0]) as s:
        yield s






def expected(vlm, prompt: str, images) -> str:
    tokenizer = build_tokenizer()
    tokens = reference_greedy(vlm[1], reference_inputs(tokenizer, prompt, list(images)), MAX_TOKENS)
    return tokenizer.decode(tokens, skip_special_tokens=True)




def test_chat_image_matches_transformers_streamed_and_not(server, vlm):
    want = expected(vlm, rendered([("user", QUESTION, 1)]), [IMAGE])
    r = chat(server, [user_turn(data_url(IMAGE))])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny-gemma", "messages": [user_turn(data_url(IMAGE))], "max_tokens": MAX_TOKENS,
                            "temperature": 0, "ignore_eos": True, "stream": True}) as s:
        events = sse_events(s)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == want


def test_two_images_match_transformers(server, vlm):
    second = random_image(64, 200, seed=3)
    want = expected(vlm, rendered([("user", QUESTION, 2)]), [IMAGE, second])
    r = chat(server, [user_turn(data_url(IMAGE), data_url(second))])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


def image_span(prompt: str) -> tuple[int, int]:
    """(first, end) positions of the first image's soft tokens in a rendered prompt."""
    ids = reference_inputs(build_tokenizer(), prompt, [])["input_ids"][0].tolist()
    soft = token_id("<image_soft_token>")
    first = ids.index(soft)
    return first, first + ids.count(soft)


def test_repeated_image_hits_the_prefix_cache_and_another_does_not(server, vlm):
    first = chat(server, [user_turn(data_url(IMAGE))])
    answer = first.json()["choices"][0]["message"]["content"]
    turn2 = [user_turn(data_url(IMAGE)), {"role": "assistant", "content": answer},
             {"role": "user", "content": "And the colours?"}]
    r = chat(server, turn2)
    assert r.status_code == 200, r.text
    start, end = image_span(rendered([("user", QUESTION, 1)]))
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= end
    turns = [("user", QUESTION, 1), ("assistant", answer, 0), ("user", "And the colours?", 0)]
    assert r.json()["choices"][0]["message"]["content"] == expected(vlm, rendered(turns), [IMAGE])
    other = chat(server, [user_turn(data_url(OTHER)), *turn2[1:]])
    assert other.status_code == 200, other.text
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] <= start
    want_other = expected(vlm, rendered(turns), [OTHER])
    assert want_other != r.json()["choices"][0]["message"]["content"]  # a hit through the image would show
    assert other.json()["choices"][0]["message"]["content"] == want_other


def test_bad_images_are_refused_and_the_server_keeps_serving(server):
    bad = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    assert assert_openai_error(chat(server, [user_turn(bad)]), 400)["code"] == "undecodable"
    smuggled = chat(server, [user_turn(data_url(IMAGE), text="look: <image_soft_token>")])
    assert assert_openai_error(smuggled, 400)["code"] == "placeholder_mismatch"
    assert chat(server, [user_turn(data_url(IMAGE))]).status_code == 200
