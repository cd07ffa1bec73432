"""OpenAI's chat messages as pymtp reads them (pymtp/chat_messages.py), for the server and
Python callers alike: what a template gets, and a ParamError naming the field otherwise."""

from __future__ import annotations

import re

import pytest

from pymtp.chat_messages import read_messages
from pymtp.config import ParamError

CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


def test_messages_as_the_template_gets_them():
    got = read_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "hm"},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
        {"role": "assistant", "content": None, "extra": 1},
    ])
    assert got == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ["a", "b"], "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "hm"},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
        {"role": "assistant", "content": ""},
    ]
    assert read_messages(({"role": "user", "content": "hi"},)) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("messages, param, code, message", [
    (None, "messages", "missing_required_parameter", "messages is required"),
    ("hi", "messages", "invalid_type", "messages must be a list of messages, got a string"),
    ([], "messages", "empty_messages", "messages must not be empty"),
    (["hi"], "messages[0]", "invalid_type", "messages[0] must be an object"),
    ([{"role": "bot", "content": "x"}], "messages[0].role", "invalid_value",
     "messages[0].role must be one of system, developer, user, assistant, tool, got 'bot'"),
    ([{"role": "user"}], "messages[0].content", "missing_required_parameter",
     "messages[0] (user) needs its content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "messages[1].content", "missing_required_parameter",
     "messages[1] (assistant) needs its content or its tool_calls"),
    ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type",
     "messages[0].content must be a string or a list of parts, got an integer"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}]}],
     "messages[0].content[1].type", "unsupported_parameter",
     "messages[0].content[1].type='image_url' is not supported: only text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text", "invalid_type",
     "messages[0].content[0].text must be a string, got an integer"),     # it said text parts were not supported
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "invalid_type",
     "messages[0].content[0].text must be a string, got null"),
    ([{"role": "assistant", "content": "", "tool_calls": "oops"}], "messages[0].tool_calls", "invalid_type",
     "messages[0].tool_calls must be a list, got a string"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls[0]",
     "invalid_type", 'messages[0].tool_calls[0] must be {"id": "...", "type": "function"'),
    ([{"role": "assistant", "content": "", "reasoning_content": 3}], "messages[0].reasoning_content",
     "invalid_type", "messages[0].reasoning_content must be a string, got an integer"),
    ([{"role": "tool", "content": "2", "tool_call_id": 7}], "messages[0].tool_call_id", "invalid_type",
     "messages[0].tool_call_id must be a string"),
])
def test_a_bad_message_names_its_field(messages, param, code, message):
    with pytest.raises(ParamError, match="^" + re.escape(message)) as exc:
        read_messages(messages)
    assert (exc.value.param, exc.value.code) == (param, code)


def test_python_chat_reads_messages_as_the_server_does(dense_model):
    # developer is system; text parts are text; a non-text part, a malformed call or a
    # message without content is a ParamError, where the template got a Python repr, an
    # unknown role, or an AttributeError from deep inside
    kw = dict(max_tokens=2, temperature=0)
    dev = dense_model.chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}], **kw)
    sys_ = dense_model.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], **kw)
    assert dev.prompt_tokens == sys_.prompt_tokens
    parts = dense_model.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], **kw)
    assert parts.prompt_tokens == dense_model.chat([{"role": "user", "content": "Hi"}], **kw).prompt_tokens
    for bad, param in (([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
                        "messages[0].content[0].type"),
                       ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": "oops"}],
                        "messages[1].tool_calls"),
                       ([{"role": "user"}], "messages[0].content")):
        with pytest.raises(ParamError) as exc:
            dense_model.chat(bad, **kw)
        assert exc.value.param == param
