"""Bad input gets an error that names what is wrong and how to fix it; nothing crashes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest

import pymtp
from pymtp import ParamError
from pymtp.gguf_info import ModelFileError


def test_missing_path(tmp_path):
    with pytest.raises(ModelFileError, match="model file not found"):
        pymtp.load(tmp_path / "nope.gguf")


def test_directory_path(tmp_path):
    with pytest.raises(ModelFileError, match="is a directory"):
        pymtp.load(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this OS (os.mkfifo)")
def test_a_pipe_is_refused_not_waited_on(tmp_path):
    """Reading a FIFO's header waited for a writer forever (in a child: a hang fails here)."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    p = subprocess.run([sys.executable, "-c", "import sys, pymtp; pymtp.load(sys.argv[1])", str(fifo)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1] == (f"pymtp.gguf_info.ModelFileError: {str(fifo)!r} is not a regular file "
                                         "(a pipe or a device); llama.cpp maps the model from disk: pass the "
                                         "path of a .gguf file")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ModelFileError, match="is not a GGUF file"):
        pymtp.load(p)


def test_truncated_gguf(tmp_path, dense_path):
    p = tmp_path / "cut.gguf"
    data = dense_path.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        pymtp.load(p)


def test_truncated_header(tmp_path, dense_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(dense_path.read_bytes()[:100])
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        pymtp.load(p)


def test_other_architecture(tmp_path):
    p = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"is a 'llama' model; pymtp runs Qwen3\.5"):
        pymtp.load(p)


def test_no_mtp_block_points_to_graft(nomtp_path):
    m = pymtp.load(nomtp_path, threads=2, n_ctx=256)
    try:
        assert not m.has_mtp
        for asks in (dict(spec="mtp"), dict(draft_max=3), dict(draft_max="auto")):
            with pytest.raises(ModelFileError, match="has no MTP block.*gguf_graft") as e:
                m.generate("hello", max_tokens=4, **asks)
            # a refused keyword, as README says every one is
            assert isinstance(e.value, pymtp.ParamError) and e.value.param == next(iter(asks)), asks
        # asked for nothing, a request decodes plainly, as pymtp serve's default on such a model
        r = m.generate("hello", max_tokens=4, spec="none", ignore_eos=True)
        assert len(r.tokens) == 4
        assert m.generate("hello", max_tokens=4, ignore_eos=True).tokens == r.tokens
        assert m.generate_batch(["hello"], max_tokens=4, ignore_eos=True)[0].tokens == r.tokens
        assert m.chat([{"role": "user", "content": "hi"}], max_tokens=3).stats.rounds == 0
    finally:
        m.close()


def test_prompt_longer_than_context(fixture_dir):
    from pymtp.testing.fixtures import fixture_path

    m = pymtp.load(fixture_path("dense", cache_dir=fixture_dir), threads=2, n_ctx=256)
    try:
        with pytest.raises(ParamError, match="prompt has 266 tokens but the context holds 256") as refused:
            m.generate([5] * 266, max_tokens=4)
        assert refused.value.code == "context_length_exceeded"
        with pytest.raises(ParamError, match="prompt has 256 tokens but the context holds 256"):
            m.stream([5] * 256, max_tokens=4)       # at the call, not at its first next()
        # 255 tokens fit: position 255 takes the first generated token, and the second,
        # sampled from it, needs no position of its own
        assert len(m.generate([5] * 255, max_tokens=4, ignore_eos=True).tokens) == 2
    finally:
        m.close()


@pytest.mark.parametrize("limit", [-1, None, np.int64(-1)])
def test_no_max_tokens_runs_to_the_contexts_end(fixture_dir, limit):
    """max_tokens=-1 or None: as -n -1 on the command line and null on the server, the
    reply ends at the context's end ("length"); the API refused both (numpy's -1 too,
    whose positive values it took)."""
    from pymtp.testing.fixtures import fixture_path

    m = pymtp.load(fixture_path("dense", cache_dir=fixture_dir), threads=1, n_ctx=256)
    try:
        ids = m.tokenize("hello there")
        r = m.generate(ids, max_tokens=limit, ignore_eos=True)
        assert (len(r.tokens), r.finish_reason) == (256 - len(ids) + 1, "length")
        assert [len(x.tokens) for x in m.generate_batch([ids], max_tokens=limit, ignore_eos=True)] == [len(r.tokens)]
    finally:
        m.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"draft_max": 0}, r'draft_max must be an integer >= 1 \(or "auto"\), got 0'),
    ({"draft_max": 99}, r"draft_max=99 exceeds this model's snapshot limit of 4; lower draft_max, or load the model "
                      r"for 99 drafts \(pymtp's --draft-max 99 at start, load\(..., draft_limit=99\) in Python\)"),
    ({"p_min": -0.1}, r"p_min must be in \[0, 1\], got -0.1"),
    ({"p_min": 1.5}, r"p_min must be in \[0, 1\], got 1.5"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, or -1 or None for no limit but the context's end; got 0"),
    ({"max_tokens": -2}, "max_tokens must be an integer >= 1, or -1 or None .*; got -2"),
    ({"max_tokens": -1.0}, "max_tokens must be an integer, got -1.0"),
    ({"spec": "eagle"}, "spec must be 'mtp' or 'none', got 'eagle'"),
    ({"rollback": "maybe"}, "rollback must be 'auto' or 'checkpoint'"),
])
def test_bad_generation_options(dense_model, kwargs, message):
    with pytest.raises(ParamError, match=message) as refused:
        dense_model.generate("hello", **kwargs)
    assert refused.value.param == next(iter(kwargs))


@pytest.mark.parametrize("prompt", [[], ""])
def test_empty_prompt(dense_model, prompt):
    with pytest.raises(ParamError, match="prompt is empty") as refused:
        dense_model.generate(prompt, max_tokens=4)
    assert (refused.value.param, refused.value.code) == ("prompt", "empty_prompt")


@pytest.mark.parametrize("options, param", [
    (dict(draft_limit=0), "draft_limit"), (dict(draft_limit="2"), "draft_limit"), (dict(n_ctx="4096"), "n_ctx"),
    (dict(n_ctx=15), "n_ctx"), (dict(n_ctx=-1), "n_ctx"), (dict(threads=0), "threads"), (dict(threads="2"), "threads"),
    (dict(n_batch="x"), "n_batch"), (dict(n_gpu_layers="all"), "n_gpu_layers"), (dict(draft_vocab=0), "draft_vocab"),
    (dict(rs_budget_bytes="x"), "rs_budget_bytes"), (dict(rs_budget_bytes=0), "rs_budget_bytes"),
])
def test_bad_load_options_are_refused_before_loading(dense_path, options, param):
    # a wrong type was loaded and failed at the first generation, far from its cause
    with pytest.raises(ParamError, match=f"{param} must be an integer >= ") as refused:
        pymtp.load(dense_path, **options)
    assert refused.value.param == param


def test_n_ctx_0_is_the_length_the_model_was_trained_for(dense_path):
    """As llama.cpp's -c 0 (it was refused as below 16)."""
    from pymtp.testing.layout import Hparams

    m = pymtp.load(dense_path, threads=1, n_ctx=0)
    try:
        assert (m.n_ctx, m.options.n_ctx) == (Hparams().n_ctx_train, 4096)
        assert len(m.generate("hi", max_tokens=3, ignore_eos=True).tokens) == 3
    finally:
        m.close()


@pytest.mark.parametrize("options, says", [
    (dict(flash_attn="yes"), "flash_attn must be one of 'auto', 'on', 'off'"),
    (dict(sampling="gpu"), "sampling must be one of 'auto', 'chain', 'numpy', 'backend'"),
    (dict(draft_kv="x"), "draft_kv must be one of 'auto', 'target', 'keep'"),
    (dict(prompt_cache_mib=-1), "prompt_cache_mib must be a number >= 0"),
    (dict(checkpoint_every=1.5), "checkpoint_every must be an integer >= 0"),
    (dict(rpc_timeout=0), "rpc_timeout must be a number of seconds > 0"),
    (dict(tensor_split=[1, 1]), "tensor_split splits the layers between this host and rpc workers"),
    # past 2**31 llama.cpp's 32-bit counts wrapped: a context of the wrapped size, or a MemoryError
    (dict(n_ctx=99999999999), "n_ctx must be at most 2147483647"),
    # past ggml's thread pool: 99,999 crashed the process (SIGSEGV)
    (dict(threads=99999), "threads must be at most 512"),
    # a string is true to Python: "false" turned the switch on
    (dict(verbose="false"), "verbose must be True or False, got 'false'"),
    (dict(row_by_row="no"), "row_by_row must be True, False or None"),
    (dict(extra_bufts=1), "extra_bufts must be True, False or None"),
    # a plain ValueError from the rpc parser, raised after the file was read
    (dict(rpc="notahost"), "rpc: 'notahost' is not host:port"),
    (dict(rpc=["10.0.0.2:50052", 5]), "rpc: each worker is a 'host:port' string, got 5"),
])
def test_bad_load_choices_are_param_errors_before_the_file_is_read(tmp_path, options, says):
    """A file that is not there: refused for the option, not for the file (these were
    plain ValueErrors, raised after the model had loaded)."""
    with pytest.raises(ParamError, match=re.escape(says)) as refused:
        pymtp.load(tmp_path / "absent.gguf", **options)
    assert refused.value.param == next(iter(options))


@pytest.mark.parametrize("options, says", [
    (dict(spec="mtp"), "unknown load option(s) spec; load takes the fields of pymtp.LoadOptions; spec is a "
                       "generation keyword: pass it to generate(), stream() or chat()"),
    (dict(max_tokens=5, temperature=0.7), "unknown load option(s) max_tokens, temperature; load takes the fields "
                                          "of pymtp.LoadOptions; max_tokens, temperature are generation keywords"),
    (dict(n_threads=2), "unknown load option(s) n_threads; load takes the fields of pymtp.LoadOptions"),
])
def test_an_unknown_load_option_is_named_and_a_generation_keyword_pointed_at_its_call(tmp_path, options, says):
    """It was the dataclass's own "LoadOptions.__init__() got an unexpected keyword
    argument 'spec'", which said nothing of where spec goes."""
    with pytest.raises(TypeError) as refused:
        pymtp.load(tmp_path / "absent.gguf", **options)
    assert str(refused.value).startswith(says)


def test_a_path_of_another_type_is_a_param_error():
    with pytest.raises(ParamError, match="path must be a GGUF file's path") as refused:
        pymtp.load(b"/models/x.gguf")
    assert refused.value.param == "path"
    with pytest.raises(ParamError, match="^path is empty") as refused:    # load(os.environ.get("MODEL", ""))
        pymtp.load("")                                                    # said '.' is a directory
    assert refused.value.param == "path"


@pytest.mark.parametrize("call, param", [
    (lambda m: m.chat([]), "messages"), (lambda m: m.chat("hi"), "messages"), (lambda m: m.chat(["hi"]), "messages[0]"),
    (lambda m: m.chat([{"content": "hi"}]), "messages[0].role"),
    (lambda m: m.chat([{"role": "user", "content": 5}]), "messages[0].content"),
    (lambda m: m.chat([{"role": "user", "content": "hi"}], template_kwargs=5), "template_kwargs"),
    (lambda m: m.tokenize(None), "text"), (lambda m: m.batcher(1.5), "slots"), (lambda m: m.batcher(0), "slots"),
    (lambda m: m.batcher(2, prefill_chunk=1.5), "prefill_chunk"), (lambda m: m.batcher(2, prefill_chunk="8"), "prefill_chunk"),
    (lambda m: m.batcher(2, follow="x"), "follow"), (lambda m: m.batcher(2, follow=m.session()), "follow"),
    (lambda m: m.generate("x", ignore_eos="yes"), "ignore_eos"),
])
def test_wrong_inputs_are_refusals_naming_them(dense_model, call, param):
    # each was an IndexError, AttributeError, KeyError or TypeError from deep inside
    with pytest.raises(ParamError) as refused:
        call(dense_model)
    assert refused.value.param == param


def test_model_still_works_after_errors(dense_model):
    with pytest.raises(ValueError):
        dense_model.generate("hello", draft_max=0)
    r = dense_model.generate("hello", max_tokens=3, ignore_eos=True)
    assert len(r.tokens) == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"draft_max": True}, 'draft_max must be an integer or "auto", got True'),
    ({"draft_max": 2.0}, 'draft_max must be an integer or "auto", got 2.0'),
    ({"p_min": "0.5"}, "p_min must be a number, got '0.5'"),
    ({"top_p": "0.9"}, "top_p must be a number, got '0.9'"),
    ({"temperature": None}, "temperature must be a number, got None"),
    ({"max_tokens": True}, "max_tokens must be an integer, got True"),
    ({"seed": "1"}, "seed must be an integer, got '1'"),
    ({"seed": -1}, r"seed must be an integer >= 0 \(or None for a fresh one\), got -1"),
    ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
    ({"stop": ["a", 3]}, r"stop must be a string or a list of strings, got \['a', 3\]"),
])
def test_wrong_types_name_the_parameter(dense_model, kwargs, message):
    (param,) = kwargs
    with pytest.raises(ParamError, match=f"^{message}$") as refused:
        dense_model.generate("hello", max_tokens=kwargs.pop("max_tokens", 4), **kwargs)
    assert refused.value.param == param


def test_unknown_keyword_is_a_type_error(dense_model):
    with pytest.raises(TypeError, match="unknown keyword.*top_q"):
        dense_model.generate("hello", max_tokens=2, top_q=0.5)


@pytest.mark.parametrize("kwargs, says", [
    (dict(stats_out=[]), "stats_out: only stream() takes it"),
    (dict(response_format={"type": "json_object"}), "response_format: pass json_schema="),
    (dict(n=2), "n: call generate once per choice"),
])
def test_an_openai_keyword_says_what_to_pass_instead(dense_model, kwargs, says):
    with pytest.raises(TypeError, match=re.escape(says)):
        dense_model.generate("hello", max_tokens=2, **kwargs)


@pytest.mark.parametrize("call, param", [
    (lambda m: m.generate("abc\ud800", max_tokens=2), "prompt"),
    (lambda m: m.tokenize("\ud800"), "prompt"),
    (lambda m: m.generate("abc", max_tokens=2, grammar='root ::= "\ud800"'), "grammar"),
    # a stop was taken, and could never be met
    (lambda m: m.generate("abc", max_tokens=2, stop=["ok", "\udc00"]), "stop"),
    (lambda m: m.chat([{"role": "user", "content": "hi"}], max_tokens=2, stop="\ud800"), "stop"),
    (lambda m: m.chat([{"role": "user", "content": "hi \ud83d"}], max_tokens=2), "messages[0].content"),
    (lambda m: m.chat([{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}], max_tokens=2),
     "messages[0].content[0]"),
])
def test_a_lone_surrogate_is_a_param_error_not_a_unicode_error(dense_model, call, param):
    """JSON's "\\ud800" decodes to a lone surrogate, which UTF-8 cannot hold: encoding it
    for llama.cpp raised a raw UnicodeEncodeError."""
    with pytest.raises(ParamError, match="lone surrogate") as refused:
        call(dense_model)
    assert (refused.value.param, refused.value.code) == (param, "invalid_unicode")


@pytest.mark.parametrize("token, says", [("a", "takes a token id"), (-5, "outside this model's vocabulary"),
                                         (10 ** 6, "outside this model's vocabulary"), (True, "takes a token id")])
def test_is_eog_refuses_what_is_no_token_id(dense_model, token, says):
    with pytest.raises(ParamError, match=says):
        dense_model.is_eog(token)


def test_stop_string_is_one_stop_not_its_characters(dense_model):
    free = dense_model.generate("hello", max_tokens=24, ignore_eos=True, spec="none").text
    # three characters whose last one also occurs earlier: split into characters, the stop
    # would end the text at that earlier place
    k = next(k for k in range(1, len(free) - 2) if free[k + 2] in free[:k] and free.index(free[k:k + 3]) == k)
    stop = free[k:k + 3]
    cut = dense_model.generate("hello", max_tokens=24, ignore_eos=True, spec="none", stop=stop)
    assert (cut.text, cut.finish_reason) == (free[:k], "stop")
    assert dense_model.generate("hello", max_tokens=24, ignore_eos=True, spec="none", stop=[stop]).text == free[:k]


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_token_id_outside_the_vocabulary(dense_model, bad):
    n_vocab = dense_model.n_vocab
    with pytest.raises(ValueError, match=rf"^prompt holds token id {bad!r}, outside the vocabulary \[0, {n_vocab}\); "
                                         r"pass a string or ids from model.tokenize\(\)$"):
        dense_model.generate([5, bad, 6], max_tokens=2)


@pytest.mark.parametrize("bad, kind", [(2.5, "float"), (True, "bool"), ((1, 2), "tuple")])
def test_what_is_no_token_id_is_named_so(dense_model, bad, kind):
    """A bool or a nested list is no id at all: it was told "outside the vocabulary"."""
    with pytest.raises(ParamError, match=rf"^prompt holds {re.escape(repr(bad))} \({kind}\), which is not a token id "
                                         r"\(an integer\); "
                                         r"pass a string or ids from model.tokenize\(\)$") as refused:
        dense_model.generate([5, bad, 6], max_tokens=2)
    assert refused.value.param == "prompt"


@pytest.mark.parametrize("bad, kind", [(None, "NoneType"), (7, "int"), ("hello", "str"), (b"hi", "bytes")])
def test_ids_that_are_no_list_are_named_so(dense_model, bad, kind):
    """detokenize(None) was Python's "'NoneType' object is not iterable", and a string's
    first character was named as a bad id."""
    with pytest.raises(ParamError, match=rf"^tokens must be a list of token ids, got {kind}; "
                                         r"pass ids from model.tokenize\(\)$") as refused:
        dense_model.detokenize(bad)
    assert refused.value.param == "tokens"


def test_stats_out_that_is_no_list_is_refused_when_the_stream_is_made(dense_model):
    """A bad stats_out failed only after every chunk had come out (an AttributeError in the
    stream's cleanup)."""
    with pytest.raises(ParamError, match=r"^stats_out must be a list .* got int$") as refused:
        dense_model.stream("hello", max_tokens=4, stats_out=5)
    assert refused.value.param == "stats_out"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_ban_of_every_token_is_refused_when_the_stream_is_made(dense_model, ignore_eos):
    """Banning all (with ignore_eos, all but the end tokens, which it bans) raised only at
    the stream's first next(), not where its docstring says the keywords are checked."""
    eog = set(dense_model.eog_ids)
    keep = eog if ignore_eos else set()
    bias = {t: float("-inf") for t in range(dense_model.n_vocab) if t not in keep}
    with pytest.raises(ParamError, match="bans every token of the vocabulary") as refused:
        dense_model.stream("hello", max_tokens=4, logit_bias=bias, ignore_eos=ignore_eos)
    assert refused.value.param == "logit_bias"
    left = max(t for t in bias if t not in eog)
    one_left = {t: b for t, b in bias.items() if t != left}
    assert dense_model.generate("hello", max_tokens=2, logit_bias=one_left, ignore_eos=ignore_eos).tokens == [left] * 2


def test_calibrate_names_itself_refusing_stop(dense_model):
    """calibrate(stop=...) said "generation takes stop", which it had just refused."""
    with pytest.raises(TypeError, match=r"^calibrate\(\) takes no stats_out or stop: "):
        dense_model.calibrate(stop="x", stats_out=[], budget_s=0.1)
