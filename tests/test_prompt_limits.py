"""A prompt too long for the context is refused with bounded memory, whatever its size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pymtp import ParamError

PROBE = r"""
import json, resource, sys
import pymtp
m = pymtp.load(sys.argv[1], threads=1, n_ctx=256)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
text = "hello world, this is a long prompt. " * (15 * 2**20 // 36)
try:
    m.generate(text, max_tokens=1)
    out = {"refused": False}
except pymtp.ParamError as e:
    out = {"refused": True, "param": e.param, "code": e.code, "message": str(e)}
out["grew_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps(out))
"""


def test_a_15_mib_prompt_is_refused_without_tokenizing_it_whole(dense_path):
    # before the bound, this prompt cost ~490 MiB (llama.cpp's tokenizer plus a list of
    # 4.4M ids) only to be refused; the text itself is 15 MiB
    p = subprocess.run([sys.executable, "-c", PROBE, str(dense_path)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["refused"] and out["param"] == "prompt" and out["code"] == "context_length_exceeded"
    assert out["message"].startswith("prompt has at least ")
    assert "but the context holds 256" in out["message"]
    assert out["grew_kib"] < 64 * 1024, out


def test_a_prompt_over_the_context_gets_its_exact_count(dense_model):
    text = "a b " * 3000
    n = len(dense_model.tokenize(text, special=True))
    with pytest.raises(ParamError, match=rf"^prompt has {n} tokens but the context holds ") as e:
        dense_model.generate(text, max_tokens=1)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"


def test_a_prompt_as_long_as_the_context_is_told_the_most_it_may_have(dense_model):
    n_ctx = dense_model.n_ctx
    ids = (dense_model.tokenize("a b " * n_ctx) * 2)[:n_ctx]
    with pytest.raises(ParamError, match=rf"holds {n_ctx} \(a prompt of at most {n_ctx - 1},") as e:
        dense_model.generate(ids, max_tokens=1)
    assert e.value.details == {"n_prompt_tokens": n_ctx, "n_ctx": n_ctx}
    assert len(dense_model.generate(ids[:-1], max_tokens=1, spec="none").tokens) == 1
