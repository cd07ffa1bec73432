"""Response and stream-chunk objects in the OpenAI shapes, plus pymtp's ``timings``.

``timings`` follows llama-server's extension field (``prompt_n``, ``predicted_per_second``,
``draft_n``, ``draft_n_accepted`` ...) so tools that read it there read it here, and adds
the MTP numbers that only a speculative decoder has.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..generate import Stats


@dataclass
class Envelope:
    """What every object of one response shares: id, creation time, model and kind."""

    kind: str                 # "completion" or "chat"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.id = f"{prefix}-{uuid.uuid4().hex}"

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, stats: Stats | None) -> dict:
    done = stats.generated_tokens if stats else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}


def timings(stats: Stats) -> dict:
    s = stats
    return {
        "prompt_n": s.prompt_tokens,
        "prompt_ms": s.prompt_seconds * 1e3,
        "prompt_per_second": (s.prompt_tokens / s.prompt_seconds) if s.prompt_seconds > 0 else 0.0,
        "predicted_n": s.generated_tokens,
        "predicted_ms": s.decode_seconds * 1e3,
        "predicted_per_second": s.tokens_per_second,
        "draft_n": s.drafted,
        "draft_n_accepted": s.accepted,
        # pymtp: verify rounds, tokens per round and acceptance at each draft position
        "draft_rounds": s.rounds,
        "mean_accept_len": s.mean_accept_len,
        "accepted_per_position": list(s.accepted_per_position),
    }


def full_response(env: Envelope, text: str, finish_reason: str, prompt_tokens: int,
                  stats: Stats | None) -> dict:
    """The non-streaming answer: ``text_completion`` or ``chat.completion``."""
    if env.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason}
        obj = env.head("chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = env.head("text_completion")
    out = {**obj, "choices": [choice], "usage": usage(prompt_tokens, stats)}
    if stats is not None:
        out["timings"] = timings(stats)
    return out


class ChunkWriter:
    """Builds the stream's chunk objects in order: role (chat), text deltas, finish, usage.

    With ``include_usage`` every chunk carries ``"usage": null`` and one more chunk with
    empty ``choices`` carries the counts, as the OpenAI API does.
    """

    def __init__(self, env: Envelope, include_usage: bool) -> None:
        self.env = env
        self.include_usage = include_usage

    def _chunk(self, choice: dict | None) -> dict:
        obj = "chat.completion.chunk" if self.env.kind == "chat" else "text_completion"
        out = {**self.env.head(obj), "choices": [choice] if choice is not None else []}
        if self.include_usage:
            out["usage"] = None
        return out

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.env.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> list[dict]:
        """Chat streams open with the assistant's role; completions have no opening."""
        return [self._chunk(self._choice(None, None, role=True))] if self.env.kind == "chat" else []

    def delta(self, text: str) -> dict:
        return self._chunk(self._choice(text, None))

    def closing(self, finish_reason: str, prompt_tokens: int, stats: Stats | None) -> list[dict]:
        last = self._chunk(self._choice(None, finish_reason))
        if stats is not None:
            last["timings"] = timings(stats)
        out = [last]
        if self.include_usage:
            out.append({**self._chunk(None), "usage": usage(prompt_tokens, stats)})
        return out
