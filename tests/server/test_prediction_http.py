"""OpenAI's Predicted Outputs over HTTP: chat's ``prediction`` field drafts the reply from
the text it carries, the reply stays what it is without it, and ``usage`` says how many of
its tokens were kept (``completion_tokens_details``)."""

from __future__ import annotations

import pytest

from conftest import require_exact_kernels

from .helpers import chat_text, parse_sse

CHAT = [{"role": "user", "content": "hello world"}]
ASK = {"messages": CHAT, "max_tokens": 40, "temperature": 0, "draft_max": 3, "ignore_eos": True}


def _reply(client, **extra) -> dict:
    r = client.post("/v1/chat/completions", json={**ASK, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prediction_drafts_the_reply_and_usage_counts_it(client):
    require_exact_kernels()
    plain = _reply(client)
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]      # no prediction, no counts of one
    for content in (text, [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]):
        got = _reply(client, prediction={"type": "content", "content": content})
        assert got["choices"][0]["message"]["content"] == text
        usage = got["usage"]
        assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
        details = usage["completion_tokens_details"]
        assert 0 < details["accepted_prediction_tokens"] < usage["completion_tokens"]
        assert details["rejected_prediction_tokens"] >= 0
        # the drafts from the prediction stand in for the head's
        assert got["timings"]["draft_n"] < plain["timings"]["draft_n"]
    unrelated = _reply(client, prediction={"type": "content", "content": "zzz qqq " * 20})
    assert unrelated["choices"][0]["message"]["content"] == text
    assert unrelated["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0


def test_a_streamed_reply_with_a_prediction_reports_it_in_its_usage_chunk(client):
    require_exact_kernels()
    whole = _reply(client, prediction={"type": "content", "content": _reply(client)["choices"][0]["message"]["content"]})
    r = client.post("/v1/chat/completions", json={**ASK, "stream": True, "stream_options": {"include_usage": True},
                                                  "prediction": {"type": "content",
                                                                 "content": whole["choices"][0]["message"]["content"]}})
    chunks = parse_sse(r.text)
    assert chat_text(chunks) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens_details"] == whole["usage"]["completion_tokens_details"]


@pytest.mark.parametrize("prediction, message", [
    ("some text", 'prediction must be {"type": "content", "content": "the text the reply is expected to repeat"}, '
                  "got a string"),
    ({"type": "text", "content": "x"}, "prediction must be {\"type\": \"content\""),
    ({"type": "content"}, "prediction must be {\"type\": \"content\""),
    ({"type": "content", "content": 5}, "prediction.content must be a string or a list of text parts"),
    ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content must be a string or a list"),
])
def test_a_bad_prediction_is_a_400_naming_it(client, prediction, message):
    r = client.post("/v1/chat/completions", json={**ASK, "prediction": prediction})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prediction" and message in err["message"], err


def test_the_openai_client_sends_a_prediction_and_reads_its_counts(dense_server):
    client = dense_server.openai()
    kw = dict(model="pymtp-fixture-dense", messages=CHAT, max_tokens=40, temperature=0,
              extra_body={"draft_max": 3, "ignore_eos": True})
    plain = client.chat.completions.create(**kw)
    text = plain.choices[0].message.content
    got = client.chat.completions.create(prediction={"type": "content", "content": text}, **kw)
    if got.choices[0].message.content != text:
        require_exact_kernels()                         # skips where kernels round per batch shape; else:
        assert got.choices[0].message.content == text   # a prediction never changes greedy output
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0


def test_a_prediction_beside_a_forced_tool_call(client):
    """Drafts from a prediction stay inside the tool call's grammar; the reply is the one
    made without it. (The fixture writes the call a byte a token: cut by max_tokens, the
    call is left out of the reply, and its tokens' text, through logprobs, is what it
    wrote, which is then the prediction.)"""
    from test_tools import WEATHER

    require_exact_kernels()
    ask = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 64,
           "temperature": 0, "draft_max": 3, "tools": [WEATHER], "logprobs": True,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}
    plain = client.post("/v1/chat/completions", json=ask).json()
    written = "".join(t["token"] for t in plain["choices"][0]["logprobs"]["content"])
    assert written.startswith("<tool_call>") and plain["choices"][0]["finish_reason"] == "length"
    assert plain["choices"][0]["message"]["content"] is None
    # the call as written, a character changed in its middle, then text the grammar refuses
    prediction = written[:30] + "#" + written[31:] + "} and more"
    got = client.post("/v1/chat/completions", json={**ask, "prediction": {"type": "content", "content": prediction}})
    got = got.json()
    assert "".join(t["token"] for t in got["choices"][0]["logprobs"]["content"]) == written
    assert got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


def test_token_origins_name_the_predictions_drafts(client):
    """The chat page's origins (``"pymtp": {"origins": true}``) with a prediction: its kept
    drafts are named "predicted", and the named pieces still join to the text."""
    text = _reply(client)["choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json={**ASK, "stream": True, "pymtp": {"origins": True},
                                                  "prediction": {"type": "content", "content": text}})
    chunks = parse_sse(r.text)
    assert not any("error" in c for c in chunks), chunks[-1]
    marks = [c["pymtp"] for c in chunks if "pymtp" in c]
    origins = [o for m in marks for o in m["origins"]]
    # a mark says whose drafts its round verified: the prediction's are named so
    assert all(m["predicted"] == ("predicted" in m["origins"]) for m in marks if m["accepted"])
    assert "predicted" in origins and not any(o.startswith("d") and o[1:].isdigit() for o in origins[:4])
    assert "".join(p for m in marks for p, _ in m["pieces"]) == chat_text(chunks)
