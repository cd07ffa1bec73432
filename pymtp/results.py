"""What a generation gives back: its text in chunks or whole, and the stats a user reads.

Plain records, apart from the engine and the model object, so that the server, the
batcher and the CLI read them without importing either.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .logprobs import TokenLogprob
from .round_state import RunStats


@dataclass(frozen=True)
class Stats:
    """Acceptance and speed of one generation (the CLI's --json ``stats`` object).

    The head's numbers (drafted, accepted, rounds, the per-position lists, mean_accept_len)
    count every round the engine verified, the last one whole where a stop string cut
    its tokens: those drafts were accepted, and the cut says nothing of the head (the
    pinned llama-server counts its drafts so too). ``generated_tokens`` counts the tokens
    output, and ``predicted_accepted`` the prediction's drafts the output kept."""

    drafted: int
    accepted: int
    acceptance_rate: float         # accepted / drafted
    mean_accept_len: float         # tokens a round made (accepted drafts + 1), before any stop string's cut
    accepted_per_position: list[float]
    rounds: int
    tokens_per_second: float       # tokens after the first / decode wall time (from_run)
    prompt_tokens: int
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    checkpoint_restores: int = 0
    cached_tokens: int = 0         # prompt tokens reused from the prompt cache, not decoded
    # prompt tokens decoded: prompt_tokens - cached_tokens once the prompt is whole, fewer
    # for a run ended during its prompt (as llama-server counts a prompt, batch by batch)
    prompt_processed: int = 0
    drafted_at: list[int] = field(default_factory=list)     # drafts made at position i
    accepted_at: list[int] = field(default_factory=list)    # ... and accepted
    # rounds by the drafts planned for them (0: a plain decode), MTP runs only; with
    # draft_max="auto" this is the depth policy's histogram
    depths: dict[int, int] = field(default_factory=dict)
    # a request with a prediction (prediction.py) of prediction_tokens tokens: its drafts,
    # in rounds apart from the head's (not in drafted/accepted/rounds above), and those
    # the output kept
    prediction_tokens: int = 0
    predicted_drafted: int = 0
    predicted_accepted: int = 0
    predicted_rounds: int = 0

    # the CLI's --json: the counts and the times the rates come from, so they can be checked
    JSON_KEYS = ("drafted", "accepted", "acceptance_rate", "mean_accept_len",
                 "accepted_per_position", "rounds", "tokens_per_second", "prompt_tokens", "depths",
                 "generated_tokens", "decode_seconds", "prompt_seconds", "cached_tokens", "prompt_processed")

    @classmethod
    def from_run(cls, r: RunStats, spec: bool) -> "Stats":
        """llama-server's timings, so that ``pymtp bench`` compares like with like: the
        prompt phase ends once every context has processed the prompt (for MTP runs the
        drafter's decode of its rows, which pymtp makes after the first token), and the
        decode speed counts the tokens after the first (that one came from the prompt's
        decode) over the time after the prompt phase."""
        t0 = r.decode_from
        decode_s = max(r.t_end - t0, 0.0) if t0 else 0.0
        rounds = r.rounds if spec else 0
        made = r.generated - r.past_stop    # the tokens output, as plain decoding makes them
        return cls(
            drafted=r.drafted, accepted=r.accepted,
            acceptance_rate=(r.accepted / r.drafted) if r.drafted else 0.0,
            mean_accept_len=((r.accepted + r.rounds) / r.rounds) if (spec and r.rounds) else 0.0,
            accepted_per_position=[a / d for a, d in zip(r.accepted_at, r.drafted_at)],
            rounds=rounds,
            tokens_per_second=((made - 1) / decode_s) if decode_s > 0 and made > 1 else 0.0,
            prompt_tokens=r.prompt_tokens, generated_tokens=made,
            prompt_seconds=max((t0 or r.t_end) - r.t_start, 0.0) if (t0 or r.prompt_processed) else 0.0,
            decode_seconds=decode_s, checkpoint_restores=r.checkpoint_restores, cached_tokens=r.cached_tokens,
            prompt_processed=r.prompt_processed,
            drafted_at=list(r.drafted_at), accepted_at=list(r.accepted_at),
            depths=dict(sorted(r.depths.items())) if spec else {},
            prediction_tokens=r.prediction_tokens,
            predicted_drafted=r.predicted_drafted, predicted_accepted=r.predicted_accepted,
            predicted_rounds=r.predicted_rounds)

    def to_dict(self) -> dict:
        """The documented stats object (the CLI's --json ``stats``)."""
        d = asdict(self)
        return {k: d[k] for k in self.JSON_KEYS}


@dataclass(frozen=True)
class Calibration:
    """What a calibration ran: each run's depth in turn (``Session.calibrate``; the depths
    measured, in order, for ``Batcher.calibrate``), how long it took, and draft_max="auto"'s
    estimated tokens a second per depth after it."""

    depths: list[int]
    seconds: float
    estimates: dict[int, float]


@dataclass
class Chunk:
    """A piece of streamed output: the text safe to show and the tokens it came from.

    With ``logprobs=N`` each token has its ``TokenLogprob`` in ``logprobs``; with
    ``prompt_logprobs=N`` the first chunk carries one per prompt token (None for the
    first, which nothing predicts). pymtp/logprobs.py says what is scored.
    """

    text: str
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # the verify round behind ``tokens`` (round_state.Step): drafts verified and accepted,
    # and whether they were the request's prediction's (not the MTP head's);
    # pymtp.origins.token_origins names each token from them
    drafted: int = 0
    accepted: int = 0
    stop_word: str | None = None      # the stop string that ended the text (finish_reason "stop")
    predicted: bool = False
    # prompt tokens the prompt cache spared decoding (Stats.cached_tokens), known from the
    # first chunk on: what a stream's opening usage reports (Anthropic's message_start)
    cached_tokens: int = 0


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str
    prompt_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None                  # one per token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None    # one per prompt token, when asked
    tool_calls: list[dict] | None = None      # chat with tools: OpenAI tool calls the reply made
    reasoning: str | None = None              # chat: the reply's thinking, apart (reasoning.py)
