"""The order in which the scheduler serves sequences: explicit priority (vLLM's semantics: lower value is
served sooner, default 0), then an automatic class, with aging.

- Class: a sequence whose prompt was mostly in the context cache when it arrived (a continuing session's
  next turn: cheap to serve, and an agent waits on it) counts half a priority level more urgent than a
  cold first turn of the same priority (half: an explicit priority still decides between two levels).
- Aging: every `aging_s` seconds a sequence has waited since it arrived make it one level more urgent,
  so any sequence eventually goes before every newer one whose priority is bounded: nothing starves.

Plain functions of a sequence's (priority, class, arrival) and the clock, so the scheduler and the
admission's wait prediction (wait_predictor.py) order the queue the same way.
"""
from __future__ import annotations

CONTINUING_MIN_CACHED_FRACTION = 0.5  # prompt share found in the cache that makes a turn "continuing"
COLD_PENALTY = 0.5  # priority levels a cold first turn yields to continuing ones


def is_continuing(num_cached_tokens: int, num_prompt_tokens: int) -> bool:
    """A continuing session's turn: most of its prompt is already cached."""
    return num_prompt_tokens > 0 and num_cached_tokens >= CONTINUING_MIN_CACHED_FRACTION * num_prompt_tokens


def urgency(priority: int, continuing: bool, arrival_time: float, now: float, aging_s: float) -> float:
    """Effective priority level at `now`: smaller is served first."""
    penalty = 0.0 if continuing else COLD_PENALTY
    return priority + penalty - max(now - arrival_time, 0.0) / aging_s


def order_key(priority: int, continuing: bool, arrival_time: float, tiebreak: int, now: float,
              aging_s: float) -> tuple[float, float, int]:
    """Sort key, smallest first: urgency, then arrival, then a stable tiebreak (the sequence id)."""
    return (urgency(priority, continuing, arrival_time, now, aging_s), arrival_time, tiebreak)
