"""llama-server's /infill (pymtp/infill.py, llama_completion.py): the fill-in-the-middle
prompt laid out as its format_prompt_infill lays it out (hand-made tokens, then the
dense fixture with FIM tokens named in its metadata, then -- where $PYMTP_LLAMA_SERVER
names a llama-server binary -- the same bodies sent to the real one); the line rules
code-completion clients send (n_indent, t_max_predict_ms); its refusals."""

from __future__ import annotations

import os

import httpx
import pytest
from gguf import GGUFValueType

import pymtp
from pymtp.infill import FimTokens, InfillUnsupported, infill_prompt
from pymtp.llama_server import LlamaServer, server_command
from pymtp.server import ServerSettings
from pymtp.server.llama_completion import LineRules
from pymtp.testing.gguf_files import with_metadata

from .helpers import app_client, parse_sse

LLAMA_SERVER = os.environ.get("PYMTP_LLAMA_SERVER")
GREEDY = {"temperature": 0}
# byte tokens no text here holds: the FIM roles in the fixture's copy
FIM_IDS = {"pre": 1, "suf": 2, "mid": 3, "rep": 4, "sep": 5}
FIM = FimTokens(pre=-1, suf=-2, mid=-3)


def _chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_prompt_is_prefix_prompt_suffix_middle():
    ids = infill_prompt(FIM, _chars, "ab", "cd", prompt=[9], n_ctx=4096)
    assert ids == [-1, 97, 98, 9, -2, 99, 100, -3]
    assert infill_prompt(FIM, _chars, "ab", "cd", n_ctx=4096, spm=True) == [-2, 99, 100, -1, 97, 98, -3]
    assert infill_prompt(FimTokens(-1, -2, -3, bos=7), _chars, "a", "", n_ctx=4096) == [7, -1, 97, -2, -3]
    assert infill_prompt(FIM, _chars, ["a", 50], [51, "b"], n_ctx=4096) == [-1, 97, 50, -2, 51, 98, -3]


def test_other_files_come_first_as_a_repository():
    rep = FimTokens(-1, -2, -3, rep=-4, sep=-5)
    ids = infill_prompt(rep, _chars, "p", "s", [("f.py", "x")], n_ctx=4096)
    assert ids == [-4, *_chars("myproject\n"), -5, *_chars("f.py\n"), 120, -5, *_chars("filename\n"),
                   -1, 112, -2, 115, -3]
    plain = infill_prompt(FIM, _chars, "p", "s", [("f.py", "x")], n_ctx=4096)   # no separators: a snippet line
    assert plain == [*_chars("\n\n--- snippet ---\n\n"), 120, -1, 112, -2, 115, -3]


def test_the_batch_is_shared_out_and_the_context_fills_with_files():
    pre, suf, extra = "a" * 100, "b" * 100, [("f", "c" * 100)]
    ids = infill_prompt(FIM, _chars, pre, suf, extra, prompt=[9, 9], n_batch=40, n_ctx=100, n_predict=10)
    # prefix: its last 3/4 of 40; suffix: its first 40/4 - 2 - 2; files: the last 100-40-20
    assert ids == [*_chars(("\n\n--- snippet ---\n\n" + "c" * 100)[-40:]), -1, *[97] * 30, 9, 9, -2, *[98] * 6, -3]
    assert infill_prompt(FIM, _chars, pre, suf, extra, n_batch=40, n_ctx=60, n_predict=10)[0] == -1
    whole = infill_prompt(FIM, _chars, pre, suf, extra, n_batch=None, n_ctx=100)
    assert whole == [*_chars("\n\n--- snippet ---\n\n" + "c" * 100), -1, *[97] * 100, -2, *[98] * 100, -3]


def test_a_vocabulary_without_fim_tokens_is_refused_naming_them():
    with pytest.raises(InfillUnsupported, match="prefix, middle token missing"):
        infill_prompt(FimTokens(None, -2, None), _chars, "a", "b", n_ctx=4096)


@pytest.mark.parametrize("text, new, want", [
    ("    a\n", "    b\n", None),            # every line indented enough
    ("    a\n", "  b", 8),                   # cut before the line's first character, its spaces kept
    ("    a\n", "  ", None),                 # nothing but spaces yet: it may still indent
    ("x", "\n\tb", None),
])
def test_n_indent_cuts_the_first_line_that_starts_further_left(text, new, want):
    assert LineRules(n_indent=3 if "\t" not in new else 1).end(text, new, 0.0) == want


def test_t_max_predict_ms_ends_at_the_next_newline_once_past():
    rules = LineRules(t_max_predict_ms=100)
    assert rules.end("a", "b\nc", 50.0) is None and rules.end("a", "bc", 150.0) is None
    assert rules.end("a", "b\nc", 150.0) == 4


@pytest.fixture(scope="module")
def fim_path(dense_path, tmp_path_factory):
    """The dense fixture with FIM tokens in its metadata, as a converted code model has."""
    values = {f"tokenizer.ggml.fim_{role}_token_id": (tid, GGUFValueType.UINT32) for role, tid in FIM_IDS.items()}
    return with_metadata(dense_path, tmp_path_factory.mktemp("fim") / "dense-fim.gguf", values)


@pytest.fixture(scope="module")
def fim_model(fim_path):
    m = pymtp.load(str(fim_path), threads=1, n_ctx=4096)
    yield m
    m.close()


@pytest.fixture(scope="module")
def infill(fim_model):
    with app_client(fim_model, ServerSettings(parallel=2)) as client:
        yield client


BODY = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(2, 3))\n",
        "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
        "prompt": "ret", "n_predict": 12}


def test_the_answer_is_the_generation_from_the_models_infill_prompt(infill, fim_model):
    ids = fim_model.infill_prompt(BODY["input_prefix"], BODY["input_suffix"], [("util.py", BODY["input_extra"][0]["text"])],
                                  "ret", n_predict=12)
    assert ids[0] == FIM_IDS["rep"] and ids[-1] == FIM_IDS["mid"] and FIM_IDS["pre"] in ids
    want = fim_model.generate(ids, max_tokens=12, temperature=0)
    r = infill.post("/infill", json={**BODY, **GREEDY, "return_tokens": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["content"] == want.text and got["tokens"] == want.tokens and got["tokens_evaluated"] == len(ids)
    streamed = parse_sse(infill.post("/infill", json={**BODY, **GREEDY, "stream": True}).text, done=False)
    assert "".join(o["content"] for o in streamed[:-1]) == want.text and streamed[-1]["stop"] is True
    # llama.vscode's sampling: top_k, top_p, then the infill sampler, at temperature 1
    body = {**BODY, "seed": 4, "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"]}
    sampled = fim_model.generate(ids, max_tokens=12, seed=4, top_k=40, top_p=0.99, temperature=1.0, infill=True)
    assert infill.post("/infill", json=body).json()["content"] == sampled.text


def test_an_editor_plugins_requests_are_served(infill, fim_model):
    """llama.vscode's two requests as it sends them: a cache warm-up of the other files
    (empty prefix and suffix, no samplers, n_predict 0), then a completion."""
    files = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": files, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1}
    r = infill.post("/infill", json=warm)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 1, r.text
    body = {"id_slot": 0, "input_prefix": "def add(a, b):\n", "input_suffix": "\n", "input_extra": files,
            "prompt": "    ", "n_predict": 24, "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "seed": 1,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "timings/predicted_ms",
                                "truncated", "tokens_cached"]}
    r = infill.post("/infill", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert set(got) == set(body["response_fields"]) and got["truncated"] is False
    ids = fim_model.infill_prompt("def add(a, b):\n", "\n", [("util.py", files[0]["text"])], "    ")
    # the warm-up left the files in the prompt cache: the completion read only what follows them
    assert 0 < got["timings/prompt_n"] < len(ids) - 20


@pytest.mark.parametrize("stream, depth", [(False, None), (True, None), (False, 3), (True, 3)])
def test_n_indent_ends_the_text_at_a_line_further_left(infill, stream, depth):
    grammar = 'root ::= "  x = 1\\n  y = 2\\nz = 3\\n  w"'
    body = {**BODY, **GREEDY, "grammar": grammar, "n_indent": 2, "n_predict": 40, "stream": stream,
            "return_tokens": True, **({"draft_max": depth} if depth else {})}
    before = _finishes(infill)
    r = infill.post("/infill", json=body)
    assert r.status_code == 200, r.text
    if stream:
        objs = parse_sse(r.text, done=False)
        content, last = "".join(o["content"] for o in objs[:-1]), objs[-1]
    else:
        last = r.json()
        content = last["content"]
    assert content == "  x = 1\n  y = 2\n"
    assert last["stop_type"] == "limit" and last["truncated"] is False
    # the tokens through the one that shows the cut, whatever the engine decoded past it
    # (the rest of a drafting round, a round more): as token-by-token decoding counts them
    assert last["timings"]["predicted_n"] == last["tokens_predicted"]
    # /metrics counts it as a generation that ended at a limit, not as a cancelled one; a
    # run that reached its own end (the grammar's) before the route read that far counts
    # its own (Run.stop): on a loaded box (CI beside a build) it did
    after = _finishes(infill)
    counted = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert counted in ({"length": 1.0}, {"stop": 1.0}), counted
    whole = infill.post("/infill", json={**body, "n_indent": 0, "stream": False}).json()
    assert whole["content"] == "  x = 1\n  y = 2\nz = 3\n  w" and whole["stop_type"] == "eos"
    if not stream:
        plain = infill.post("/infill", json={**body, "draft_max": None, "spec": "none"}).json()
        assert (last["tokens"], last["tokens_predicted"]) == (plain["tokens"], plain["tokens_predicted"])


def _finishes(client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for sample in fam.samples:
            if "finish_reason" in sample.labels and sample.name.endswith("_total"):
                out[sample.labels["finish_reason"]] = sample.value
    return out


@pytest.mark.parametrize("body, status, param", [
    ({"input_suffix": ""}, 400, "input_prefix"),
    ({"input_prefix": ""}, 400, "input_suffix"),
    ({"input_prefix": 3, "input_suffix": ""}, 400, "input_prefix"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": {"text": "x"}}, 400, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": 0}, 400, "input_extra"),      # falsy: not absent
    ({"input_prefix": "", "input_suffix": "", "input_extra": ""}, 400, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "f"}]}, 400, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "x", "filename": 1}]}, 400, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "prompt": ["x"]}, 400, "prompt"),
    ({"input_prefix": "", "input_suffix": "", "n_indent": "2"}, 400, "n_indent"),
    # an id outside the vocabulary: it named "prompt", a field the body built below it
    ({"input_prefix": [999999], "input_suffix": ""}, 400, "input_prefix"),
    ({"input_prefix": "", "input_suffix": ["a", -5]}, 400, "input_suffix"),
])
def test_bad_bodies_are_400s_naming_the_field(infill, body, status, param):
    r = infill.post("/infill", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_a_model_without_fim_tokens_answers_501(dense_model):
    with app_client(dense_model) as client:
        r = client.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 501 and "Infill is not supported by this model" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "a", "suffix": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text


def test_openais_suffix_makes_a_fill_in_the_middle_completion(infill, fim_model):
    """OpenAI's completions suffix: the text after the insertion, laid out as /infill lays it."""
    ids = fim_model.infill_prompt("def add(a, b):\n    ", "\n\nprint(add(2, 3))\n")
    want = fim_model.generate(ids, max_tokens=10, temperature=0)
    body = {"prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(2, 3))\n", "max_tokens": 10, **GREEDY}
    got = infill.post("/v1/completions", json=body).json()
    assert got["choices"][0]["text"] == want.text and got["usage"]["prompt_tokens"] == len(ids)
    two = infill.post("/v1/completions", json={**body, "prompt": [body["prompt"], "x = "]}).json()
    assert two["choices"][0]["text"] == want.text
    assert two["choices"][1]["text"] == fim_model.generate(fim_model.infill_prompt("x = ", body["suffix"]),
                                                           max_tokens=10, temperature=0).text
    for name, value in (("echo", True), ("logprobs", 2)):
        r = infill.post("/v1/completions", json={**body, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name
    # the texts are kept whole (the /infill layout cuts the prefix to 3/4 of a 2048-token batch)
    long = {**body, "prompt": "x = 1\n" * 700}
    ids = fim_model.infill_prompt(long["prompt"], body["suffix"], trim=False)
    assert len(ids) > 2048 > len(fim_model.infill_prompt(long["prompt"], body["suffix"]))
    assert infill.post("/v1/completions", json=long).json()["usage"]["prompt_tokens"] == len(ids)
    assert infill.post("/v1/completions", json={**body, "suffix": ""}).json()["choices"][0]["text"] == \
        fim_model.generate(body["prompt"], max_tokens=10, temperature=0).text      # no suffix: a plain completion


@pytest.mark.skipif(not LLAMA_SERVER, reason="set PYMTP_LLAMA_SERVER to a llama-server binary")
def test_the_real_llama_server_builds_the_same_prompt_and_answer(infill, fim_path, tmp_path):
    server = LlamaServer(lambda port: server_command(LLAMA_SERVER, str(fim_path), port=port, threads=1,
                                                     n_ctx=4096, n_batch=2048, extra_args=["-np", "1"]),
                         tmp_path / "llama-server.log")
    long = "x = 1\n" * 500            # past 3/4 of the batch: its head is cut
    bodies = [
        {**BODY, "n_predict": 8},
        {"input_prefix": "def f(", "input_suffix": "", "n_predict": 6},
        {"input_prefix": long, "input_suffix": long, "prompt": "y", "n_predict": 4,
         "input_extra": [{"text": "a = 2\n"}, {"filename": "b.py", "text": "b = 3\n" * 400}]},
        {**BODY, "n_predict": 24, "grammar": 'root ::= "  x = 1\\n  y = 2\\nz = 3\\n  w"', "n_indent": 2,
         "return_tokens": True},
    ]
    server.start()
    try:
        for body in bodies:
            body = {**body, **GREEDY}
            theirs = httpx.post(server.url + "/infill", json=body, timeout=60)
            ours = infill.post("/infill", json=body)
            assert ours.status_code == theirs.status_code == 200, (theirs.text, ours.text)
            t, o = theirs.json(), ours.json()
            for key in ("prompt", "tokens_evaluated", "content", "stop_type", "truncated", "tokens_predicted",
                        "tokens", "tokens_cached"):
                assert o[key] == t[key], (key, body.get("n_predict"), o[key], t[key])
            assert o["timings"]["predicted_n"] == t["timings"]["predicted_n"], (o["timings"], t["timings"])
    finally:
        server.stop()
