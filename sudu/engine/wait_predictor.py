"""Predicted time to first token of an arriving request, for admission by predicted wait.

Inputs, all the engine's own:
- the queue: every sequence running or waiting, as a `SeqLoad` (prompt tokens still to compute, tokens
  still to generate at most, and what the scheduler orders it by), snapshotted by the engine thread
  after each step (`snapshot`), plus the requests admitted since;
- the arriving prompt's uncached tokens (the context cache's lookup, block_manager.cached_prefix_tokens);
- the engine's measured speed (`ServiceRates`): seconds per prompt token and per decode step, moving
  averages over recent steps, and a calibration factor: the moving ratio of each request's actual wait to
  what was predicted for it (its 90th percentile over recent requests, so that the limit holds for the
  tail), which absorbs what the model below leaves out.

The model (`predict_wait`): the running batch has `max_num_seqs` slots. A slot frees when its sequence has
computed its prompt and generated all of its tokens (max_tokens is an upper bound: a stop may come
sooner); the sequences ahead of the new one in schedule order (schedule_policy.py) take slots as they
free, earliest first; the new one starts in the next free slot and has its first token once its own
uncached prompt is computed. Prompt computation is also one serial resource: the new request's first
token cannot come before every prompt token ahead of it and its own are computed. The prediction is the
larger of the two, times the calibration factor; the limit is held against its part spent behind others
(the prediction less the request's own prompt time).
While sequences decode, prompt tokens share steps with them under the scheduler's chunk allowance (a step
carrying prompt chunks takes up to `--max-itl-factor` decode steps): prompt tokens then cost
factor / (factor - 1) times their rate alone, and decode steps up to factor times theirs.

Cold start: before both speeds have been measured (a step with prompt tokens, a decode-only step) there is
no honest number to give; a request is then admitted only if it would start at once (a slot free for it
after those ahead of it have taken theirs), and is otherwise refused with a short retry (`COLD_RETRY_S`).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass

from sudu.engine.schedule_policy import order_key

PRIOR_OUTPUT_TOKENS = 256.0  # tokens a sequence is expected to generate before any has finished
COLD_RETRY_S = 1.0  # Retry-After while the engine's speed is unmeasured
CALIBRATION_RANGE = (0.5, 4.0)  # the actual/predicted factor is kept within this
# admission promises a bound on the tail of the wait, not on its mean: predictions are scaled by this
# quantile of the last CALIBRATION_WINDOW requests' actual / predicted ratios
CALIBRATION_QUANTILE = 0.9
CALIBRATION_WINDOW = 64
MIN_CALIBRATION_WAIT_S = 0.05  # waits shorter than this are noise against the step time: not calibrated on
# a mixed step with fewer prompt tokens than this says little about the prompt rate: what it took beyond a
# decode step is mostly the step's own noise and a new sequence's fixed costs, which divided by a few tokens
# would read as a rate tens of times the real one
MIN_PREFILL_TOKENS_OBSERVED = 32
# the measured turn rate (first tokens per second while the engine is at capacity) forgets with this time
# constant: long enough to average over many steps' bursts, short enough to follow a change of load
TURN_WINDOW_S = 30.0


@dataclass(frozen=True)
class SeqLoad:
    """What one sequence still asks of the engine, and where it stands in the queue."""

    prefill_tokens: int  # prompt tokens still to compute (uncached)
    decode_tokens: int  # tokens it may still generate (max_tokens left)
    output_tokens: int = 0  # tokens it has generated
    priority: int = 0
    continuing: bool = False
    arrival_time: float = 0.0
    tiebreak: int = 0

    def key(self, now: float, aging_s: float) -> tuple:
        return order_key(self.priority, self.continuing, self.arrival_time, self.tiebreak, now, aging_s)


@dataclass(frozen=True)
class EngineLoad:
    """The engine's queue at one moment (the engine thread's snapshot)."""

    running: tuple[SeqLoad, ...] = ()
    waiting: tuple[SeqLoad, ...] = ()


@dataclass(frozen=True)
class WaitPrediction:
    wait_s: float | None  # predicted seconds to the first token; None: the speed is not measured yet
    admitted: bool
    retry_after_s: float  # when refused: seconds until a request like it would be admitted (predicted drain)
    uncached_tokens: int  # of the prompt: what the context cache does not hold
    num_ahead: int  # sequences running or queued ahead of it
    limit_s: float = 0.0  # the limit it was held against (0: none)
    queue_s: float | None = None  # of wait_s, the part spent behind others (what the limit bounds)


class ServiceRates:
    """Moving averages of the engine's measured speed, fed one step at a time, of the tokens a sequence
    generates, fed one finish at a time, and the calibration factor, fed one first token at a time (the
    engine thread writes, any thread reads: floats are replaced whole)."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.prefill_s_per_token: float | None = None
        self.decode_step_s: float | None = None
        self.output_tokens: float | None = None  # generated per finished sequence
        self.calibration = 1.0
        # the mean of the same ratios: what a long queue's drain takes per predicted second. A drain is a sum
        # of many services, whose errors average out, so it is priced at the mean, not at a single wait's tail
        self.mean_ratio = 1.0
        self._ratios: deque[float] = deque(maxlen=CALIBRATION_WINDOW)
        # decayed sums of prompt seconds and prompt tokens: a step's share in the rate is its token count, so
        # a mixed step of a few prompt tokens (whose cost beyond a decode step is mostly noise) weighs little
        self._prefill_s = self._prefill_tokens = 0.0
        # how much slower prompt tokens and decode steps go while the two share steps (WaitModel sets them
        # from the scheduler's chunk allowance, --max-itl-factor); 1: as fast as alone
        self.mixed_prefill_factor = self.mixed_decode_factor = 1.0
        # seconds per turn (a request's first token) while the engine is at capacity: what a long queue of
        # requests like the recent ones takes per request, measured rather than modelled; None until seen
        self.turn_s: float | None = None
        self._busy_s = self._turns = 0.0

    def expected_remaining(self, load: "SeqLoad") -> float:
        """Tokens a sequence will still generate: its max_tokens left, at most what sequences have been
        generating on average (a sequence past that average is expected to end soon; before any has
        finished, PRIOR_OUTPUT_TOKENS stands in for the average)."""
        mean = self.output_tokens if self.output_tokens is not None else PRIOR_OUTPUT_TOKENS
        return min(load.decode_tokens, max(mean - load.output_tokens, 1.0))

    def observe_finish(self, num_output_tokens: int) -> None:
        self.output_tokens = self._ema(self.output_tokens, float(num_output_tokens))

    @property
    def measured(self) -> bool:
        return self.prefill_s_per_token is not None and self.decode_step_s is not None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_step(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """One step's wall time, with its decoding sequences and prompt tokens. A mixed step's prompt cost is
        what it took beyond a decode-only step; the prompt rate is the decayed sum of prompt seconds over the
        decayed sum of prompt tokens."""
        if num_prefill_tokens == 0:
            if num_decodes:
                self.decode_step_s = self._ema(self.decode_step_s, seconds)
            return
        if num_prefill_tokens < MIN_PREFILL_TOKENS_OBSERVED:
            return
        if num_decodes == 0:
            extra = seconds
        elif self.decode_step_s is not None:
            extra = max(seconds - self.decode_step_s, 0.0)
        else:
            return
        keep = 1.0 - self.alpha
        self._prefill_s = keep * self._prefill_s + extra
        self._prefill_tokens = keep * self._prefill_tokens + num_prefill_tokens
        self.prefill_s_per_token = self._prefill_s / self._prefill_tokens

    def observe_turns(self, first_tokens: int, seconds: float, at_capacity: bool) -> None:
        """A step's first tokens and wall time; counted only while the engine is at capacity (every slot
        taken or requests waiting), where the pace of first tokens is the pace of the queue."""
        if not at_capacity:
            return
        keep = math.exp(-seconds / TURN_WINDOW_S)
        self._busy_s = keep * self._busy_s + seconds
        self._turns = keep * self._turns + first_tokens
        if self._turns >= 1.0:
            self.turn_s = self._busy_s / self._turns

    def observe_wait(self, predicted_raw_s: float, actual_s: float) -> None:
        """A request's first token came actual_s after it arrived; the uncalibrated model had said
        predicted_raw_s."""
        if max(predicted_raw_s, actual_s) < MIN_CALIBRATION_WAIT_S:
            return
        self._ratios.append(actual_s / max(predicted_raw_s, MIN_CALIBRATION_WAIT_S))
        ranked = sorted(self._ratios)
        lo, hi = CALIBRATION_RANGE
        self.calibration = min(max(ranked[min(int(CALIBRATION_QUANTILE * len(ranked)), len(ranked) - 1)], lo), hi)
        self.mean_ratio = min(max(sum(ranked) / len(ranked), lo), hi)


def raw_wait_s(load: EngineLoad, new: SeqLoad, max_num_seqs: int, rates: ServiceRates, now: float,
               aging_s: float) -> tuple[float, int]:
    """(uncalibrated predicted seconds to new's first token, of which its own prompt, sequences ahead of
    it): see the module's docstring for the model. Needs measured rates."""
    p, d = rates.prefill_s_per_token, rates.decode_step_s
    new_key = new.key(now, aging_s)
    ahead = sorted((w for w in load.waiting if w.key(now, aging_s) < new_key), key=lambda w: w.key(now, aging_s))
    # prompts computed beside decoding sequences share their steps: the chunk allowance gives a prompt the
    # time of (factor - 1) decode steps per step, so prompt tokens go slower and decode steps take longer
    if load.running:
        p *= rates.mixed_prefill_factor
    if new.prefill_tokens or any(w.prefill_tokens for w in ahead) or any(s.prefill_tokens for s in load.running):
        d *= rates.mixed_decode_factor
    slots = [s.prefill_tokens * p + rates.expected_remaining(s) * d for s in load.running]
    slots += [0.0] * max(max_num_seqs - len(slots), 0)
    heapq.heapify(slots)
    for w in ahead:
        start = heapq.heappop(slots)
        heapq.heappush(slots, start + w.prefill_tokens * p + rates.expected_remaining(w) * d)
    start = heapq.heappop(slots)
    serial_prefill = sum(s.prefill_tokens for s in load.running) + sum(w.prefill_tokens for w in ahead)
    own = new.prefill_tokens * p
    return max(start + own, (serial_prefill + new.prefill_tokens) * p), own, len(load.running) + len(ahead)


def predict_wait(load: EngineLoad, new: SeqLoad, max_num_seqs: int, rates: ServiceRates, max_queue_wait_s: float,
                 now: float, aging_s: float) -> tuple[WaitPrediction, float | None]:
    """The admission decision for `new` arriving at `now` (max_queue_wait_s 0: no limit), and the
    uncalibrated prediction (None while the speed is unmeasured) for calibrating on its actual wait."""
    p, d, calibration = rates.prefill_s_per_token, rates.decode_step_s, rates.calibration
    if p is None or d is None:
        new_key = new.key(now, aging_s)
        ahead = sum(1 for w in load.waiting if w.key(now, aging_s) < new_key)
        starts_now = len(load.running) + ahead < max_num_seqs
        admitted = starts_now or max_queue_wait_s == 0
        return WaitPrediction(None, admitted, 0.0 if admitted else COLD_RETRY_S, new.prefill_tokens,
                              len(load.running) + ahead, max_queue_wait_s), None
    raw, own, num_ahead = raw_wait_s(load, new, max_num_seqs, rates, now, aging_s)
    wait = raw * calibration
    # the limit bounds the wait behind others: a request's own prompt takes as long whenever it is sent, so
    # refusing it for that would help no one (a long prompt on an idle engine is admitted)
    queue = max(raw - own, 0.0) * calibration
    admitted = max_queue_wait_s == 0 or queue <= max_queue_wait_s
    # told to come back when the queue ahead is predicted to have drained (its turn), not when the queue
    # would just fit the limit: a prediction made many seconds ahead errs both ways, and coming back a few
    # seconds early then still finds a queue within the limit, where aiming at the limit's edge would be
    # refused again for any early error. Coming back late costs the engine nothing under overload: newer
    # requests are admitted into the gap
    retry = 0.0 if admitted else max(1.0, math.ceil(queue))
    return WaitPrediction(wait, admitted, retry, new.prefill_tokens, num_ahead, max_queue_wait_s, queue), raw


def seq_load(seq) -> SeqLoad:
    """A scheduler Sequence's load. One with nothing computed (waiting, or preempted) counts its tokens
    minus what the cache held when it arrived."""
    if seq.num_computed_tokens == 0:
        prefill = max(seq.num_tokens - seq.num_cached_at_arrival, 1)
    else:
        prefill = seq.num_uncomputed_tokens if seq.num_uncomputed_tokens > 1 else 0
    return SeqLoad(prefill, max(seq.max_total_tokens - seq.num_tokens, 0), seq.num_output_tokens, seq.priority,
                   seq.continuing, seq.arrival_time, seq.seq_id)


def snapshot(scheduler) -> EngineLoad:
    """The scheduler's queue as loads (engine thread, between steps)."""
    return EngineLoad(tuple(seq_load(s) for s in scheduler.running),
                      tuple(seq_load(s) for s in scheduler.waiting if not s.held_back))


class WaitModel:
    """The engine's side of admission: measures speed and output lengths, and calibrates the model on each
    request's actual wait: at add, the engine predicts (uncalibrated, from its exact queue) when the
    request's first token will come; at its first token the actual wait is compared with it. Engine thread
    only, except `rates`, which any thread may read."""

    def __init__(self, max_num_seqs: int, aging_s: float, itl_factor: float = 1.0):
        """itl_factor: the scheduler's --max-itl-factor; a step carrying prompt chunks beside decoding
        sequences takes up to that many decode steps' time, of which all but one go to the prompts."""
        self.max_num_seqs = max_num_seqs
        self.aging_s = aging_s
        self.rates = ServiceRates()
        if itl_factor > 1.0:
            self.rates.mixed_prefill_factor = itl_factor / (itl_factor - 1.0)
            self.rates.mixed_decode_factor = itl_factor
        # request id -> (its uncalibrated prediction at add, when it was added)
        self._predicted_raw_s: dict[str, tuple[float, float]] = {}
        self._first_tokens = 0  # in the current step

    def on_add(self, request_id: str, scheduler, seq, arrived: float) -> None:
        """Called after the request's sequences were queued (seq: its first); arrived: when the request
        reached the engine's front (perf_counter), so that the time it took to be queued counts in its
        actual wait."""
        if not self.rates.measured:
            return
        now = time.perf_counter()  # the clock of the sequences' arrival times
        load = EngineLoad(tuple(seq_load(s) for s in scheduler.running),
                          tuple(seq_load(s) for s in scheduler.waiting if s is not seq and not s.held_back))
        raw = raw_wait_s(load, seq_load(seq), self.max_num_seqs, self.rates, now, self.aging_s)[0]
        self._predicted_raw_s[request_id] = (raw, min(arrived, now))

    def on_step(self, scheduler, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """After each step: its speed, and its first tokens against its time if the engine is at capacity."""
        self.rates.observe_step(num_decodes, num_prefill_tokens, seconds)
        at_capacity = bool(scheduler.waiting) or len(scheduler.running) >= self.max_num_seqs
        self.rates.observe_turns(self._first_tokens, seconds, at_capacity)
        self._first_tokens = 0

    def on_first_token(self, request_id: str, now: float) -> None:
        self._first_tokens += 1
        entry = self._predicted_raw_s.pop(request_id, None)
        if entry is not None:
            self.rates.observe_wait(entry[0], now - entry[1])

    def on_finish(self, request_id: str, seq, reason: str | None) -> None:
        self._predicted_raw_s.pop(request_id, None)
        if reason in ("stop", "length"):
            self.rates.observe_finish(seq.num_output_tokens)
