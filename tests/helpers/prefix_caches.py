"""Fake servers with an ideal prefix cache, for the bench's tests: the cached tokens each request would get
from a perfect cache, reported in usage as a real server reports its hits."""
import os

from sudu.bench.fake_server import chat_script

CACHE_BLOCK = 16


class PrefixCache:
    """An unbounded prefix cache over word tokens (the synthesized prompts' tokens), in 16-token blocks:
    cached = the longest block-aligned prefix some earlier prompt had."""

    def __init__(self, answer_s: float = 0.005):
        self.seen: set = set()
        self.answer_s = answer_s

    def __call__(self, body):
        prompt = body.get("prompt")
        if prompt is None:
            prompt = "".join(m["content"] for m in body.get("messages") or body.get("input") or [])
        words = prompt.split(" ")[1:]  # every word is led by a space
        h, cached, hit = 0, 0, True
        for k in range(0, len(words) // CACHE_BLOCK * CACHE_BLOCK, CACHE_BLOCK):
            h = hash((h, tuple(words[k:k + CACHE_BLOCK])))
            if hit and h in self.seen:
                cached = k + CACHE_BLOCK
            else:
                hit = False
            self.seen.add(h)
        n = body.get("max_tokens") or body.get("max_output_tokens") or 4
        usage = {"prompt_tokens": len(words), "completion_tokens": n, "total_tokens": len(words) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        pieces = [(self.answer_s * (i + 1) / n, " x") for i in range(n)]
        return chat_script(pieces, usage=usage, model=body.get("model", "fake"))


class PrefixCacheServer:
    """An ideal prefix cache in front of a fake model: a prompt's tokens are its characters / 4, its cached
    tokens the longest prefix shared with any earlier prompt."""

    def __init__(self):
        self.seen: list[str] = []
        self.order: list[tuple[str, int]] = []  # (system prompt head, turn) in arrival order

    def __call__(self, body):
        text = "".join(m["role"] + m["content"] for m in body["messages"])
        best = max((len(os.path.commonprefix([text, s])) for s in self.seen), default=0)
        self.seen.append(text)
        turns = sum(m["role"] == "assistant" for m in body["messages"]) + 1
        self.order.append((body["messages"][0]["content"][:34], turns))
        usage = {"prompt_tokens": len(text) // 4, "completion_tokens": 3, "total_tokens": len(text) // 4 + 3,
                 "prompt_tokens_details": {"cached_tokens": best // 4}}
        return chat_script([(0.001, "Reading "), (0.002, "the file. "), (0.003, '{"tool": "read_file"}')], usage=usage)
