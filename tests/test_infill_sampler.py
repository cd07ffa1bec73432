"""llama.cpp's infill sampler (``DecodeParams.infill``, llama-server's samplers list
"infill"): the support it keeps equals an independent reading of its rule, on the
fixture's rows and on rows made to reach each of its branches; it never samples in the
graph; and speculative sampling with it keeps plain sampling's distribution."""

from __future__ import annotations

import numpy as np
import pytest

from pymtp.config import DecodeParams, ParamError
from pymtp.engine import Engine
from pymtp.native import NativeModel
from pymtp.round_state import RunStats
from pymtp.sampling import make_sampler

from conftest import one_row_logits
from test_stochastic import N, SAMPLING, _histogram, chi2_homogeneity_pvalue


def infill_support(ids: np.ndarray, logits: np.ndarray, piece, is_eog, eot: int) -> list[int]:
    """The tokens the infill sampler keeps of candidates ``ids`` with ``logits`` (what the
    filters before it left), read from its description: probabilities (float32 softmax,
    likeliest first); end-of-generation tokens alone where their mass is large; else each
    token whose text starts another's takes that one's probability (the likelier of the
    two keeps it); then the text tokens under 0.2, then under 1/(n+1) of the rest, go;
    none left: the end-of-text token."""
    order = np.argsort(-logits, kind="stable")
    ids, x = ids[order], logits[order].astype(np.float32)
    p = np.exp(x - x.max()).astype(np.float32)
    p /= p.sum(dtype=np.float32)
    eog = np.array([is_eog(int(t)) for t in ids])
    if 3 * p[eog].sum(dtype=np.float32) * len(ids) > p[~eog].sum(dtype=np.float32):
        return sorted(int(t) for t in ids[eog])
    alive = np.isfinite(x)
    for i0 in range(len(ids)):
        for i1 in range(len(ids)):
            if not alive[i0]:
                break
            if i0 == i1 or not alive[i1]:
                continue
            a, b = piece(int(ids[i0])), piece(int(ids[i1]))
            if a and len(a) <= len(b) and b.startswith(a):
                dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                p[dst] += p[src]
                p[src], alive[src] = 0.0, False
    keep = (p >= np.float32(0.2)) | eog
    n_text = int((keep & ~eog).sum())
    if n_text == 0:
        return [eot]
    p = np.where(keep, p / p[keep].sum(dtype=np.float32), 0)
    keep &= (p >= np.float32(1.0 / (n_text + 1))) | eog
    return sorted(int(t) for t in ids[keep])


def _oracle(model, row: np.ndarray, top_k: int) -> list[int]:
    native = model._native
    ids = np.argsort(-row, kind="stable")[:top_k]
    eot = native.meta("tokenizer.ggml.eot_token_id") or native.meta("tokenizer.ggml.eos_token_id")
    return infill_support(ids, row[ids], lambda t: native.token_to_bytes(t), native.is_eog, int(eot))


def _kept(model, row: np.ndarray, top_k: int, temperature: float = 0.8) -> list[int]:
    s = make_sampler(temperature, top_k, seed=0, infill_vocab=model._native.vocab)
    return s.dist(row).ids.tolist()


def test_the_support_is_the_rules_on_the_fixtures_rows(dense_model):
    tokens = dense_model.tokenize("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")
    rows = one_row_logits(dense_model, tokens)
    seen = set()
    for row in rows:
        for k in (5, 40):
            want = _oracle(dense_model, row, k)
            assert _kept(dense_model, row, k) == want
            seen.add(len(want))
    assert len(seen) > 1           # rows that keep one token and rows that keep more


def test_each_branch_of_the_rule(dense_model):
    n = dense_model.n_vocab
    im_end = dense_model.tokenize("<|im_end|>", special=True, add_special=False)[0]
    pieces = {dense_model.token_bytes(t, special=False): t for t in range(n)}
    a, ab = next((pieces[b], pieces[c]) for b in pieces if len(b) > 1
                 for c in pieces if len(c) > len(b) and c.startswith(b))
    base = np.full(n, -30.0, dtype=np.float32)
    cases = {
        "end-of-generation mass": {im_end: 2.0, 10: 2.5, 11: 2.4},
        "a token that starts another takes its probability": {a: 1.0, ab: 1.2, 12: 1.6, 13: 1.5},
        "nothing likely left: end of text": {t: 1.0 for t in range(100, 108)},
    }
    eot = _oracle(dense_model, _row(base, cases["nothing likely left: end of text"]), 8)
    banned = _row(base, cases["nothing likely left: end of text"])
    banned[eot] = -np.inf          # a logit bias banned it: the sampler still ends the text
    assert make_sampler(0.8, 8, seed=0, infill_vocab=dense_model._native.vocab).dist(banned).ids.tolist() == eot
    for name, logits in cases.items():
        row = _row(base, logits)
        want = _oracle(dense_model, row, len(logits))
        assert _kept(dense_model, row, len(logits)) == want, name


def _row(base: np.ndarray, logits: dict) -> np.ndarray:
    row = base.copy()
    row[list(logits)] = list(logits.values())
    return row


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_infill_runs_on_the_host_chain_and_needs_temperature(dense_path, dense_model, spec):
    engine = Engine(NativeModel(str(dense_path)), n_ctx=256, n_batch=64, threads=1, draft_limit=4,
                    flash_attn="off", sampling="backend")
    used, tokens = [], []
    try:
        for infill in (True, False):
            stats = RunStats()
            p = DecodeParams(max_tokens=8, temperature=0.8, top_k=40, seed=3, ignore_eos=True, spec=spec,
                             infill=infill)
            tokens.append([t for step in engine.run([1, 2, 3, 4, 5], p, stats) for t in step.tokens])
            used.append(stats.sampling)
    finally:
        engine.close()
    assert used == ["chain", "backend"]
    assert tokens[0] == dense_model.generate([1, 2, 3, 4, 5], max_tokens=8, temperature=0.8, top_k=40, seed=3,
                                             ignore_eos=True, spec=spec, infill=True).tokens
    for top_k in (40, 0):      # at temperature 0 that first: top_k's error came first, then this one
        with pytest.raises(ParamError, match="infill sampler needs temperature > 0"):
            dense_model.generate("x", temperature=0, top_k=top_k, infill=True)
    with pytest.raises(ParamError, match="needs top_k from 1 to 1000") as err:
        dense_model.generate("x", temperature=0.8, infill=True)        # every pair of the whole row
    assert err.value.param == "top_k"
    with pytest.raises(ParamError, match="cannot follow a grammar"):
        dense_model.generate("x", temperature=0.8, top_k=40, infill=True, grammar='root ::= "a"')
    with pytest.raises(ValueError, match="path='chain'"):
        make_sampler(0.8, path="numpy", infill_vocab=dense_model._native.vocab)


def test_rejection_sampling_keeps_the_infill_distribution(dense_model):
    kw = {**SAMPLING, "infill": True, "top_k": 8}
    plain = _histogram(dense_model, range(N), spec="none", **kw)
    spec = _histogram(dense_model, range(N, 2 * N), **kw)
    assert len(plain) >= 2 and min(plain.values()) > 100
    assert chi2_homogeneity_pvalue(plain, spec) > 1e-3
