"""transformers' own GGUF loading for the real-model tests, with each file read once per test session.

transformers builds a fresh `gguf.GGUFReader` for a file's config, again for its tokenizer and again for its
weights. The reader makes a Python object per vocabulary entry, 15-30 s per catalog file on a 2-core
machine, so the reference side cost several times what the checks do. `readers_once()` makes `gguf.GGUFReader`
hand out one reader per catalog file (files in the model cache, which are never rewritten): the same parse,
the same bytes, built once. Other files (tests' own GGUFs in temporary directories) are read afresh. sudu
reads its files with its own parser (sudu/weights/gguf.py), which this does not touch."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from sudu.paths import models_dir

_READERS: dict[tuple[str, str], gguf.GGUFReader] = {}


def _reader(path, mode: str = "r") -> gguf.GGUFReader:
    resolved = Path(path).resolve()
    if mode != "r" or resolved.parent != models_dir().resolve():
        return _ORIGINAL(path, mode)
    key = (str(resolved), mode)
    if key not in _READERS:
        _READERS[key] = _ORIGINAL(path, mode)
    return _READERS[key]


_ORIGINAL = gguf.GGUFReader


@contextlib.contextmanager
def readers_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` of a catalog file returns the reader already built for it; the
    readers are dropped after the block."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", _reader)
        try:
            yield
        finally:
            _READERS.clear()
