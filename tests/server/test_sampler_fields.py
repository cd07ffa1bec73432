"""llama-server's own sampler fields (``samplers``, ``typical_p``, ``mirostat`` ...): honoured
where pymtp gives the tokens llama-server's chain would, a 400 naming the field where it
cannot. They used to be ignored whatever their value."""

from __future__ import annotations

import pytest

from pymtp.config import DecodeParams
from pymtp.server.errors import APIError
from pymtp.server.sampler_fields import honour, read
from pymtp.server.schemas import GenerationRequest, decode_kwargs

PROMPT = "The quick brown fox"


def _number(body: dict):
    return lambda name: None if body.get(name) is None else float(body[name])


def _read(body: dict):
    return read(body, _number(body))


@pytest.mark.parametrize("body, param", [
    ({"typical_p": 0.9}, "typical_p"),
    ({"top_n_sigma": 1.5}, "top_n_sigma"),
    ({"xtc_probability": 0.5}, "xtc_probability"),
    ({"xtc_probability": 0.5, "xtc_threshold": 0.5}, "xtc_probability"),
    ({"dry_multiplier": 0.8}, "dry_multiplier"),
    ({"dynatemp_range": 0.5}, "dynatemp_range"),
    ({"mirostat": 2}, "mirostat"),
    ({"mirostat": 1, "samplers": ["top_k"]}, "mirostat"),       # mirostat replaces the whole chain
    ({"adaptive_target": 0.5, "samplers": ["top_k", "adaptive_p"]}, "adaptive_target"),
    ({"min_keep": 5}, "min_keep"),
    ({"t_max_predict_ms": 500}, "t_max_predict_ms"),
    ({"n_indent": 4}, "n_indent"),
    ({"lora": [{"id": 0, "scale": 1.0}]}, "lora"),
    ({"samplers": "kpq"}, "samplers"),                          # no such code
    ({"samplers": ["top_k", "nucleus", "entropy"]}, "samplers"),
    ({"samplers": {"top_k": 1}}, "samplers"),
])
def test_a_setting_pymtp_cannot_apply_is_refused_naming_it(body, param):
    with pytest.raises(APIError) as err:
        _read(body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("body", [
    {"typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "dry_multiplier": 0.0,
     "dynatemp_range": 0.0, "mirostat": 0, "adaptive_target": -1.0, "min_keep": 0, "t_max_predict_ms": -1,
     "n_indent": 0, "lora": []},
    {"xtc_probability": 0.5, "xtc_threshold": 0.6},             # a threshold over 0.5 switches XTC off
    {"dry_multiplier": 0.8, "dry_penalty_last_n": 0},
    {"typical_p": 0.5, "dry_multiplier": 0.8, "samplers": ["top_k", "temperature"]},   # not in the chain
    {"dynatemp_range": 0.5, "samplers": "kp"},                  # dynatemp belongs to temperature
    {"adaptive_target": 0.5},                                   # adaptive_p only when listed
    {"min_keep": 1},
])
def test_settings_that_leave_their_sampler_off_are_served(body):
    _read(body)


def test_sampler_names_read_as_llama_cpp_reads_them():
    assert _read({"samplers": ["Top-K", "nucleus", "minp", "TEMP", "typ", "top_n_sigma"]}) == \
        ("top_k", "top_p", "min_p", "temperature", "typ_p", "top_n_sigma")
    assert _read({"samplers": "edskypmxt"}) == ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p",
                                                "min_p", "xtc", "temperature")
    assert _read({}) is None


def test_names_an_older_llama_cpp_took_are_skipped_as_llama_server_skips_them():
    # llama.cpp's old web UI's list and codes: the pinned llama-server runs them without
    # tail-free sampling and without the old typical name (it calls it typ_p now)
    old_ui = ["top_k", "tfs_z", "typical_p", "top_p", "min_p", "temperature"]
    assert _read({"samplers": old_ui, "typical_p": 0.9}) == ("top_k", "top_p", "min_p", "temperature")
    assert _read({"samplers": ["TFS", "Typical-P", "typical", "tfs-z", "temp"]}) == ("temperature",)
    assert _read({"samplers": "kfypmt"}) == ("top_k", "typ_p", "top_p", "min_p", "temperature")


SAMPLED = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1,
           "frequency_penalty": 0.5, "presence_penalty": 0.5, "repeat_last_n": 64}


def test_a_sampler_left_out_of_the_list_is_switched_off():
    assert honour(("penalties", "top_k", "top_p", "min_p", "temperature"), SAMPLED) == SAMPLED
    assert honour(None, SAMPLED) == SAMPLED
    out = honour(("top_p", "temperature"), SAMPLED)
    assert out == {**SAMPLED, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "frequency_penalty": 0.0,
                   "presence_penalty": 0.0}
    # no temperature sampler: llama-server's dist draws from the row at temperature 1, greedy included
    assert honour(("top_k",), {**SAMPLED, "temperature": 0.0})["temperature"] == 1.0


@pytest.mark.parametrize("names", [
    ("temperature", "top_k"),
    ("top_p", "top_k", "temperature"),
    ("top_k", "temperature", "penalties"),
    ("top_p", "top_p", "temperature"),          # top_p twice renormalises twice
    ("infill", "top_k"),                        # the infill sampler reads what the filters left
])
def test_a_list_out_of_pymtps_order_is_refused(names):
    with pytest.raises(APIError) as err:
        honour(names, SAMPLED)
    assert err.value.param == "samplers" and "penalties, top_k, top_p, min_p, infill, temperature" in err.value.message


def test_the_order_of_samplers_left_off_does_not_matter():
    off = {**SAMPLED, "top_k": 0, "temperature": 1.0, "repeat_penalty": 1.0, "frequency_penalty": 0.0,
           "presence_penalty": 0.0}
    assert honour(("temperature", "top_p", "top_k", "min_p", "penalties"), off) == off
    assert honour(("temperature", "penalties", "top_p"), {**off, "repeat_last_n": 0, "repeat_penalty": 1.5}) \
        == {**off, "repeat_last_n": 0, "repeat_penalty": 1.5, "min_p": 0.0}


def test_the_servers_defaults_count_as_the_requests():
    # a server started with --top-k 40: a request whose list leaves top_k out samples without it
    req = GenerationRequest(kind="completion", prompt="x", temperature=0.7, samplers=("top_p", "temperature"))
    assert decode_kwargs(req, DecodeParams(top_k=40), max_tokens=8)["top_k"] == 0
    with pytest.raises(APIError):
        decode_kwargs(GenerationRequest(kind="completion", prompt="x", samplers=("temperature", "top_k")),
                      DecodeParams(temperature=0.7, top_k=40), max_tokens=8)


@pytest.mark.parametrize("spec", ["mtp", "none"])
def test_the_list_reaches_the_engine(client, dense_model, spec):
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "spec": spec, "seed": 7,
            "temperature": 0.9, "top_k": 1}
    r = client.post("/v1/completions", json={**body, "samplers": ["top_p", "min_p", "temperature"]})
    assert r.status_code == 200, r.text
    want = dense_model.generate(PROMPT, max_tokens=16, ignore_eos=True, spec=spec, seed=7, temperature=0.9)
    assert r.json()["choices"][0]["text"] == want.text
    greedy = dense_model.generate(PROMPT, max_tokens=16, ignore_eos=True, spec=spec)
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == greedy.text
    assert want.text != greedy.text          # top_k 1 was greedy; without it the request sampled


def test_no_temperature_sampler_samples_at_one(client, dense_model):
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "seed": 3, "temperature": 0, "samplers": "kpm"}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    want = dense_model.generate(PROMPT, max_tokens=16, ignore_eos=True, seed=3, temperature=1.0)
    assert r.json()["choices"][0]["text"] == want.text


def test_an_old_web_uis_list_samples_without_the_samplers_llama_cpp_retired(client, dense_model):
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "seed": 11, "temperature": 0.9,
            "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 0.5, "tfs_z": 0.5,
            "samplers": ["top_k", "tfs_z", "typical_p", "top_p", "min_p", "temperature"]}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    want = dense_model.generate(PROMPT, max_tokens=16, ignore_eos=True, seed=11, temperature=0.9, top_k=40,
                                top_p=0.95, min_p=0.05, repeat_penalty=1.0)
    assert r.json()["choices"][0]["text"] == want.text


def test_a_code_completion_clients_list_samples_with_the_infill_sampler(client, dense_model):
    """llama.vscode's and llama.vim's list: top_k, top_p, then llama.cpp's infill sampler,
    no temperature (so 1); with a temperature after it at 0 it is a 400 naming infill."""
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "seed": 5, "top_k": 40, "top_p": 0.99,
            "samplers": ["top_k", "top_p", "infill"]}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    kw = dict(max_tokens=12, ignore_eos=True, seed=5, top_k=40, top_p=0.99, temperature=1.0)
    want = dense_model.generate(PROMPT, infill=True, **kw)
    assert r.json()["choices"][0]["text"] == want.text != dense_model.generate(PROMPT, **kw).text
    r = client.post("/v1/completions", json={**body, "temperature": 0, "samplers": ["top_k", "infill", "temperature"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "samplers", r.text
    assert "needs temperature > 0" in r.json()["error"]["message"]


def test_a_client_sending_every_field_off_gets_the_plain_answer(client):
    msgs = [{"role": "user", "content": "hello"}]
    body = {"messages": msgs, "max_tokens": 8, "ignore_eos": True}
    off = {"typical_p": 1, "top_n_sigma": -1, "xtc_probability": 0, "xtc_threshold": 0.1, "dry_multiplier": 0,
           "dry_base": 1.75, "dry_allowed_length": 2, "dynatemp_range": 0, "dynatemp_exponent": 1, "mirostat": 0,
           "mirostat_tau": 5, "mirostat_eta": 0.1, "min_keep": 0, "n_probs": 0,
           "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]}
    plain = client.post("/v1/chat/completions", json=body)
    full = client.post("/v1/chat/completions", json={**body, **off})
    assert full.status_code == 200, full.text
    assert full.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


@pytest.mark.parametrize("route, extra", [("/v1/completions", {"prompt": PROMPT}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
@pytest.mark.parametrize("field, value, message", [
    ("typical_p", 0.9, "typical_p=0.9 is not implemented by pymtp; send 1.0 (or more), or leave it out"),
    ("mirostat", 2, "mirostat=2 is not implemented by pymtp; send 0"),
    ("dry_multiplier", "lots", "dry_multiplier must be a number"),
    ("samplers", ["temperature", "top_k"], "pymtp applies them as penalties, top_k, top_p, min_p, infill, temperature"),
])
def test_over_http_a_refusal_is_a_400_naming_the_field(client, route, extra, field, value, message):
    r = client.post(route, json={**extra, "max_tokens": 2, "temperature": 0.7, "top_k": 40, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and message in err["message"], err
