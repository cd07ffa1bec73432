"""A request's ``draft_max: "auto"`` through the server, and bad values named in a 400."""

from __future__ import annotations

import pytest

from conftest import require_exact_kernels

PROMPT = "def fibonacci(n):"


def test_auto_request_gives_plain_decodings_text(client, dense_model):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "draft_max": "auto"})
    assert r.status_code == 200, r.text
    require_exact_kernels()
    plain = dense_model.generate(PROMPT, max_tokens=24, spec="none")
    assert r.json()["choices"][0]["text"] == plain.text


@pytest.mark.parametrize("value", ["fast", 2.5, True, [3]])
def test_bad_draft_max_is_a_400_naming_the_field(client, value):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "draft_max": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "draft_max" and 'draft_max must be an integer or "auto"' in err["message"]
