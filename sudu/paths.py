"""Where sudu keeps files on disk: everything lives under $SUDU_HOME (default ~/.cache/sudu). A module of
its own so that weights/, tokenizer.py, kernels/ and the engine can share a path without importing
each other."""
from __future__ import annotations

import os
from pathlib import Path


def sudu_home() -> Path:
    return Path(os.environ.get("SUDU_HOME") or "~/.cache/sudu").expanduser()


def models_dir() -> Path:
    """Assembled catalog models (`sudu models pull`)."""
    return sudu_home() / "models"
