"""A whole reply on the Anthropic and Responses routes is its stream's deltas read at once
(pymtp/server/chat_reply.py): for the same deltas the whole answer's blocks and items
equal the ones the stream's events build, in order (text after a call included), and a
finish at the token limit marks the same item."""

from __future__ import annotations

import json

import pytest

from pymtp.server.anthropic import _Blocks, message
from pymtp.server.chat_reply import parts
from pymtp.server.responses import Envelope
from pymtp.server.responses_api import _Items, output_items

CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
CALL2 = {**CALL, "index": 1, "id": "call_2", "function": {"name": "add", "arguments": '"x"'}}
CASES = {
    "nothing": ([], "stop"),
    "text": ([{"content": "Hel"}, {"content": "lo"}], "stop"),
    "thinking cut": ([{"reasoning_content": "hm"}, {"reasoning_content": "m"}], "length"),
    "thinking then text": ([{"reasoning_content": "hm", "content": "A"}, {"content": "B"}], "length"),
    "text, a call, text": ([{"content": "Sure."}, {"tool_calls": [CALL]}, {"content": "Done."}], "tool_calls"),
    "two calls, then the limit": ([{"content": "x", "tool_calls": [CALL, CALL2]}], "length"),
}


def test_parts_merge_runs_and_keep_the_order():
    deltas, _ = CASES["text, a call, text"]
    assert parts(deltas) == [("text", "Sure."), ("call", CALL), ("text", "Done.")]
    assert parts(CASES["thinking then text"][0]) == [("thinking", "hm"), ("text", "AB")]


def _without_ids(objs: list[dict]) -> list[dict]:
    return [{k: v for k, v in o.items() if k != "id"} for o in objs]


@pytest.mark.parametrize("name", list(CASES))
def test_the_whole_responses_items_are_the_streams(name):
    deltas, finish = CASES[name]
    items = _Items()
    for d in deltas:
        items.feed(d)
    items.finish(finish)
    assert _without_ids(output_items(parts(deltas), finish)) == _without_ids(items.items)


@pytest.mark.parametrize("name", list(CASES))
def test_the_whole_anthropic_blocks_are_the_streams(name):
    deltas, finish = CASES[name]
    blocks, events = [], _Blocks()
    for d in deltas:
        for kind, data in events.feed(d):
            if kind == "content_block_start":
                blocks.append(dict(data["content_block"]))
            elif kind == "content_block_delta":
                delta, block = data["delta"], blocks[data["index"]]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                elif delta["type"] == "input_json_delta":
                    block["input"] = json.loads(delta["partial_json"])
    for kind, _ in events.close():
        assert kind in ("content_block_delta", "content_block_stop")
    for b in blocks:
        if b["type"] == "thinking":
            b["signature"] = ""
    env = Envelope("chat", "m", id="msg_1")
    assert message(env, parts(deltas), finish, None, {})["content"] == blocks


def _whole(text_pieces: list[str], parallel: bool = True) -> tuple[list[tuple[str, object]], str]:
    from pymtp.results import Chunk
    from pymtp.server.chat_reply import whole_parts
    from pymtp.server.service import Run
    from pymtp.tools import ToolPlan
    from test_tools import ADD, WEATHER

    run = Run(1, None, tools=ToolPlan.of([WEATHER, ADD], "auto", parallel))
    chunks = [Chunk(t, [i]) for i, t in enumerate(text_pieces)]
    chunks[-1].finish_reason = "stop"
    return whole_parts(Envelope("chat", "m"), run, chunks)


@pytest.mark.parametrize("cut", [None, 13, 15, 30])
def test_calls_are_read_as_the_chat_routes_whole_reply_reads_them(cut):
    """Whole or streamed, a reply's calls and text are ToolPlan.read's: the text stripped of
    the white space before and between calls, the first call only without parallel calls,
    wherever the verify rounds cut the text."""
    from pymtp.tools import ToolPlan
    from test_tools import ADD, REPLY, WEATHER

    text = REPLY + "\n"
    pieces = [text] if cut is None else [text[:cut], text[cut:cut + 7], text[cut + 7:]]
    for parallel in (True, False):
        content, calls = ToolPlan.of([WEATHER, ADD], "auto", parallel).read(text)
        got, finish = _whole(pieces, parallel)
        assert finish == "tool_calls"
        assert [v for k, v in got if k == "text"] == [content]
        assert [v["function"] for k, v in got if k == "call"] == [c["function"] for c in calls]
    assert len(calls) == 1 and len(_whole(pieces)[0]) == 3


def test_a_reply_without_calls_keeps_its_white_space():
    assert _whole(["Hello ", "there \n"])[0] == [("text", "Hello there \n")]


@pytest.mark.parametrize("text", [
    'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n"""\n\nDone.\n',
    '\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n  Done.',
    'A <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> B <tool_call>\n'
    '{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n',
    # white space before text that comes first went out before any call was known
    '  \n Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n',
    ' <tool_call>\nnot json\n</tool_call> <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
])
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_content_around_calls_is_the_whole_replys(text, size):
    """The chat stream's content joined is ToolPlan.read's: the white space between the
    text before a call and the text after it stays, the ends of a reply with calls go."""
    from pymtp.results import Chunk
    from pymtp.server.responses import ChunkWriter
    from pymtp.tools import ToolPlan
    from test_tools import ADD, WEATHER

    plan = ToolPlan.of([WEATHER, ADD], "auto")
    writer = ChunkWriter(Envelope("chat", "m"), False, tools=plan)
    deltas = [writer.delta(Chunk(text[i:i + size], []))["choices"][0]["delta"] for i in range(0, len(text), size)]
    deltas += [o["choices"][0]["delta"] for o in writer.closing("stop", None)]
    content, calls = plan.read(text)
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert [c["function"] for d in deltas for c in d.get("tool_calls") or ()] == [c["function"] for c in calls]


# --- the text's logprobs (the Responses API's include: ["message.output_text.logprobs"])

CALL_TOKENS = ["<tool_call>", "\n", '{"name": "add", "arguments": {"a": 1, "b": 2}}', "\n", "</tool_call>"]


def _placed(pieces: list[str | bytes], size: int, *, tools: bool = False, reasoning: bool | None = None,
            prefill: str = "") -> tuple[list[tuple[str, object]], list[list[tuple[str, float]]], list[dict]]:
    """A reply of ``pieces`` (a token each, text or bytes, logprob -(i+1)), ``size`` tokens
    a chunk: its parts, each text part's logprobs as (token, logprob), and the deltas."""
    import codecs

    from pymtp.results import Chunk
    from pymtp.logprobs import TokenLogprob
    from pymtp.server.chat_reply import text_logprobs, whole_deltas
    from pymtp.server.responses import Extras
    from pymtp.server.service import Run
    from pymtp.tools import ToolPlan
    from test_tools import ADD

    vocab = list(dict.fromkeys(p if isinstance(p, bytes) else p.encode() for p in pieces))
    ids = [vocab.index(p if isinstance(p, bytes) else p.encode()) for p in pieces]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    chunks = [Chunk("".join(decoder.decode(vocab[t]) for t in ids[i:i + size]), ids[i:i + size],
                    logprobs=[TokenLogprob(t, -float(i + j + 1)) for j, t in enumerate(ids[i:i + size])])
              for i in range(0, len(ids), size)]
    chunks[-1].finish_reason = "stop"
    extras = Extras("chat", lambda t, special=False: vocab[t], logprobs=True)
    run = Run(1, None, extras=extras, tools=ToolPlan.of([ADD], "auto") if tools else None, reasoning=reasoning,
              prefill=prefill)
    deltas, _ = whole_deltas(Envelope("chat", "m"), run, chunks)
    lps = [[(e["token"], e["logprob"]) for e in part] for part in text_logprobs(deltas)]
    return parts(deltas), lps, deltas


@pytest.mark.parametrize("size", [1, 3, 100])
def test_a_texts_logprobs_leave_out_the_thinking_and_its_tags(size):
    """"in" inside "</think>" is not the text's "in": tokens are placed where their text
    sits, not where a search for the text finds it first."""
    pieces = ["<think>", "ab", "c", "</th", "in", "k>", "\n\n", "in", " fact"]
    got, lps, deltas = _placed(pieces, size, reasoning=False)
    assert got == [("thinking", "abc"), ("text", "in fact")]
    assert lps == [[("in", -8.0), (" fact", -9.0)]]
    # a stream's deltas: each text delta's own tokens
    assert [[e["token"] for e in d["logprobs"]] for d in deltas if d.get("content")] == \
        ([["in"], [" fact"]] if size == 1 else [["in", " fact"]])


@pytest.mark.parametrize("size", [1, 2, 100])
def test_a_texts_logprobs_leave_out_a_calls_tokens(size):
    """Text, a call, text: the text's tokens, in order, make its text (the white space
    beside the call included); a token that the calls' parser holds back while a later one
    is handed out waits for it; none of the call's is there."""
    pieces = ["Hi", "\n"] + CALL_TOKENS + ["\n", "add", "ed"]
    got, lps, _ = _placed(pieces, size, tools=True)
    assert "".join(v for k, v in got if k == "text") == "Hi\n\nadded" and [k for k, _ in got].count("call") == 1
    assert [x for part in lps for x in part] == [("Hi", -1.0), ("\n", -2.0), ("\n", -8.0), ("add", -9.0), ("ed", -10.0)]


@pytest.mark.parametrize("size", [1, 6])
def test_a_continued_thinkings_text_keeps_its_logprobs(size):
    """A prefill that opened the thinking: the parsers read it first, so the reply's
    tokens sit after it."""
    pieces = [" about", " it", "</think>", "\n\n", "Hi", " there"]
    got, lps, _ = _placed(pieces, size, reasoning=False, prefill="<think>\nLet me think ")
    assert got[-1] == ("text", "Hi there") and lps == [[("Hi", -5.0), (" there", -6.0)]]


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("tools, reasoning", [(True, None), (False, False), (False, None)])
def test_a_characters_tokens_all_go_with_its_text(size, tools, reasoning):
    """A token of a character's first bytes renders nothing until the next ends it, and a
    token may render nothing at all: each is placed on the character that follows."""
    head = ["<think>", "hm", "</think>\n\n"] if reasoning is not None else []
    pieces = head + ["ab", b"\xc3", b"\xa9", b"", "x"]
    _, lps, _ = _placed(pieces, size, tools=tools, reasoning=reasoning)
    assert [lp for part in lps for _, lp in part] == [-float(len(head) + i) for i in range(1, 6)]
    # the tag's token carries the text's first byte
    _, lps, _ = _placed(["<think>", "hm", b"</think>\n\n\xe6", b"\x97\xa5", "x"], size, reasoning=False)
    assert lps == [[("</think>\n\n\ufffd", -3.0), ("\ufffd\ufffd", -4.0), ("x", -5.0)]]


@pytest.mark.parametrize("size", [1, 3])
def test_white_space_the_reply_trims_around_a_call_has_no_logprobs(size):
    got, lps, _ = _placed(CALL_TOKENS + ["\n\n", "Bye"], size, tools=True)
    assert got[-1] == ("text", "Bye") and lps == [[("Bye", -7.0)]]
    got, lps, _ = _placed(["\n\n"] + CALL_TOKENS + ["\n", "ok"], size, tools=True)
    assert got[-1] == ("text", "ok") and lps == [[("ok", -8.0)]]
