"""Real catalog models against transformers' own GGUF loading: tokenization, chat templates and config must
match (the dequantized weights: test_real_forward.py, which loads transformers' model once for both checks).
Slow (transformers converts each GGUF), so marked; a model not in the cache yet is pulled from the offline
catalog on first use."""
from __future__ import annotations


import pytest

from sudu.tokenizer import GEMMA_DEFAULT_CHAT_TEMPLATE, IncrementalDetokenizer
from sudu.weights.catalog import pull
from sudu.weights.loader import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("gguf_readers_once")]  # tests/helpers/hf_gguf.py
transformers = pytest.importorskip("transformers")

QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma-3-270m"


def _model_file(name: str):
    return pull(name, progress=False)


_HF_TOKENIZERS: dict = {}
_CHECKPOINTS: dict = {}


def hf_tokenizer(name: str):
    if name not in _HF_TOKENIZERS:
        path = _model_file(name)
        _HF_TOKENIZERS[name] = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return _HF_TOKENIZERS[name]


def checkpoint(name: str):
    _model_file(name)
    if name not in _CHECKPOINTS:
        _CHECKPOINTS[name] = load_checkpoint(name, pull=False, progress=False)
    return _CHECKPOINTS[name]


_BASE_TEXTS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "Hello world", "Hello  world", " Hello world", "Hello world ",
    "hello, world!", "HELLO WORLD", "The quick brown fox jumps over the lazy dog.", "I'm can't won't they'll we've",
    "It's 3.14159 and 1,234,567 and 2024-11-30T12:34:56Z", "a" * 50, "ab " * 30, "  leading and trailing  ",
    "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; ++i) {\n\tsum += x[i];\n}",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)", "    indented\n        more\n            most",
    "SELECT * FROM users WHERE id = 42;", "<div class=\"a\">&nbsp;</div>", "console.log(`${a} + ${b}`);",
    "fn main() { println!(\"hi\"); }", "#include <stdio.h>\nint main(void) { return 0; }",
    "x=1;y=2;z=x+y", "if x:\n\tpass\nelse:\n\traise ValueError('bad')", "// comment\n/* block */",
    "你好，世界", "我们今天去公园散步。", "中文和English混合 text", "日本語のテキストです", "한국어 문장입니다",
    "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "ภาษาไทย",
    "😀", "👍🏽", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵", "emoji 🎉🎉🎉 party", "✓ ✗ → ← ∑ ∫ √ ∞", "café naïve résumé",
    "e\u0301 combining", "\u00a0nbsp\u00a0", "zero\u200bwidth", "tab\tseparated\tvalues", "CRLF\r\nline\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>", "text<|im_end|>more",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>", "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>x<eos>", "<pad><unk><mask>",
    "[multimodal]", "<unused0>", "<|im_start", "im_end|>", "<< >> <> </>", "``` python\nprint(1)\n```",
    "$$ E = mc^2 $$", "1+1=2\n2+2=4", "0x1F 0b1010 1e-9", "a\u3000b", "trailing newline\n",
]


def _texts() -> list[str]:
    texts = []
    for t in _BASE_TEXTS:
        texts += [t, " " + t, t + "\n", t + " " + t[::-1]]
    assert len(texts) >= 200
    return texts


@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_tokenization_matches_transformers(name):
    hf = hf_tokenizer(name)
    tok = checkpoint(name).tokenizer
    for text in _texts():
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text
        detok = IncrementalDetokenizer(tok)
        streamed = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert streamed == tok.decode(ids), text


_CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about caches."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "用中文回答 😀"}],
    [{"role": "system", "content": "Code only."}, {"role": "user", "content": "  def f():\n\tpass  "},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
]


def test_qwen_chat_template_matches_transformers():
    hf = hf_tokenizer(QWEN)
    tok = checkpoint(QWEN).tokenizer
    for messages in _CONVERSATIONS:
        for gen in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a haiku"}, {"type": "text", "text": "about caches."}]}]
    joined = [{"role": "user", "content": "Write a haiku\nabout caches."}]  # text parts are joined by lines
    assert tok.apply_chat_template(parts) == hf.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)


def test_gemma_default_chat_template_renders_like_transformers():
    hf = hf_tokenizer(GEMMA)
    tok = checkpoint(GEMMA).tokenizer
    assert tok.chat_template is None  # the 270M base model ships none; sudu's documented default applies
    for messages in _CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                          chat_template=GEMMA_DEFAULT_CHAT_TEMPLATE)
        assert tok.apply_chat_template(messages) == expected
    ids = tok.encode_chat(_CONVERSATIONS[0])
    assert ids[:2] == [tok.bos_token_id, tok.token_to_id("<start_of_turn>")]  # one BOS, not two


def test_gemma_config_matches_transformers():
    path = _model_file(GEMMA)
    hf = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = getattr(hf, "text_config", hf)
    cfg = checkpoint(GEMMA).config
    assert cfg.hidden_size == hf.hidden_size and cfg.num_hidden_layers == hf.num_hidden_layers
    assert cfg.head_dim == hf.head_dim and cfg.num_key_value_heads == hf.num_key_value_heads
    assert cfg.sliding_window == hf.sliding_window
    rope = hf.rope_parameters  # transformers 5: per layer type
    assert cfg.rope_local_base_freq == rope["sliding_attention"]["rope_theta"]
    assert cfg.rope_theta == rope["full_attention"]["rope_theta"]
    assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert cfg.layer_types == list(hf.layer_types)
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6) and cfg.vocab_size == hf.vocab_size
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
