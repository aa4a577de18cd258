"""Re-counting output tokens with the model's own tokenizer (sudu.tokenizer), when sudu knows the
model. Everything is imported lazily and every failure degrades to "not recounted": the bench works
against any server, with or without sudu's engine installed."""
from __future__ import annotations

from typing import Callable

NOT_RECOUNTED = "not recounted"


def load_token_counter(model: str | None) -> tuple[Callable[[str], int] | None, str]:
    """(count_tokens, note). count_tokens(text) -> number of tokens, without special tokens."""
    if not model:
        return None, f"{NOT_RECOUNTED}: no model name"
    try:
        from sudu import tokenizer as tokenizer_module
    except Exception as exc:  # the engine side is optional for the bench: any import failure degrades
        return None, f"{NOT_RECOUNTED}: sudu.tokenizer unavailable ({type(exc).__name__})"
    loader = getattr(tokenizer_module, "load_tokenizer", None)
    cls = getattr(tokenizer_module, "Tokenizer", None)
    if loader is None and cls is not None:
        loader = getattr(cls, "from_model", None) or getattr(cls, "load", None)
    if loader is None:
        return None, f"{NOT_RECOUNTED}: sudu.tokenizer has no loader"
    try:
        tok = loader(model)
    except Exception as exc:  # unknown model, file not downloaded, ...
        return None, f"{NOT_RECOUNTED}: {model!r} not available to sudu.tokenizer ({type(exc).__name__}: {exc})"
    encode = tok.encode

    def count_tokens(text: str) -> int:
        try:
            return len(encode(text, add_special_tokens=False))
        except TypeError:
            return len(encode(text))

    return count_tokens, f"recounted with sudu.tokenizer ({model})"
