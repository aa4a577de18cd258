"""Re-counting output tokens with the model's own tokenizer (sudu.tokenizer), when the model name is in
sudu's catalog and its file is present. Everything is imported lazily and every failure degrades to
"not recounted": the bench works against any server, with or without sudu's engine installed."""
from __future__ import annotations

from typing import Callable

NOT_RECOUNTED = "not recounted"


def load_token_counter(model: str | None) -> tuple[Callable[[str], int] | None, str]:
    """(count_tokens, note). count_tokens(text) -> number of tokens, without special tokens."""
    if not model:
        return None, f"{NOT_RECOUNTED}: no model name"
    try:
        from sudu.weights import catalog

        path = catalog.resolve_model_path(model, pull=False, progress=False)
    except Exception as exc:  # not a sudu model, or not downloaded: nothing to recount with
        return None, f"{NOT_RECOUNTED}: {model!r} is not a model file sudu has ({type(exc).__name__})"
    try:
        from sudu.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(path) if path.is_dir() else Tokenizer.from_gguf(str(path))
    except Exception as exc:  # the tokenizer is optional for the bench: any failure degrades
        return None, f"{NOT_RECOUNTED}: sudu.tokenizer could not load {path} ({type(exc).__name__}: {exc})"

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    return count_tokens, f"recounted with sudu.tokenizer ({path})"
