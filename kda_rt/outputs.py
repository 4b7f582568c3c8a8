"""Request results with vLLM's names: `RequestOutput` holding one `CompletionOutput` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "vllm_logprobs"]


class Logprob(float):
    """One token's log probability as vLLM's `Logprob` (`.logprob`, `.rank`: 1 = most likely, None where the
    step did not rank it; `.decoded_token`), and at the same time that float: arithmetic, comparisons, `json` and
    `msgpack` treat it as one (msgspec needs `enc_hook=float`).  The offline API (`LLM`, `AsyncLLM`) hands these
    out."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


def vllm_logprobs(entry: dict[int, float], num: int, decode, rank: int | None = None,
                  greedy: bool = False) -> dict[int, Logprob]:
    """{token: Logprob} of one position's {token: logprob}: the chosen token first, then the top `num` by value
    (samplers' and prompt_logprobs' order).  Each top token's rank is 1 + the entries above it (every token above
    it is among them); so is the chosen token's when it is one of the top `num` (the dict then holds at most `num`
    entries), else its rank is `rank` (when the caller knows it), 1 when `greedy` (the sampled token is the most
    likely one), or None.  `decode(token) -> str` names them."""
    rank = 1 if rank is None and greedy else rank
    items = list(entry.items())
    chosen_in_top = len(items) <= num
    out = {}
    for k, (token, value) in enumerate(items):
        if k == 0 and rank is not None:
            r = rank
        else:
            r = 1 + sum(v > value for _, v in items) if k > 0 or chosen_in_top else None
        out[token] = Logprob(value, r, decode(token))
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # per generated token: {token_id: logprob} (offline: `Logprob`s, floats with vLLM's rank and decoded_token)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """vLLM's `RequestMetrics` (its V0 engine's; wall-clock `time.time()` stamps): when the request arrived, was
    first scheduled (its queue time ends), gave its first and latest tokens, and finished (None while running)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float
    time_in_queue: float | None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # with SamplingParams.prompt_logprobs: per prompt token, {token_id: logprob} of that token and the
    # top N (None for the first token, which has no context)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # vLLM's field: prompt tokens served from the prefix cache (enable_prefix_caching)
    # vLLM's field, as its V0 engine fills it, on a request's first output and its last (None between them; vLLM's V1
    # engine leaves it None)
    metrics: RequestMetrics | None = None
