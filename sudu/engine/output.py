"""What a sampled token does to a sequence's output, as pure functions: whether it ends the sequence
(`check_stop`: end-of-sequence and stop token ids, then length and a finished grammar), how new text is split
around stop strings (`split_stop_text`: the text to emit, the tail held back while it could still begin a stop
string, the stop string hit), and a token's logprob entry with its text. The engine's step applies them; they
read nothing but their arguments, so they are tested on their own."""
from __future__ import annotations

from dataclasses import dataclass

from sudu.engine.outputs import TokenLogprob
from sudu.sampling import SamplingParams


def check_stop(token: int, params: SamplingParams, eos_token_ids: frozenset[int] | set[int]) -> tuple[str, int] | None:
    """("stop", token) when the token itself ends the sequence (end-of-sequence unless ignore_eos, or one of the
    request's stop token ids), else None. Checked before the token's text is added: such a token has no text."""
    if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop", token
    return None


def check_end(num_tokens: int, max_total_tokens: int, grammar_stopped: bool) -> tuple[str, None] | None:
    """After the token's text: ("length", None) at the token limit, ("stop", None) where the grammar is complete
    (only end-of-sequence could follow), else None."""
    if num_tokens >= max_total_tokens:
        return "length", None
    if grammar_stopped:
        return "stop", None
    return None


@dataclass(frozen=True)
class StopText:
    emit: str  # text to send now
    held: str  # tail held back: it could still be the start of a stop string
    hit: str | None  # the stop string found (emit ends right before it), else None


def split_stop_text(text: str, stops: list[str] | None) -> StopText:
    """Split text (the held tail plus the new token's text) by the request's stop strings: the earliest stop
    string found ends the output before it; otherwise the longest tail that begins some stop string is held."""
    if not stops:
        return StopText(text, "", None)
    hit = min(((text.find(s), s) for s in stops if s in text), default=None)
    if hit is not None:
        return StopText(text[: hit[0]], "", hit[1])
    hold = stop_prefix_len(text, stops)
    return StopText(text[: len(text) - hold], text[len(text) - hold:], None)


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is the start of some stop string (held back)."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


def token_logprob(decode, token: int, logprob: float, top: list[tuple[int, float]] | None) -> TokenLogprob:
    """A token's logprob entry: its own text and each top alternative's, decoded alone with special tokens."""
    return TokenLogprob(token, decode([token], skip_special_tokens=False), logprob,
                        [(t, decode([t], skip_special_tokens=False), lp) for t, lp in (top or [])])
