"""A chat reply as the routes of other APIs read it (anthropic.py, responses_api.py): the
chat route's deltas, split by ``ChunkWriter`` into thinking, content and tool calls,
without the text of a continued (prefilled) turn, which those APIs do not repeat. The
writer still reads that text first, so its parsers' state is the reply's.

A whole answer is its stream's deltas, read from the collected chunks (``whole_parts``),
so both show the same parts in the same order: text after a call is a part of its own,
and a prefill's thinking is left out of both.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable

from ..generate import Chunk
from .responses import ChunkWriter, Envelope
from .service import Run


class _Reader:
    """The chat's deltas, chunk by chunk, then what the parsers held back."""

    def __init__(self, env: Envelope, run: Run) -> None:
        self.writer = ChunkWriter(env, False, run.extras, run.tools, reasoning=run.reasoning, prefill=run.prefill)
        self.writer.opening()          # the continued turn's text: read, not sent

    def delta(self, chunk: Chunk) -> dict | None:
        return self.writer.delta(chunk)["choices"][0]["delta"] if self.writer.wants(chunk) else None

    def closing(self, finish: str) -> tuple[list[dict], str]:
        """The deltas the parsers held back, and the finish reason ("tool_calls" for a
        reply with calls)."""
        deltas = []
        for obj in self.writer.closing(finish, None):
            choice = obj["choices"][0]
            if choice["delta"]:
                deltas.append(choice["delta"])
            finish = choice["finish_reason"] or finish
        return deltas, finish


class StreamedReply:
    """The chat's deltas as the run makes them; once they are all out, its chunks and
    finish reason."""

    def __init__(self, env: Envelope, run: Run) -> None:
        self.run = run
        self.reader = _Reader(env, run)
        self.chunks: list[Chunk] = []
        self.finish_reason = "length"

    async def deltas(self) -> AsyncIterator[dict]:
        run = self.run
        chunk = run.first
        while chunk is not None:
            self.chunks.append(chunk)
            delta = self.reader.delta(chunk)
            if delta is not None:
                yield delta
            run.finish_reason = chunk.finish_reason or run.finish_reason
            chunk = await anext(run.gen, None)
        rest, self.finish_reason = self.reader.closing(run.finish_reason or "length")
        for delta in rest:
            yield delta


def whole_parts(env: Envelope, run: Run, chunks: list[Chunk]) -> tuple[list[tuple[str, Any]], str]:
    """A whole reply as its stream would show it (``parts``), and its finish reason."""
    reader = _Reader(env, run)
    deltas = [d for d in map(reader.delta, chunks) if d is not None]
    finish = next((c.finish_reason for c in reversed(chunks) if c.finish_reason), "length")
    rest, finish = reader.closing(finish)
    return parts(deltas + rest), finish


def parts(deltas: Iterable[dict]) -> list[tuple[str, Any]]:
    """Deltas as the reply's parts in order: ("thinking", text) and ("text", text), each a
    run of deltas of its kind, and ("call", call) for each tool call; a delta's thinking
    comes before its text, its text before its calls, as the streams open their blocks."""
    out: list[tuple[str, Any]] = []
    for d in deltas:
        for kind, key in (("thinking", "reasoning_content"), ("text", "content")):
            text = d.get(key)
            if not text:
                continue
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))
        out += [("call", call) for call in d.get("tool_calls") or ()]
    return out
