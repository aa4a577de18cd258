"""Text <-> token ids, chat templates and streaming detokenization.

A `Tokenizer` is built either from a GGUF file's metadata or from a Hugging Face `tokenizer.json`,
always as a `tokenizers` (Rust) tokenizer. For GGUF the build mirrors what transformers' GGUF
converter produces, so ids are identical to `AutoTokenizer.from_pretrained(dir, gguf_file=...)`:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE over the file's vocabulary and merges, split first
  by the pre-tokenizer regex named in `tokenizer.ggml.pre` (qwen2, llama3, ...).
- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte fallback and `▁` for spaces;
  the files carry no merges, so they are rebuilt from the vocabulary, ranked by token score (Llama 2
  style) or, for Gemma, by the order tokens appear in the file (Gemma's scores do not follow its
  merge order; Gemma also writes spaces as themselves instead of a "▁" prefix).
- Tokens the file marks CONTROL become special added tokens, USER_DEFINED ones plain added tokens,
  so `<|im_start|>` or `<start_of_turn>` in text stays one token.

Chat templates are rendered with jinja2 in a sandbox, the way transformers does (trim_blocks,
lstrip_blocks, `raise_exception`, `tojson`). `IncrementalDetokenizer` turns a stream of generated
ids into text pieces without re-decoding the whole output each step.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from sudu.errors import RequestTooLongError, SuduError
from sudu.paths import sudu_home

_GIL_FREE_MIN_CHARS = 4096  # texts this long are encoded without holding the GIL

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer splits by `tokenizer.ggml.pre`; the regexes are the ones the vocabularies were trained with.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}

# Ids that end a turn, beyond the file's own eos id: an instruct model ends its answer with the turn
# terminator, a base model with the end-of-text token, and sudu should stop on either.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "<|eot_id|>", "<|end_of_text|>")

# Gemma 3 270M (base) ships no chat template; this is Gemma's turn format, with a system message folded
# into the first user turn as Gemma's own instruct template does. Documented in docs/models.md.
GEMMA_DEFAULT_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\n' + (system_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
# A model with neither a template nor Gemma's turn tokens still gets a usable ChatML format.
CHATML_DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible spelling of bytes as printable characters (byte-level BPE vocabularies use it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str | None) -> RustTokenizer:
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        # A token already in byte spelling stays; one written as plain text (rare) is respelled.
        key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[key] = index
    pairs = [tuple(m.split(" ")) for m in merges]
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_vocab(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary
    tokens, highest-priority merged token first, then longer left and right pieces first."""
    candidates = []
    for token, token_priority in priority.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        candidates.extend((left, right, token_priority) for left, right in local)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _gemma_backend(tokens: list[str]) -> RustTokenizer:
    # Gemma files store tokens made only of spaces as real spaces; the model looks them up as "▁".
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    # Gemma's scores do not follow its merge order; the order tokens appear in the file does.
    position = {token: -index for index, token in enumerate(tokens)}
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=_merges_from_vocab(vocab, position), fuse_unk=True,
                                       unk_token="<unk>", dropout=None, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _sentencepiece_backend(tokens: list[str], scores: list[float]) -> RustTokenizer:
    """Llama-2-style SentencePiece: merges ranked by token score, "▁" prepended to the first word only,
    byte fallback, and the prefix space stripped again when decoding."""
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=_merges_from_vocab(vocab, dict(zip(tokens, scores))),
                                       fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return backend


def _add_marked_tokens(backend: RustTokenizer, tokens: list[str], token_types: list[int], byte_level: bool) -> None:
    alphabet = set(byte_to_unicode().values()) if byte_level else None
    # In a byte-level vocabulary a CONTROL token outside the byte alphabet is a mislabel; adding it
    # would grow the vocabulary past the model's, so it is skipped (as transformers does).
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types)
               if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def _bos_post_processor(bos: str, bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def _field(source, key: str, default=None):
    # `source` is sudu's parsed GGUFFile, or a gguf.GGUFReader when a caller already has one.
    if hasattr(source, "metadata"):
        return source.metadata.get(key, default)
    field = source.fields.get(key)
    return default if field is None else field.contents()


def render_content(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI-style parts: only text parts carry text for a text model; joined by lines, as vLLM does.
    return "\n".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def _chat_message(message: dict) -> dict:
    """A message as templates expect it: OpenAI's `developer` role is the system role, content is text."""
    role = message.get("role")
    return dict(message, role="system" if role == "developer" else role,
                content=render_content(message.get("content")))


@lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """One model's tokenizer. `vocab_size` counts the ids the tokenizer knows (the model's embedding may
    have more rows, e.g. Qwen's padding); `eos_token_ids` are every id that ends generation."""

    def __init__(self, backend: RustTokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 pad_token_id: int | None, chat_template: str | None, add_bos: bool):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        if bos_token_id is not None and add_bos and backend.post_processor is None:
            backend.post_processor = _bos_post_processor(backend.id_to_token(bos_token_id), bos_token_id)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token covers (its longest vocabulary entry: a
        byte-level entry spells each byte as one character, SentencePiece spells a space as one "▁"), so a
        text of more than max_tokens * max_token_chars characters cannot fit in max_tokens."""
        return max(len(token) for token in self._backend.get_vocab(with_added_tokens=True))

    @property
    def backend(self) -> RustTokenizer:
        """The underlying `tokenizers.Tokenizer` (batch encoding, offsets)."""
        return self._backend

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids; with add_special_tokens, BOS is prepended when the model wants it (Gemma yes, Qwen no).
        With max_tokens, a text of more tokens raises RequestTooLongError before its ids are built."""
        if len(text) < _GIL_FREE_MIN_CHARS:
            encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        else:
            # encode_batch runs without the GIL (encode holds it for the whole text), so a long prompt
            # tokenized in a worker thread never stalls the server's event loop or the engine thread
            encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise RequestTooLongError(f"the prompt has {len(encoding)} tokens, more than the {max_tokens} this "
                                      f"model's context holds")
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for a conversation. The text already holds BOS where the model wants it, so
        encode it with add_special_tokens=False (or use `encode_chat`)."""
        template = _compile_template(self.template_source)
        chat = [_chat_message(m) for m in messages]
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "pad_token": "" if self.pad_token_id is None else self._backend.id_to_token(self.pad_token_id)}
        try:
            return template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                   **{"tools": None, **special, **kwargs})
        except Exception as exc:
            import jinja2

            if isinstance(exc, jinja2.exceptions.TemplateError):
                raise SuduError(f"chat template: {exc}") from None
            raise

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    max_tokens: int | None = None, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """The token ids of a conversation: the one chat -> ids path (server, `sudu generate --chat`,
        benchmarks). The template writes its own special tokens; BOS is added only where the tokenizer
        has one and the rendered text does not already start with it. tools: OpenAI tool definitions, for
        templates that render them (sudu/tools/messages.py handles templates that do not).
        template_kwargs: further template variables (`enable_thinking`)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools=tools, **(template_kwargs or {}))
        bos = self.bos_token
        return self.encode(text, add_special_tokens=bool(bos) and not text.startswith(bos), max_tokens=max_tokens)

    @property
    def template_source(self) -> str:
        """The chat template in use: the model's own, else sudu's default for its family."""
        return self.chat_template or self._default_chat_template()

    def _default_chat_template(self) -> str:
        if self.token_to_id("<start_of_turn>") is not None:
            return GEMMA_DEFAULT_CHAT_TEMPLATE
        return CHATML_DEFAULT_CHAT_TEMPLATE

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """From a GGUF file's metadata: sudu's parsed file (weights/gguf.py `open_gguf`, which reads a 150k-token
        vocabulary in well under a second) or a `gguf.GGUFReader` a caller already has (an independent reading,
        as tests use; it builds an object per token and takes tens of seconds on a real vocabulary)."""
        if isinstance(reader, (str, Path)):
            raise TypeError("Tokenizer.from_gguf takes a parsed file: Tokenizer.from_gguf(open_gguf(path))")
        kind = _field(reader, "tokenizer.ggml.model")
        arch = _field(reader, "general.architecture")
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise SuduError("GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
        token_types = _field(reader, "tokenizer.ggml.token_type") or []
        if kind == "gpt2":
            backend = _byte_level_backend(tokens, _field(reader, "tokenizer.ggml.merges") or [],
                                          _field(reader, "tokenizer.ggml.pre"))
            add_bos_default = False
        elif kind == "llama" and arch in ("gemma", "gemma2", "gemma3"):
            backend = _cached_backend(("gemma", tokens), lambda: _gemma_backend(tokens))
            add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary unless told otherwise
        elif kind == "llama":
            scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
            backend = _cached_backend(("spm", tokens, scores), lambda: _sentencepiece_backend(tokens, scores))
            add_bos_default = True
        else:
            raise SuduError(f"GGUF tokenizer {kind!r} for architecture {arch!r} is not supported "
                            "(sudu reads byte-level BPE and SentencePiece vocabularies)")
        _add_marked_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")
        add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
        bos = _field(reader, "tokenizer.ggml.bos_token_id")
        eos = _field(reader, "tokenizer.ggml.eos_token_id")
        if add_bos and bos is not None:
            backend.post_processor = _bos_post_processor(tokens[bos], bos)
        return cls(backend, bos_token_id=bos, eos_token_ids=_stop_ids(backend, eos),
                   pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
                   chat_template=_field(reader, "tokenizer.chat_template"), add_bos=add_bos)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise SuduError(f"{path} has no tokenizer.json")
        backend = RustTokenizer.from_file(str(path / "tokenizer.json"))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        chat_template = tok_cfg.get("chat_template")
        if isinstance(chat_template, list):  # named templates; the default one is what chat uses
            chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text()

        def token_id(key: str) -> int | None:
            value = tok_cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return None if value is None else backend.token_to_id(value)

        eos_ids = []
        for source in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
            eos = source.get("eos_token_id")
            eos_ids += [eos] if isinstance(eos, int) else list(eos or [])
        eos_tok = token_id("eos_token")
        first_eos = eos_tok if eos_tok is not None else (eos_ids[0] if eos_ids else None)
        stops = _stop_ids(backend, first_eos)
        stops += [i for i in eos_ids if i not in stops]
        bos = token_id("bos_token")
        # tokenizer.json's own post-processor already decides about BOS.
        add_bos = bool(tok_cfg.get("add_bos_token", backend.post_processor is not None and bos is not None))
        return cls(backend, bos_token_id=bos, eos_token_ids=stops, pad_token_id=token_id("pad_token"),
                   chat_template=chat_template, add_bos=add_bos)


_BACKEND_CACHE_VERSION = "2"  # bump when the way a backend is built from metadata changes


def _cached_backend(inputs: tuple, build) -> RustTokenizer:
    """SentencePiece merges are rebuilt from the vocabulary (seconds for Gemma's 262k tokens); the result is
    cached as tokenizer.json under $SUDU_HOME/tokenizers, keyed by a hash of everything the build reads."""
    digest = hashlib.sha256(_BACKEND_CACHE_VERSION.encode())
    for part in inputs:
        digest.update(b"\x00" + json.dumps(part, ensure_ascii=False).encode())
    path = sudu_home() / "tokenizers" / f"{digest.hexdigest()}.json"
    if path.is_file():
        try:
            return RustTokenizer.from_file(str(path))
        except Exception:  # a damaged cache entry is rebuilt below
            path.unlink(missing_ok=True)
    backend = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        tmp.write_text(backend.to_str())
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the rebuild next time
        pass
    return backend


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _stop_ids(backend: RustTokenizer, eos_id: int | None) -> list[int]:
    ids = [] if eos_id is None else [eos_id]
    added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    for token in _STOP_TOKENS:
        token_id = added.get(token)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids


class IncrementalDetokenizer:
    """Streams generated ids as text. Keeps two offsets into the ids (vLLM's prefix/read offsets): text is
    decoded only over the short window since the last emitted point, and held back while the window
    ends in U+FFFD (a multi-byte character split across tokens). The concatenation of everything
    `add` and `flush` return equals `tokenizer.decode(all_ids)`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start: a point where decoded text ended on a whole character
        self._read_offset = 0  # ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truly invalid byte sequence at the end)."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]
