"""What sudu bench sends: prompts in a declared cache state (cold / warm / shared-prefix), filler text of
a given length, and request arrival schedules (Poisson, gamma with burstiness, constant)."""
from __future__ import annotations

import uuid

import numpy as np

from sudu.errors import SuduError

CACHE_STATES = ("cold", "warm", "shared-prefix")
ARRIVALS = ("poisson", "gamma", "constant")

SHORT_QUESTION = "In two sentences, why is the sky blue?"
LONG_ANSWER_QUESTION = "Write a long, detailed essay about the history of computing, from the abacus to today."

# Common short English words: about one token each in BPE vocabularies, so N words ~ N tokens.
_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "not but one their they first also new after who its two been more other when into time there year "
    "all would can some her about over during may city world most over then them these than known later "
    "such many where between work both only three under while made part well high team game state found "
    "school early since film life best back used through area long water group same north south east west "
    "light river small road house music family great before large second being around war own old left "
    "people each several main head still open field until set power name line order play land form sea"
).split()


def salt() -> str:
    """A unique random prefix: no two cold prompts share more than the chat template's role header."""
    return f"[{uuid.uuid4().hex}] "


def filler_text(num_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = rng.choice(_WORDS, size=num_words)
    sentences = []
    for i in range(0, num_words, 12):
        s = " ".join(words[i : i + 12])
        sentences.append(s[:1].upper() + s[1:] + ".")
    return " ".join(sentences)


def make_messages(cache_state: str, user: str, system: str | None = None) -> list[dict]:
    """Messages for one request. cold: a fresh salt at the very start of the system message; warm and
    shared-prefix: the text as given (warm-ness comes from sending the identical prompt just before;
    shared-prefix from a common `system` with distinct `user` tails)."""
    if cache_state not in CACHE_STATES:
        raise SuduError(f"unknown cache state {cache_state!r}; use one of {', '.join(CACHE_STATES)}")
    messages = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user})
    if cache_state == "cold":
        # the salt goes as early as the chat API allows: the first (system) message. Without a system
        # message of our own, templates insert a default one (Qwen's) that every request would share.
        if system is None:
            messages.insert(0, {"role": "system", "content": salt().strip()})
        else:
            messages[0] = {**messages[0], "content": salt() + messages[0]["content"]}
    return messages


def long_prompt(num_words: int, seed: int, question: str = "Summarize the text above in one sentence.") -> str:
    return filler_text(num_words, seed) + "\n\n" + question


def arrival_offsets(n: int, rate: float | None, arrival: str = "poisson", burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s) of n requests at `rate` requests/s. None or inf rate -> all at once. Gamma
    inter-arrivals keep the mean 1/rate; burstiness < 1 is burstier than Poisson, > 1 more regular."""
    if rate is None or rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise SuduError("request rate must be > 0")
    if arrival not in ARRIVALS:
        raise SuduError(f"unknown arrival process {arrival!r}; use one of {', '.join(ARRIVALS)}")
    rng = np.random.default_rng(seed)
    if arrival == "constant":
        gaps = np.full(n, 1.0 / rate)
    elif arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
    else:
        if burstiness <= 0:
            raise SuduError("burstiness must be > 0")
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def parse_list(text: str | None, kind=float, name: str = "list") -> list:
    if not text:
        return []
    try:
        return [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SuduError(f"bad {name} {text!r}: expected comma-separated numbers") from None
