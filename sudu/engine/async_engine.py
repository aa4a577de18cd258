"""AsyncLLMEngine: runs LLMEngine.step() in its own thread and streams each request's outputs to an
asyncio consumer, so the HTTP event loop never waits on a forward pass.

The event loop never touches the engine directly: adds and aborts go through a command queue that the
engine thread drains between steps; outputs come back through each request's asyncio.Queue via
call_soon_threadsafe. A request is validated once, by `check_request` in the caller (so a bad one fails
there with a clear error), and the CheckedRequest it returns is what `generate` queues.

Faults: the engine fails a request whose fault it can pin on it (LLMEngine.step). Anything that escapes
a step, or the engine thread itself, means the engine cannot continue: `failure` is set, every stream
ends with EngineFailedError, new requests get it at once, and `wait_failed()` returns (the server then
answers 503 and exits non-zero, for a supervisor to restart it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from sudu.config import EngineConfig
from sudu.engine.llm_engine import LLMEngine
from sudu.engine.outputs import RequestOutput
from sudu.engine.stream_interval import coalesced
from sudu.engine.memory import kv_resident_bytes
from sudu.engine.request import CheckedRequest
from sudu.engine.promises import Promise, PromiseBook
from sudu.engine.schedule_policy import is_continuing
from sudu.engine.wait_predictor import EngineLoad, SeqLoad, WaitPrediction, predict_wait, snapshot
from sudu.errors import EngineFailedError
from sudu.sampling import SamplingParams

log = logging.getLogger(__name__)

TRANSIT_EXPIRY_S = 30.0  # an admitted request whose generate never came stops counting after this
PROMISE_GRACE_S = 5.0  # a refused request's place is kept this long after its Retry-After has passed
# promised turns fill this share of the engine's measured pace: a queue served at exactly its capacity has no
# room for the spread of service times and its wait grows without bound (a random walk); the rest of the
# capacity goes to new arrivals admitted into the gaps
PROMISED_UTILIZATION = 0.85
# a client back at its turn is admitted if its first token is due within this many times --max-queue-wait (at
# the measured pace): its Retry-After was a prediction too, and being refused twice for a near miss would
# break the promise for little gain
PROMISE_SLACK = 1.4


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, max_queue_len: int = 256, progress: bool = True,
                 engine: LLMEngine | None = None, stall_timeout_s: float = 300.0):
        self.engine = engine or LLMEngine(config, progress=progress)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.grammar_backend = self.engine.grammar_backend
        self.model_name = config.model
        self.max_model_len = self.engine.max_model_len
        self.max_queue_len = max_queue_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._stats = self.engine.stats()
        # admission by predicted wait (wait_predictor.py): the queue as of the last step, and the requests
        # admitted since, which that snapshot does not show yet
        self._load = EngineLoad()
        self._admission_lock = threading.Lock()
        self._in_transit: dict[str, tuple[float, tuple[SeqLoad, ...]]] = {}  # id -> (admitted at, loads)
        self._added_since_snapshot: list[str] = []
        # refused requests' places, by (the prompt, max_tokens, priority): one that comes back after its
        # Retry-After is predicted and queued from its first arrival, ahead of those that came later, and
        # its work counts ahead of new arrivals in the share that clients come back (promises.py)
        self._promises = PromiseBook(PROMISE_GRACE_S)
        self._arrival_of: dict[str, float] = {}  # admitted returning request -> its first arrival
        self.failure: str | None = None  # why the engine cannot continue, once it cannot
        self._failed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # a step that has not returned after stall_timeout_s (a hung kernel, a deadlock) is a failure
        # too: nobody would ever be answered otherwise
        self.stall_timeout_s = stall_timeout_s
        self._step_started_at: float | None = None  # time.monotonic() while a step runs

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._failed = asyncio.Event()
            self._thread = threading.Thread(target=self._run, name="sudu-engine", daemon=True)
            self._thread.start()
            threading.Thread(target=self._watch_steps, name="sudu-engine-watchdog", daemon=True).start()
            # the grammar engine's view of the vocabulary takes a moment to build: not on the first
            # structured-output request's clock
            threading.Thread(target=self.engine.grammar_backend.warm, name="sudu-grammar-warm", daemon=True).start()

    async def wait_failed(self) -> str:
        """Return (with the reason) once the engine cannot continue; never, while it can."""
        await self._failed.wait()
        return self.failure

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop accepting; let in-flight requests finish for up to timeout_s, then fail the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self.num_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._streams_lock:
            left = list(self._streams)
        for rid in left:
            self._commands.put(("abort", rid, "the server is shutting down"))
        self._wake.set()
        while self.num_unfinished() and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.02)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None
        await asyncio.to_thread(self.engine.close)

    # ---- requests -------------------------------------------------------------------------------
    def num_unfinished(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    def is_full(self) -> bool:
        return self.num_unfinished() >= self.config.max_num_seqs + self.max_queue_len

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, images: tuple = ()
                      ) -> CheckedRequest:
        """Raise RequestTooLongError / ValueError now for a request that can never run. Reads only what
        is fixed at load, so any thread may call it. images: a vision-language prompt's (media.image.ImageInput)."""
        return self.engine.check_request(prompt_token_ids, params, images)

    @property
    def image_processor(self):
        """The model's image preprocessing (media/), or None for a model without vision."""
        return self.engine.image_processor

    def try_admit(self, request_id: str, request: CheckedRequest, priority: int = 0) -> WaitPrediction:
        """Predict the request's wait (uncached prompt from the context cache's lookup, the queue ahead of
        it, the measured speed) and admit it if that is within config.max_queue_wait; an admitted request
        counts in the next predictions until the engine has it. The caller then calls generate (or drops
        the request: its reservation expires). A refused one keeps its place: the same request (prompt,
        max_tokens, priority) coming back after its Retry-After is predicted, and queued, from its first
        arrival. Any thread; the prompt's lookup hashes it, so a worker's."""
        ids = request.prompt_token_ids
        cached = self.engine.block_manager.cached_prefix_tokens(ids, request.images)
        key = hash((tuple(ids), request.max_tokens, priority))
        now = time.perf_counter()
        with self._admission_lock:
            for rid, (at, _) in list(self._in_transit.items()):
                if now - at > TRANSIT_EXPIRY_S:
                    del self._in_transit[rid]
            self._promises.expire(now)
            promise = self._promises.redeem(key)
            arrival = promise.arrival if promise is not None else now
            new = SeqLoad(len(ids) - cached, request.max_tokens, 0, priority, is_continuing(cached, len(ids)), arrival)
            transit = tuple(s for _, loads in self._in_transit.values() for s in loads)
            base = self._load

            limit = self.config.max_queue_wait

            def predict(promised: tuple[SeqLoad, ...]) -> WaitPrediction:
                load = EngineLoad(base.running, base.waiting + transit + promised)
                return predict_wait(load, new, self.config.max_num_seqs, self.engine.wait_model.rates,
                                    limit, now, self.config.priority_aging_s)[0]

            # admitted now: the promises due before its first token would be ahead of it. A request that would
            # start at once on the engine's real queue (a free slot, no prompt ahead) is admitted whatever was
            # promised: refusing it would only idle the engine, and the promises' owners still go first when
            # they come back
            due_soon = self._promises.ahead(now, self.config.max_queue_wait)
            prediction = predict(due_soon)
            if not prediction.admitted and len(self._promises):
                now_alone = predict(())
                if now_alone.queue_s == 0.0:
                    prediction = now_alone
            rates = self.engine.wait_model.rates
            if not prediction.admitted and promise is not None and rates.turn_s is not None:
                # a client back at its turn is judged at the pace its turn was placed by: the requests not yet
                # started ahead of it at the measured seconds per first token, then its own prompt, held to
                # PROMISE_SLACK x the limit. The per-request model, which admission holds new arrivals to,
                # overestimates a full engine's queue; a promise should not fail on that. A queue that did grow
                # past the slack (the engine fell behind its pace) still refuses it
                aging_s = self.config.priority_aging_s
                key_now = new.key(now, aging_s)
                unstarted = sum(1 for s in base.running if s.output_tokens == 0) + sum(
                    1 for s in base.waiting + transit + due_soon if s.key(now, aging_s) < key_now)
                paced = unstarted * rates.turn_s
                own = (prediction.wait_s or 0.0) - (prediction.queue_s or 0.0)  # its own prompt's time
                if paced + own <= PROMISE_SLACK * limit:
                    prediction = dataclasses.replace(prediction, admitted=True, retry_after_s=0.0, queue_s=paced)
            loads = (new,) * request.params.n
            if prediction.admitted:
                self._in_transit[request_id] = (now, loads)
                if promise is not None:
                    self._arrival_of[request_id] = arrival
            elif prediction.wait_s is not None:
                # told to come back at its turn in a virtual queue of the promises (promises.py): after the
                # engine's own queue has drained, and after the latest turn still promised by its share of
                # the engine. That share is measured: the seconds per first token while the engine runs at
                # capacity (over a long queue of requests like the recent ones, a per-request model's errors
                # add up; the measured pace does not), stretched to PROMISED_UTILIZATION. Until measured, the
                # model's cost of one more request like it. Predictions come at the tail's calibration; a
                # drain is priced at the mean ratio
                scale = rates.mean_ratio / rates.calibration
                own_queue = predict(())
                if rates.turn_s is not None:
                    step = rates.turn_s * request.params.n / PROMISED_UTILIZATION
                else:
                    one_more = dataclasses.replace(new, tiebreak=new.tiebreak - 1)  # queued just ahead of it
                    step = max(predict((one_more,) * request.params.n).queue_s - own_queue.queue_s, 0.0) * scale
                turn = self._promises.next_turn(now, own_queue.queue_s * scale, step)
                prediction = dataclasses.replace(prediction, retry_after_s=max(1, math.ceil(turn - now)))
                self._promises.keep(key, Promise(now + prediction.retry_after_s, arrival, loads, turn))
        return prediction

    async def generate(self, request_id: str, request: CheckedRequest, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:  # under the lock: a failure cannot slip between this check and the add
            if self.failure is not None:
                raise EngineFailedError(self.failure)
            if not self._accepting:
                raise RuntimeError("the engine is shutting down")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        with self._admission_lock:
            queued_since = self._arrival_of.pop(request_id, None)
        self._commands.put(("add", request_id, (request, priority, time.perf_counter(), queued_since)))
        self._wake.set()
        finished = False
        try:
            async with aclosing(coalesced(stream.queue, self.config.stream_interval)) as outputs:
                async for out in outputs:
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    async def run_in_engine(self, fn):
        """fn(engine) run in the engine thread between steps (the pool and the prefix cache hold still),
        in order with the requests added before and after it; returns its result or raises its error."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", None, (fn, future)))
        self._wake.set()
        return await future

    def stats(self) -> dict:
        """Engine counters as of the last step (read without stopping the engine thread), the admission's
        measured speed, and the KV pools' resident bytes now (mincore: the pool commits pages as the
        prefix cache spreads over it, up to --kv-cache-memory)."""
        rates = self.engine.wait_model.rates
        with self._admission_lock:
            in_transit, book = len(self._in_transit), self._promises
            promised, kept, expired, show_rate = len(book), book.kept, book.expired, book.show_rate
        return {
            **self._stats,
            "admission_in_transit": in_transit,
            "admission_promised": promised,
            "admission_promises_kept": kept,
            "admission_promises_expired": expired,
            "admission_show_rate": show_rate,
            "admission_prefill_s_per_token": rates.prefill_s_per_token or 0.0,
            "admission_decode_step_s": rates.decode_step_s or 0.0,
            "admission_turn_s": rates.turn_s or 0.0,
            "admission_calibration": rates.calibration,
            "memory_kv_resident_bytes": kv_resident_bytes(self.engine),
        }

    # ---- the engine thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
            if stream is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_commands(self) -> None:
        eng = self.engine
        while True:
            try:
                kind, rid, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                fn, future = payload
                try:
                    result, error = fn(eng), None
                except Exception as exc:  # noqa: BLE001 -- the caller's fault: it gets the error, the loop goes on
                    result, error = None, exc
                loop = future.get_loop()
                if error is None:
                    loop.call_soon_threadsafe(lambda f=future, r=result: f.done() or f.set_result(r))
                else:
                    loop.call_soon_threadsafe(lambda f=future, e=error: f.done() or f.set_exception(e))
            elif kind == "add":
                self._added_since_snapshot.append(rid)
                request, priority, arrival, queued_since = payload
                try:
                    eng.add_request(rid, request, priority=priority, arrival_time=arrival, queued_since=queued_since)
                except Exception as exc:  # noqa: BLE001 -- this request's fault: fail it, keep the loop
                    self._deliver(rid, exc)
            elif rid in eng.requests:
                eng.abort(rid, error=payload)

    def _run(self) -> None:
        try:
            self._loop_steps()
        except BaseException as exc:  # noqa: BLE001 -- the engine cannot continue; say so, fail everyone
            self._fail(exc)

    def _snapshot(self) -> None:
        """Publish the engine's counters and queue; requests now in the queue leave the transit list."""
        eng = self.engine
        self._stats = eng.stats()
        load = snapshot(eng.scheduler)
        with self._admission_lock:
            self._load = load
            for rid in self._added_since_snapshot:
                self._in_transit.pop(rid, None)
        self._added_since_snapshot.clear()

    def _loop_steps(self) -> None:
        eng = self.engine
        while not self._stopping:
            self._drain_commands()
            if not eng.has_unfinished():
                self._snapshot()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self._step_started_at = time.monotonic()
            outputs = eng.step()
            self._step_started_at = None
            if self._stopping:  # failed by the watchdog meanwhile: nobody is waiting for these
                return
            for out in outputs:
                self._deliver(out.request_id, out)
            self._snapshot()

    def _watch_steps(self) -> None:
        while not self._stopping:
            started = self._step_started_at
            if started is not None and time.monotonic() - started > self.stall_timeout_s:
                self._fail(TimeoutError(f"an engine step made no progress for {self.stall_timeout_s:.0f} s"))
                return
            time.sleep(min(1.0, self.stall_timeout_s / 4))

    def _fail(self, exc: BaseException) -> None:
        with self._streams_lock:
            if self.failure is not None:  # the watchdog and the engine thread may both get here
                return
            log.critical("the engine cannot continue; failing every request in flight", exc_info=exc)
            self.failure = f"{type(exc).__name__}: {exc}"
            self._accepting = False
            self._stopping = True
            streams = list(self._streams.values())
            self._streams.clear()
        error = EngineFailedError(f"the engine failed: {self.failure}")
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        try:
            self._loop.call_soon_threadsafe(self._failed.set)
        except RuntimeError:  # the event loop is already closed: nobody is waiting
            pass
