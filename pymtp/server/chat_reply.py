"""A chat reply as the routes of other APIs read it (anthropic.py, responses_api.py): the
chat route's message, whole or as deltas, split by ``ChunkWriter`` into thinking, content
and tool calls, without the text of a continued (prefilled) turn, which those APIs do
not repeat. The writer still reads that text first, so its parsers' state is the reply's.
"""

from __future__ import annotations

from typing import AsyncIterator

from ..generate import Chunk
from .responses import Choice, ChunkWriter, Envelope, full_response
from .service import Run


def whole_reply(env: Envelope, run: Run, chunks: list[Chunk]) -> tuple[dict, str]:
    """The chat's message (``content``, ``reasoning_content``, ``tool_calls``) and finish
    reason ("tool_calls" for a reply with calls)."""
    choice = full_response(env, [Choice(chunks, run.stats, run.extras, run.tools, run.reasoning, run.prefill)],
                           run.prompt_tokens)["choices"][0]
    msg = dict(choice["message"])
    thinking, content = _prefill_parts(env, run)
    if content and (msg.get("content") or "").startswith(content):
        msg["content"] = msg["content"][len(content):]
    if thinking and (msg.get("reasoning_content") or "").startswith(thinking):
        msg["reasoning_content"] = msg["reasoning_content"][len(thinking):]
        if not msg["reasoning_content"]:
            del msg["reasoning_content"]
    return msg, choice["finish_reason"]


def _prefill_parts(env: Envelope, run: Run) -> tuple[str, str]:
    """The continued turn's thinking and content, as a stream's writer reads them first
    (``StreamedReply`` does not send them): a prefill that holds a whole thinking block
    is thinking, then content, not the content's start."""
    if not run.prefill:
        return "", ""
    writer = ChunkWriter(env, False, run.extras, run.tools, reasoning=run.reasoning, prefill=run.prefill)
    deltas = [obj["choices"][0]["delta"] for obj in writer.opening()[1:]]
    return ("".join(d.get("reasoning_content", "") for d in deltas),
            "".join(d.get("content") or "" for d in deltas))


class StreamedReply:
    """The chat's deltas as the run makes them; once they are all out, its chunks and
    finish reason."""

    def __init__(self, env: Envelope, run: Run) -> None:
        self.run = run
        self.writer = ChunkWriter(env, False, run.extras, run.tools, reasoning=run.reasoning, prefill=run.prefill)
        self.chunks: list[Chunk] = []
        self.finish_reason = "length"

    async def deltas(self) -> AsyncIterator[dict]:
        run, writer = self.run, self.writer
        writer.opening()          # the continued turn's text: read, not sent
        chunk = run.first
        while chunk is not None:
            self.chunks.append(chunk)
            if writer.wants(chunk):
                yield writer.delta(chunk)["choices"][0]["delta"]
            run.finish_reason = chunk.finish_reason or run.finish_reason
            chunk = await anext(run.gen, None)
        finish = run.finish_reason or "length"
        for obj in writer.closing(finish, None):      # what the parsers held back, then the finish
            choice = obj["choices"][0]
            if choice["delta"]:
                yield choice["delta"]
            finish = choice["finish_reason"] or finish
        self.finish_reason = finish
