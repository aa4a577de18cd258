"""Stream interval (engine/stream_interval.py): outputs waiting for the consumer are joined into one item;
with an interval N > 1 items after the first token carry N new tokens, the finish is never held, an
error ends the stream after what came before it, and the tokens are the same as one item per step."""
from __future__ import annotations

import asyncio

import pytest

from sudu.config import EngineConfig
from sudu.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from sudu.engine.stream_interval import coalesced
from sudu.sampling import SamplingParams
from tests.helpers.greedy import GREEDY, prompts_of


def out(tokens: list[int], finished: bool = False, index: int = 0, logprobs: bool = False) -> RequestOutput:
    lps = [TokenLogprob(t, str(t), -0.5) for t in tokens] if logprobs else None
    choice = CompletionOutput(index, "".join(f"<{t}>" for t in tokens), list(tokens), lps,
                              "length" if finished else None, None, tokens[-1] if tokens else 0)
    return RequestOutput("r", [7, 8], [choice], finished, 0, RequestMetrics(0.0))


def test_then_joins_each_choices_deltas_and_keeps_the_later_state():
    a = out([1, 2], logprobs=True)
    a.outputs.append(CompletionOutput(1, "x", [9], None))
    b = out([3], finished=True, logprobs=True)
    b.outputs.append(CompletionOutput(2, "y", [5], None, "stop", "y"))
    b.num_cached_tokens, b.route = 16, {"replica": "A"}
    joined = a.then(b)
    assert [c.index for c in joined.outputs] == [0, 1, 2]
    first = joined.outputs[0]
    assert first.token_ids == [1, 2, 3] and first.text == "<1><2><3>"
    assert [e.token_id for e in first.logprobs] == [1, 2, 3]
    assert first.finish_reason == "length" and first.num_output_tokens == 3
    assert joined.outputs[1].token_ids == [9] and joined.outputs[2].stop_reason == "y"
    assert joined.finished and joined.num_cached_tokens == 16 and joined.route == {"replica": "A"}
    assert joined.prompt_token_ids == [7, 8] and joined.most_new_tokens == 3
    assert out([1]).then(out([2])).outputs[0].logprobs is None


def run_feed(interval: int, feed) -> list:
    """Feed items to a coalesced stream one at a time, letting the consumer run after each; returns what
    the consumer had received after each item (and the error it ended with, if any)."""
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        got: list = []

        async def consume():
            try:
                async for item in coalesced(queue, interval):
                    got.append(item.outputs[0].token_ids if item.outputs else [])
            except RuntimeError as exc:
                got.append(str(exc))

        task = asyncio.ensure_future(consume())
        seen = []
        for batch in feed:
            for item in batch:
                queue.put_nowait(item)
            for _ in range(5):
                await asyncio.sleep(0)
            seen.append(list(got))
        await asyncio.wait_for(task, 5)
        return seen

    return asyncio.run(scenario())


def test_first_token_goes_at_once_then_items_carry_the_interval_and_the_finish_is_not_held():
    seen = run_feed(3, [[out([1])], [out([2])], [out([3])], [out([4])], [out([5], finished=True)]])
    assert seen == [[[1]], [[1]], [[1]], [[1], [2, 3, 4]], [[1], [2, 3, 4], [5]]]


def test_outputs_waiting_for_the_consumer_go_as_one_item():
    seen = run_feed(1, [[out([1]), out([2]), out([3])], [out([4])], [out([5, 6], finished=True)]])
    assert seen == [[[1, 2, 3]], [[1, 2, 3], [4]], [[1, 2, 3], [4], [5, 6]]]


def test_an_error_ends_the_stream_after_the_tokens_before_it():
    seen = run_feed(4, [[out([1])], [out([2])], [RuntimeError("engine failed")]])
    assert seen[-1] == [[1], [2], "engine failed"]


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0).validate()


@pytest.mark.parametrize("interval", [1, 4])
def test_the_engine_streams_the_same_tokens_in_fewer_items(tiny_model_dirs, interval):
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["qwen2"]), kv_cache_memory=8 << 20, speculative="none",
                          stream_interval=interval)
    engine = AsyncLLMEngine(config, progress=False)
    prompt = prompts_of([11], seed=5)[0]
    eng = engine.engine
    eng.add_request("ref", prompt, SamplingParams(max_tokens=13, **GREEDY))
    want = []
    while eng.has_unfinished():
        want += [t for o in eng.step() for c in o.outputs for t in c.token_ids]

    async def scenario():
        await engine.start()
        items = [o async for o in engine.generate("s", engine.check_request(prompt, SamplingParams(max_tokens=13, **GREEDY)))]
        await engine.shutdown(1)
        return items

    items = asyncio.run(scenario())
    assert [t for o in items for c in o.outputs for t in c.token_ids] == want
    assert items[-1].finished and items[-1].outputs[0].finish_reason == "length"
    if interval > 1:
        assert len(items) <= 1 + -(-12 // interval)
        assert all(o.most_new_tokens >= interval for o in items[1:-1])
