"""Response and stream-chunk objects in the OpenAI shapes, plus pymtp's ``timings``.

``timings`` follows llama-server's extension field (``prompt_n``, ``predicted_per_second``,
``draft_n``, ``draft_n_accepted`` ...) so tools that read it there read it here, and adds
the MTP numbers that only a speculative decoder has.

Logprobs (``Extras``) take OpenAI's two shapes: completions ``{tokens, token_logprobs,
top_logprobs, text_offset}``, where each ``top_logprobs`` entry maps token text to logprob
and always holds the chosen token too, and chat ``{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}``. Token text is the token's bytes as UTF-8
with U+FFFD for a piece of a character (chat's ``bytes`` keeps the exact bytes), control
tokens spelled out (``<|im_end|>``). ``text_offset`` counts characters from the start of
the prompt's text, echoed or not, as OpenAI's does.

Tool calls (a chat with ``tools``): the reply's ``<tool_call>`` blocks become the
message's ``tool_calls`` (``content`` the rest, null when empty) and ``finish_reason`` is
"tool_calls"; a stream holds back text that may open a block and sends each call as one
``delta.tool_calls`` entry (its whole arguments at once) once its block closes.
"""

from __future__ import annotations

import codecs
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..results import Chunk, Stats
from .. import __version__
from ..logprobs import TokenLogprob
from ..reasoning import ReasoningStream, split_reasoning
from ..tools import ToolPlan

# OpenAI's backend configuration a reply came from (llama-server sends its build, b1-0c1e570)
FINGERPRINT = f"pymtp-{__version__}"
# What OpenAI reports for a token too unlikely to have a number; JSON has no -Infinity.
UNLIKELY = -9999.0


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
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}


def usage(prompt: tuple[int, int], stats: Sequence[Stats | None], thought: Sequence[int | None] = ()) -> dict:
    """OpenAI's usage object from each choice's stats (None: nothing ran): the completion
    tokens summed; ``prompt`` the prompts' tokens and those of them the prompt cache held
    (``cached_tokens``), each prompt counted once; ``completion_tokens_details`` where there is
    something to detail: the thinking's tokens (``thought``, a choice's
    ``service.reasoning_tokens``) where the chat's thinking comes back apart, and a
    prediction's drafts."""
    done = sum(s.generated_tokens for s in stats if s is not None)
    prompt_tokens, cached = prompt
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
           "prompt_tokens_details": {"cached_tokens": cached}}
    details = {}
    if any(n is not None for n in thought):
        details["reasoning_tokens"] = sum(n or 0 for n in thought)
    ran = [s for s in stats if s is not None]
    if any(s.prediction_tokens for s in ran):
        # OpenAI's Predicted Outputs: drafts from the prediction the reply kept, and those
        # decoded and thrown away (OpenAI bills those in completion_tokens; pymtp's
        # completion_tokens count the reply's tokens only)
        kept = sum(s.predicted_accepted for s in ran)
        details |= {"accepted_prediction_tokens": kept,
                    "rejected_prediction_tokens": sum(s.predicted_drafted for s in ran) - kept}
    if details:
        out["completion_tokens_details"] = details
    return out


def timings(stats: Stats) -> dict:
    """As llama-server's: ``prompt_n`` the prompt tokens decoded, ``cache_n`` those reused."""
    s = stats
    processed = s.prompt_processed
    return {
        "cache_n": s.cached_tokens,
        "prompt_n": processed,
        "prompt_ms": s.prompt_seconds * 1e3,
        "prompt_per_token_ms": s.prompt_seconds * 1e3 / processed if processed else 0.0,
        "prompt_per_second": (processed / s.prompt_seconds) if s.prompt_seconds > 0 else 0.0,
        "predicted_n": s.generated_tokens,
        "predicted_ms": s.decode_seconds * 1e3,
        # per step after the first token (the prompt's logits give it), as llama-server's and
        # as predicted_per_second counts
        "predicted_per_token_ms": s.decode_seconds * 1e3 / steps if (steps := s.generated_tokens - 1) > 0 else 0.0,
        "predicted_per_second": s.tokens_per_second,
        "draft_n": s.drafted,
        "draft_n_accepted": s.accepted,
        # pymtp: verify rounds, tokens per round and acceptance at each draft position
        "draft_rounds": s.rounds,
        "mean_accept_len": s.mean_accept_len,
        "accepted_per_position": list(s.accepted_per_position),
        # rounds by the drafts planned for them (0: a plain decode): the depth "auto" chose
        "draft_depths": {str(k): n for k, n in sorted(s.depths.items())},
    }


def _cut_before(decoder: codecs.IncrementalDecoder, data: bytes) -> int:
    """1 where the character the decoder holds open is cut by ``data``'s first byte (its
    U+FFFD comes out with ``data``'s text but is not ``data``'s: the token starts after
    it), else 0 (nothing open, or ``data`` goes on with that character)."""
    pending = decoder.getstate()[0]
    if not pending or not data:
        return 0
    try:
        codecs.getincrementaldecoder("utf-8")().decode(pending + data[:1])
    except UnicodeDecodeError:
        return 1
    return 0


class Extras:
    """What a response shows besides the generated text: the echoed prompt (completions'
    ``echo``) and the tokens' logprobs (when asked), one per response: text offsets
    continue from chunk to chunk.

    A token's logprob goes out with the first of its text that does: text held back for a
    possible stop string holds its tokens' logprobs too, and a token whose text a stop
    string took whole has none, as llama-server's answers have none for the stop word's
    tokens (they lined up with text the reply never shows)."""

    def __init__(self, kind: str, token_bytes: Callable[..., bytes], *, logprobs: bool = False,
                 echo: bool = False, prompt_text: str = "", prompt_ids: Sequence[int] = (),
                 prompt_logprobs: list[TokenLogprob | None] | None = None) -> None:
        self.kind = kind
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_text = prompt_text
        self.prompt_ids = list(prompt_ids)
        self.prompt_logprobs = prompt_logprobs
        self._token_bytes = token_bytes
        self._pieces: dict[tuple[int, bool], bytes] = {}
        # the tokens' text as the generation's decoder made it, so that it counts as the
        # text shown does (an invalid byte is one replacement character in both); a
        # token's first character is also its text_offset, after the prompt's
        # (the token's first character, the end of its place, its record)
        self._held: list[tuple[int, int, TokenLogprob]] = []
        self._made = 0        # characters of the tokens so far
        self._shown = 0       # characters of the text the reply has shown so far
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # where the text of each token ``of`` last gave out sits in the reply's: (start, end)
        self.places: list[tuple[int, int]] = []

    def opening(self) -> tuple[str, dict | None]:
        """The echoed prompt's text and logprobs ("", None without echo)."""
        if not self.echo:
            return "", None
        if not self.logprobs or self.prompt_logprobs is None:
            return self.prompt_text, None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offsets, at = [], 0
        for t in self.prompt_ids:
            offsets.append(at + _cut_before(decoder, self._bytes(t, True)))
            piece = decoder.decode(self._bytes(t, True))
            # a control token the client's text does not hold (the BOS the vocabulary adds)
            # takes no room in it: counted, every later offset pointed past its token
            if self.prompt_text.startswith(piece, at) or self._bytes(t, False):
                at += len(piece)
        entries = [(t, lp) for t, lp in zip(self.prompt_ids, self.prompt_logprobs)]
        return self.prompt_text, self._completion(entries, offsets)

    def of(self, chunk: Chunk) -> dict | None:
        """The logprobs object of the tokens whose text showed with this chunk's (None
        when not asked). Once per chunk, in order: it moves on what is held back."""
        if not self.logprobs:
            return None
        shown = self._showing(chunk)
        self.places = [(at, end) for at, end, _ in shown]
        if chunk.logprobs is None and not shown:
            return None
        if self.kind == "chat":     # OpenAI's object has both keys; a reply here refuses nothing
            return {"content": [self._chat_entry(r) for _, _, r in shown], "refusal": None}
        return self._completion([(r.token, r) for _, _, r in shown],
                                [len(self.prompt_text) + at for at, _, _ in shown])

    def _showing(self, chunk: Chunk) -> list[tuple[int, int, TokenLogprob]]:
        for r in chunk.logprobs or ():
            start = self._made + _cut_before(self._decoder, self._bytes(r.token, False))
            end = self._made + len(self._decoder.decode(self._bytes(r.token, False)))   # as the text renders it
            # a token that starts a character a later one ends, or renders nothing, is placed
            # on the character that follows: its text, as far as there is one
            place = end + 1 if self._decoder.getstate()[0] or end == self._made else end
            self._held.append((start, place, r))
            self._made = end
        self._shown += len(chunk.text)
        if chunk.finish_reason is not None and chunk.stop_word is None:
            n = len(self._held)             # the end: what was held back is text
        else:
            n = next((i for i, (start, _, _) in enumerate(self._held) if start >= self._shown), len(self._held))
        out = self._held[:n]
        self._held = [] if chunk.stop_word is not None else self._held[n:]
        return out

    # -- shapes
    def _completion(self, entries: list[tuple[int, TokenLogprob | None]], offsets: list[int]) -> dict:
        tokens, token_lps, tops = [], [], []
        for token, r in entries:
            tokens.append(self._legacy_text(token))
            token_lps.append(None if r is None else _finite(r.logprob))
            if r is None:
                tops.append(None)
                continue
            top: dict[str, float] = {}
            for t, lp in r.top + ((r.token, r.logprob),):   # the chosen token always, as OpenAI's
                top.setdefault(self._legacy_text(t), _finite(lp))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, r: TokenLogprob) -> dict:
        return {**self._chat_token(r.token, r.logprob),
                "top_logprobs": [self._chat_token(t, lp) for t, lp in r.top]}

    def _chat_token(self, token: int, logprob: float) -> dict:
        return {"token": self._text(token), "logprob": _finite(logprob), "bytes": list(self._bytes(token, True))}

    def _legacy_text(self, token: int) -> str:
        """A token as the legacy shape names it: its text, or ``bytes:\\xNN...`` (OpenAI's
        form) for bytes that are not whole UTF-8, which has no ``bytes`` field to tell them
        apart: as one replacement character, the alternatives of a character split over
        tokens were one key of ``top_logprobs`` and the chosen token's could be lost."""
        b = self._bytes(token, True)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b)

    def _text(self, token: int) -> str:
        return self._bytes(token, True).decode("utf-8", errors="replace")

    def _bytes(self, token: int, special: bool) -> bytes:
        key = (token, special)
        b = self._pieces.get(key)
        if b is None:
            b = self._pieces[key] = self._token_bytes(token, special=special)
        return b


def _finite(logprob: float) -> float:
    return max(logprob, UNLIKELY)


def merge_logprobs(parts: list[dict | None]) -> dict | None:
    """One logprobs object from those of several chunks (the non-streaming answer)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return {key: [x for p in parts for x in p[key]] if isinstance(parts[0][key], list) else parts[0][key]
            for key in parts[0]}


def tool_finish(finish_reason: str, calls: list) -> str:
    """"tool_calls" for a reply that ended by itself with calls in it."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


@dataclass
class Choice:
    """One generation of a non-streaming answer: its chunks and how it was made."""

    chunks: list[Chunk]
    stats: Stats | None = None
    extras: Extras | None = None
    tools: ToolPlan | None = None
    reasoning: bool | None = None      # service.Run.reasoning
    prefill: str = ""                  # service.Run.prefill

    @property
    def finish_reason(self) -> str:
        return next((c.finish_reason for c in reversed(self.chunks) if c.finish_reason), "length")


def full_response(env: Envelope, choices: list[Choice], prompt: tuple[int, int],
                  thought: Sequence[int | None] = ()) -> dict:
    """The non-streaming answer: ``text_completion`` or ``chat.completion``, a choice per
    generation (``n``); ``timings`` (llama-server's, one generation's) only for one;
    ``thought`` as ``usage`` reads it."""
    obj = env.head("chat.completion" if env.kind == "chat" else "text_completion")
    stats = [c.stats for c in choices]
    out = {**obj, "choices": [_choice(env, c, i) for i, c in enumerate(choices)],
           "usage": usage(prompt, stats, thought)}
    if len(choices) == 1 and stats[0] is not None:
        out["timings"] = timings(stats[0])
    return out


def _choice(env: Envelope, c: Choice, index: int) -> dict:
    chunks, extras, tools, finish_reason = c.chunks, c.extras, c.tools, c.finish_reason
    text = c.prefill + "".join(c.text for c in chunks)
    logprobs = None
    if extras is not None:
        echoed, opening = extras.opening()
        text = echoed + text
        logprobs = merge_logprobs([opening] + [extras.of(c) for c in chunks])
        if extras.logprobs and logprobs is None:    # asked, but no token was generated
            logprobs = {"content": [], "refusal": None} if env.kind == "chat" else \
                {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if env.kind == "chat":
        thinking = None
        if c.reasoning is not None:
            thinking, text = split_reasoning(text, c.reasoning)
        message: dict = {"role": "assistant", "content": text, "refusal": None}     # OpenAI's schema requires the key
        if tools is not None:
            cut = finish_reason == "length" or any(ch.stop_word for ch in chunks)   # by max_tokens or a stop string
            if cut and (kept := tools.uncut(text)) != text:
                text = kept         # no call, and no markup of the call cut: llama-server's null if nothing is left
                message["content"] = text or None
            content, calls = tools.read(text)
            if calls:
                message = {"role": "assistant", "content": content or None, "refusal": None, "tool_calls": calls}
                finish_reason = tool_finish(finish_reason, calls)
        if thinking:
            message["reasoning_content"] = thinking
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _runs(places: list[int]) -> list[tuple[int, int]]:
    """Places as (start, end) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for at in places:
        if out and out[-1][1] == at:
            out[-1] = (out[-1][0], at + 1)
        else:
            out.append((at, at + 1))
    return out


class ChunkWriter:
    """Builds the stream's chunk objects in order: role (chat), text deltas, finish, usage.

    With ``include_usage`` every chunk carries ``"usage": null`` and one more chunk with
    empty ``choices`` carries the counts, as the OpenAI API does.
    """

    def __init__(self, env: Envelope, include_usage: bool, extras: Extras | None = None,
                 tools: ToolPlan | None = None, index: int = 0, reasoning: bool | None = None,
                 prefill: str = "") -> None:
        self.env = env
        self.include_usage = include_usage
        self.index = index            # the choice this writer's chunks belong to (``n``)
        self.extras = extras
        self.tools = tools if tools is not None and tools.parses else None
        self._calls = self.tools.stream() if self.tools is not None else None
        self._n_calls = 0
        self._kept_calls = 0          # calls read so far (``parallel`` false: one)
        self._space = ""              # white space after the content, held until text follows
        self._said = False            # content handed out so far
        # the thinking apart (service.Run.reasoning), before the content is read for calls
        self._thinking = ReasoningStream(reasoning) if reasoning is not None and env.kind == "chat" else None
        self._split_of: tuple[Chunk, tuple[str, str, list[dict]]] | None = None   # wants() to delta()
        self._logprobs_of: tuple[Chunk, dict | None] | None = None                  # wants() to delta()
        self.prefill = prefill      # the continued message's text: the reply's content starts with it
        # where the last read's content came from, as (start, end) offsets into the text
        # read so far (the prefill's, then the reply's): tokens there made it
        self.text_spans: list[tuple[int, int]] = []
        self._fed = 0
        self._space_at: list[int] = []   # where ``_space``'s characters were read
        self._worded = False             # a stop string ended the text: it may cut a call as max_tokens does

    def _chunk(self, choice: dict | None) -> dict:
        obj = "chat.completion.chunk" if self.env.kind == "chat" else "text_completion"
        out = {**self.env.head(obj), "choices": [choice] if choice is not None else []}
        if self.include_usage:
            out["usage"] = None
        return out

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False,
                logprobs: dict | None = None, calls: list[dict] | None = None, thinking: str = "") -> dict:
        if self.env.kind == "chat":
            # content null until text comes, as llama-server's first delta: a reply of calls
            # alone then accumulates to the whole answer's null, not ""
            delta: dict = {"role": "assistant", "content": None} if role else {}
            if text is not None:
                delta["content"] = text
            if thinking:
                if not text:
                    delta.pop("content", None)
                delta["reasoning_content"] = thinking
            if calls:
                if not text:
                    delta.pop("content", None)
                delta["tool_calls"] = [{"index": self._n_calls + i, **c} for i, c in enumerate(calls)]
                self._n_calls += len(calls)
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self) -> list[dict]:
        """Chat streams open with the assistant's role; completions with the echoed prompt,
        if asked, else nothing."""
        if self.env.kind == "chat":
            out = [self._chunk(self._choice(None, None, role=True))]
            if self.prefill:
                thinking, text, calls = self._split(Chunk(self.prefill, []))
                if thinking or text or calls:
                    out.append(self._chunk(self._choice(text, None, calls=calls, thinking=thinking)))
            return out
        if self.extras is not None and self.extras.echo:
            text, logprobs = self.extras.opening()
            return [self._chunk(self._choice(text, None, logprobs=logprobs))]
        return []

    def parses(self) -> bool:
        """Whether the reply's text goes through parsers (thinking, calls) that split it."""
        return self._calls is not None or self._thinking is not None

    def delta(self, chunk: Chunk) -> dict:
        """A chunk's text, with its tokens' logprobs when asked (with tools: its content and
        the calls whose blocks closed in it, as ``wants`` split them)."""
        thinking, text, calls = self._split(chunk)
        return self._chunk(self._choice(text, None, logprobs=self._logprobs(chunk), calls=calls, thinking=thinking))

    def wants(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` makes an event: it has text, or logprobs whose tokens' text
        showed (an empty text may end one: Extras says when a logprob goes out)."""
        thinking, text, calls = self._split(chunk)
        if thinking or text or calls:
            return True
        logprobs = self._logprobs(chunk)
        return bool(logprobs and any(logprobs.get(key) for key in ("content", "tokens")))

    def _logprobs(self, chunk: Chunk) -> dict | None:
        """``Extras.of`` the chunk, once per chunk (``wants`` then ``delta`` ask for it)."""
        if self.extras is None:
            return None
        if self._logprobs_of is None or self._logprobs_of[0] is not chunk:
            self._logprobs_of = (chunk, self.extras.of(chunk))
        return self._logprobs_of[1]

    def _split(self, chunk: Chunk) -> tuple[str, str, list[dict]]:
        """The chunk's thinking, content and completed calls (once per chunk: the streams
        hold state)."""
        self._worded = self._worded or chunk.stop_word is not None
        if self._calls is None and self._thinking is None:
            return "", chunk.text, []
        if self._split_of is None or self._split_of[0] is not chunk:
            self._split_of = (chunk, self._read(chunk.text))
        return self._split_of[1]

    def _read(self, text: str, last: bool = False, cut: bool = False) -> tuple[str, str, list[dict]]:
        """Text through the thinking's stream, then its content through the calls' (``last``:
        the end of the reply, whatever they hold back; ``cut``: by max_tokens or a stop string)."""
        thinking = ""
        self._fed += len(text)
        if self._thinking is not None:
            thinking, text = self._thinking.feed(text)
            if last:
                more, rest = self._thinking.finish()
                thinking, text = thinking + more, text + rest
        # the thinking's stream hands out content as the end of what it read
        if self._calls is None:
            self.text_spans = [(self._fed - len(text), self._fed)] if text else []
            return thinking, text, []
        text, calls = self._calls.feed(text)
        spans = self._calls.spans
        if last:
            more, last_calls = self._calls.finish(cut)
            text, calls, spans = text + more, calls + last_calls, spans + self._calls.spans
        shift = self._fed - self._calls.fed      # the calls' stream read the content, which ends here
        where = [at for a, b in spans for at in range(a + shift, b + shift)]
        if not self.tools.parallel:       # the first call only, as the whole reply's ToolPlan.read
            calls = calls[:max(0, 1 - self._kept_calls)]
        self._kept_calls += len(calls)
        first = self._calls.first_call_at
        return thinking, self._trimmed(text, where, last, None if first is None else first + shift), calls

    def _trimmed(self, text: str, where: list[int], last: bool, call: int | None) -> str:
        """Content as the whole reply reads it (``ToolPlan.read`` strips the text of a reply
        with calls, the text around them joined): white space after the text waits until
        the next text says it is inside the content, or the end of a reply that made calls
        drops it; white space before the content is none where a call came first (``call``:
        where the first call was read). ``where``: each character's place in what was
        read, which ``text_spans`` keeps for those handed out."""
        text, where = self._space + text, self._space_at + where
        n = len(text) - len(text.lstrip())
        if not self._said and call is not None and (n == len(text) or where[n] > call):
            text, where = text[n:], where[n:]
        body = text.rstrip()
        self._space, self._space_at = text[len(body):], where[len(body):]
        if last:
            if not self._kept_calls:
                body = body + self._space
            self._space, self._space_at = "", []
        self._said = self._said or bool(body)
        self.text_spans = _runs(where[:len(body)])
        return body

    def closing(self, finish_reason: str, stats: Stats | None, with_timings: bool = True) -> list[dict]:
        """The choice's last objects: text a tool-call stream held back, then its finish
        (with llama-server's ``timings`` unless ``with_timings`` is off: n > 1)."""
        out = []
        if self._calls is not None or self._thinking is not None:
            thinking, text, calls = self._read("", last=True, cut=finish_reason == "length" or self._worded)
            if thinking or text or calls:
                out.append(self._chunk(self._choice(text, None, calls=calls, thinking=thinking)))
        if self._calls is not None:
            finish_reason = tool_finish(finish_reason, [None] * self._n_calls)
        last = self._chunk(self._choice(None, finish_reason))
        if stats is not None and with_timings:
            last["timings"] = timings(stats)
        out.append(last)
        return out

    def usage(self, prompt: tuple[int, int], stats: Sequence[Stats | None],
              thought: Sequence[int | None] = ()) -> list[dict]:
        """With ``include_usage``, the stream's last chunk: empty ``choices``, the counts
        of every choice (``usage``)."""
        return [{**self._chunk(None), "usage": usage(prompt, stats, thought)}] if self.include_usage else []
