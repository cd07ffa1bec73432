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
