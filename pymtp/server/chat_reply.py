"""A chat reply as the routes of other APIs read it (anthropic.py, responses_api.py): the
chat route's deltas, split by ``ChunkWriter`` into thinking, content and tool calls,
without the text of a continued (prefilled) turn, which those APIs do not repeat. The
writer still reads that text first, so its parsers' state is the reply's.

A whole answer is its stream's deltas, read from the collected chunks (``whole_parts``),
so both show the same parts in the same order: text after a call is a part of its own,
and a prefill's thinking is left out of both.

A delta carries its chunk's token logprobs (when asked) as ``logprobs``, the chat's
``content`` list; ``text_logprobs`` says which of them go with the reply's text.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable, Iterator

from ..generate import Chunk
from .responses import ChunkWriter, Envelope
from .service import Run


class _Reader:
    """The chat's deltas, chunk by chunk, then what the parsers held back.

    With logprobs asked, a delta's ``logprobs`` are those of the tokens that made its
    content: the parsers split the reply's text, not its tokens, and hold text back (a
    possible ``</think>`` or call), so a token's logprob may come a chunk before its text.
    Each content (and thinking) delta is found in the text shown so far, after the last
    found; the tokens whose text starts inside a content's span, or runs into it, are
    its. Thinking's and markup's are left out."""

    def __init__(self, env: Envelope, run: Run) -> None:
        self.writer = ChunkWriter(env, False, run.extras, run.tools, reasoning=run.reasoning, prefill=run.prefill)
        self.writer.opening()          # the continued turn's text: read, not sent
        self.shown = ""                # the reply's text so far, as Extras counts its tokens' starts
        self.at = 0                    # where the deltas found so far end in it
        self.pending: list[tuple[int, dict]] = []   # (first character, entry) not yet placed

    def delta(self, chunk: Chunk) -> dict | None:
        self.shown += chunk.text
        if not self.writer.wants(chunk):
            return None
        choice = self.writer.delta(chunk)["choices"][0]
        lps = (choice.get("logprobs") or {}).get("content")
        if lps:
            self.pending += zip(self.writer.extras.starts, lps)
        return self._placed(choice["delta"])

    def closing(self, finish: str) -> tuple[list[dict], str]:
        """The deltas the parsers held back, and the finish reason ("tool_calls" for a
        reply with calls)."""
        deltas = []
        for obj in self.writer.closing(finish, None):
            choice = obj["choices"][0]
            if choice["delta"]:
                deltas.append(self._placed(choice["delta"]))
            finish = choice["finish_reason"] or finish
        return deltas, finish

    def _placed(self, delta: dict) -> dict:
        """``delta`` with its content's logprobs (when asked)."""
        if self.writer.extras is None or not self.writer.extras.logprobs:
            return delta
        for key in ("reasoning_content", "content"):
            text = delta.get(key)
            if not text:
                continue
            at = self.shown.find(text, self.at)
            end = len(self.shown) if at < 0 else at + len(text)    # not found: joined around a call
            if key == "content":
                start = self.at if at < 0 else at
                mine = [e for s, e in self.pending if s < end and (s >= start or s + len(e["token"]) > start)]
                delta = {**delta, "logprobs": mine}
            self.pending = [(s, e) for s, e in self.pending if s >= end]
            self.at = end
        return delta

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
    deltas, finish = whole_deltas(env, run, chunks)
    return parts(deltas), finish


def whole_deltas(env: Envelope, run: Run, chunks: list[Chunk]) -> tuple[list[dict], str]:
    """A whole reply's deltas as its stream would make them, and its finish reason."""
    reader = _Reader(env, run)
    deltas = [d for d in map(reader.delta, chunks) if d is not None]
    finish = next((c.finish_reason for c in reversed(chunks) if c.finish_reason), "length")
    rest, finish = reader.closing(finish)
    return deltas + rest, finish


def _pieces(deltas: Iterable[dict]) -> Iterator[tuple[str, Any, dict]]:
    """Each delta's thinking, text and calls in that order, as the streams open their
    blocks: (kind, value, the delta)."""
    for d in deltas:
        for kind, key in (("thinking", "reasoning_content"), ("text", "content")):
            if d.get(key):
                yield kind, d[key], d
        for call in d.get("tool_calls") or ():
            yield "call", call, d


def parts(deltas: Iterable[dict]) -> list[tuple[str, Any]]:
    """Deltas as the reply's parts in order: ("thinking", text) and ("text", text), each a
    run of deltas of its kind, and ("call", call) for each tool call."""
    out: list[tuple[str, Any]] = []
    for kind, value, _ in _pieces(deltas):
        if kind != "call" and out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def text_logprobs(deltas: Iterable[dict]) -> list[list[dict]]:
    """The logprobs of each text part's tokens (``_Reader``), a list per ``parts``' text
    part in order."""
    out: list[list[dict]] = []
    last = None
    for kind, _, d in _pieces(deltas):
        if kind == "text":
            if last != "text":
                out.append([])
            out[-1] += d.get("logprobs") or []
        last = kind
    return out
