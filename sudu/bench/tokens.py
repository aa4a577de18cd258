"""Re-counting output tokens with the model's own tokenizer (sudu.tokenizer), when the model name is in
sudu's catalog and its file is present. Everything is imported lazily and every failure degrades to
"not recounted": the bench works against any server, with or without sudu's engine installed."""
from __future__ import annotations

from typing import Callable

NOT_RECOUNTED = "not recounted"


def load_tokenizer(model: str | None, path: str | None = None):
    """(sudu.tokenizer.Tokenizer or None, note): from `path` (a model directory or .gguf) when given, else
    from the catalog model named `model`."""
    if path is None:
        if not model:
            return None, f"{NOT_RECOUNTED}: no model name"
        try:
            from sudu.weights import catalog

            found = catalog.resolve_model_path(model, pull=False, progress=False)
        except Exception as exc:  # not a sudu model, or not downloaded: nothing to recount with
            return None, f"{NOT_RECOUNTED}: {model!r} is not a model file sudu has ({type(exc).__name__})"
    else:
        from pathlib import Path

        found = Path(path)
    try:
        from sudu.tokenizer import Tokenizer
        from sudu.weights.gguf import open_gguf

        tok = Tokenizer.from_dir(found) if found.is_dir() else Tokenizer.from_gguf(open_gguf(found))
    except Exception as exc:  # the tokenizer is optional for the bench: any failure degrades
        return None, f"{NOT_RECOUNTED}: sudu.tokenizer could not load {found} ({type(exc).__name__}: {exc})"
    return tok, f"recounted with sudu.tokenizer ({found})"


def load_token_counter(model: str | None, path: str | None = None) -> tuple[Callable[[str], int] | None, str]:
    """(count_tokens, note). count_tokens(text) -> number of tokens, without special tokens."""
    tok, note = load_tokenizer(model, path)
    if tok is None:
        return None, note

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    return count_tokens, note
