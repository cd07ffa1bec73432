"""A chat reply as the routes of other APIs read it (anthropic.py, responses_api.py): the
chat route's deltas, split by ``ChunkWriter`` into thinking, content and tool calls,
without the text of a continued (prefilled) turn, which those APIs do not repeat. The
writer still reads that text first, so its parsers' state is the reply's. The generation
prompt's think tags that reasoning_format "none" leaves in the content (``Run.opener``) are
the reply's first text, as on the chat route (read, not sent, before a continued turn).

A whole answer is its stream's deltas, read from the collected chunks (``whole_parts``),
so both show the same parts in the same order: text after a call is a part of its own,
and a prefill's thinking is left out of both.

A delta carries its chunk's token logprobs (when asked) as ``logprobs``, the chat's
``content`` list; ``text_logprobs`` says which of them go with the reply's text.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable, Iterator

from ..results import Chunk
from .responses import ChunkWriter, Envelope
from .service import Run


class _Reader:
    """The chat's deltas, chunk by chunk, then what the parsers held back.

    With logprobs asked, a delta's ``logprobs`` are those of the tokens that made its
    content. The parsers split the reply's text, not its tokens, and hold text back (a
    possible ``</think>`` or call), so a token's logprob may come chunks before its
    text: each waits until the parsers hand out text from where it sits
    (``ChunkWriter.text_spans``), or pass it by, which leaves it out (the thinking's,
    its tags', a call's)."""

    def __init__(self, env: Envelope, run: Run) -> None:
        unsent = run.preamble if run.prefill else ""
        self.writer = ChunkWriter(env, False, run.extras, run.tools, reasoning=run.reasoning, prefill=unsent)
        self.writer.opening()          # the continued turn's text: read, not sent
        self.asked = run.extras is not None and run.extras.logprobs
        self.parsed = self.writer.parses()
        self.base = len(unsent) if self.parsed else 0       # the parsers read the prefill first
        # reasoning_format "none"'s think tags, sent as the reply's first text where no turn is continued
        self.lead = None if run.prefill or not run.opener else Chunk(run.opener, [])
        self.waiting: list[tuple[int, int, dict]] = []       # (start, end, entry): not yet placed
        self.text: list[dict] = []                           # placed in text not yet handed out

    def delta(self, chunk: Chunk) -> dict | None:
        if not self.writer.wants(chunk):
            self._place(self.writer.text_spans if self.parsed else [])
            return None
        choice = self.writer.delta(chunk)["choices"][0]
        if self.asked:
            lps = (choice.get("logprobs") or {}).get("content") or ()
            places = self.writer.extras.places
            self.waiting += [(self.base + at, self.base + end, e) for (at, end), e in zip(places, lps)]
        # unparsed, the text is the chunk's, and its tokens the ones Extras gave out with it
        return self._place(self.writer.text_spans if self.parsed else [(0, 1 << 62)], choice["delta"])

    def opening(self) -> dict | None:
        """The delta of the reply's first text that the run did not make (``lead``), if any."""
        return None if self.lead is None else self.delta(self.lead)

    def closing(self, finish: str) -> tuple[list[dict], str]:
        """The deltas the parsers held back, and the finish reason ("tool_calls" for a
        reply with calls)."""
        deltas = []
        for obj in self.writer.closing(finish, None):
            choice = obj["choices"][0]
            if choice["delta"]:
                deltas.append(self._place(self.writer.text_spans if self.parsed else [], choice["delta"]))
            finish = choice["finish_reason"] or finish
        return deltas, finish

    def _place(self, spans: list[tuple[int, int]], delta: dict | None = None) -> dict | None:
        """``delta`` with its content's logprobs when asked: the waiting tokens whose text
        ``spans`` handed out join the text; those the spans passed by are left out."""
        if not self.asked:
            return delta
        for a, b in spans:
            self.text += [e for s, t, e in self.waiting if s < b and t > a]
            self.waiting = [(s, t, e) for s, t, e in self.waiting if not (s < b and t > a) and t > b]
        if delta is None or not delta.get("content"):
            return delta
        out, self.text = self.text, []
        return {**delta, "logprobs": out}


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
        if (lead := self.reader.opening()) is not None:
            yield lead
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
    deltas = [d for d in [reader.opening(), *map(reader.delta, chunks)] if d is not None]
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
