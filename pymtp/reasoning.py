"""A reply's thinking, apart from its content: the leading ``<think>...</think>`` block of
a reasoning model's reply goes to ``reasoning_content``, as llama-server (its default
``--reasoning-format auto``) and vLLM's Qwen3 reasoning parser hand it back.

Qwen3.5's templates open the block in the prompt: the generation prompt ends in
``<think>\\n`` (and, with ``enable_thinking`` false, in an empty closed block instead). A
reply to such a prompt starts inside the block and holds only its end tag
(``opened_by``). Other models write the open tag themselves, first. Only a block at the
reply's start is thinking: a ``<think>`` later in the text is content.

The thinking is stripped of the white space before it (it keeps what ends it, as the
pinned llama-server's parser does), and the content of the white space after the end
tag, in a stream as in a whole reply: ``ReasoningStream`` holds back leading white space
and any text that may be the start of a tag until the next text says what it is, so the
pieces it hands out join to ``split_reasoning``'s strings.
"""

from __future__ import annotations

import codecs
from typing import Iterable

from .constraint import grammar_words, renamed_rules, text_until
from .stops import THINK_CLOSE, THINK_OPEN, held_suffix


_START, _INSIDE, _AFTER_CLOSE, _CONTENT = range(4)


def opened_by(prompt_tail: str) -> bool:
    """Whether a rendered prompt that ends in ``prompt_tail`` leaves a think block open."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def block_at_start(thinks: bool, prompt_tail: str, prefill: str = "") -> bool | None:
    """Whether a chat reply starts inside a think block (True), may open one first (False),
    or has none (None): a template that ``thinks`` (others' replies never do, as
    llama-server reads them), the prompt's end, which ends with ``prefill`` where the reply
    continues a message (that text starts the reply: inside the block where the template
    opened it before the text and the text does not close it). What the model may write,
    whatever ``reasoning_format`` then makes of it: a reply that a grammar formats (a
    forced tool call, response_format) thinks first by ``think_first``'s grammar, and a
    reasoning budget counts from here.

    Where the template closed the block itself (Qwen3.5's ``enable_thinking: false`` writes
    an empty one), the reply is all content, as llama-server reads it: a ``<think>`` the
    model writes stays text, and a formatted reply gets no block to open."""
    if not thinks:
        return None
    continued = bool(prefill) and prompt_tail.endswith(prefill)
    head = prompt_tail[:len(prompt_tail) - len(prefill)] if continued else prompt_tail
    if head.rstrip().endswith(THINK_CLOSE):
        return None
    return opened_by(head) and not (continued and THINK_CLOSE in prefill)


def reply_split(fmt: str, thinks: bool, prompt_tail: str, prefill: str = "") -> bool | None:
    """Whether a chat reply's thinking is split off (None: the reply stays as written), and
    if so whether it starts inside the block (``block_at_start``): ``fmt`` (FORMATS)."""
    if fmt == "none":
        return None
    return block_at_start(thinks, prompt_tail, prefill)


def opener(fmt: str, thinks: bool, prompt_tail: str, prefill: str = "") -> str:
    """The generation prompt's think tags that a chat reply's content starts with under
    ``fmt`` "none" (FORMATS), "" elsewhere: llama-server reads a reply after its generation
    prompt, whose text from the reasoning start tag on it keeps as content when it splits
    nothing off (``<think>\\n`` where the template opened the block, the empty closed block
    where it closed it), so a client that parses the tags itself finds the block whole.
    ``prompt_tail`` ends with ``prefill`` where the reply continues a message; the tags are
    those just before it."""
    if fmt != "none" or not thinks:
        return ""
    continued = bool(prefill) and prompt_tail.endswith(prefill)
    head = prompt_tail[:len(prompt_tail) - len(prefill)] if continued else prompt_tail
    at = head.rfind(THINK_OPEN)
    if at < 0 or head[at + len(THINK_OPEN):].strip() not in ("", THINK_CLOSE):
        return ""
    return head[at:]


def budget_start(thinking: bool | None, format_first: bool) -> bool | None:
    """Where a chat's reasoning budget counts: from the reply's start where the prompt
    opened the block (True), from a block the model opens (False), as ``thinking``
    (``block_at_start``) says, not from a ``<think>`` in a message. None, no budget, where
    the reply may not think: a template that does not, or that closed the block, or a
    formatted reply whose grammar starts at once (``format_first``: reasoning_format
    "none", as llama-server's grammar then has no room for thinking either), where the
    forced end tag would be text the grammar refuses."""
    return None if format_first else thinking


def think_first(gbnf: str, opened: bool = True) -> str:
    """A GBNF grammar of a reply that may think before what ``gbnf`` allows: where the
    prompt ``opened`` the block, its rest and end tag come first; otherwise the reply may
    start with a whole block. So a forced tool call or a JSON reply can think first, as
    llama-server's grammars let it: under ``gbnf`` alone an opened block could never close,
    and the whole reply would be unclosed thinking.

    The block's text is read by an automaton over the end tag (``text_until``), so the
    block ends at its first ``</think>`` and nowhere else, as ``split_reasoning`` says.
    The new rules' names are made unused in ``gbnf`` (a JSON schema's ``$defs`` become rule
    names)."""
    words = grammar_words(gbnf)
    prefix = "pymtp-reply"
    while any(w.startswith(prefix) for w in words):
        prefix += "x"
    body = f"{prefix}-body"
    rules = [renamed_rules(gbnf, {"root": body}), ""]
    rules.append(f"root ::= {prefix}-t0" if opened else
                 f'root ::= {body} | [ \\t\\n]* "{THINK_OPEN}" {prefix}-t0')
    rules += text_until(f"{prefix}-t", THINK_CLOSE, f"[ \\t\\n]* {body}")
    return "\n".join(rules) + "\n"


class ReasoningStream:
    """Splits streamed text into (thinking, content) pieces as it comes; ``opened``: the
    prompt opened the block, so the reply starts inside it."""

    def __init__(self, opened: bool = False) -> None:
        self.state = _INSIDE if opened else _START
        self.held = ""
        self.thought = opened       # a block was seen (an opened one counts, empty or not)
        self.began = False          # the thinking handed out so far is not empty

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        thinking, content = [], []
        while True:
            if self.state == _START:
                rest = self.held.lstrip()
                if rest.startswith(THINK_OPEN):
                    self.held, self.state, self.thought = rest[len(THINK_OPEN):], _INSIDE, True
                    continue
                if THINK_OPEN.startswith(rest):       # white space, or a tag's beginning
                    break
                self.state = _CONTENT
            if self.state == _INSIDE:
                if not self.began:
                    self.held = self.held.lstrip()
                end = self.held.find(THINK_CLOSE)
                if end >= 0:
                    thinking.append(self.held[:end])
                    self.held, self.state = self.held[end + len(THINK_CLOSE):], _AFTER_CLOSE
                    continue
                keep = len(self.held) - held_suffix(self.held, (THINK_CLOSE,))
                out = self.held[:keep]
                thinking.append(out)
                self.held = self.held[len(out):]
                self.began = self.began or bool(out)
                break
            if self.state == _AFTER_CLOSE:
                self.held = self.held.lstrip()
                if not self.held:
                    break
                self.state = _CONTENT
            content.append(self.held)
            self.held = ""
            break
        return "".join(thinking), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held at the end: content that looked like the start of a tag. Inside
        the block it is the start of the end tag (``feed`` hands out the rest), which a cut
        (max_tokens, a reasoning budget's forced tag cut short) left unfinished: neither
        thinking nor content, as llama-server drops it (it was ``"</th"`` in the thinking)."""
        held, state = self.held, self.state
        self.held = ""
        return "", held if state in (_START, _CONTENT) else ""


def thinking_tokens(pieces: Iterable[bytes], opened: bool) -> int:
    """How many of a reply's tokens (``pieces``, each token's bytes) its thinking took, as
    OpenAI's usage counts ``reasoning_tokens``: up to the token that completes the block's
    end tag; all of them where the block never ends; none where the reply has no block
    at its start (and the prompt, ``opened``, opened none)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, inside, n = "", opened, 0
    for n, piece in enumerate(pieces, 1):
        text += decoder.decode(piece)
        if not inside:
            head = text.lstrip()
            if head.startswith(THINK_OPEN):
                inside, text = True, head[len(THINK_OPEN):]
            elif not THINK_OPEN.startswith(head):
                return 0
        if inside and THINK_CLOSE in text:
            return n
        text = text[-len(THINK_CLOSE):] if inside else text      # all a tag split across tokens needs
    return n if inside else 0


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole reply as (thinking, content); thinking is None where the reply has no
    block at its start (and the prompt opened none)."""
    stream = ReasoningStream(opened)
    thinking, content = stream.feed(text)
    more_thinking, more_content = stream.finish()
    return (thinking + more_thinking if stream.thought else None), content + more_content

