"""Images through the server on a tiny random Qwen2.5-VL: chat completions (data: URLs and an allowed http URL),
Anthropic Messages image blocks and Responses input_image answer with transformers' greedy tokens, streamed or
not; every refused image (a model without vision, undecodable bytes, too many bytes or pixels, too many images, a
forbidden URL) is a 4xx in the asking API's shape and the server keeps serving; a repeated image is served from
the encoder cache and, in a second turn, from the prefix cache (cached tokens covering it, the same answer),
while a different image at the same place is never served past its position."""
from __future__ import annotations

import base64
import contextlib
import http.server
import threading

import httpx
import pytest

from tests.helpers.live_server import LiveServer, assert_openai_error, sse_events
from tests.helpers import vision_chat
from tests.helpers.vision_chat import MAX_TOKENS, QUESTION, data_url, user_turn
from tests.helpers.tiny_vlm import (PLACEHOLDER, build_vl_tokenizer, png_bytes, random_image, reference_greedy,
                                    reference_inputs, save_tiny_vlm, token_id)


def rendered(turns):
    return vision_chat.rendered(turns, PLACEHOLDER)


def chat(server, messages, **extra):
    return vision_chat.chat(server, messages, "tiny-vl", **extra)


IMAGE = random_image(100, 70, seed=1)  # 8 image tokens
OTHER = random_image(100, 70, seed=2)  # the same size: the same tokens, other pixels




@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl_server") / "model")


@pytest.fixture(scope="module")
def image_host():
    """A local http server with the test image at /image.png (fetched only where allowed)."""
    body = png_bytes(IMAGE)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/image.png"
    server.shutdown()


@contextlib.contextmanager
def serve(model_dir, **media):
    from sudu.config import EngineConfig
    from sudu.engine.async_engine import AsyncLLMEngine
    from sudu.media.limits import ImageLimits
    from sudu.server.app import build_app
    from sudu.server.media_input import MediaPolicy

    policy = MediaPolicy(media.pop("allowed_domains", ()), ImageLimits(**media))
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, kv_cache_memory=8 << 20,
                                         max_num_seqs=8), max_queue_len=16)
    with LiveServer(build_app(engine, served_model_name="tiny-vl", media=policy)) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def server(vlm, image_host):
    with serve(vlm[0], allowed_domains=("127.0.0.1",), max_pixels=300 * 300, max_images=3) as s:
        yield s






def expected(vlm, prompt: str, images) -> str:
    """transformers' greedy answer to the rendered prompt, decoded as the server decodes."""
    tokenizer = build_vl_tokenizer()
    tokens = reference_greedy(vlm[1], reference_inputs(tokenizer, prompt, list(images)), MAX_TOKENS)
    return tokenizer.decode(tokens, skip_special_tokens=True)




def test_chat_image_matches_transformers_streamed_and_not(server, vlm):
    want = expected(vlm, rendered([("user", QUESTION, 1)]), [IMAGE])
    r = chat(server, [user_turn(data_url(IMAGE))])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == want
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny-vl", "messages": [user_turn(data_url(IMAGE))], "max_tokens": MAX_TOKENS,
                            "temperature": 0, "ignore_eos": True, "stream": True}) as s:
        events = sse_events(s)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == want


def test_two_images_and_a_fetched_url(server, vlm, image_host):
    second = random_image(64, 200, seed=3)
    want = expected(vlm, rendered([("user", QUESTION, 2)]), [IMAGE, second])
    r = chat(server, [user_turn(image_host, data_url(second))])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


def test_messages_and_responses_take_images(server, vlm):
    want = chat(server, [user_turn(data_url(IMAGE))], ignore_eos=False).json()["choices"][0]["message"]["content"]
    png = base64.b64encode(png_bytes(IMAGE)).decode()
    r = httpx.post(server.url + "/v1/messages", timeout=120, json={
        "model": "tiny-vl", "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
            {"type": "text", "text": QUESTION}]}]})
    assert r.status_code == 200, r.text
    assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == want
    r = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "model": "tiny-vl", "max_output_tokens": MAX_TOKENS, "temperature": 0, "store": False,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMAGE)},
                                               {"type": "input_text", "text": QUESTION}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == want


BAD = [
    ("undecodable", "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), 400),
    ("too_large", data_url(random_image(400, 300, seed=4)), 413),
    ("forbidden_url", "http://example.com/cat.png", 403),
    ("forbidden_url", "file:///etc/passwd", 400),
]


@pytest.mark.parametrize("code,url,status", BAD)
def test_bad_images_are_refused_and_the_server_keeps_serving(server, code, url, status):
    error = assert_openai_error(chat(server, [user_turn(url)]), status)
    assert error["code"] == code
    assert chat(server, [user_turn(data_url(IMAGE))]).status_code == 200


def test_text_cannot_smuggle_image_tokens(server):
    """A text part holding the placeholder token itself: the prompt's placeholders no longer match the images."""
    r = chat(server, [user_turn(data_url(IMAGE), text="look: <|image_pad|>")])
    assert assert_openai_error(r, 400)["code"] == "placeholder_mismatch"
    assert chat(server, [user_turn(data_url(IMAGE))]).status_code == 200


def test_too_many_images_in_each_api_shape(server):
    urls = [data_url(IMAGE)] * 4
    assert assert_openai_error(chat(server, [user_turn(*urls)]), 400)["code"] == "too_many"
    png = base64.b64encode(png_bytes(IMAGE)).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "tiny-vl", "max_tokens": 4, "messages": [{"role": "user", "content": [block] * 4}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert chat(server, [user_turn(data_url(IMAGE))]).status_code == 200


def test_a_model_without_vision_refuses_images(tiny_model_dirs):
    with serve(tiny_model_dirs["qwen2"]) as s:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-vl", "messages": [user_turn(data_url(IMAGE))], "max_tokens": 2})
        assert assert_openai_error(r, 400)["code"] == "no_vision"
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-vl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200


def image_span(prompt: str) -> tuple[int, int]:
    """(first, end) positions of the first image's tokens in a rendered prompt (one 8-token image)."""
    ids = build_vl_tokenizer()(prompt, add_special_tokens=False)["input_ids"]
    first = ids.index(token_id("<|image_pad|>"))
    return first, first + 8


def test_repeated_image_hits_the_encoder_and_prefix_caches(vlm):
    with serve(vlm[0]) as s:
        vision = s.engine.engine.runner.vision
        first = chat(s, [user_turn(data_url(IMAGE))])
        answer = first.json()["choices"][0]["message"]["content"]
        misses = vision.cache.misses
        turn2 = [user_turn(data_url(IMAGE)), {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And the colours?"}]
        r = chat(s, turn2)
        assert r.status_code == 200, r.text
        start, end = image_span(rendered([("user", QUESTION, 1)]))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= end
        want = expected(vlm, rendered([("user", QUESTION, 1), ("assistant", answer, 0),
                                       ("user", "And the colours?", 0)]), [IMAGE])
        assert r.json()["choices"][0]["message"]["content"] == want
        # the whole image was served from the prefix cache; asked again with new text after it, from the
        # encoder cache: no encode either time
        again = chat(s, [user_turn(data_url(IMAGE), text="Something else entirely, please.")])
        assert again.status_code == 200
        assert vision.cache.misses == misses
        # another image in the same place: nothing cached past the image's first position, and its own answer
        other = chat(s, [user_turn(data_url(OTHER)), *turn2[1:]])
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] <= start
        assert vision.cache.misses == misses + 1
        metrics = httpx.get(s.url + "/metrics").text
        assert f"sudu:encoder_cache_misses_total {float(misses + 1)}" in metrics
        assert f"sudu:encoder_cache_hits_total {float(vision.cache.hits)}" in metrics
        want_other = expected(vlm, rendered([("user", QUESTION, 1), ("assistant", answer, 0),
                                             ("user", "And the colours?", 0)]), [OTHER])
        assert other.json()["choices"][0]["message"]["content"] == want_other
