"""The soak (benchmarks/soak.py) in a short form: misbehaving streaming clients against a
real ``pymtp serve`` on the demo model, with every check of the long form.

Eight clients on two slots with short stalls, so that requests queue (a stalled client
has its whole answer already and waits on no slot) and some are abandoned there, however
fast the machine; the 10-minute form (16 clients, ``--parallel 4``) is run by hand, see
the script.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_rows_within_patch

REPO = Path(__file__).resolve().parents[2]
SOAK = REPO / "benchmarks" / "soak.py"
SHORT = ["--clients", "8", "--parallel", "2", "--duration", "20", "--prompts", "4", "--stall-max", "2",
         "--rss-every", "2"]


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """One short soak, shared by the tests below (it takes ~25 s)."""
    tmp = tmp_path_factory.mktemp("soak")
    out = tmp / "soak.json"
    proc = subprocess.run([sys.executable, str(SOAK), *SHORT, "--json", str(out), "--log-dir", str(tmp)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _mismatch(violation: str) -> bool:
    return violation.startswith("mismatch for ")


def test_short_soak_holds(short_soak):
    """Every check but equality to the solo runs, which the next test owns."""
    proc, r = short_soak
    others = [v for v in r["violations"] if not _mismatch(v)]
    assert others == [] and r["unexercised_actions"] == [], proc.stdout[-3000:]
    # the script fails exactly when it found a violation (a mismatch included)
    assert proc.returncode == (1 if r["violations"] else 0), proc.stdout[-3000:] + proc.stderr[-3000:]
    # each kind of misbehaviour happened, not only planned
    for outcome in ("finished", "stalled, then read to the end", "reset mid-stream", "closed mid-stream",
                    "abandoned while waiting"):
        assert r["outcomes"].get(outcome, 0) >= 1, (outcome, r["outcomes"])
    assert r["outcomes"]["finished"] >= 10
    final = r["final"]
    assert final["slots_busy"] == final["queue_waiting"] == 0 and final["requests_in_flight"] == 1
    assert final["slots_processing"] == []          # /slots: every slot's last request ended
    # the abandoned requests were answered 499 (client closed) by the server, not generated later
    assert sum(v for k, v in final["server_statuses"].items() if 'status="499"' in k) >= 1
    assert not any('status="5' in k for k in final["server_statuses"])
    assert r["exit_status"] == 0
    assert len(r["rss_mb"]) >= 8 and all(mb > 0 for _, mb in r["rss_mb"])
    assert "RSS (MB):" in proc.stdout


def test_short_soak_answers_equal_solo_runs(short_soak):
    """Every answer read to the end under load equals its solo run (batched rows included)."""
    require_rows_within_patch("the soak's batched rounds")
    proc, r = short_soak
    assert [v for v in r["violations"] if _mismatch(v)] == []
    assert "0 violations" in proc.stdout


def test_soak_reports_a_mismatch_and_exits_1(tmp_path, monkeypatch, capsys):
    """The equality check can fail: references with one text changed."""
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "soak", soak)     # dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))   # it adds benchmarks/ to import load_server
    spec.loader.exec_module(soak)
    real = soak.solo_answers

    async def wrong_answers(port, jobs):
        answers = await real(port, jobs)
        return {job: soak.Answer(a.text + "!", a.completion_tokens, a.finish_reason) for job, a in answers.items()}

    monkeypatch.setattr(soak, "solo_answers", wrong_answers)
    args = ["--clients", "2", "--parallel", "2", "--duration", "3", "--prompts", "1", "--finish", "1",
            "--stall", "0", "--disconnect", "0", "--cancel", "0", "--abandon", "0", "--log-dir", str(tmp_path)]
    assert soak.main(args) == 1
    out = capsys.readouterr().out
    assert "VIOLATION mismatch for /v1/" in out and "!'" in out
