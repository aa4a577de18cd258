"""Gemma 3 (vision) against transformers on a tiny random model: sudu's preprocessing gives the reference
processor's pixel values and its placeholder expansion the processor's token ids; the network's logits over
prompts with one and two images match within 1e-4 (float32), the image tokens attending to each other both ways
(the reference without its image mask differs, so the check can fail); the engine's greedy tokens equal
transformers' with prompt chunks that would otherwise end inside an image, and from the prefix cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.tiny_gemma3_vl import (BOI, TOKENS_PER_IMAGE, build_tokenizer, image_processor,
                                          reference_inputs, save_tiny_gemma3_vl)
from tests.helpers.tiny_vlm import png_bytes, random_image, reference_greedy, step_requests, sudu_processor

PROMPT = "<|im_start|>user\n{images}Describe it.<|im_end|>\n<|im_start|>assistant\n"
SIZES = [(100, 70), (64, 200), (333, 251), (56, 56)]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return save_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl") / "model")



def sudu_prompt(processor, tokenizer, text: str, images):
    """The prompt as sudu's server builds it: each image's BOI as the processor's placeholder text, tokenized,
    the soft token expanded."""
    from sudu.media.image import content_hash

    ids = tokenizer.encode(text.replace(BOI, processor.placeholder), add_special_tokens=False)
    return processor.expand(ids, [processor.image_input(im, content_hash(png_bytes(im))) for im in images])


@pytest.mark.parametrize("size", SIZES)
def test_preprocessing_matches_transformers(vlm, size):
    from sudu.media.gemma3_vl import Gemma3Processor

    image = random_image(*size, seed=sum(size))
    reference = image_processor()(images=[image], return_tensors="np")["pixel_values"][0]
    _, processor = sudu_processor(vlm[0])
    assert isinstance(processor, Gemma3Processor)
    pixels = processor.preprocess(image)
    assert pixels.shape == reference.shape == (3, 56, 56)
    np.testing.assert_allclose(pixels, reference, rtol=0, atol=1e-6)


def test_placeholder_expands_as_the_processor_does(vlm):
    ckpt, processor = sudu_processor(vlm[0])
    text = PROMPT.format(images=f"a {BOI}b{BOI}\n")
    images = [random_image(100, 70, seed=1), random_image(64, 200, seed=2)]
    ids, placed = sudu_prompt(processor, ckpt.tokenizer, text, images)
    reference = reference_inputs(build_tokenizer(), text, images)
    assert ids == reference["input_ids"][0].tolist()
    soft = reference["token_type_ids"][0].nonzero()[:, 0].tolist()
    assert [p for im in placed for p in range(im.offset, im.offset + im.num_tokens)] == soft
    assert [im.num_tokens for im in placed] == [TOKENS_PER_IMAGE] * 2


def sudu_logits(model, ids, placed, chunk: int | None = None):
    """The network's logits of every prompt row, computed in chunks of `chunk` rows (None: one pass) that
    each end outside an image, over float32 pools."""
    from sudu.engine.text_eval import float_pools
    from sudu.layers.attention import build_metadata

    n = len(ids)
    embeds = {im.content_hash: model.encode_images(im.pixel_values, [im.grid_thw]) for im in placed}
    pools = float_pools(model.config, n)
    spans_all = [(im.offset, im.offset + im.num_tokens) for im in placed]
    out, start = [], 0
    while start < n:
        end = min(n, start + (chunk or n))
        for a, b in spans_all:
            if a < end < b:
                end = a if a > start else b
        spans = [(a, b) for a, b in spans_all if a < end and b > start]
        meta = build_metadata([end - start], [torch.arange(end)], pools, model.config.sliding_window,
                              image_spans=[spans])
        rows = [(r, im) for im in placed for r in range(max(im.offset, start), min(im.offset + im.num_tokens, end))]
        image_rows = None
        if rows:
            image_rows = (torch.tensor([r - start for r, _ in rows]),
                          torch.stack([embeds[im.content_hash][r - im.offset] for r, im in rows]))
        hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, image_rows=image_rows)
        out.append(model.compute_logits(hidden))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("num_images,chunk", [(1, None), (2, None), (2, 6)])
def test_logits_match_transformers(vlm, num_images, chunk):
    """chunk 6: prompt chunks of at most 6 rows, each image's 4 rows kept in one of them."""
    from sudu.config import EngineConfig
    from sudu.engine.network import prepare_network

    model_dir, hf = vlm
    images = [random_image(*SIZES[i], seed=i) for i in range(num_images)]
    text = PROMPT.format(images=BOI * num_images)
    ref = reference_inputs(build_tokenizer(), text, images)
    with torch.no_grad():
        expected = hf(**ref).logits[0]
        causal = hf(**{k: v for k, v in ref.items() if k != "token_type_ids"}).logits[0]
    ckpt, processor = sudu_processor(model_dir)
    ids, placed = sudu_prompt(processor, ckpt.tokenizer, text, images)
    assert ids == ref["input_ids"][0].tolist()
    model, _ = prepare_network(ckpt, EngineConfig(model=str(model_dir), quantization="none"))
    with torch.inference_mode():
        logits = sudu_logits(model, ids, placed, chunk)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert (causal - expected).abs().max() > 1e-3  # the image mask matters: a causal-only network would fail


def engine_runs(model_dir, chunk: int, text: str, images, quantization: str = "none"
                ) -> tuple[dict, dict, dict, tuple]:
    """(tokens, logprobs, cached tokens) by request of a greedy request run twice (the second from the prefix
    cache) with prompt chunks of at most `chunk` tokens; and the placed images."""
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine
    from sudu.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, kv_cache_memory=8 << 20,
                                    max_num_batched_tokens=chunk, prefill_chunk_when_decoding=chunk, block_size=4,
                                    kv_cache_dtype="float32", speculative="none", quantization=quantization),
                       progress=False)
    ids, placed = sudu_prompt(engine.image_processor, engine.tokenizer, text, images)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs, logprobs, cached = {}, {}, {}
    for rid in ("first", "again"):
        engine.add_request(rid, engine.check_request(ids, params, placed))
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
                logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.outputs[0].logprobs)
                cached[out.request_id] = out.num_cached_tokens
    return outputs, logprobs, cached, placed


@pytest.mark.parametrize("chunk", [2048, 5])
def test_greedy_tokens_match_transformers(vlm, chunk):
    """chunk 5: chunks of 5 tokens would end inside the images (4 tokens each); the scheduler moves their ends."""
    model_dir, hf = vlm
    images = [random_image(*SIZES[i + 1], seed=10 + i) for i in range(2)]
    text = PROMPT.format(images=BOI * 2)
    ref_logprobs: list[float] = []
    expected = reference_greedy(hf, reference_inputs(build_tokenizer(), text, images), 8, ref_logprobs)
    outputs, logprobs, cached, placed = engine_runs(model_dir, chunk, text, images)
    assert outputs["first"] == outputs["again"] == expected
    assert logprobs["first"] == pytest.approx(ref_logprobs, abs=1e-4)
    assert logprobs["again"] == pytest.approx(ref_logprobs, abs=1e-4)
    assert cached["again"] >= placed[-1].offset + placed[-1].num_tokens  # the images from the prefix cache


def test_chunking_and_the_prefix_cache_leave_every_logprob_unchanged(vlm):
    """With int8 weights (one arithmetic at every row count: docs/exactness.md) the answer's logprobs are the
    same bits whether the prompt ran whole or in chunks of 5 around the images, or came from the prefix cache."""
    images = [random_image(*SIZES[i + 1], seed=10 + i) for i in range(2)]
    text = PROMPT.format(images=BOI * 2)
    whole = engine_runs(vlm[0], 2048, text, images, "int8")
    chunked = engine_runs(vlm[0], 5, text, images, "int8")
    assert chunked[0]["first"] == whole[0]["first"]
    assert chunked[1]["first"] == chunked[1]["again"] == whole[1]["first"] == whole[1]["again"]


def test_a_cached_prefix_that_ends_inside_an_image(vlm):
    """A request aborted after its chunk that ends at the image's end leaves cached blocks up to a block boundary
    inside the image; the same prompt then starts there, its image rows seeing the cached ones, and answers as
    transformers does."""
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine
    from sudu.sampling import SamplingParams

    model_dir, hf = vlm
    images = [random_image(100, 70, seed=7)]
    text = PROMPT.format(images="xy " + BOI)
    ref_logprobs: list[float] = []
    expected = reference_greedy(hf, reference_inputs(build_tokenizer(), text, images), 6, ref_logprobs)
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, kv_cache_memory=8 << 20,
                                    max_num_batched_tokens=5, prefill_chunk_when_decoding=5, block_size=4,
                                    kv_cache_dtype="float32", speculative="none"), progress=False)
    ids, placed = sudu_prompt(engine.image_processor, engine.tokenizer, text, images)
    a, b = placed[0].offset, placed[0].offset + placed[0].num_tokens
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    engine.add_request("aborted", engine.check_request(ids, params, placed))
    while not a < engine.block_manager.cached_prefix_tokens(ids, placed) < b:
        assert engine.has_unfinished() and engine.block_manager.cached_prefix_tokens(ids, placed) < a
        engine.step()
    engine.abort("aborted")
    engine.add_request("resumed", engine.check_request(ids, params, placed))
    tokens, logprobs, cached = [], [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
            logprobs.extend(lp.logprob for lp in out.outputs[0].logprobs)
            cached = out.num_cached_tokens
    assert a < cached < b
    assert tokens == expected
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


def test_chunks_never_end_inside_an_image():
    from sudu.engine.scheduler import keep_images_whole
    from sudu.engine.sequence import Sequence
    from sudu.sampling import SamplingParams

    seq = Sequence(request_id="r", index=0, token_ids=list(range(40)), num_prompt_tokens=40, params=SamplingParams(),
                   priority=0, arrival_time=0.0, max_total_tokens=50)
    seq.image_spans = ((10, 20), (25, 30))
    assert keep_images_whole(seq, 5) == 5  # ends before the first image
    assert keep_images_whole(seq, 15) == 10  # would end inside it: cut back to its start
    seq.num_computed_tokens = 10
    assert keep_images_whole(seq, 4) == 10  # starts at it: carried on to its end
    assert keep_images_whole(seq, 17) == 15  # past the first, inside the second: back to the second's start
    seq.num_computed_tokens = 13  # a cached prefix ended inside the image
    assert keep_images_whole(seq, 2) == 7


def test_gemma3_vl_config_needs_a_step_that_holds_an_image(vlm):
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine
    from sudu.errors import SuduError

    with pytest.raises(SuduError, match="one image's 4 tokens"):
        LLMEngine(EngineConfig(model=str(vlm[0]), max_model_len=256, kv_cache_memory=4 << 20,
                               max_num_batched_tokens=3, speculative="none"), progress=False)


# google/gemma-3-4b-it's config.json as released: the text and vision parts hold only what differs from
# transformers' defaults
RELEASED_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_the_released_4b_config_builds_the_reference_network():
    """The released 4B config.json (defaults left out) gives transformers' network: the same tensors by name
    (through sudu's checkpoint-name mapping) and shape, the layer pattern, the image token count."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration as HFGemma3

    from sudu.media.processors import image_processor as sudu_image_processor
    from sudu.model_config import ModelConfig
    from sudu.models import build_model
    from sudu.weights.safetensors import canonical_name

    cfg = ModelConfig.from_hf_config(RELEASED_4B_CONFIG)
    assert cfg.architecture == "gemma3_vl" and cfg.mm_tokens_per_image == 256 and cfg.image_token_id == 262144
    assert cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and cfg.sliding_window == 1024
    assert cfg.rope_theta == 1e6 and cfg.rope_local_base_freq == 1e4 and cfg.rope_scaling_factor == 8.0
    assert cfg.eos_token_id == [1, 106]
    with torch.device("meta"):
        ours = {n: tuple(t.shape) for n, t in build_model(cfg).state_dict().items() if n != "lm_head.weight"}
        hf = HFGemma3(Gemma3Config(**{k: v for k, v in RELEASED_4B_CONFIG.items() if k != "architectures"}))
    theirs = {canonical_name(n, "gemma3_vl"): tuple(t.shape) for n, t in hf.state_dict().items()
              if n != "lm_head.weight"}
    assert ours == theirs
    # the released files' own names
    assert canonical_name("vision_tower.vision_model.encoder.layers.3.mlp.fc1.weight", "gemma3_vl") in ours
    assert canonical_name("language_model.model.layers.33.self_attn.q_norm.weight", "gemma3_vl") in ours
    processor = sudu_image_processor(cfg, {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 2,
                                           "size": {"height": 896, "width": 896}})
    assert (processor.height, processor.width, processor.tokens_per_image) == (896, 896, 256)


def greedy(engine, text: str, images, max_tokens: int = 8) -> list[int]:
    from sudu.sampling import SamplingParams

    ids, placed = sudu_prompt(engine.image_processor, engine.tokenizer, text, images)
    engine.add_request("r", engine.check_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                     ignore_eos=True), placed))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
    return tokens


@pytest.mark.slow  # two runs of llama.cpp's converter (about a minute on two shared cores)
def test_gguf_and_mmproj_from_llama_cpps_converter_give_the_directorys_tokens(tmp_path):
    """The tiny model converted with llama.cpp's convert_hf_to_gguf.py (the language model, and --mmproj the
    vision tower and projector) and served as `--model model.gguf --mmproj mmproj.gguf` answers a two-image
    prompt with the Hugging Face directory's greedy tokens, and transformers'."""
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine
    from tests.helpers.tiny_gemma3_vl import convert_to_gguf

    model_dir, hf = save_tiny_gemma3_vl(tmp_path / "model", gguf_ready=True)
    text_gguf, mmproj = convert_to_gguf(model_dir, tmp_path)
    images = [random_image(100, 70, seed=21), random_image(64, 200, seed=22)]
    text = PROMPT.format(images=BOI * 2)
    expected = reference_greedy(hf, reference_inputs(build_tokenizer(), text, images), 8)
    answers, embeddings = [], []
    for model, extra in ((model_dir, {}), (text_gguf, {"mmproj": str(mmproj)})):
        engine = LLMEngine(EngineConfig(model=str(model), max_model_len=512, kv_cache_memory=8 << 20,
                                        kv_cache_dtype="float32", speculative="none", **extra), progress=False)
        assert engine.model_config.architecture == "gemma3_vl" and engine.model_config.mm_tokens_per_image == 4
        answers.append(greedy(engine, text, images))
        image = engine.image_processor.image_input(images[0], b"0" * 16)
        with torch.inference_mode():
            embeddings.append(engine.runner.model.encode_images(image.pixel_values, [image.grid_thw]))
    assert answers[0] == answers[1] == expected
    # the converter stores the projection in float16 (its rounding is the only difference)
    torch.testing.assert_close(embeddings[1], embeddings[0], atol=5e-3, rtol=0)


def test_mmproj_needs_a_gemma3_language_model(tmp_path):
    from sudu.errors import SuduError
    from sudu.weights.loader import load_checkpoint
    from tests.helpers.gguf_files import write_tiny_gguf

    write_tiny_gguf(tmp_path / "qwen.gguf", "qwen2")
    with pytest.raises(SuduError, match="not a llama.cpp mmproj"):
        load_checkpoint(str(tmp_path / "qwen.gguf"), pull=False, progress=False, mmproj=str(tmp_path / "qwen.gguf"))


def test_images_encoded_between_decode_steps_leave_both_answers_unchanged(vlm, monkeypatch):
    """Two images arriving while another request decodes, encoded one tower stage per step (each of 2 layers'
    attention, then its MLP; then the projector): the prompt's text before the first image runs meanwhile, each
    image is computed whole once it is ready, and both answers' tokens and logprobs are the bits each request
    gives alone (int8 weights)."""
    import sudu.engine.vision_inputs as vision_inputs
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine
    from sudu.sampling import SamplingParams

    config = EngineConfig(model=str(vlm[0]), max_model_len=1024, kv_cache_memory=8 << 20, quantization="int8",
                          kv_cache_dtype="float32", speculative="none", encoder_cache_memory=0)
    first = LLMEngine(config, progress=False)
    images = [random_image(*SIZES[i + 1], seed=30 + i) for i in range(2)]
    image_ids, placed = sudu_prompt(first.image_processor, first.tokenizer, PROMPT.format(images=BOI * 2), images)
    text_ids = first.tokenizer.encode(PROMPT.format(images="Say something long. "), add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    text_alone = step_requests(first, [("text", text_ids, (), params, 0)])
    image_alone = step_requests(LLMEngine(config, progress=False), [("image", image_ids, placed, params, 0)])

    monkeypatch.setattr(vision_inputs, "encode_allowance", lambda scheduler: 0.0)  # one stage per step
    together = LLMEngine(config, progress=False)
    computed = []  # the image request's computed prompt tokens after each step

    def on_step(engine, step):
        state = engine.requests.get("image")
        computed.append(state.seqs[0].num_computed_tokens if state is not None else None)

    outputs, logprobs = step_requests(together, [("text", text_ids, (), params, 0),
                                                ("image", image_ids, placed, params, 3)], on_step)
    assert (outputs["text"], logprobs["text"]) == (text_alone[0]["text"], text_alone[1]["text"])
    assert (outputs["image"], logprobs["image"]) == (image_alone[0]["image"], image_alone[1]["image"])
    # first the text before the first image while its first stage runs, nothing more while its other three
    # do, then the first image whole once its projector has run (never a part of it) while the second is encoded
    assert computed[3] == computed[4] == computed[5] == computed[6] == placed[0].offset
    assert computed[7] >= placed[0].offset + placed[0].num_tokens
    assert together.runner.vision.encoder.stages_run == 8  # both towers' stages ran in jobs, one per step
