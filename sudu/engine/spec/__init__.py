"""Speculative decoding: verify.py (the lossless check, the floor of this package), one file per drafter
(ngram.py, draft_model.py, mtp.py), cost.py (what a draft token's verification row costs and earns) and
controller.py (the Speculator the engine's step calls, and per-drafter defaults)."""
