"""sudu bench's multimodal suite: generated images (deterministic per seed and salt, the size asked, a new image
per salt); against a tiny Qwen2.5-VL sudu server the suite runs, its declared cold image requests miss every
cache (no cached tokens, the encoder encodes each image), warm ones hit the prefix cache past the image, and
shared-image ones reuse the encoder cache without a prefix hit; the image-to-first-token summary computed from
hand-made records; bad flags are one-line errors."""
from __future__ import annotations

import io

import pytest
from PIL import Image

from sudu.bench.client import RequestRecord
from sudu.bench.images import make_image, parse_sizes
from sudu.bench.metrics import request_metrics
from sudu.bench.multimodal import TEXT_GROUP, group_name
from sudu.bench.report import build_report, markdown_summary
from sudu.bench.suites import Group, Run
from sudu.errors import SuduError
from tests.helpers.bench_cli import read_report, run_cli
from tests.helpers.live_server import LiveServer
from tests.helpers.tiny_vlm import image_processor, save_tiny_vlm

SIZES = [(64, 64), (224, 168)]


def test_images_are_deterministic_per_seed_and_salt():
    a, b, c = make_image(224, 168, 3, "run:0"), make_image(224, 168, 3, "run:0"), make_image(224, 168, 3, "run:1")
    assert a.png == b.png and a.digest == b.digest
    assert c.digest != a.digest and c.png != a.png
    assert make_image(224, 168, 4, "run:0").digest != a.digest
    decoded = Image.open(io.BytesIO(a.png))
    assert decoded.size == (224, 168) and decoded.mode == "RGB"
    assert a.data_url.startswith("data:image/png;base64,")
    assert parse_sizes("448x448, 1024X768") == [(448, 448), (1024, 768)]
    for bad in ("448", "0x10", "axb", ""):
        with pytest.raises(SuduError):
            parse_sizes(bad)


def _rec(rid, group, state, ttft, prompt_tokens, cached=0, warmup=False, tokens=5, gap=0.01):
    rec = RequestRecord(request_id=rid, group=group, cache_state=state, warmup=warmup, status=200)
    rec.chunk_times_s = [ttft + gap * i for i in range(tokens)]
    rec.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
    rec.metrics = request_metrics(rec)
    return rec


def test_image_to_first_token_summary_from_hand_made_records():
    cold, warm, shared = (group_name(448, 448, s) for s in ("cold", "warm", "shared-image"))
    run = Run(suite="multimodal", target={}, config={})
    run.groups = [Group(TEXT_GROUP, "cold"), Group(cold, "cold"), Group(warm, "warm"), Group(shared, "shared-image")]
    run.records = [
        _rec(0, TEXT_GROUP, "cold", 0.1, 20), _rec(1, TEXT_GROUP, "cold", 0.3, 21), _rec(2, TEXT_GROUP, "cold", 0.2, 20),
        _rec(3, cold, "cold", 9.0, 500, warmup=True),  # a priming request: never in a figure
        _rec(4, cold, "cold", 1.0, 120), _rec(5, cold, "cold", 1.4, 121), _rec(6, cold, "cold", 1.2, 120, cached=4),
        _rec(7, warm, "warm", 0.3, 120, cached=112), _rec(8, warm, "warm", 0.5, 121, cached=112),
        _rec(9, shared, "shared-image", 0.6, 120), _rec(10, shared, "shared-image", 0.6, 120, cached=64),
    ]
    run.multimodal = {"sizes": [(448, 448)], "states": ["cold", "warm", "shared-image"],
                      "evidence": {cold: {"hits": 1.0, "misses": 2.0, "seconds": 1.5, "requests": 3},
                                   shared: {"hits": 1.0, "misses": 1.0, "seconds": 0.7, "requests": 2}}}
    report = build_report(run)
    mm = report["multimodal"]
    assert mm["text_only"]["ttft_s"] == pytest.approx(0.2) and mm["text_only"]["prompt_tokens"] == 20
    row = mm["sizes"][0]
    assert row["cold"]["ttft_s"] == pytest.approx(1.2) and row["cold"]["n"] == 3  # the 9 s priming one left out
    assert row["image_tokens"] == 100  # median 120 - median 20
    assert row["image_cost_s"] == pytest.approx(1.0)  # 1.2 - 0.2
    assert row["warm"]["ttft_s"] == pytest.approx(0.4) and row["warm"]["cached_tokens"] == 112
    assert row["cold_over_warm"] == pytest.approx(3.0)
    assert row["cold_over_shared_image"] == pytest.approx(2.0)
    assert row["cold"]["output_speed_tok_s"] == pytest.approx(100.0)  # chunks 10 ms apart
    assert row["shared-image"]["encoder"]["hits"] == 1.0
    flags = report["flags"]
    assert any("request 10" in f and "shared-image" in f for f in flags)  # 64 cached tokens past the salt
    assert any(f.startswith(cold) and "1 hits" in f for f in flags)  # a cold image the encoder cache held
    assert any(f.startswith(shared) and "encoded it again 1 of 2" in f for f in flags)
    assert not any("request 9" in f for f in flags)
    text = markdown_summary(report)
    assert "| 448x448 | 100 | 200.0 | 1200.0 (0) | 1000.0 | 400.0 (112) | 600.0 (1/2) | 3.00x | 2.00x | 100.0 |" in text


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    from sudu.config import EngineConfig
    from sudu.engine.async_engine import AsyncLLMEngine
    from sudu.server.app import build_app

    model_dir, _ = save_tiny_vlm(tmp_path_factory.mktemp("bench_vlm") / "model")
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, kv_cache_memory=8 << 20,
                                         max_num_seqs=4, block_size=16), max_queue_len=16)
    with LiveServer(build_app(engine, served_model_name="tiny-vl")) as server:
        server.wait_healthy()
        yield server


def test_multimodal_suite_on_a_tiny_vlm_server(vlm_server, tmp_path):
    code = run_cli(["multimodal", "--url", vlm_server.url, "--sizes", ",".join(f"{w}x{h}" for w, h in SIZES),
                    "-n", "2", "--max-tokens", "4", "--ignore-eos", "--out", str(tmp_path), "--no-html",
                    "--no-progress"])
    assert code == 0
    _, rep = read_report(tmp_path, "multimodal")
    groups = {g["name"]: g for g in rep["groups"]}
    measured = [r for r in rep["records"] if not r["warmup"]]
    assert measured and all(r["ok"] for r in rep["records"])
    pads = {size: int(image_processor()(images=[Image.new("RGB", size)], return_tensors="pt")["image_grid_thw"]
                      .prod() // 4) for size in SIZES}
    cold_digests = []
    for (w, h) in SIZES:
        cold = [r for r in measured if r["group"] == group_name(w, h, "cold")]
        warm = [r for r in measured if r["group"] == group_name(w, h, "warm")]
        shared = [r for r in measured if r["group"] == group_name(w, h, "shared-image")]
        assert len(cold) == len(warm) == len(shared) == 2
        # cold: nothing cached, a new image every time, each one encoded
        assert all(r["metrics"]["cached_tokens"] <= 16 for r in cold)
        cold_digests += [r["images"][0]["sha256_16"] for r in cold]
        assert all(r["images"][0]["width"] == w and r["images"][0]["height"] == h for r in cold)
        assert rep["multimodal"]["sizes"][SIZES.index((w, h))]["cold"]["encoder"] == pytest.approx(
            {"hits": 0, "misses": 2, "seconds": rep["multimodal"]["sizes"][SIZES.index((w, h))]["cold"]["encoder"]["seconds"],
             "requests": 2})
        # warm: the prompt cached past the whole image (all but the last block)
        assert all(r["metrics"]["cached_tokens"] >= r["metrics"]["prompt_tokens"] - 16 for r in warm)
        assert all(r["metrics"]["cached_tokens"] > pads[(w, h)] for r in warm)
        # shared-image: no prefix hit past the salt, and the encoder cache held every image
        assert all(r["metrics"]["cached_tokens"] <= 16 for r in shared)
        ev = rep["multimodal"]["sizes"][SIZES.index((w, h))]["shared-image"]["encoder"]
        assert ev["hits"] == 2 and ev["misses"] == 0
        row = rep["multimodal"]["sizes"][SIZES.index((w, h))]
        # the image's tokens as the server counted them: its pads plus the start and end markers and a newline,
        # give or take the salt's tokens
        assert pads[(w, h)] + 1 <= row["image_tokens"] <= pads[(w, h)] + 6
        assert groups[group_name(w, h, "cold")]["metrics"]["ttft_s"]["n"] == 2
    assert len(set(cold_digests)) == len(cold_digests)
    assert groups[TEXT_GROUP]["observed_cache"]["mean_cached_tokens"] == 0
    assert not [f for f in rep["flags"] if "cache" in f or "cached" in f or "encoded" in f]
