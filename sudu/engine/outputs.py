"""What the engine hands back per step: one RequestOutput per request that advanced, carrying the new
tokens/text of each of its n choices (deltas), finish reasons, cache accounting and timings."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # decoded text of this token alone
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token_id, text, logprob), best first


@dataclass
class CompletionOutput:
    index: int  # choice index, 0..n-1
    text: str  # new text since the previous output of this choice (stop strings never included)
    token_ids: list[int]  # new tokens since the previous output
    logprobs: list[TokenLogprob] | None = None  # one per new token when logprobs were asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_output_tokens: int = 0  # total generated so far by this choice

    def then(self, later: CompletionOutput) -> CompletionOutput:
        """This delta followed by a later one of the same choice, as one delta."""
        logprobs = (None if self.logprobs is None and later.logprobs is None
                    else (self.logprobs or []) + (later.logprobs or []))
        return CompletionOutput(self.index, self.text + later.text, self.token_ids + later.token_ids, logprobs,
                                later.finish_reason, later.stop_reason, later.num_output_tokens)


@dataclass
class RequestMetrics:
    """Engine-side timestamps (time.perf_counter seconds) and derived durations of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding (zero when off)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0  # verification passes
    disk_load_s: float = 0.0  # loading prompt blocks from the context cache's disk tier

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_len(self) -> float | None:
        """Tokens gained per verification pass: accepted drafts + the target's own token."""
        if not self.num_spec_steps:
            return None
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps

    @property
    def queue_s(self) -> float:
        return (self.first_scheduled_time or self.arrival_time) - self.arrival_time

    @property
    def prefill_s(self) -> float:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return 0.0
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_s(self) -> float:
        if self.finished_time is None or self.first_token_time is None:
            return 0.0
        return self.finished_time - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # deltas of the choices that advanced (or finished) this step
    finished: bool  # every choice has finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache (RAM and disk)
    metrics: RequestMetrics
    num_cached_tokens_disk: int = 0  # of those, loaded from the disk tier
    error: str | None = None  # set when the engine failed this request (the output is then finished)
    # set by a cluster ingress (sudu/cluster/) on a request's first output: the replica that serves it and
    # the router's predicted prefix hit; the server adds it to the `sudu` extension
    route: dict | None = None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output followed by a later one of the same request, as one output: each choice's deltas
        joined, the request's state (finish, cache accounting, metrics, error) as of the later one."""
        choices = {c.index: c for c in self.outputs}
        for c in later.outputs:
            choices[c.index] = choices[c.index].then(c) if c.index in choices else c
        route = {**(self.route or {}), **(later.route or {})} or None
        return replace(later, prompt_token_ids=self.prompt_token_ids or later.prompt_token_ids,
                       outputs=[choices[i] for i in sorted(choices)], error=later.error or self.error, route=route)

    @property
    def most_new_tokens(self) -> int:
        """The most new tokens any one choice carries."""
        return max((len(c.token_ids) for c in self.outputs), default=0)

    def routed(self, route: dict | None, **changes) -> RequestOutput:
        """This output with route's entries added to its own route, and any other fields replaced."""
        if route:
            changes["route"] = {**(self.route or {}), **route}
        return replace(self, **changes)
