"""Tokenizer without a real model: tiny byte-level and Gemma-style vocabularies built from GGUF-shaped
metadata, special tokens, chat templates, tokenizer.json directories, and the streaming detokenizer
(never a broken character, and its pieces add up to decode(all))."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from sudu.errors import SuduError
from sudu.tokenizer import GEMMA_DEFAULT_CHAT_TEMPLATE, IncrementalDetokenizer, Tokenizer, byte_to_unicode
from sudu.weights.gguf import open_gguf

TEXTS = [
    "hello world", "  two  spaces  ", "你好，世界！我们今天去公园。", "emoji 😀👍🏽👨‍👩‍👧‍👦 and 🇫🇷 flags",
    "mixed 中文 and English 🎉", "tabs\tand\nnewlines\r\n", "café naïve", "ab ab abab", "",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_metadata(chat_template: str | None = QWEN_LIKE_TEMPLATE) -> dict:
    spell = byte_to_unicode()
    tokens = [spell[b] for b in range(256)]
    merges = []

    def merge(left: bytes, right: bytes):
        a, b = "".join(spell[x] for x in left), "".join(spell[x] for x in right)
        merges.append(f"{a} {b}")
        tokens.append(a + b)

    merge(b"a", b"b")
    merge(b"ab", b" ")
    # Merges that end in the middle of a character, so tokens straddle UTF-8 boundaries.
    nihao = "你好".encode()
    merge(nihao[2:3], nihao[3:4])
    merge(nihao[0:1], nihao[1:2])
    smile = "😀".encode()
    merge(smile[0:1], smile[1:2])
    merge(smile[2:3], smile[3:4])
    tokens += SPECIALS
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    meta = {
        "general.architecture": "qwen2",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": len(tokens) - 3,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
        "tokenizer.ggml.padding_token_id": len(tokens) - 3,
        "tokenizer.ggml.add_bos_token": False,
    }
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


def gemma_like_metadata() -> dict:
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    words = ["▁", "a", "b", "c", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hel", "hell", "hello", "▁hello",
             "wo", "wor", "worl", "world", "▁world", "  ", "你", "好"]
    tokens += words
    types += [1] * len(words)
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }


@pytest.fixture(scope="module", autouse=True)
def sudu_home(tmp_path_factory):
    # Gemma-style builds are cached under $SUDU_HOME; keep the user's cache out of tests.
    home = tmp_path_factory.mktemp("sudu_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SUDU_HOME", str(home))
        yield home


def make(meta: dict) -> Tokenizer:
    return Tokenizer.from_gguf(SimpleNamespace(metadata=meta))


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return make(byte_level_metadata())


@pytest.fixture(scope="module")
def gemma_tok() -> Tokenizer:
    return make(gemma_like_metadata())


@pytest.fixture(scope="module")
def spm_tok() -> Tokenizer:
    return make(spm_metadata())


@pytest.mark.parametrize("which", ["byte_tok", "gemma_tok", "spm_tok"])
def test_roundtrip(which, request):
    tok = request.getfixturevalue(which)
    for text in TEXTS:
        # SentencePiece (Llama 2) drops one leading space on decode, as sentencepiece and transformers do
        expected = text[1:] if which == "spm_tok" and text.startswith(" ") else text
        assert tok.decode(tok.encode(text)) == expected


def test_byte_level_specials_and_bos(byte_tok):
    ids = byte_tok.encode("<|im_start|>user\nab <|im_end|>")
    assert ids[0] == byte_tok.token_to_id("<|im_start|>") and byte_tok.token_to_id("<|im_end|>") in ids
    assert byte_tok.is_special(ids[0]) and not byte_tok.is_special(ids[1])
    assert byte_tok.decode(ids) == "user\nab "
    assert byte_tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nab <|im_end|>"
    assert byte_tok.bos_token_id is not None and byte_tok.encode("ab")[0] != byte_tok.bos_token_id  # qwen: no BOS
    assert byte_tok.eos_token_ids == [byte_tok.token_to_id("<|im_end|>"), byte_tok.token_to_id("<|endoftext|>")]
    # the qwen2 split regex keeps the space with the following word: "ab", " ab"
    assert byte_tok.encode("ab ab") == [byte_tok.token_to_id("ab"), 32, byte_tok.token_to_id("ab")]


def test_gemma_like_bos_and_stops(gemma_tok):
    ids = gemma_tok.encode("hello world")
    assert ids == [2, gemma_tok.token_to_id("hello"), gemma_tok.token_to_id("▁world")]
    assert gemma_tok.encode("hello", add_special_tokens=False) == [gemma_tok.token_to_id("hello")]
    assert gemma_tok.eos_token_ids == [1, gemma_tok.token_to_id("<end_of_turn>")]
    assert gemma_tok.decode(gemma_tok.encode("😀")) == "😀"  # byte fallback


def _stream(tok, ids, chunks, skip=True):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i = [], 0
    for size in chunks:
        pieces.append(detok.add(ids[i:i + size]))
        i += size
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("which", ["byte_tok", "gemma_tok", "spm_tok"])
def test_incremental_detokenizer_never_breaks_characters(which, request):
    tok = request.getfixturevalue(which)
    rng = random.Random(0)
    for text in TEXTS + ["".join(TEXTS)]:
        ids = tok.encode(text, add_special_tokens=False)
        for chunks in ([1] * len(ids), [rng.randint(1, 3) for _ in range(len(ids))]):
            pieces = _stream(tok, ids, chunks)
            assert all("\ufffd" not in p for p in pieces), (text, pieces)
            assert "".join(pieces) == tok.decode(ids)


def test_incremental_detokenizer_with_specials(byte_tok):
    ids = byte_tok.encode("<|im_start|>assistant\n你好 😀<|im_end|>")
    for skip in (True, False):
        pieces = _stream(byte_tok, ids, [1] * len(ids), skip=skip)
        assert "".join(pieces) == byte_tok.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in p for p in pieces)


def test_incremental_detokenizer_flushes_truly_invalid_bytes(byte_tok):
    # A lone lead byte at the end is held back by add() and released by flush(), as decode() shows it.
    ids = byte_tok.encode("ok", add_special_tokens=False) + [byte_tok.token_to_id(byte_to_unicode()[0xE4])]
    detok = IncrementalDetokenizer(byte_tok)
    assert detok.add(ids[:2]) == "ok"
    assert detok.add(ids[2:]) == ""
    assert detok.flush() == "\ufffd"


def test_chat_template(byte_tok):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    text = byte_tok.apply_chat_template(messages)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n"
    developer = [{"role": "developer", "content": "be brief"}] + messages[1:]
    assert byte_tok.apply_chat_template(developer) == text  # OpenAI's developer role is the system role
    assert not byte_tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    assert byte_tok.encode_chat(messages)[0] == byte_tok.token_to_id("<|im_start|>")


def test_chat_template_errors_are_sudu_errors():
    tok = make(byte_level_metadata("{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(SuduError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_gemma_default_chat_template(gemma_tok):
    assert gemma_tok.chat_template is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    assert gemma_tok.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert gemma_tok.encode_chat(messages[1:2]).count(2) == 1  # the template's BOS, not a second one
    with pytest.raises(SuduError, match="alternate"):
        gemma_tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert GEMMA_DEFAULT_CHAT_TEMPLATE.startswith("{{- bos_token")


def test_from_dir(tmp_path, byte_tok):
    (tmp_path / "tokenizer.json").write_text(byte_tok.backend.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": QWEN_LIKE_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "add_bos_token": False}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [byte_tok.token_to_id("<|endoftext|>")]}))
    tok = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == byte_tok.encode(text)
    assert tok.eos_token_ids == byte_tok.eos_token_ids
    assert tok.pad_token_id == byte_tok.token_to_id("<|endoftext|>") and tok.bos_token_id is None
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == \
        byte_tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_unsupported_gguf_tokenizer():
    meta = byte_level_metadata()
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(SuduError, match="not supported"):
        make(meta)


def test_gemma_backend_cache(sudu_home, gemma_tok):
    before = set((sudu_home / "tokenizers").glob("*.json"))
    assert before  # the fixture's build was cached
    again = make(gemma_like_metadata())
    assert set((sudu_home / "tokenizers").glob("*.json")) == before  # served from the cache, nothing new
    for text in TEXTS:
        assert again.encode(text) == gemma_tok.encode(text)
    for path in before:
        path.write_text("not json")  # a damaged entry is rebuilt, not fatal
    assert make(gemma_like_metadata()).encode("hello") == gemma_tok.encode("hello")


def spm_metadata() -> dict:
    """A Llama-2-style SentencePiece vocabulary: merges follow the scores, "▁" marks word starts."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "▁h", "he", "ll", "llo", "hello", "▁hello", "wo", "rl",
             "orl", "world", "▁w", "▁world", "ab", "▁a", "▁ab"]
    tokens += words
    types += [1] * len(words)
    scores += [-float(i) for i in range(len(words))]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }


def _write_tokenizer_gguf(path, meta: dict) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), meta["general.architecture"])
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    w.add_tensor("token_embd.weight", np.zeros((len(meta["tokenizer.ggml.tokens"]), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("build", [byte_level_metadata, gemma_like_metadata, spm_metadata])
def test_tiny_vocabularies_match_transformers(tmp_path, build):
    transformers = pytest.importorskip("transformers")
    meta = build()
    path = tmp_path / "tok.gguf"
    _write_tokenizer_gguf(path, meta)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = Tokenizer.from_gguf(open_gguf(path))
    texts = TEXTS + ["hello world", " hello  world ", "ab ab\nab", "helloworld", "<s>hello</s>", "  ", "\n\nhello"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_tokenizer_does_not_import_weights():
    # weights/loader.py builds tokenizers, so tokenizer.py must not reach back into weights/ (not even
    # inside a function): shared paths come from sudu.paths, GGUF metadata from the caller or `gguf`.
    import ast
    import inspect

    import sudu.tokenizer

    tree = ast.parse(inspect.getsource(sudu.tokenizer))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("sudu.weights")]
