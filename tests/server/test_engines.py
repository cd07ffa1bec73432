"""``pymtp serve --engines``: the slots shared among batched engines, each stepped by its
own thread; every response still equals its solo run, and /metrics adds the engines up."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pymtp.server import ServerSettings
from pymtp.server.batching import default_engines, engine_sizes
from pymtp.server.cli import serve
from conftest import require_cache_exact
from server.helpers import app_client
from test_batch import require_batch_exact
from test_batch_server import PROMPTS, _metric_samples, all_equal_solo_runs


def test_engine_sizes_share_the_slots():
    assert engine_sizes(8, 4) == [2, 2, 2, 2]
    assert engine_sizes(7, 3) == [3, 2, 2]
    assert engine_sizes(3, 1) == [3]
    with pytest.raises(ValueError, match="between 1 and the slots"):
        engine_sizes(2, 3)
    with pytest.raises(ValueError, match="between 1 and the slots"):
        engine_sizes(2, 0)


def test_default_engines_split_only_on_a_local_gpu():
    assert default_engines(8, offloaded=True, rpc=False) == 4
    assert default_engines(32, offloaded=True, rpc=False) == 4        # MAX_AUTO_ENGINES
    assert default_engines(3, offloaded=True, rpc=False) == 1
    assert default_engines(1, offloaded=True, rpc=False) == 1
    assert default_engines(8, offloaded=False, rpc=False) == 1
    assert default_engines(8, offloaded=True, rpc=True) == 1


@pytest.mark.parametrize("args, message", [
    (["--engines", "0"], "neither a count of engines"),
    (["--engines", "two"], "neither a count of engines"),
    (["--engines", "3", "--parallel", "2"], "more than the 2 slot(s)"),
    (["--engines", "2", "--parallel", "2", "--rpc", "127.0.0.1:1"], "cannot serve a model split over --rpc"),
])
def test_bad_engines_are_refused_before_loading(args, message):
    r = CliRunner().invoke(serve, ["no-such-model.gguf", *args])
    assert r.exit_code == 2 and message in r.output, r.output


def test_two_engines_answer_as_solo_runs(dense_model):
    """Six requests with different depths, temperatures and seeds on two engines of two
    slots: each text equals ``Model.generate`` of the same request; both engines ran
    rounds, and the metrics count every request once."""
    require_batch_exact()
    with app_client(dense_model, ServerSettings(parallel=4, engines=2)) as c:
        service = c.app.state.service
        assert len(service.workers) == 2
        assert [w.batcher.slots for w in service.workers] == [2, 2]
        assert c.get("/v1/models").json()["data"][0]["meta"]["engines"] == 2
        # one depth schedule: the second engine drafts what the first one's search picks
        first = service.workers[0].batcher.engine.rounds.epochs
        assert service.workers[1].batcher.engine.rounds.epochs.leader is first

        all_equal_solo_runs(c, dense_model)
        assert all(w.batcher.metrics.rounds > 0 for w in service.workers)
        m = _metric_samples(c)
        assert m["pymtp_queue_seconds_count"] == len(PROMPTS)
        assert m["pymtp_time_to_first_token_seconds_count"] == len(PROMPTS)
        rounds = sum(v for k, v in m.items() if k.startswith("pymtp_batch_rounds_total{size="))
        assert rounds == sum(w.batcher.metrics.rounds for w in service.workers)
        drafted = sum(v for k, v in m.items() if k.startswith("pymtp_slot_draft_tokens_total{"))
        assert drafted == m["pymtp_draft_tokens_total"] > 0
        assert sum(1 for k in m if k.startswith("pymtp_slot_draft_tokens_total{")) == 4
        assert c.get("/pymtp/stats").json()["batch"]["engines"] == 2
        assert m["pymtp_slots_busy"] == 0


def test_per_slot_metrics_are_labelled_as_slots_and_id_slot_number_them(dense_model):
    """Three slots on two engines: the pool takes the engines' slots in turn (engine 0's
    seq 0, engine 1's seq 0, engine 0's seq 1), and /metrics labels each slot's drafts by
    that index, the one /slots and a response's id_slot give; numbered engine by engine, a
    dashboard pairing the two read another slot's acceptance."""
    with app_client(dense_model, ServerSettings(parallel=3, engines=2)) as c:
        service = c.app.state.service
        for e, worker in enumerate(service.workers):
            for seq, slot in enumerate(worker.batcher.metrics.slots):
                slot.drafted, slot.accepted = 10 * (e + 1) + seq, 100 * (e + 1) + seq
        m = _metric_samples(c)
        drafted = {k: v for k, v in m.items() if k.startswith("pymtp_slot_draft_tokens_total{")}
        accepted = {k: v for k, v in m.items() if k.startswith("pymtp_slot_draft_tokens_accepted_total{")}
        assert drafted == {'pymtp_slot_draft_tokens_total{slot=0}': 10, 'pymtp_slot_draft_tokens_total{slot=1}': 20,
                           'pymtp_slot_draft_tokens_total{slot=2}': 11}
        assert accepted == {'pymtp_slot_draft_tokens_accepted_total{slot=0}': 100,
                            'pymtp_slot_draft_tokens_accepted_total{slot=1}': 200,
                            'pymtp_slot_draft_tokens_accepted_total{slot=2}': 101}
        pooled = [(service.workers.index(s.worker), s.seq) for s in service.pool.sessions]
        assert pooled == [(0, 0), (1, 0), (0, 1)]


def test_a_follow_up_goes_to_the_engine_holding_its_prefix(dense_model):
    """Two engines: a request that extends an earlier one's prompt is sent to the engine
    whose prompt cache holds it (its usage reports the reused tokens), not to the other
    engine, which the slot order alone would pick next."""
    first = PROMPTS[1] * 6
    with app_client(dense_model, ServerSettings(parallel=4, engines=2)) as c:
        def complete(prompt: str, **extra) -> dict:
            r = c.post("/v1/completions", json=dict(prompt=prompt, max_tokens=8, ignore_eos=True, **extra))
            assert r.status_code == 200, r.text
            return r.json()

        one = complete(first)
        follow = first + one["choices"][0]["text"] + " and then"
        warm = complete(follow)
        cold = complete(follow, cache_prompt=False)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= one["usage"]["prompt_tokens"] - 4
        require_cache_exact()
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
