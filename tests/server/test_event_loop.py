"""Work a request's size decides stays off the server's event loop.

A forced tool's grammar is built for every tool (1,500 tools held /health 11.5 s in
session 66's fuzzing) and a logit_bias text is tokenized whole (15 MB: 9.7 s); on the event
loop either stalls every other request. The tests check where the work ran, not how long.
"""

from __future__ import annotations

import asyncio

from pymtp.server import schemas

from .helpers import app_client

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
HI = [{"role": "user", "content": "Weather in Paris?"}]
OPENAI = {"messages": HI, "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
          "tool_choice": "required", "max_tokens": 1}
ANTHROPIC = {"messages": HI, "tools": [{"name": "get_weather", "input_schema": PARAMS}],
             "tool_choice": {"type": "any"}, "max_tokens": 1}
RESPONSES = {"input": "Weather in Paris?", "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
             "tool_choice": "required", "max_output_tokens": 1}
ROUTES = [("/v1/chat/completions", OPENAI), ("/chat/completions/input_tokens", OPENAI),
          ("/apply-template", OPENAI), ("/v1/messages", ANTHROPIC), ("/v1/messages/count_tokens", ANTHROPIC),
          ("/v1/responses", RESPONSES), ("/v1/responses/input_tokens", RESPONSES)]


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_every_route_reads_its_tools_off_the_event_loop(dense_model, monkeypatch):
    real = schemas.ToolPlan.of
    where: list[bool] = []

    def of(*args, **kwargs):
        where.append(_on_loop())
        return real(*args, **kwargs)

    monkeypatch.setattr(schemas.ToolPlan, "of", staticmethod(of))
    with app_client(dense_model) as client:
        for path, body in ROUTES:
            where.clear()
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            assert where == [False], path       # read once, by a worker thread


def test_a_logit_bias_text_is_tokenized_off_the_event_loop(dense_model, monkeypatch):
    real = dense_model.tokenize
    where: list[bool] = []

    def tokenize(text, *args, **kwargs):
        if text == " the lazy":
            where.append(_on_loop())
        return real(text, *args, **kwargs)

    monkeypatch.setattr(dense_model, "tokenize", tokenize)
    bias = {"logit_bias": [[" the lazy", -5]]}
    with app_client(dense_model) as client:
        for path, body in [("/completion", {"prompt": "The quick", "n_predict": 1, **bias}),
                           ("/v1/completions", {"prompt": "The quick", "max_tokens": 1, **bias}),
                           ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, **bias})]:
            where.clear()
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            assert where and not any(where), (path, where)
