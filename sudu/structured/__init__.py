"""Structured output: llguidance grammars built from JSON schemas, regexes, choices, Lark/GBNF and tool
definitions (grammars.py), compiled and cached per served tokenizer (backend.py), and enforced inside the
engine's step: masks computed while the forward pass runs, speculative drafts cut to the grammar, forced
tokens appended without a model step (masks.py)."""
