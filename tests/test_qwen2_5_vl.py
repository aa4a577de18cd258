"""Qwen2.5-VL against transformers on a tiny random model: sudu's image preprocessing gives the reference
processor's pixel values and grids; the network's logits over prompts with one and two images match within
1e-4 (float32); the engine's greedy tokens equal transformers' greedy tokens, with the image's tokens split
across prompt chunks and served from the prefix cache too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.tiny_vlm import (PLACEHOLDER, build_vl_tokenizer, image_processor, random_image,
                                    reference_greedy, reference_inputs, save_tiny_vlm, step_requests,
                                    sudu_processor)

PROMPT = "<|im_start|>user\n{images}Describe it.<|im_end|>\n<|im_start|>assistant\n"
SIZES = [(100, 70), (64, 200), (333, 251), (28, 28)]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl") / "model")



@pytest.mark.parametrize("size", SIZES)
def test_preprocessing_matches_transformers(vlm, size):
    from sudu.media.qwen_vl import QwenVLProcessor

    image = random_image(*size, seed=sum(size))
    reference = image_processor()(images=[image], return_tensors="np")
    _, processor = sudu_processor(vlm[0])
    assert isinstance(processor, QwenVLProcessor)
    pixels, grid = processor.preprocess(image)
    assert list(grid) == reference["image_grid_thw"][0].tolist()
    assert pixels.shape == reference["pixel_values"].shape
    np.testing.assert_array_equal(pixels, reference["pixel_values"])


def sudu_prompt(processor, tokenizer, text: str, images):
    from sudu.media.image import content_hash
    from tests.helpers.tiny_vlm import png_bytes

    ids = tokenizer.encode(text, add_special_tokens=False)
    inputs = [processor.image_input(im, content_hash(png_bytes(im))) for im in images]
    return processor.expand(ids, inputs)


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_transformers(vlm, num_images):
    from sudu.config import EngineConfig
    from sudu.engine.network import prepare_network
    from sudu.engine.text_eval import float_pools
    from sudu.layers.attention import build_metadata

    model_dir, hf = vlm
    images = [random_image(*SIZES[i], seed=i) for i in range(num_images)]
    text = PROMPT.format(images=PLACEHOLDER * num_images)
    ref_inputs = reference_inputs(build_vl_tokenizer(), text, images)
    with torch.no_grad():
        expected = hf(**ref_inputs).logits[0]
    ckpt, processor = sudu_processor(model_dir)
    ids, placed = sudu_prompt(processor, ckpt.tokenizer, text, images)
    assert ids == ref_inputs["input_ids"][0].tolist()
    model, _ = prepare_network(ckpt, EngineConfig(model=str(model_dir), quantization="none"))
    n = len(ids)
    with torch.inference_mode():
        positions, _ = model.prompt_positions(n, placed)
        embeds = model.encode_images(torch.cat([p.pixel_values for p in placed]), [p.grid_thw for p in placed])
        rows = torch.cat([torch.arange(p.offset, p.offset + p.num_tokens) for p in placed])
        meta = build_metadata([n], [torch.arange(n)], float_pools(model.config, n), None)
        logits = model.compute_logits(model(torch.tensor(ids), positions, meta, image_rows=(rows, embeds)))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_images,chunk", [(1, 2048), (2, 2048), (2, 7)])
def test_greedy_tokens_match_transformers(vlm, num_images, chunk):
    """chunk 7: the prompt runs in chunks of 7 tokens, images split across them."""
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine
    from sudu.sampling import SamplingParams

    model_dir, hf = vlm
    images = [random_image(*SIZES[i + 1], seed=10 + i) for i in range(num_images)]
    text = PROMPT.format(images=PLACEHOLDER * num_images)
    ref_logprobs: list[float] = []
    expected = reference_greedy(hf, reference_inputs(build_vl_tokenizer(), text, images), 8, ref_logprobs)
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, kv_cache_memory=8 << 20,
                                    max_num_batched_tokens=chunk, prefill_chunk_when_decoding=chunk,
                                    kv_cache_dtype="float32", speculative="none"), progress=False)
    ids, placed = sudu_prompt(engine.image_processor, engine.tokenizer, text, images)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs, logprobs, cached = {}, {}, {}
    for rid in ("first", "again"):  # the second run's prompt comes from the prefix cache
        engine.add_request(rid, engine.check_request(ids, params, placed))
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
                logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.outputs[0].logprobs)
                cached[out.request_id] = out.num_cached_tokens
    assert outputs["first"] == expected
    assert outputs["again"] == expected
    # every decode step's position too (text after the image shifted by the image's rope index)
    assert logprobs["first"] == pytest.approx(ref_logprobs, abs=1e-4)
    assert logprobs["again"] == pytest.approx(ref_logprobs, abs=1e-4)
    assert cached["again"] >= placed[-1].offset + placed[-1].num_tokens - engine.config.block_size


def test_int8_quantizes_the_vision_tower_too(vlm):
    """--quantization int8 runs the vision tower's linears on the quantized path as well; the image still steers
    the answer (two different images, two different greedy continuations of the same text)."""
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine
    from sudu.layers.linear import QuantizedLinear
    from sudu.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(vlm[0]), max_model_len=1024, kv_cache_memory=8 << 20,
                                    quantization="int8", speculative="none"), progress=False)
    visual = engine.runner.model.visual
    assert isinstance(visual.blocks[0].attn.qkv, QuantizedLinear)
    assert isinstance(visual.blocks[0].mlp.down_proj, QuantizedLinear)
    assert isinstance(visual.merger.mlp[0], QuantizedLinear)
    text = PROMPT.format(images=PLACEHOLDER)
    answers = []
    for seed in (1, 2):
        ids, placed = sudu_prompt(engine.image_processor, engine.tokenizer, text, [random_image(100, 70, seed=seed)])
        engine.add_request(str(seed), engine.check_request(ids, SamplingParams(temperature=0.0, max_tokens=12,
                                                                              ignore_eos=True), placed))
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.outputs[0].token_ids)
        answers.append(tokens)
    assert len(answers[0]) == 12 and answers[0] != answers[1]


def run_requests(engine, rid: str, ids, placed) -> tuple[list[int], int, int]:
    """(greedy tokens, cached prompt tokens, of those from disk) of one request run to its end."""
    from sudu.sampling import SamplingParams

    engine.add_request(rid, engine.check_request(ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                                 placed))
    tokens, cached, disk = [], 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
            cached, disk = out.num_cached_tokens, out.num_cached_tokens_disk
    return tokens, cached, disk


def test_disk_tier_serves_a_repeated_image_and_never_another(vlm, tmp_path):
    """After a restart, the same image's prompt is served from the disk tier through the image (same tokens);
    another image in the same place is not served past the image's first position."""
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine

    def engine():
        return LLMEngine(EngineConfig(model=str(vlm[0]), max_model_len=1024, kv_cache_memory=8 << 20,
                                      speculative="none", disk_cache_size="64MiB", disk_cache_dir=str(tmp_path)),
                         progress=False)

    text = PROMPT.format(images=PLACEHOLDER) + "The picture shows"
    first = engine()
    ids, placed = sudu_prompt(first.image_processor, first.tokenizer, text, [random_image(100, 70, seed=1)])
    other_ids, other = sudu_prompt(first.image_processor, first.tokenizer, text, [random_image(100, 70, seed=2)])
    assert other_ids == ids  # the same tokens: only the image's hash tells the prompts apart
    cold, _, _ = run_requests(first, "cold", ids, placed)
    other_cold, _, _ = run_requests(first, "other-cold", other_ids, other)
    first.close()
    restarted = engine()
    image_end = placed[0].offset + placed[0].num_tokens
    tokens, cached, disk = run_requests(restarted, "warm", ids, placed)
    assert tokens == cold and disk == cached >= image_end
    # the other image's blocks are on disk too (it ran above); a third image finds none of them
    third_ids, third = sudu_prompt(restarted.image_processor, restarted.tokenizer, text,
                                   [random_image(100, 70, seed=3)])
    _, cached, _ = run_requests(restarted, "third", third_ids, third)
    assert cached <= placed[0].offset
    tokens, cached, _ = run_requests(restarted, "other-warm", other_ids, other)
    assert tokens == other_cold and cached >= image_end


def test_an_image_is_encoded_between_decode_steps_and_answers_are_unchanged(vlm, monkeypatch):
    """An image request arriving while another request decodes: with no time to spare per step, its tower runs
    one stage per step (each of 3 blocks' attention, then its MLP; then the merger), the decoding stream gets
    its token every step meanwhile, the image's tokens are scheduled only once its embeddings are ready, and
    both answers (tokens and logprobs) are what each request gives alone."""
    import sudu.engine.vision_inputs as vision_inputs
    from sudu.config import EngineConfig
    from sudu.engine.llm_engine import LLMEngine
    from sudu.sampling import SamplingParams

    model_dir, _ = vlm
    # int8 weights: the native kernels, whose rows do not depend on what shares their step (float weights run
    # PyTorch GEMMs, which are not batch-invariant: docs/exactness.md)
    config = EngineConfig(model=str(model_dir), max_model_len=1024, kv_cache_memory=8 << 20, quantization="int8",
                          kv_cache_dtype="float32", speculative="none", encoder_cache_memory=0)

    def engine():
        return LLMEngine(config, progress=False)

    first = engine()
    images = [random_image(*SIZES[2], seed=21)]
    image_ids, placed = sudu_prompt(first.image_processor, first.tokenizer, PROMPT.format(images=PLACEHOLDER), images)
    text_ids = first.tokenizer.encode(PROMPT.format(images="Say something long. "), add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    text_alone = step_requests(first, [("text", text_ids, (), params, 0)])
    image_alone = step_requests(engine(), [("image", image_ids, placed, params, 0)])

    monkeypatch.setattr(vision_inputs, "encode_allowance", lambda scheduler: 0.0)  # one stage per step
    together = engine()
    encoder = together.runner.vision.encoder
    seen = []  # per step: (stages run so far, the text request's tokens, whether the image request has a token)

    def on_step(engine, step):
        seen.append((encoder.stages_run, len(engine.requests["text"].seqs[0].output_token_ids)
                     if "text" in engine.requests else None,
                     bool("image" in engine.requests and engine.requests["image"].seqs[0].output_token_ids)))

    outputs, logprobs = step_requests(together, [("text", text_ids, (), params, 0), ("image", image_ids, placed, params, 3)],
                                   on_step)
    assert outputs["text"] == text_alone[0]["text"] and logprobs["text"] == text_alone[1]["text"]
    assert outputs["image"] == image_alone[0]["image"] and logprobs["image"] == image_alone[1]["image"]
    # the image came at step 3 with the text request decoding: one tower stage per step from then on, the text
    # request's token count growing by one each of those steps, and the image request's first token only after
    # the merger ran (the step after the last stage)
    stages = [b for b, _, _ in seen]
    assert stages[:3] == [0, 0, 0] and stages[3:9] == [1, 2, 3, 4, 5, 6]
    tokens = [t for _, t, _ in seen]
    assert [b - a for a, b in zip(tokens[2:9], tokens[3:10])] == [1] * 7
    assert not any(has for _, _, has in seen[:10])
    assert encoder.jobs == {} and encoder.done == {}  # nothing held once the image was read


def test_a_chunk_stops_before_an_image_that_is_not_ready():
    from types import SimpleNamespace

    from sudu.engine.scheduler import stop_before_unready
    from sudu.media.image import ImageInput

    a = ImageInput(b"a", torch.zeros(1), (1, 1, 1), offset=10, num_tokens=5)
    b = ImageInput(b"b", torch.zeros(1), (1, 1, 1), offset=20, num_tokens=5)
    seq = SimpleNamespace(num_computed_tokens=4, images=(a, b))
    assert stop_before_unready(seq, 30, lambda image: True) == 30
    assert stop_before_unready(seq, 30, lambda image: image is a) == 16  # up to b's start
    assert stop_before_unready(seq, 30, lambda image: False) == 6  # up to a's start
    assert stop_before_unready(seq, 5, lambda image: False) == 5  # the chunk ends before a
    seq.num_computed_tokens = 12  # a cached prefix ended inside a: nothing until a is encoded
    assert stop_before_unready(seq, 30, lambda image: image is b) == 0
