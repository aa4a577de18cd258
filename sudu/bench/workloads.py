"""What sudu bench sends: prompts in a declared cache state (cold / warm / shared-prefix), filler text of
a given length, and request arrival schedules (Poisson, gamma with burstiness, constant)."""
from __future__ import annotations

import hashlib
import uuid

import numpy as np

from sudu.errors import SuduError

CACHE_STATES = ("cold", "warm", "shared-prefix")
ARRIVALS = ("poisson", "gamma", "constant")

SHORT_QUESTION = "In two sentences, why is the sky blue?"

# The `single` suite's prompts: everyday coding-assistant and chat turns, each with a different answer,
# so that a long (or --ignore-eos) answer is a real one and not one answer repeated. Lengths as such turns
# come: a question of 10-30 words, or a request with 5-40 lines of code. Sent in order, cycling.
CHAT_CODE_PROMPTS = (
    "Explain the difference between a process and a thread, with an example of when to use each.",
    "Write a Python function that parses a duration like '1h30m15s' into seconds, with tests.",
    "What are the trade-offs between PostgreSQL and SQLite for a small web app?",
    "Review this function and suggest improvements:\n\n```python\ndef avg(xs):\n    s = 0\n    for i in range(len(xs)):\n"
    "        s = s + xs[i]\n    return s / len(xs)\n```",
    "How do I undo the last git commit but keep the changes in my working tree?",
    "Write a bash script that finds the ten largest files under a directory and prints their sizes.",
    "Explain what a race condition is to a new programmer, and show one in Python.",
    "Convert this callback code to async/await:\n\n```javascript\nfunction load(url, cb) {\n  fetch(url).then(r => "
    "r.json()).then(d => cb(null, d)).catch(e => cb(e));\n}\n```",
    "Plan a three-day trip to Kyoto for someone who likes gardens and food.",
    "Write a SQL query that returns each customer's most recent order, given customers(id, name) and "
    "orders(id, customer_id, created_at, total).",
    "Why does my Python program print 0.30000000000000004 for 0.1 + 0.2, and what should I do about it?",
    "Implement an LRU cache class in Python with get and put in O(1), and explain the design.",
    "Summarize the main ideas of the CAP theorem and how real databases deal with it.",
    "Find the bug:\n\n```python\ndef merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] < b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n"
    "    return out\n```",
    "Write a short, friendly email declining a meeting invitation and proposing another time.",
    "Explain how HTTPS keeps a connection private, step by step, without heavy math.",
    "Write a Rust function that counts word frequencies in a string and returns the top five.",
    "What is the difference between a list and a tuple in Python, and when does it matter?",
    "Design the REST endpoints for a simple todo app with users, lists and items.",
    "Write unit tests with pytest for a function slugify(title) that lowercases, trims and joins words with dashes.",
)
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


def prompt_set_id(name: str, texts) -> str:
    """`name@<12 hex>`: the same id if and only if the same prompt texts (before any salt) were used."""
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]
    return f"{name}@{digest}"


def length_summary(texts) -> dict:
    """The prompt-length distribution that a report declares, in words."""
    words = sorted(len(t.split()) for t in texts)
    return {"min_words": words[0], "median_words": words[len(words) // 2], "max_words": words[-1], "n_prompts": len(words)}


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
