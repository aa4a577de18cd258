"""A toy language model for FakeServer (a script function) that answers non-streaming chat and
completions requests, for testing `sudu bench determinism`: its answer is a pure function of the prompt
text, the temperature and the seed, unless a switchable non-determinism is turned on:

- `perturb="load"`: the tokens from index `diverge_at` on change while another request is in flight
  (one that arrived less than 0.9 `hold_s` ago: every answer is held `hold_s` before it is sent, so a
  request sent after another one's answer came back is never taken for one beside it);
- `perturb="cache"`: they change with the number of prompt words already seen at the start of an earlier
  prompt (the toy's prefix cache, reported as `usage.prompt_tokens_details.cached_tokens` in every mode);
- `perturb="logprobs"`: under load the tokens stay and only the logprob at `diverge_at` moves (a last-bit
  difference, which only a logprob comparison sees).

Tokens are words with a leading space; a request with temperature > 0 and no `seed` gets a fresh random
seed, as a server that ignores seeds would."""
from __future__ import annotations

import hashlib
import json
import random
import threading
import time

from sudu.bench.fake_server import ScriptedResponse

PERTURBATIONS = (None, "load", "cache", "logprobs")
_VOCAB = ("alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega", "tau", "rho", "zeta", "eta")


def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def prompt_text(body: dict) -> str:
    if isinstance(body.get("messages"), list):
        return "\n".join(str(m.get("content") or "") for m in body["messages"])
    return str(body.get("prompt") or "")


class ToyLM:
    """`FakeServer(ToyLM(...))`; `bodies` keeps every request body it answered."""

    def __init__(self, perturb: str | None = None, diverge_at: int = 5, hold_s: float = 0.3):
        if perturb not in PERTURBATIONS:
            raise ValueError(f"perturb must be one of {PERTURBATIONS}")
        self.perturb, self.diverge_at, self.hold_s = perturb, diverge_at, hold_s
        self.bodies: list[dict] = []
        self._seen: list[list[str]] = []  # earlier prompts, as words
        self._arrivals: list[float] = []
        self._lock = threading.Lock()

    def _cached_words(self, words: list[str]) -> int:
        best = 0
        for seen in self._seen:
            n = 0
            while n < min(len(seen), len(words) - 1) and seen[n] == words[n]:
                n += 1
            best = max(best, n)
        return best

    def tokens(self, text: str, temperature: float, seed: int | None, n: int, variant: object = "") -> list[str]:
        """The toy's answer; a `variant` other than "" changes the token at `diverge_at` and those after it."""
        def pick(i: int, v: object) -> int:
            return (_h(text, i, v) if temperature == 0 else _h(text, i, v, temperature, seed)) % len(_VOCAB)

        out = []
        for i in range(n):
            k = pick(i, variant if i >= self.diverge_at else "")
            if variant != "" and i == self.diverge_at and k == pick(i, ""):
                k = (k + 1) % len(_VOCAB)  # the first changed token always differs
            out.append(" " + _VOCAB[k])
        return out

    def __call__(self, body: dict) -> ScriptedResponse:
        now = time.perf_counter()
        text = prompt_text(body)
        words = text.split()
        with self._lock:
            self.bodies.append(body)
            loaded = any(now - t < 0.9 * self.hold_s for t in self._arrivals)
            self._arrivals.append(now)
            cached = self._cached_words(words)
            self._seen.append(words)
        temperature = float(body.get("temperature", 1.0))
        seed = body.get("seed")
        if temperature > 0 and seed is None:
            seed = random.getrandbits(32)
        variant = ""
        if self.perturb == "load" and loaded:
            variant = "load"
        elif self.perturb == "cache" and cached:
            variant = f"cached-{cached}"
        n = max(1, min(int(body.get("max_tokens") or 16), 256))
        toks = self.tokens(text, temperature, seed, n, variant)
        logprobs = [-(_h(text, t, i) % 1000) / 97.0 for i, t in enumerate(toks)]
        if self.perturb == "logprobs" and loaded and self.diverge_at < n:
            logprobs[self.diverge_at] = logprobs[self.diverge_at] * (1 + 2 ** -40)
        answer = "".join(toks)
        usage = {"prompt_tokens": len(words), "completion_tokens": n, "total_tokens": len(words) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        want_logprobs = bool(body.get("logprobs"))
        if "messages" in body:
            lp = {"content": [{"token": t, "logprob": p} for t, p in zip(toks, logprobs)]} if want_logprobs else None
            choice = {"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": lp,
                      "finish_reason": "length"}
            obj = "chat.completion"
        else:
            lp = {"tokens": toks, "token_logprobs": logprobs} if want_logprobs else None
            choice = {"index": 0, "text": answer, "logprobs": lp, "finish_reason": "length"}
            obj = "text_completion"
        out = {"id": "toy", "object": obj, "model": body.get("model", "fake"), "choices": [choice], "usage": usage}
        return ScriptedResponse(body=json.dumps(out).encode(), headers_at_s=self.hold_s)
