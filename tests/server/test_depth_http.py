"""A request's ``draft_max: "auto"`` through the server, bad values named in a 400, and an auto
server's search of the depths at start."""

from __future__ import annotations

import re

import pytest

from conftest import require_exact_kernels
from server.helpers import live_server

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


@pytest.mark.parametrize("calibrate", [True, False])
def test_an_auto_server_searches_the_depths_at_start_when_told_to(dense_path, tmp_path, calibrate):
    """``pymtp serve --draft-max auto --calibrate`` runs the batched search before it
    answers /health (Batcher.calibrate): its estimates are on /metrics before any
    request, and the start-up line says how long it took. Without the flag the first
    requests search."""
    args = [str(dense_path), "--parallel", "2", "--ctx-size", "512", "--threads", "1", "--draft-max", "auto"]
    with live_server(args + (["--calibrate"] if calibrate else []), tmp_path) as srv:
        rates = {k: v for k, v in srv.metrics().items() if k.startswith("pymtp_auto_estimated_tokens_per_second")}
        log = srv.log.read_text()
    said = "pymtp serve: draft_max=auto calibrated at start in"
    if not calibrate:
        assert rates == {} and said not in log
        return
    line = next(ln for ln in log.splitlines() if said in ln)
    assert "2 sequence(s) a round, estimated tok/s k=0: " in line, line
    logged = {int(k): float(v) for k, v in re.findall(r"k=(\d+): ([0-9.]+)", line)}
    scraped = {int(re.search(r"depth=(\d+)", k)[1]): round(v, 1) for k, v in rates.items() if "occupancy=2}" in k}
    assert 0 in logged and scraped == logged, (rates, line)


def test_engines_calibrate_side_by_side(dense_path, tmp_path):
    """``--engines 2 --calibrate``: every engine runs the calibration prompts at start (at
    once, in threads), the first one's search picking the depth for both
    (depth_batched.Following), by the sequences decoding in both; /metrics has that search's
    estimates, under engine 0 alone, and the start-up line the same."""
    args = [str(dense_path), "--parallel", "4", "--engines", "2", "--ctx-size", "512", "--threads", "1",
            "--draft-max", "auto", "--calibrate"]
    with live_server(args, tmp_path) as srv:
        rates = {k: v for k, v in srv.metrics().items() if k.startswith("pymtp_auto_estimated_tokens_per_second")}
        log = srv.log.read_text()
    line = next(ln for ln in log.splitlines() if "calibrated at start in" in ln)
    assert "2 sequence(s) a round in each of 2 engines, estimated tok/s k=0: " in line, line
    logged = {int(k): float(v) for k, v in re.findall(r"k=(\d+): ([0-9.]+)", line)}
    scraped = {int(re.search(r"depth=(\d+)", k)[1]): round(v, 1) for k, v in rates.items()
               if "engine=0," in k and "occupancy=3-4}" in k}      # the full batch: 2 + 2 sequences
    assert 0 in scraped and scraped == logged, (rates, line)
    assert not [k for k in rates if "engine=0," not in k], rates
