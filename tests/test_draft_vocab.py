"""A draft vocabulary: the MTP head drafts over n ids from a file of its own, the output
stays the target's (pymtp/draft_vocab.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader

import pymtp
from conftest import require_exact_kernels
from pymtp.cli import main as cli
from pymtp.config import ParamError
from pymtp.draft_vocab import (FALLBACK, IDS_KEY, DraftVocab, DraftVocabError, cache_dir, draft_file, draft_ids,
                               read_ids)
from pymtp.drafter import DraftJob, MTPDrafter
from pymtp.native import ContextConfig, NativeModel
from pymtp.sampling import Dist, make_sampler

from test_stochastic import N, SAMPLING, _histogram, chi2_homogeneity_pvalue

KEPT = 300     # of the fixtures' 384 tokens: the 256 bytes and 44 merges


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("pymtp-cache")
        mp.setenv("PYMTP_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def dv_model(cache, dense_path):
    m = pymtp.load(dense_path, threads=1, n_ctx=1024, draft_vocab=KEPT)
    yield m
    m.close()


# ---------------------------------------------------------------------------- the ids


def test_the_first_ids_and_every_control_token_after_them_are_kept():
    types = np.array([1] * 10 + [3, 1, 4, 1, 5, 3], dtype=np.int32)   # 3 control, 4 user-defined, 5 unused
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("pymtp.draft_vocab.MIN_IDS", 4)
        assert draft_ids(types, 4).tolist() == [0, 1, 2, 3, 10, 12, 15]
        assert draft_ids(types, 12).tolist() == list(range(12)) + [12, 15]


@pytest.mark.parametrize("n", [255, 384, 1000, True, 300.0])
def test_a_draft_vocabulary_outside_its_range_is_refused(n):
    with pytest.raises(ParamError, match=r"draft_vocab must be an integer from 256 .* to 383") as e:
        draft_ids(np.ones(384, dtype=np.int32), n)
    assert e.value.param == "draft_vocab"


def test_ids_map_both_ways_and_absent_tokens_read_as_the_files_first():
    v = DraftVocab.of(np.array([0, 2, 5, 7]), 9)
    assert v.inputs(np.array([5, 1, 7, 0, 8])).tolist() == [2, FALLBACK, 3, 0, FALLBACK]
    assert v.token(3) == 7
    d = v.dist(Dist(np.array([1, 3], dtype=np.int32), np.array([0.25, 0.75])))
    assert d.ids.tolist() == [2, 7] and d.probs.tolist() == [0.25, 0.75]
    row = v.widen(np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32))
    assert row.tolist() == [1.0, -np.inf, 2.0, -np.inf, -np.inf, 3.0, -np.inf, 4.0, -np.inf]


@pytest.mark.parametrize("ids", [[], [0, 0, 1], [2, 1], [0, 9], [-1, 3]])
def test_ids_that_do_not_ascend_within_the_vocabulary_are_refused(ids):
    with pytest.raises(DraftVocabError, match="must ascend within"):
        DraftVocab.of(np.array(ids), 9)


# ---------------------------------------------------------------------------- the file


@pytest.mark.parametrize("kind", ["dense", "moe"])   # the MoE block's expert tensors are 3-D
def test_the_draft_file_holds_the_mtp_block_and_the_kept_rows(cache, kind, request):
    model = request.getfixturevalue(f"{kind}_path")
    path = draft_file(model, KEPT)
    assert path.parent == cache_dir() and path.parent.parent == cache
    src, out = GGUFReader(model), GGUFReader(path)
    types = src.fields["tokenizer.ggml.token_type"].contents()
    ids = draft_ids(np.array(types), KEPT)
    assert read_ids(path).tolist() == ids.tolist()
    assert out.fields[IDS_KEY].contents() == ids.tolist()
    assert ids[-1] >= KEPT and types[ids[-1]] == 3          # the end-of-text control token rides along
    tokens = src.fields["tokenizer.ggml.tokens"].contents()
    assert out.fields["tokenizer.ggml.tokens"].contents() == [tokens[i] for i in ids]
    assert out.fields["tokenizer.ggml.token_type"].contents() == [types[i] for i in ids]
    # special ids renumbered to the file's tokens, or dropped where the file lacks them
    for key, f in src.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            old = f.contents()
            if old in ids:
                assert out.fields[key].contents() == int(np.flatnonzero(ids == old)[0])
            else:
                assert key not in out.fields
    arch = src.fields["general.architecture"].contents()
    n_trunk = src.fields[f"{arch}.block_count"].contents() - src.fields[f"{arch}.nextn_predict_layers"].contents()
    src_t = {t.name: t for t in src.tensors}
    names = [t.name for t in out.tensors]
    assert names == [n for n in src_t if not n.startswith("blk.") or int(n.split(".")[1]) >= n_trunk]
    assert "output.weight" in names and any(".nextn." in n for n in names)
    for t in out.tensors:
        old = np.asarray(src_t[t.name].data)
        want = old[ids] if t.name in ("token_embd.weight", "output.weight") else old
        assert np.array_equal(np.asarray(t.data), want), t.name


def test_the_draft_file_is_made_once_and_again_for_a_changed_model(cache, dense_path, tmp_path):
    first = draft_file(dense_path, KEPT)
    stamp = first.stat().st_mtime_ns
    assert draft_file(dense_path, KEPT) == first and first.stat().st_mtime_ns == stamp
    copy = tmp_path / dense_path.name
    copy.write_bytes(dense_path.read_bytes())
    os.utime(copy, ns=(1, 1))
    assert draft_file(copy, KEPT) != first
    assert draft_file(dense_path, KEPT + 1) != first


@pytest.mark.parametrize("cut", [0, 100, "data"])
def test_a_cached_draft_file_cut_short_is_made_again(dense_path, tmp_path, monkeypatch, cut):
    """pymtp's own file, damaged since it was written (an empty file, a header cut off, the
    tensor data cut off): made again rather than refused with a byte offset, or loaded short."""
    monkeypatch.setenv("PYMTP_CACHE_DIR", str(tmp_path))      # not the cache the other tests share
    first = draft_file(dense_path, KEPT)
    whole = first.read_bytes()
    size = len(whole) - 64 if cut == "data" else cut
    first.write_bytes(whole[:size])
    assert draft_file(dense_path, KEPT) == first and first.read_bytes() == whole


def test_a_split_model_gives_the_draft_file_of_the_whole(cache, dense_path, tmp_path):
    from pymtp.testing.gguf_files import split_gguf

    n = len(GGUFReader(dense_path).tensors)
    parts = split_gguf(dense_path, tmp_path / "m.gguf", [2, n - 12, 10])   # the MTP block spans two parts
    whole, split = GGUFReader(draft_file(dense_path, KEPT)), GGUFReader(draft_file(parts[0], KEPT))
    assert [t.name for t in split.tensors] == [t.name for t in whole.tensors]
    assert all(np.array_equal(np.asarray(a.data), np.asarray(b.data)) for a, b in zip(split.tensors, whole.tensors))
    assert not any(k.startswith("split.") for k in split.fields)
    assert split.fields[IDS_KEY].contents() == whole.fields[IDS_KEY].contents()


def test_a_cache_that_cannot_be_written_is_named(dense_path, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PYMTP_CACHE_DIR", str(blocker))      # a file where a folder should go
    with pytest.raises(DraftVocabError, match="cannot write the draft file .* set PYMTP_CACHE_DIR"):
        draft_file(dense_path, KEPT)


def test_a_file_without_ids_is_not_taken_for_a_draft_file(dense_path):
    with pytest.raises(DraftVocabError, match="is not a pymtp draft file"):
        read_ids(dense_path)


# ---------------------------------------------------------------------------- the drafter


def test_the_heads_row_over_the_kept_ids_is_the_whole_heads_at_them(dv_model, dense_model):
    # the same MTP block on the same rows (kept tokens, so the same inputs) and the same
    # batch shapes: its logits at the kept ids, bit for bit (an H100 with the CUDA build
    # too: a head's row does not depend on how many rows the head has)
    rows = np.arange(65, 75, dtype=np.int32)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((len(rows), dense_model._native.n_embd_out)).astype(np.float32)
    cfg = ContextConfig(n_ctx=256, n_batch=64, n_ubatch=64, threads=1, mtp=True, n_outputs_max=1, flash_attn="off")
    heads = []
    for draft in (None, dv_model._draft):
        d = MTPDrafter(dense_model._native, cfg, draft=draft)
        try:
            job = DraftJob(0, rows, hidden, k=1)
            d.propose([job])
            heads.append((np.array(d.ctx.logits(1)[0]), job.drafts))
        finally:
            d.close()
    (full, full_draft), (sub, sub_draft) = heads
    ids = dv_model._draft.vocab.ids
    assert sub.shape == (ids.size,)
    assert np.array_equal(sub, full[ids])
    assert sub_draft == [int(ids[np.argmax(full[ids])])]


def _bare_drafter(vocab: DraftVocab) -> MTPDrafter:
    d = object.__new__(MTPDrafter)      # _draft reads only the vocabulary
    d.vocab = vocab
    return d


def test_a_draft_is_the_model_id_of_the_rows_best_kept_token():
    d = _bare_drafter(DraftVocab.of(np.array([1, 4, 6, 8]), 10))
    job = DraftJob(0, np.zeros(1, np.int32), np.zeros((1, 2), np.float32), k=2)
    assert d._draft(job, np.array([0.0, 3.0, 1.0, 2.0], dtype=np.float32), 0) == 4
    assert d._draft(job, np.array([0.0, 1.0, 1.0, 5.0], dtype=np.float32), 0) == 8
    assert job.drafts == [4, 8]


def test_a_sampled_draft_and_its_q_speak_the_models_ids():
    d = _bare_drafter(DraftVocab.of(np.array([1, 4, 6, 8]), 10))
    sampler = make_sampler(temperature=1.0, top_k=2, seed=0)
    job = DraftJob(0, np.zeros(1, np.int32), np.zeros((1, 2), np.float32), k=1, sampler=sampler, sample=True)
    tok = d._draft(job, np.array([5.0, 0.0, 4.0, 1.0], dtype=np.float32), 0)
    q = job.dists[0]
    assert q.ids.tolist() == [1, 6] and tok in (1, 6) and job.drafts == [tok]
    assert np.allclose(q.probs, np.exp([5.0, 4.0]) / np.exp([5.0, 4.0]).sum())    # float32 against float64


def test_a_penalised_draft_sees_the_row_widened_to_the_models_ids():
    # the penalty lands on model id 6 (the file's token 2), which no longer wins
    d = _bare_drafter(DraftVocab.of(np.array([1, 4, 6, 8]), 10))
    sampler = make_sampler(temperature=0.0, presence_penalty=2.0, repeat_last_n=4)
    job = DraftJob(0, np.zeros(1, np.int32), np.zeros((1, 2), np.float32), k=1, sampler=sampler,
                   recent=np.array([6], dtype=np.int32))
    assert d._draft(job, np.array([0.0, 1.0, 3.0, 2.0], dtype=np.float32), 0) == 8


def test_a_biased_draft_sees_the_row_widened_to_the_models_ids():
    # the bias lands on model id 8 (the file's token 3), not on the file's token 8
    d = _bare_drafter(DraftVocab.of(np.array([1, 4, 6, 8]), 10))
    sampler = make_sampler(temperature=0.0, logit_bias={8: 2.0})
    job = DraftJob(0, np.zeros(1, np.int32), np.zeros((1, 2), np.float32), k=1, sampler=sampler)
    assert d._draft(job, np.array([0.0, 1.0, 3.0, 2.0], dtype=np.float32), 0) == 8


def test_greedy_output_is_plain_decodings_with_a_draft_vocabulary(dv_model, dense_model):
    require_exact_kernels()
    for text in ("The quick brown fox", "Once upon a time", "def main():"):
        prompt = dense_model.tokenize(text)
        plain = dense_model.generate(prompt, spec="none", max_tokens=40, ignore_eos=True).tokens
        r = dv_model.generate(prompt, draft_max=3, max_tokens=40, ignore_eos=True)
        assert r.tokens == plain
        assert r.stats.drafted > 0 and r.stats.accepted > 0


def _record_jobs(monkeypatch) -> list[DraftJob]:
    """Every job the drafters propose for from now on, with its drafts and q filled."""
    jobs_seen: list[DraftJob] = []
    real = MTPDrafter.propose

    def propose(self, jobs):
        real(self, jobs)
        jobs_seen.extend(jobs)
    monkeypatch.setattr(MTPDrafter, "propose", propose)
    return jobs_seen


def test_drafts_come_from_the_kept_ids_only(dv_model, monkeypatch):
    jobs = _record_jobs(monkeypatch)
    dv_model.generate("The quick brown fox", draft_max=3, max_tokens=40, ignore_eos=True)
    dv_model.generate("Once upon a time", draft_max=2, max_tokens=40, ignore_eos=True, temperature=0.9, seed=1)
    seen = {t for j in jobs for t in j.drafts}
    assert seen and seen <= set(dv_model._draft.vocab.ids.tolist())


def test_drafts_sampled_in_the_graph_map_to_the_models_ids(cache, dense_path, monkeypatch):
    # sampling="backend": q comes from the chain in the draft file's context, over its ids
    m = pymtp.load(dense_path, threads=1, n_ctx=1024, draft_vocab=KEPT, sampling="backend")
    jobs = _record_jobs(monkeypatch)
    try:
        kw = dict(draft_max=3, max_tokens=32, ignore_eos=True, temperature=0.8, top_k=8, seed=5)
        first = m.generate("Once upon a time", **kw)
        assert m.generate("Once upon a time", **kw).tokens == first.tokens
        assert first.stats.drafted > 0
    finally:
        m.close()
    kept = m._draft.vocab.ids
    qs = [q for j in jobs for q in j.dists]
    assert qs and all(np.all(np.diff(q.ids) > 0) and np.isin(q.ids, kept).all() for q in qs)


def test_greedy_drafts_from_the_graph_map_to_the_models_ids(cache, dv_model, dense_path, monkeypatch):
    # sampling="backend" at temperature 0: the draft file's context takes each draft's
    # argmax in its graph, over the file's ids; mapped back they are the host's drafts
    m = pymtp.load(dense_path, threads=1, n_ctx=1024, draft_vocab=KEPT, sampling="backend")
    jobs = _record_jobs(monkeypatch)
    kw = dict(draft_max=3, max_tokens=40, ignore_eos=True)
    try:
        for text in ("The quick brown fox", "Once upon a time"):
            jobs.clear()
            graph = m.generate(text, **kw)
            graph_jobs = [(list(j.drafts), j.sampled) for j in jobs if j.k]
            jobs.clear()
            host = dv_model.generate(text, **kw)
            assert graph_jobs == [(list(j.drafts), True) for j in jobs if j.k]
            assert not any(j.sampled for j in jobs)
            assert graph.tokens == host.tokens and graph.stats.drafted > 0
            assert (graph.stats.drafted, graph.stats.accepted) == (host.stats.drafted, host.stats.accepted)
    finally:
        m.close()


@pytest.mark.parametrize("top_k", [KEPT, KEPT + 40])
def test_a_top_k_past_the_draft_files_rows_keeps_the_drafter_on_the_host(cache, dense_path, top_k):
    # the graph's top_k aborts the process on a k past the row (ggml_top_k's assert): the
    # draft file's rows hold KEPT ids, so such a top_k drafts on the host (numpy's top_k
    # keeps the whole row), where before one request killed the process
    m = pymtp.load(dense_path, threads=1, n_ctx=1024, draft_vocab=KEPT, sampling="backend")
    try:
        kw = dict(draft_max=3, max_tokens=16, ignore_eos=True, temperature=0.8, seed=2, top_k=top_k)
        got = m.generate("The quick brown fox", **kw)
        assert len(got.tokens) == 16 and got.stats.drafted > 0
    finally:
        m.close()


def test_penalties_grammars_and_biases_see_the_row_widened(dv_model, dense_model):
    # all speak the model's ids: the drafter widens the file's row for them, and the
    # output stays plain decoding's
    require_exact_kernels()
    prompt = dense_model.tokenize("The quick brown fox")
    first = dense_model.generate(prompt, spec="none", max_tokens=2, ignore_eos=True).tokens
    for kw in (dict(repeat_penalty=1.3, repeat_last_n=16), dict(grammar='root ::= [a-z ]+ "."'),
               dict(logit_bias={first[1]: -100.0})):
        plain = dense_model.generate(prompt, spec="none", max_tokens=24, ignore_eos=True, **kw).tokens
        assert dv_model.generate(prompt, draft_max=3, max_tokens=24, ignore_eos=True, **kw).tokens == plain


def test_rejection_sampling_keeps_the_target_distribution_with_a_draft_vocabulary(dv_model, dense_model):
    plain = _histogram(dense_model, range(N), spec="none", **SAMPLING)
    spec = _histogram(dv_model, range(N, 2 * N), **SAMPLING)
    assert chi2_homogeneity_pvalue(plain, spec) > 1e-3


def test_a_batch_with_a_draft_vocabulary_gives_each_prompt_its_solo_output(dv_model):
    require_exact_kernels()
    prompts = ["The quick brown fox", "Once upon a time", "def main():", "A B C"]
    kw = dict(draft_max=3, max_tokens=24, ignore_eos=True)
    solo = [dv_model.generate(p, **kw).tokens for p in prompts]
    assert [r.tokens for r in dv_model.generate_batch(prompts, **kw)] == solo


# ---------------------------------------------------------------------------- load and CLI


def test_a_model_without_an_mtp_head_refuses_a_draft_vocabulary(cache, nomtp_path):
    with pytest.raises(DraftVocabError, match="has no MTP head"):
        pymtp.load(nomtp_path, threads=1, n_ctx=256, draft_vocab=KEPT)


def test_the_cli_names_the_draft_vocabulary_it_refuses(cache, dense_path):
    r = CliRunner().invoke(cli, ["generate", str(dense_path), "-p", "x", "-n", "4", "--draft-vocab", "100"])
    assert r.exit_code == 2, r.output     # a bad value of the option, as click's own checks
    assert "Invalid value for '--draft-vocab': draft_vocab must be an integer from 256 (the byte tokens) to 383" \
        in r.output


def test_the_cli_generates_with_a_draft_vocabulary(cache, dense_path):
    r = CliRunner().invoke(cli, ["generate", str(dense_path), "-p", "The quick brown fox", "-n", "12",
                                 "--ignore-eos", "-t", "1", "--draft-vocab", str(KEPT), "--json"])
    assert r.exit_code == 0, r.output
    import json

    out = json.loads(r.output.strip().splitlines()[-1])
    assert len(out["tokens"]) == 12 and out["stats"]["drafted"] > 0
