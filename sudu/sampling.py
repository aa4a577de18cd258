"""SamplingParams: how one request's tokens are chosen and when its generation stops."""
from __future__ import annotations

from dataclasses import dataclass, field

# The temperature the samplers divide by is capped here, inside float32's range: a larger one becomes inf
# in float32, and a masked (-inf) logit divided by inf is NaN. At the cap every finite logit's quotient is
# already 0, so the distribution is the same (uniform over the tokens not masked).
MAX_SCALED_TEMPERATURE = 1e30


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 -> off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None -> until the context is full
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None -> none; k -> sampled token's logprob plus top-k alternatives
    skip_special_tokens: bool = True
    # an llguidance grammar (sudu.structured.grammars builds one from a JSON schema, regex, choices, Lark
    # or GBNF): every token is sampled from what it allows; None -> unconstrained
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for any out-of-range field."""
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 for off), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def scaled_temperature(self) -> float:
        """What the samplers divide the logits by."""
        return min(self.temperature, MAX_SCALED_TEMPERATURE)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
