"""benchmarks/round_profile.py, host_calls.py, sampling_cost.py and micro_decode.py run end
to end on the demo model and report numbers that add up (their figures are measured by the
lead's runs); benchmarks/load_server.py's --table starts the servers its options name."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import require_rows_within_patch
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
                "--temperature", "0.7", "--top-k", "40", "--sampling", sampling, "--passes", "2", "--json", str(out))
    rep = json.loads(out.read_text())
    assert rep["n_vocab"] == 8192 and rep["sampling_option"] == sampling and rep["device"] in ("cpu", "gpu")
    rows = {r["setting"]: r for r in rep["results"]}
    assert set(rows) == {"no-spec", "mtp k=3"}
    for r in rows.values():
        # the window's tokens: each prompt's first came from its prefill, before the window
        assert r["tokens"] == 2 * 23 and r["sampling"] == sampling
        # per-round means the report rounds to 1e-4 ms each (benchmarks/round_profile.py)
        assert abs(r["native_ms_per_round"] + r["python_ms_per_round"] - r["round_ms"]) < 1e-3
        assert 0.0 < r["python_share"] < 1.0
        steps = sum(s["python_ms_per_round"] + s["native_ms_per_round"] for s in r["steps"].values())
        assert steps + r["outside_steps_ms_per_round"] == pytest.approx(r["round_ms"], abs=1e-3)
        # the unsynchronised pass did the same work; its wall less the synced pass's native
        # time is the Python on the critical path (on a CPU the two passes differ by noise)
        assert r["same_work"] and r["free_round_ms"] > 0
        # two pairs of passes, the row one of them (the median: the lower of two)
        assert len(r["passes"]) == 2
        assert r["critical_python_share"] == min(x["critical_python_share"] for x in r["passes"])
        assert r["critical_python_ms_per_round"] + r["native_ms_per_round"] == pytest.approx(r["free_round_ms"],
                                                                                            abs=1e-3)
    # no-spec: one round per token after the prefill's; k=3: fewer rounds than tokens
    assert rows["no-spec"]["rounds"] == 2 * 23 == rows["no-spec"]["tokens"]
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
    # its round includes the acceptance over what it hands back, as the host paths' do
    assert backend["accept_ms"] > 0


def test_sampling_cost_names_the_numpy_fallback_of_the_chain_path(monkeypatch):
    """Without top_k a 248k row takes the numpy path under path="chain": its row says so."""
    sc = _script_module(monkeypatch, "sampling_cost")
    assert list(sc.host_paths(sc.FILTERS["top_p only"], 248_320))[2] == \
        "C chain on candidates (numpy: no top_k on a long row)"
    assert list(sc.host_paths(sc.FILTERS["top_p only"], 8192))[2] == "C chain on candidates"
    assert list(sc.host_paths(sc.FILTERS["qwen"], 248_320))[2] == "C chain on candidates"


def test_micro_decode_times_every_piece_from_a_fresh_drafter():
    """Its drafter rows ran on one position count across rows, and the rows after
    ``propose`` (which resets the drafter) decoded at stale positions: llama.cpp refused
    the masked-nextn row ("inconsistent sequence positions") and the script died."""
    proc = _run("micro_decode.py", str(DEMO), "--iters", "3", "--threads", "1")
    pieces = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")][1:]
    assert pieces == ["target decode, 1 row", "verify 2 rows + rollback", "verify 4 rows + rollback",
                      "MTP step, 1 row", "MTP 3-row catch-up + 1 step", "propose k=1", "propose k=3",
                      "MTP step, 1 row, masked nextn", "MTP step, 1 row, 1 thread",
                      "MTP step, decode only (no reads)", "Python side of a step, no decode"]


def test_host_calls_names_the_helpers_of_a_rejection_round(tmp_path):
    out = tmp_path / "calls.json"
    proc = _run("host_calls.py", str(DEMO), "-t", "1", "--limit", "2", "-n", "24", "-k", "3", "--temperature", "0.7",
                "--top-k", "40", "--sampling", "backend", "--accept", "rejection", "--cold-warm", "--calls-json", str(out))
    rep = json.loads(out.read_text())
    calls = {r["helper"]: r["calls"] for r in rep["helpers"]}
    q, p = calls["drafter.sampled_dist"], calls["backend_sampling.sampled_dist"]
    # every draft drew its token from its q; every backend row's Dist was built twice,
    # cold then warm, through the wrapped from_sparse; no exact-match rule ran
    assert q > 0 and p > 0 and calls["sampling.Sampler.sample"] == q
    assert rep["dist_builds"]["calls"] == q + p and calls["sampling.Dist.from_sparse"] == 2 * (q + p)
    assert calls["round_judge.rejection_accept"] > 0 and calls["round_judge.exact_match_draws"] == 0
    assert calls["drafter.MTPDrafter._fill"] == calls["drafter.MTPDrafter._advance"] > 0
    assert rep["dist_builds"]["cold_us"] > 0 and rep["dist_builds"]["warm_us"] > 0
    assert "| drafter.sampled_dist " in proc.stdout and "Python/policy share of a k=3 round" in proc.stdout


def test_host_calls_names_a_helper_that_moved(monkeypatch):
    from benchmarks import host_calls

    monkeypatch.setattr(host_calls, "HELPERS", (("pymtp.rounds", "no_such_rule", "gone"),))
    with pytest.raises(SystemExit, match="pymtp.rounds has no no_such_rule: update HELPERS in host_calls.py"):
        host_calls.instrument(host_calls.Tally(), cold_warm=False)


def test_admission_cost_names_each_decode_by_its_context():
    """A prompt round decodes the target and, where the sequences draft, the MTP head:
    admission_cost.py books each decode under its own context's name."""
    proc = _run("admission_cost.py", str(DEMO), "--slots", "2", "--requests", "2", "-n", "8",
                "--spec", "none", "--spec", "3")
    none, drafting = proc.stdout.split("spec 3:")
    assert "llama_decode (target)" in none and "(MTP)" not in none
    for part in drafting.split("  prompt:"):      # its decode rounds, then its prompt rounds
        assert "llama_decode (target)" in part and "llama_decode (MTP)" in part, proc.stdout


def _script_module(monkeypatch, name: str):
    """benchmarks/NAME.py imported as a module (its functions called without a run)."""
    monkeypatch.setattr(sys, "path", list(sys.path))      # a script adds the repository to it
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_load_table_serves_pymtp_without_drafts_for_draft_max_none(monkeypatch):
    """``--draft-max none`` is a pymtp row with ``--spec none``; llama-server's MTP twin
    drafts the first fixed depth asked for."""
    ls = _script_module(monkeypatch, "load_server")
    args = ls.parse_args(["--table", "m.gguf", "--llama-server", "ls", "--draft-max", "none",
                          "--draft-max", "auto", "--draft-max", "2"])
    servers = {name: argv for name, argv, _ in ls.table_servers(args)}
    none = servers["pymtp serve --parallel 4 --draft-max none"]
    assert none[none.index("--spec") + 1] == "none" and "--draft-max" not in none
    auto = servers["pymtp serve --parallel 4 --draft-max auto"]
    assert auto[auto.index("--draft-max") + 1] == "auto" and "--spec" not in auto
    assert "llama-server -np 4 --spec-type draft-mtp --spec-draft-n-max 2" in servers
    # an HTTP thread for every connection the clients hold (the table's 8 by default), and a few more
    plain = servers["llama-server -np 4"]
    assert plain[plain.index("--threads-http") + 1] == str(args.clients + 4) == "12"
    with pytest.raises(SystemExit):
        ls.parse_args(["--table", "m.gguf", "--draft-max", "0"])
    # --pymtp-args: appended to every pymtp server, named in its row; llama-server's untouched
    args = ls.parse_args(["--table", "m.gguf", "--llama-server", "ls", "--draft-max", "none",
                          "--pymtp-args=--cache-ram 0"])
    servers = {name: argv for name, argv, _ in ls.table_servers(args)}
    assert servers["pymtp serve --parallel 4 --draft-max none --cache-ram 0"][-2:] == ["--cache-ram", "0"]
    assert "--cache-ram" not in servers["llama-server -np 4"]
    # repeated: a set of pymtp rows for each, in the same passes
    args = ls.parse_args(["--table", "m.gguf", "--draft-max", "3", "--draft-max", "none",
                          "--pymtp-args=--engines 1", "--pymtp-args=--engines 4"])
    servers = {name: argv for name, argv, _ in ls.table_servers(args)}
    assert sorted(servers) == [f"pymtp serve --parallel 4 --draft-max {d} --engines {e}"
                               for d in ("3", "none") for e in (1, 4)]
    assert servers["pymtp serve --parallel 4 --draft-max none --engines 4"][-2:] == ["--engines", "4"]


def test_load_table_rows_per_pymtp_source(monkeypatch, tmp_path):
    """``--pymtp-src``: a pymtp row per folder and depth, run from that folder and named
    after it; llama-server's rows run from the checkout. Without it, the checkout, unnamed."""
    ls = _script_module(monkeypatch, "load_server")
    old = tmp_path / "old"
    args = ls.parse_args(["--table", "m.gguf", "--llama-server", "ls", "--draft-max", "none", "--draft-max", "3",
                          "--pymtp-src", str(old), "--pymtp-src", str(ls.REPO)])
    rows = {name: src for name, _, src in ls.table_servers(args)}
    tag = f" [{ls.REPO.name}]"
    assert rows == {"pymtp serve --parallel 4 --draft-max none [old]": old.resolve(),
                    "pymtp serve --parallel 4 --draft-max 3 [old]": old.resolve(),
                    "pymtp serve --parallel 4 --draft-max none" + tag: ls.REPO,
                    "pymtp serve --parallel 4 --draft-max 3" + tag: ls.REPO,
                    "llama-server -np 4 --spec-type draft-mtp --spec-draft-n-max 3": ls.REPO,
                    "llama-server -np 4": ls.REPO}
    # the model as an absolute path: a server started in another folder still finds it
    assert all(str(Path("m.gguf").resolve()) in argv for _, argv, _ in ls.table_servers(args))
    rows = {name: src for name, _, src in ls.table_servers(ls.parse_args(["--table", "m.gguf"]))}
    assert rows == {"pymtp serve --parallel 4": ls.REPO}
    # one depth other than the default 3 is named too: the row ran it, not llama-server's 3
    rows = {name for name, _, _ in ls.table_servers(ls.parse_args(["--table", "m.gguf", "--draft-max", "auto"]))}
    assert rows == {"pymtp serve --parallel 4 --draft-max auto"}


def test_load_table_refuses_two_servers_of_one_name(monkeypatch):
    """A depth or pymtp argument listed twice gave two servers one row: the second's
    passes merged into the first's, and one of them was never measured apart."""
    ls = _script_module(monkeypatch, "load_server")
    for argv in (["--draft-max", "3", "--draft-max", "3"], ["--pymtp-args", "--engines 2", "--pymtp-args", "--engines 2"]):
        with pytest.raises(SystemExit, match="two servers named 'pymtp serve --parallel 4"):
            ls.table_servers(ls.parse_args(["--table", "m.gguf", *argv]))


def test_load_counts_a_refused_connection_as_a_request_that_failed(monkeypatch):
    """A request the server never answered (it crashed, say) has no status: it was left out
    of the requests and their rate, and the run passed. Here a real connection to a closed
    loopback port."""
    import asyncio

    import httpx

    from pymtp.testing.processes import free_port

    ls = _script_module(monkeypatch, "load_server")
    tally = ls.Tally()

    async def once():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}", timeout=5) as client:
            return await ls.stream_one(client, "/v1/completions", ls.request_body("/v1/completions", "a", 4), tally)

    assert asyncio.run(once()) is None
    assert tally.sent == 1 and not tally.statuses and dict(tally.outcomes) == {"transport_error:ConnectError": 1}


def test_load_options_in_either_spelling_and_percentiles_inside_the_values(monkeypatch):
    """``--max-tokens=50`` is the table's length as ``--max-tokens 50`` is (it was replaced
    by 128, and --min-tokens went unchecked); a p95 of 16 values is at most the largest."""
    ls = _script_module(monkeypatch, "load_server")
    a = ls.parse_args(["--table", "m.gguf", "--max-tokens=50", "--clients=3"])
    assert (a.max_tokens, a.clients) == (50, 3)
    assert (ls.parse_args(["--table", "m.gguf"]).max_tokens, ls.parse_args([]).max_tokens) == (128, 64)
    with pytest.raises(SystemExit):
        ls.parse_args(["--table", "m.gguf", "--max-tokens=50", "--min-tokens", "100"])
    assert ls.pct([6.0] * 14 + [7.0, 8.0], 95) <= 8.0 and ls.pct([0.5, 0.52, 0.55, 0.6], 95) <= 0.6


# a stand-in pymtp whose server answers /health with the file it was imported from
_WHICH_PYMTP = """
import http.server, sys
import pymtp

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = pymtp.__file__.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_load_table_server_runs_the_pymtp_of_its_source(monkeypatch, tmp_path):
    """A real child process: ``python -m pymtp.server.cli`` started for another folder
    imports that folder's pymtp, not the checkout's (an A/B of two trees compared one tree
    with itself while the checkout came first on the child's path)."""
    ls = _script_module(monkeypatch, "load_server")
    (tmp_path / "pymtp" / "server").mkdir(parents=True)
    (tmp_path / "pymtp" / "__init__.py").write_text("")
    (tmp_path / "pymtp" / "server" / "__init__.py").write_text("")
    (tmp_path / "pymtp" / "server" / "cli.py").write_text(_WHICH_PYMTP)
    argv = [sys.executable, "-m", "pymtp.server.cli"]
    with ls.running(argv, tmp_path / "log", timeout=60, src=tmp_path) as url:
        served = httpx.get(url + "/health", timeout=10).text
    assert Path(served).resolve() == (tmp_path / "pymtp" / "__init__.py").resolve()


def _pass(sizes=None, solo=None, parted=(), depths=None):
    return {"batch_sizes": sizes or {}, "identical_to_solo": solo, "parted": list(parted), "acceptance": 0.5,
            "depths": depths or {}, "auto_estimates": {}}


def test_load_table_notes_every_row_and_fails_on_any_parted_row(monkeypatch):
    """Under the table: a pre-batching server (no batch metrics) still says how many
    responses equalled their solo runs; llama-server says nothing; the exit status fails
    when any pymtp row, not only the last one, parted from its solo runs."""
    ls = _script_module(monkeypatch, "load_server")
    parted = {"request": 1, "at": 5, "load": "ab", "solo": "ac"}
    runs = {"pymtp [main]": [_pass({"2": 3}), _pass({"2": 4}, "3/4", [parted], {"3": 6})],
            "pymtp [pre10]": [_pass(), _pass(solo="4/4")],
            "llama-server": [_pass(), _pass()]}
    lines, ok = ls.row_notes(runs, 4)
    assert not ok
    assert "pymtp [main]: rounds by sequences decoded together {'2': 7}, acceptance 0.5, " \
           "responses identical to solo runs 3/4" in lines
    assert "pymtp [main]: request 1 parts from its solo run at character 5: 'ab' under load, 'ac' alone" in lines
    assert "pymtp [pre10]: responses identical to solo runs 4/4" in lines
    assert not any(line.startswith("llama-server") for line in lines)
    runs["pymtp [main]"][-1]["identical_to_solo"] = "4/4"
    assert ls.row_notes(runs, 4)[1]
    runs["pymtp [pre10]"][-1]["identical_to_solo"] = "2/4"      # the last row's check no longer decides alone
    assert not ls.row_notes(runs, 4)[1]


def test_first_difference_is_where_two_texts_part(monkeypatch):
    ls = _script_module(monkeypatch, "load_server")
    assert ls.first_difference("def f(x):", "def f(x):") is None
    assert ls.first_difference("def f(x):", "def g(x):") == 4
    assert ls.first_difference("abc", "abcd") == 3 and ls.first_difference("", "a") == 0


def test_load_table_reruns_each_request_alone_and_says_where_none_parted():
    # a real pymtp server on the demo model, k=3: each response equals its solo run where
    # batched rows hold the bits of a solo run's (tests/test_batch.py), so the check
    # passes and lists no parted request
    require_rows_within_patch("a round of several sequences")
    proc = _run("load_server.py", "--table", str(DEMO), "--parallel", "2", "--clients", "2", "--requests", "1",
                "--threads", "1", "--max-tokens", "16", "--draft-max", "3")
    assert "responses identical to solo runs 2/2" in proc.stdout, proc.stdout
    row = json.loads(next(line for line in proc.stderr.splitlines()
                          if line.startswith("pymtp serve --parallel 2: {")).split(": ", 1)[1])
    assert row["identical_to_solo"] == "2/2" and row["parted"] == [] and row["tokens"] == 2 * 16


def test_load_table_sends_the_held_out_prompts_then_each_again_under_a_line_of_its_own(monkeypatch):
    """16 clients x 2 requests need 32 prompts; the held-out file has 24. A repeat starts
    with a line of its own, so no prompt cache reuses the first one's prefix."""
    ls = _script_module(monkeypatch, "load_server")
    prompts = ls.table_prompts(["a b", "c d", "e f"], 7)
    assert prompts == ["a b", "c d", "e f", "# request 4\na b", "# request 5\nc d", "# request 6\ne f",
                       "# request 7\na b"]
    assert ls.table_prompts(["a b", "c d", "e f"], 2) == ["a b", "c d"]


def test_load_table_lengths_differ_by_request_and_are_the_same_for_every_server(monkeypatch):
    """``--min-tokens`` draws each request's length between it and ``--max-tokens``,
    seeded by ``--seed`` and the request's index: every server (and the solo check) gets
    the same lengths, and they differ from request to request. Without it all ask for
    ``--max-tokens``."""
    ls = _script_module(monkeypatch, "load_server")
    args = ls.parse_args(["--table", "m.gguf", "--max-tokens", "128", "--min-tokens", "32"])
    lengths = [ls.request_tokens(args, n) for n in range(32)]
    assert lengths == [ls.request_tokens(ls.parse_args(["--table", "m.gguf", "--max-tokens", "128",
                                                        "--min-tokens", "32"]), n) for n in range(32)]
    assert all(32 <= t <= 128 for t in lengths) and len(set(lengths)) > 8
    other = ls.parse_args(["--table", "m.gguf", "--max-tokens", "128", "--min-tokens", "32", "--seed", "1"])
    assert [ls.request_tokens(other, n) for n in range(32)] != lengths
    fixed = ls.parse_args(["--table", "m.gguf", "--max-tokens", "128"])
    assert {ls.request_tokens(fixed, n) for n in range(32)} == {128}


def test_load_counts_each_pass_by_the_labels_its_counters_grew_by(monkeypatch):
    """A pass's batch sizes and depths are the deltas of /metrics' labelled counters:
    what the pass added, not what the server counted since it started."""
    ls = _script_module(monkeypatch, "load_server")
    before = {'pymtp_draft_depth_rounds_total{depth="0"}': 40.0, 'pymtp_draft_depth_rounds_total{depth="4"}': 256.0,
              'pymtp_batch_rounds_total{size="8"}': 30.0}
    after = {'pymtp_draft_depth_rounds_total{depth="0"}': 296.0, 'pymtp_draft_depth_rounds_total{depth="4"}': 256.0,
             'pymtp_draft_depth_rounds_total{depth="10"}': 3.0, 'pymtp_batch_rounds_total{size="8"}': 62.0,
             'pymtp_batch_rounds_total{size="2"}': 5.0, "pymtp_generated_tokens_total": 9.0}
    assert ls.by_label(before, after, "pymtp_draft_depth_rounds_total") == {0: 256, 10: 3}
    assert list(ls.by_label(before, after, "pymtp_draft_depth_rounds_total")) == [0, 10]
    assert ls.by_label(before, after, "pymtp_batch_rounds_total") == {2: 5, 8: 32}


def test_trace_report_counts_decode_rounds_since_the_rows_changed():
    """round_trace/report.py: a decode round after a prompt round or a change of rows is
    1, the next 2, and so on up to 4+; prompt rounds and lone sequences are not decode
    rounds; the round after an idle gap is not timed, and the count goes on across it
    (the GPU keeps its graphs while the loop idles)."""
    spec = importlib.util.spec_from_file_location("trace_report", REPO / "benchmarks" / "round_trace" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)

    def rnd(t, rows, prompt=0, n=8):
        return {"t": t, "n": n, "rows": rows, "prompt": prompt}

    rounds = [rnd(0.000, 8), rnd(0.001, 8), rnd(0.005, 12, prompt=5), rnd(0.009, 8), rnd(0.012, 8),
              rnd(0.013, 8), rnd(0.014, 8), rnd(0.015, 8), rnd(0.018, 7), {"idle": 0.02},
              rnd(0.030, 7), rnd(0.040, 7), rnd(0.041, 1, n=1)]
    line = report.since_change(rounds)[0]
    # 1: 0.009 after the prompt round (4 ms) and 0.018, 7 rows after 8 (3 ms); 2: 0.012
    # (3 ms) and 0.040 (10 ms; 0.030, after the gap, is not timed); 3: 0.013; 4+: 0.001,
    # 0.014 and 0.015 (1 ms each)
    assert line.endswith("1: 2 x 3.50 ms, 2: 2 x 6.50 ms, 3: 1 x 1.00 ms, 4+: 3 x 1.00 ms"), line


@pytest.mark.skipif(not os.environ.get("PYMTP_LLAMA_SERVER"), reason="set PYMTP_LLAMA_SERVER to a llama-server binary")
def test_prefill_times_both_systems_on_the_same_prompt_tokens(tmp_path):
    """benchmarks/prefill.py: pymtp and llama-server read the same held-out prompt into the
    same number of tokens, with the MTP head and without, and each reports a rate."""
    out = tmp_path / "prefill.json"
    _run("prefill.py", str(DEMO), "--llama-server", os.environ["PYMTP_LLAMA_SERVER"], "--threads", "1",
         "--limit", "1", "--json", str(out))
    rep = json.loads(out.read_text())
    assert set(rep) == {f"{s} {k}" for s in ("pymtp", "llama-server") for k in ("no-spec", "mtp")}
    assert len({r["prompt_tokens"] for r in rep.values()}) == 1 and rep["pymtp mtp"]["prompt_tokens"] > 100
    assert all(r["tok_s"] > 0 for r in rep.values())
