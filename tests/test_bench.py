"""``pymtp bench --against-llama-server``: request building, response parsing, the
comparison report (hand-made dicts), the server process lifecycle (a fake server script),
and, when $PYMTP_LLAMA_SERVER names a llama-server binary, the real thing on a fixture."""

from __future__ import annotations

import glob
import json
import os
import signal
import statistics
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from click.testing import CliRunner

from pymtp.bench import (Setting, _interleave, auto_against_fixed, compare, format_comparison,
                         format_table, ratio_interval, run_bench)
from pymtp.cli import main
from pymtp.llama_server import Completion, LlamaServerPool, completion_body, parse_completion, server_command

LLAMA_SERVER = os.environ.get("PYMTP_LLAMA_SERVER")
needs_server = pytest.mark.skipif(not (LLAMA_SERVER and os.path.isfile(LLAMA_SERVER)),
                                  reason="set PYMTP_LLAMA_SERVER to a llama-server binary")
PROMPTS = ["def f(x):", "The quick brown fox"]


def _row(system, spec, k=0, tok_s=100.0, p_min=0.0, **extra):
    label = "no-spec" if spec == "none" else f"mtp k={k}"
    return {"system": system, "setting": label, "spec": spec, "draft_max": k, "p_min": p_min,
            "accept": None, "median_tok_s": tok_s, "speedup": 1.0, "acceptance": 0.5 if spec == "mtp" else None,
            "accepted_per_position": [], "identical_to_nospec": "2/2", "runs": 2, **extra}


# ---------------------------------------------------------------- requests and responses

def test_greedy_body_overrides_server_sampler_defaults():
    b = completion_body([1, 2, 3], max_tokens=16, temperature=0.0, top_k=40, top_p=0.9, min_p=0.1, seed=7)
    assert b["prompt"] == [1, 2, 3] and b["n_predict"] == 16
    assert (b["temperature"], b["top_k"], b["top_p"], b["min_p"]) == (0.0, 1, 1.0, 0.0)
    assert b["cache_prompt"] is False and b["return_tokens"] is True and b["ignore_eos"] is True
    assert b["samplers"] == ["top_k", "top_p", "min_p", "temperature"]


def test_sampled_body_sends_every_filter():
    b = completion_body([5], max_tokens=8, temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=3,
                        ignore_eos=False)
    # 0 / 1.0 / 0.0 must be sent, or llama-server's top_k 40, top_p 0.95, min_p 0.05 apply
    assert (b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seed"]) == (0.7, 0, 1.0, 0.0, 3)
    assert b["repeat_penalty"] == 1.0 and b["dry_multiplier"] == 0.0 and b["ignore_eos"] is False


def test_server_command_mtp_flags_only_with_depth():
    nospec = server_command("bin", "m.gguf", port=8123, threads=2, n_ctx=1024, n_batch=512)
    assert nospec[:7] == ["bin", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "8123"]
    assert "-np" in nospec and nospec[nospec.index("-np") + 1] == "1"
    assert nospec[nospec.index("-c") + 1] == "1024" and nospec[nospec.index("-t") + 1] == "2"
    assert "--spec-type" not in nospec and "--no-repack" not in nospec
    mtp = server_command("bin", "m.gguf", port=1, threads=2, n_ctx=1024, n_batch=512, draft_max=3,
                         p_min=0.5, no_repack=True, extra_args=["-fa", "on"])
    assert " ".join(mtp).endswith("--spec-type draft-mtp --spec-draft-n-max 3 --spec-draft-p-min 0.5 "
                                  "--no-repack -fa on")


def test_parse_completion_reads_tokens_and_draft_timings():
    resp = {"content": "xy", "tokens": [11, 12], "timings": {
        "prompt_n": 5, "predicted_n": 2, "predicted_per_second": 123.5, "draft_n": 4, "draft_n_accepted": 3,
        "prompt_ms": 40.0, "predicted_ms": 16.0}}
    assert parse_completion(resp) == Completion([11, 12], 123.5, 4, 3, 5, 0.056)
    del resp["timings"]["draft_n"], resp["timings"]["draft_n_accepted"]   # no-spec omits them
    assert parse_completion(resp).drafted == 0 and parse_completion(resp).accepted == 0


def test_parse_completion_rejects_incomplete_responses():
    with pytest.raises(ValueError, match="return_tokens"):
        parse_completion({"timings": {"predicted_per_second": 1.0}})
    with pytest.raises(ValueError, match="timings"):
        parse_completion({"tokens": [1]})


# ---------------------------------------------------------------- report building

def test_compare_ratio_per_setting_and_best_against_best():
    rows = [_row("pymtp", "none", tok_s=100.0), _row("pymtp", "mtp", 1, 150.0), _row("pymtp", "mtp", 2, 180.0),
            _row("llama-server", "none", tok_s=80.0, identical_to_pymtp="2/2"),
            _row("llama-server", "mtp", 1, 160.0, identical_to_pymtp="1/2"),
            _row("llama-server", "mtp", 2, 120.0, identical_to_pymtp="2/2")]
    rows[0]["median_request_tok_s"], rows[3]["median_request_tok_s"] = 60.0, 50.0
    c = compare(rows)
    assert [(p["setting"], p["ratio"]) for p in c["per_setting"]] == [
        ("no-spec", 1.25), ("mtp k=1", 0.938), ("mtp k=2", 1.5)]
    # whole requests where both reported them (prompt + decode), else none
    assert [p["request_ratio"] for p in c["per_setting"]] == [1.2, None, None]
    assert c["best_mtp"]["pymtp"]["setting"] == "mtp k=2" and c["best_mtp"]["llama_server"]["setting"] == "mtp k=1"
    assert c["best_mtp"]["ratio"] == 1.125     # 180 tok/s against 160
    assert c["nospec_identical_to_pymtp"] == "2/2"
    text = format_comparison(c)
    assert "best MTP" in text and "180.0 (mtp k=2)" in text and "1.12x" in text
    assert "whole request" in text and "| 1.25x" in text and "| 1.20x" in text
    table = format_table(rows)
    assert table.splitlines()[0].startswith("| system") and "same as pymtp" in table
    assert "| llama-server | mtp k=1" in table


def test_best_mtp_leaves_out_a_row_that_drafted_nothing():
    """An auto row whose requests all ran at depth 0 decoded as no-spec: it is no MTP row to
    set against llama-server's best."""
    rows = [_row("pymtp", "none", tok_s=100.0), _row("pymtp", "mtp", 2, 150.0),
            _row("pymtp", "mtp", "auto", 200.0, acceptance=None, requests_at_depth={0: 2}),
            _row("llama-server", "none", tok_s=90.0), _row("llama-server", "mtp", 2, 120.0)]
    b = compare(rows)["best_mtp"]
    assert b["pymtp"] == {"setting": "mtp k=2", "tok_s": 150.0} and b["ratio"] == 1.25
    rows[1]["acceptance"] = None
    assert compare(rows)["best_mtp"] is None


def test_comparison_names_the_acceptance_rules_above_temperature_0():
    rows = [_row("pymtp", "none"), _row("pymtp", "mtp", 2), _row("llama-server", "none"),
            _row("llama-server", "mtp", 2)]
    assert compare(rows)["accept_rules"] is None
    assert "acceptance rules" not in format_comparison(compare(rows))
    sampled = compare(rows, greedy=False)
    assert "--accept exact" in sampled["accept_rules"] and "rejection sampling" in sampled["accept_rules"]
    assert f'\nacceptance rules: {sampled["accept_rules"]}' in format_comparison(sampled)
    # no MTP row: nothing was accepted by either rule
    assert compare([rows[0], rows[2]], greedy=False)["accept_rules"] is None


def test_warm_up_reads_the_last_prompt_and_the_measured_runs_start_at_the_first(dense_model, monkeypatch):
    """Prompt 0's first measured run must not come right after the same prompt's warm-up."""
    read = []
    generate = dense_model.generate
    monkeypatch.setattr(dense_model, "generate", lambda ids, **kw: read.append(list(ids)) or generate(ids, **kw))
    run_bench(dense_model, PROMPTS, [Setting("none"), Setting("mtp", 1)], max_tokens=2, warmup=1)
    ids = [dense_model.tokenize(p, special=True) for p in PROMPTS]
    assert read == [ids[1], ids[1], ids[0], ids[0], ids[1], ids[1]]


def test_table_without_llama_server_has_no_system_column():
    assert "system" not in format_table([_row("pymtp", "none"), _row("pymtp", "mtp", 1)])


def test_table_says_at_which_depths_auto_ran_its_requests():
    auto = _row("pymtp", "mtp", "auto", requests_at_depth={0: 13, 3: 2, 4: 1})
    text = format_table([_row("pymtp", "none"), _row("pymtp", "mtp", 3, requests_at_depth={3: 16}), auto])
    assert "mtp k=auto: runs by depth k=0: 13, k=3: 2, k=4: 1 (k=0: decoded as no-spec)" in text.splitlines()
    assert "mtp k=3: runs by depth" not in text


def test_auto_is_set_against_the_best_fixed_setting_on_both_clocks():
    """#12's first bar: auto against pymtp's best fixed setting, no-spec included, on the
    decode speed and on whole requests, each with its own best."""
    rows = [_row("pymtp", "none", tok_s=200.0, median_request_tok_s=130.0),
            _row("pymtp", "mtp", 3, 230.0, median_request_tok_s=128.0),
            _row("pymtp", "mtp", "auto", 207.0, median_request_tok_s=127.4),
            _row("llama-server", "mtp", 3, 400.0, median_request_tok_s=300.0)]
    assert auto_against_fixed(rows) == {"decode": {"best_fixed": "mtp k=3", "ratio": 0.9, "interval": None},
                                        "request": {"best_fixed": "no-spec", "ratio": 0.98}}
    assert format_table(rows).splitlines()[-1] == \
        "auto against the best fixed setting: 0.90x (mtp k=3), whole requests 0.98x (no-spec)"
    assert auto_against_fixed(rows[:2]) is None
    assert auto_against_fixed([_row("pymtp", "mtp", "auto")]) is None


def test_auto_running_the_best_settings_own_runs_gets_an_interval_around_one():
    runs = [180.0, 210.0, 195.0, 220.0, 205.0, 190.0, 200.0, 215.0]
    assert ratio_interval(runs, [runs]) == (1.0, 1.0)
    # beside a slower fixed setting nothing changes: the best is picked again in every draw
    assert ratio_interval(runs, [runs, [r * 0.5 for r in runs]]) == (1.0, 1.0)


def test_a_slower_auto_gets_an_interval_below_the_best():
    fixed = [180.0, 210.0, 195.0, 220.0, 205.0, 190.0, 200.0, 215.0]
    lo, hi = ratio_interval([r * 0.8 for r in fixed], [fixed])
    assert lo == hi == 0.8
    # spread between the runs widens it, around the ratio of the medians
    noisy = [r * f for r, f in zip(fixed, (0.7, 1.1, 0.9, 1.2, 0.8, 1.0, 0.95, 1.05))]
    lo, hi = ratio_interval(noisy, [fixed])
    assert lo < 0.99 < hi and hi - lo > 0.05


def test_the_best_of_several_noisy_settings_reads_high():
    """Two fixed settings of one true speed, each with its own noise: the best median of
    the two sits above either, so auto at that speed lands under 1 in most draws."""
    rng = np.random.default_rng(1)
    a, b, auto = (list(200 + 20 * rng.standard_normal(16)) for _ in range(3))
    lo, hi = ratio_interval(auto, [a, b])
    assert lo < 1.0 and (lo + hi) / 2 < 1.0


def test_runs_that_do_not_pair_give_no_interval():
    assert ratio_interval([1.0] * 8, [[1.0] * 7]) is None
    assert ratio_interval([1.0] * 3, [[1.0] * 3]) is None
    assert ratio_interval([1.0] * 8, []) is None


def test_the_table_gives_autos_interval_where_the_runs_pair():
    runs = [180.0, 210.0, 195.0, 220.0, 205.0, 190.0, 200.0, 215.0]
    rows = [_row("pymtp", "none", tok_s=202.5, tok_s_runs=runs),
            _row("pymtp", "mtp", "auto", 162.0, tok_s_runs=[r * 0.8 for r in runs])]
    assert auto_against_fixed(rows)["decode"]["interval"] == (0.8, 0.8)
    assert format_table(rows).splitlines()[-1] == ("auto against the best fixed setting: 0.80x (no-spec) "
                                                   "[95% over resampled prompts: 0.80-0.80], whole requests - (no-spec)")


def test_each_server_cell_follows_its_last_pymtp_twin():
    ours = [("pymtp", Setting("none")), ("pymtp", Setting("mtp", 2, 0.0, "rejection")),
            ("pymtp", Setting("mtp", 2, 0.0, "exact"))]
    theirs = [("llama-server", Setting("none")), ("llama-server", Setting("mtp", 2))]
    assert _interleave(ours, theirs) == [ours[0], theirs[0], ours[1], ours[2], theirs[1]]


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the bench extra (pymtp[bench]), not a test extra")
    from pymtp.bench import plot_depths

    rows = [_row("pymtp", "none"), _row("pymtp", "mtp", 1, 150.0), _row("llama-server", "none", tok_s=90.0),
            _row("llama-server", "mtp", 1, 140.0)]
    plot_depths(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- server lifecycle (fake server)

FAKE_SERVER = textwrap.dedent("""\
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    if "--fail" in argv:
        sys.exit("error: invalid argument --fail")
    port, k = int(argv[argv.index("--port") + 1]), 0
    if "--spec-draft-n-max" in argv:
        k = int(argv[argv.index("--spec-draft-n-max") + 1])
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def reply(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(data)))
            self.end_headers(); self.wfile.write(data)
        def do_GET(self): self.reply({"status": "ok"})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            toks = [t + 1 for t in body["prompt"]][: body["n_predict"]]
            self.reply({"tokens": toks, "timings": {"prompt_n": len(body["prompt"]),
                        "predicted_per_second": 100.0 + k, "draft_n": 2 * k, "draft_n_accepted": k,
                        "prompt_ms": 10.0, "predicted_ms": 30.0}})
    HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


@pytest.fixture
def fake_server(tmp_path):
    path = tmp_path / "fake-llama-server"
    path.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_pool_serves_each_setting_and_kills_servers(fake_server):
    with LlamaServerPool(fake_server, "m.gguf", [(0, 0.0), (2, 0.0), (0, 0.0)], threads=1, n_ctx=64,
                         n_batch=64) as pool:
        assert sorted(pool.servers) == [(0, 0.0), (2, 0.0)]
        procs = [s.proc for s in pool.servers.values()]
        c = pool.complete((2, 0.0), completion_body([1, 2, 3], max_tokens=2))
        assert c == Completion([2, 3], 102.0, 4, 2, 3, 0.04)
        assert "--spec-draft-n-max 2" in pool.commands()["k=2 p_min=0"]
    assert all(p.poll() is not None for p in procs)


def test_pool_reports_a_server_that_dies_at_startup(fake_server):
    pool = LlamaServerPool(fake_server, "m.gguf", [(0, 0.0)], threads=1, n_ctx=64, n_batch=64,
                           extra_args=["--fail"])
    with pytest.raises(RuntimeError, match="invalid argument --fail"), pool:
        pass
    assert pool.servers == {}


def test_run_bench_rotates_both_systems(dense_model, fake_server):
    with LlamaServerPool(fake_server, "m.gguf", [(0, 0.0), (1, 0.0)], threads=1, n_ctx=64, n_batch=64) as pool:
        rows = run_bench(dense_model, PROMPTS, [Setting("none"), Setting("mtp", 1)], max_tokens=4,
                         warmup=0, llama_server=pool)
    assert [(r["system"], r["setting"]) for r in rows] == [
        ("pymtp", "no-spec"), ("pymtp", "mtp k=1"), ("llama-server", "no-spec"), ("llama-server", "mtp k=1")]
    server = rows[2:]
    assert [r["median_tok_s"] for r in server] == [100.0, 101.0] and server[1]["speedup"] == 1.01
    assert server[1]["acceptance"] == 0.5 and server[1]["accepted_per_position"] == []
    assert all(r["identical_to_pymtp"] == "0/2" for r in server)    # the fake echoes prompt + 1
    # whole requests: the fake's 40 ms each; pymtp's own prompt and decode seconds
    lengths = [min(4, len(dense_model.tokenize(p, special=True))) for p in PROMPTS]
    assert server[0]["median_request_tok_s"] == pytest.approx(statistics.median(n / 0.04 for n in lengths))
    assert all(r["median_request_tok_s"] > 0 for r in rows[:2])
    assert "identical_to_pymtp" not in rows[0]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    out = []
    for stat_file in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat_file).read().rsplit(")", 1)[1].split()
        except OSError:
            continue                # gone meanwhile
        if int(fields[1]) == pid:
            out.append(int(stat_file.split("/")[2]))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the bench's servers in Linux's /proc")
def test_a_terminated_bench_stops_its_llama_servers(dense_path, fake_server, tmp_path):
    """SIGTERM (a plain kill, a supervisor) ended the bench at once and left its servers
    running, each holding the whole model, and their log folder; Ctrl-C stopped them."""
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # --reps: a run no machine ends before the signal (500 ended first on the H100, status 0)
    err = tmp_path / "bench.err"      # a file, not a pipe nobody reads: a CUDA build's log filled
    with open(err, "wb") as sink:     # the pipe, and the bench hung writing on its way out
        bench = subprocess.Popen([sys.executable, "-m", "pymtp", "bench", str(dense_path), "--prompts", str(f),
                                  "-n", "64", "--reps", "100000", "-k", "1", "--threads", "1",
                                  "--against-llama-server", fake_server],
                                 env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL, stderr=sink)
    try:
        deadline = time.monotonic() + 120
        while len(servers := _children(bench.pid)) < 2 or not any(tmp.glob("pymtp-llama-server-*/*.log")):
            assert bench.poll() is None and time.monotonic() < deadline, err.read_text(errors="replace")
            time.sleep(0.1)
        time.sleep(1.0)             # the bench is under way
        bench.send_signal(signal.SIGTERM)
        try:
            status = bench.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bench did not end 60 s after SIGTERM; its stderr:\n{err.read_text(errors='replace')[-3000:]}")
    finally:
        if bench.poll() is None:
            bench.kill()
    alive = [pid for pid in servers if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    for pid in alive:               # leave nothing behind, then fail
        os.kill(pid, signal.SIGKILL)
    assert (status, alive, list(tmp.glob("pymtp-llama-server-*"))) == (128 + signal.SIGTERM, [], [])


# ---------------------------------------------------------------- real llama-server

@needs_server
def test_llama_server_greedy_matches_pymtp_token_for_token(dense_model, dense_path):
    with LlamaServerPool(LLAMA_SERVER, dense_path, [(0, 0.0)], threads=2, n_ctx=1024, n_batch=512) as pool:
        for prompt in PROMPTS:
            ids = dense_model.tokenize(prompt, special=True)
            ours = dense_model.generate(ids, max_tokens=16, spec="none", ignore_eos=True).tokens
            for _ in range(2):      # the repeat must process its prompt again: cache_prompt is off
                c = pool.complete((0, 0.0), completion_body(ids, max_tokens=16))
                assert c.tokens == ours and c.prompt_tokens == len(ids) and c.tok_s > 0


@needs_server
def test_a_logit_bias_moves_both_systems_alike(dense_model, dense_path):
    # llama-server puts its logit_bias sampler first in its chain; pymtp's bias comes
    # before its penalties and filters alike: greedy, with and without drafts, the same tokens
    with LlamaServerPool(LLAMA_SERVER, dense_path, [(0, 0.0)], threads=2, n_ctx=1024, n_batch=512) as pool:
        for prompt in PROMPTS:
            ids = dense_model.tokenize(prompt, special=True)
            plain = dense_model.generate(ids, max_tokens=16, spec="none", ignore_eos=True).tokens
            bias = {plain[0]: -100.0, plain[4]: 4.0, plain[6]: -2.5}
            ours = dense_model.generate(ids, max_tokens=16, spec="none", ignore_eos=True, logit_bias=bias).tokens
            assert ours != plain
            assert dense_model.generate(ids, max_tokens=16, draft_max=3, ignore_eos=True, logit_bias=bias).tokens == ours
            body = {**completion_body(ids, max_tokens=16), "logit_bias": [[t, b] for t, b in bias.items()]}
            assert pool.complete((0, 0.0), body).tokens == ours


@needs_server
def test_bench_json_against_llama_server(dense_path, tmp_path):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS))
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "-n", "16", "-k", "2",
                                  "--threads", "2", "--ctx-size", "1024", "--against-llama-server",
                                  LLAMA_SERVER, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [(x["system"], x["setting"]) for x in out["results"]] == [
        ("pymtp", "no-spec"), ("pymtp", "mtp k=2"), ("llama-server", "no-spec"), ("llama-server", "mtp k=2")]
    assert out["comparison"]["nospec_identical_to_pymtp"] == "2/2"
    server_mtp = out["results"][3]
    assert server_mtp["acceptance"] is not None and server_mtp["median_tok_s"] > 0
    assert "--spec-draft-n-max 2" in out["llama_server"]["commands"]["k=2 p_min=0"]
    table = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "-n", "16", "-k", "2",
                                      "--threads", "2", "--ctx-size", "1024", "--against-llama-server", LLAMA_SERVER])
    assert table.exit_code == 0, table.output
    assert "pymtp / llama-server" in table.output and "best MTP" in table.output
    assert "greedy no-spec outputs identical across systems: 2/2 prompts" in table.output
