"""benchmarks/round_profile.py and benchmarks/sampling_cost.py run end to end on the demo
model and report numbers that add up (their figures are measured by the lead's runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pymtp.testing.processes import child_env

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "pymtp" / "data" / "qwen35-tiny-mtp-q8_0.gguf"     # 8,192 tokens


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=True,
                          env=child_env(REPO))


@pytest.mark.parametrize("sampling", ["chain", "backend"])
def test_round_profile_splits_the_round_into_native_and_python(tmp_path, sampling):
    out = tmp_path / "profile.json"
    proc = _run("round_profile.py", str(DEMO), "-t", "1", "--limit", "2", "-n", "24", "-k", "0", "-k", "3",
                "--temperature", "0.7", "--top-k", "40", "--sampling", sampling, "--json", str(out))
    rep = json.loads(out.read_text())
    assert rep["n_vocab"] == 8192 and rep["sampling_option"] == sampling and rep["device"] in ("cpu", "gpu")
    rows = {r["setting"]: r for r in rep["results"]}
    assert set(rows) == {"no-spec", "mtp k=3"}
    for r in rows.values():
        assert r["tokens"] == 2 * 24 and r["sampling"] == sampling
        assert abs(r["native_ms_per_round"] + r["python_ms_per_round"] - r["round_ms"]) < 1e-3
        assert 0.0 < r["python_share"] < 1.0
        steps = sum(s["python_ms_per_round"] + s["native_ms_per_round"] for s in r["steps"].values())
        assert steps + r["outside_steps_ms_per_round"] == pytest.approx(r["round_ms"], abs=1e-3)
    # no-spec: one round per token after the prefill's; k=3: fewer rounds than tokens
    assert rows["no-spec"]["rounds"] == 2 * 23
    assert rows["mtp k=3"]["rounds"] < 2 * 23 and rows["mtp k=3"]["acceptance"] > 0
    assert f"Python/policy share of a k=3 round: {100 * rows['mtp k=3']['python_share']:.1f}%" in proc.stdout


def test_sampling_cost_measures_every_path_and_says_what_backend_sampling_returns():
    proc = _run("sampling_cost.py", "--small", str(DEMO), "--padded", str(DEMO), "--filters", "qwen",
                "--iters", "1", "--backend-iters", "2", "--threads", "1", "--json")
    results = json.loads(proc.stdout)["results"]
    assert [r["path"] for r in results[:4]] == ["numpy", "C chain, whole row", "C chain on candidates", "backend"]
    for r in results:
        if r["path"] != "backend":
            assert r["dist_ms"] > 0 and r["round_ms"] > r["dist_ms"]
    backend = results[3]
    # CPU builds run it too: every sampler in the graph, 20 candidates (top_k) and their
    # probabilities, summing to 1
    assert backend["works"] and backend["offloaded"] == ["+top-k", "+top-p", "+temp", "+dist"]
    assert backend["sample"]["candidates"] == backend["sample"]["probs"] == 20
    assert backend["sample"]["probs_sum"] == pytest.approx(1.0, abs=1e-5)
