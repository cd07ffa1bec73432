"""The pymtp command: real processes and in-process click runs against fixture models."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from conftest import exact_kernels
from pymtp.bench import Setting, format_table, read_prompts, run_bench
from pymtp.cli import main
from pymtp.round_state import RunStats
from pymtp.results import Stats

STATS_KEYS = {"drafted", "accepted", "acceptance_rate", "mean_accept_len", "accepted_per_position",
              "rounds", "tokens_per_second", "prompt_tokens", "depths", "generated_tokens", "decode_seconds",
              "prompt_seconds", "cached_tokens", "prompt_processed"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pymtp.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_json_matches_api(dense_path, dense_model):
    p = _run("generate", str(dense_path), "--prompt", "def f(x):", "-n", "24", "--draft-max", "2",
             "--threads", "2", "--ignore-eos", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)            # exactly one JSON object on stdout
    assert set(out) == {"text", "tokens", "finish_reason", "stats"}
    assert set(out["stats"]) == STATS_KEYS
    api = dense_model.generate("def f(x):", max_tokens=24, draft_max=2, ignore_eos=True)
    assert out["tokens"] == api.tokens and out["text"] == api.text
    assert out["finish_reason"] == api.finish_reason == "length"
    s = out["stats"]
    want = api.stats.to_dict()
    for key in ("drafted", "accepted", "acceptance_rate", "mean_accept_len", "accepted_per_position", "rounds"):
        assert s[key] == want[key], key
    depths = {int(k): n for k, n in s["depths"].items()}
    assert depths == want["depths"] and set(depths) <= {0, 2} and depths[2] == s["rounds"]   # 0: capped by -n
    assert s["prompt_tokens"] == len(dense_model.tokenize("def f(x):"))
    assert len(s["accepted_per_position"]) == 2 and s["rounds"] > 0 and s["tokens_per_second"] > 0
    # the rate can be checked from the counts and times beside it
    assert s["generated_tokens"] == len(out["tokens"]) == 24
    assert s["tokens_per_second"] == pytest.approx(23 / s["decode_seconds"])    # float rounding of one division
    assert s["cached_tokens"] + s["prompt_processed"] == s["prompt_tokens"] and s["prompt_seconds"] > 0


def test_stats_from_counters():
    """Hand-counted: 4 rounds drafting 3, 3, 2, 1 and accepting 3, 1, 0, 1."""
    run = RunStats(prompt_tokens=5, generated=9, drafted=9, accepted=5, rounds=4,
                   drafted_at=[4, 3, 2], accepted_at=[3, 1, 1], t_start=1.0, t_prompt_done=1.5, t_end=3.5)
    s = Stats.from_run(run, spec=True)
    assert s.acceptance_rate == 5 / 9
    assert s.mean_accept_len == 2.25            # 9 tokens emitted (5 accepted + 4) over 4 rounds
    assert s.accepted_per_position == [0.75, 1 / 3, 0.5]
    # the tokens after the first (it came from the prompt's decode) over the decode time
    assert (s.prompt_seconds, s.decode_seconds, s.tokens_per_second) == (0.5, 2.0, 4.0)
    run.t_draft_ready = 2.5       # the drafter's prompt rows ended the prompt phase
    s = Stats.from_run(run, spec=True)
    assert (s.prompt_seconds, s.decode_seconds, s.tokens_per_second) == (1.5, 1.0, 8.0)
    plain = Stats.from_run(run, spec=False)
    assert (plain.rounds, plain.mean_accept_len) == (0, 0.0)


def test_generate_spec_none_zeroes_draft_fields(dense_path):
    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "abc", "-n", "8", "--spec", "none",
                                  "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)["stats"]
    assert (s["drafted"], s["accepted"], s["acceptance_rate"], s["mean_accept_len"], s["rounds"]) == (0, 0, 0.0, 0.0, 0)
    assert s["accepted_per_position"] == []


def test_generate_streams_text(dense_path, dense_model):
    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "abc", "-n", "8", "--ignore-eos"])
    assert r.exit_code == 0
    assert r.output.startswith(dense_model.generate("abc", max_tokens=8, ignore_eos=True).text)
    assert "tok/s" in r.output and "acceptance" in r.output


def test_cli_errors_are_clean(tmp_path, dense_path):
    missing = CliRunner().invoke(main, ["generate", str(tmp_path / "x.gguf"), "-p", "a"])
    assert missing.exit_code == 1 and "model file not found" in missing.output
    bad = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "a", "--p-min", "2"])
    assert bad.exit_code == 2
    assert "Invalid value for '--p-min': p_min must be in [0, 1], got 2.0" in bad.output
    assert "Traceback" not in bad.output


def _before_the_model(tmp_path) -> dict[str, list[str]]:
    """Each command's other required options, for a run that ends before the model loads."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    return {"generate": ["-p", "a"], "serve": ["--port", "1"], "bench": ["--prompts", str(prompts)]}


@pytest.mark.parametrize("command, option, value, message", [
    (command, "--top-p", "2", "top_p must be in (0, 1], got 2.0") for command in ("generate", "serve")] + [
    (command, "--temperature", "-1", "temperature must be finite and >= 0, got -1.0") for command in ("generate", "serve")] + [
    ("generate", "--max-tokens", "0", "give a number of tokens >= 1, or -1 for no limit but the context's end; got 0"),
    ("bench", "--max-tokens", "0", "bench times the tokens after the first (as llama-server does): give 2 or more, got 0"),       # bench checked them after the load
    ("bench", "--top-p", "2", "top_p must be in (0, 1], got 2.0"),
    ("bench", "--temperature", "-1", "temperature must be finite and >= 0, got -1.0"),
    ("bench", "--p-min", "7", "p_min must be in [0, 1]"),
])
def test_option_values_are_refused_before_the_model_loads(tmp_path, command, option, value, message):
    """A wrong value is named at once, not after a load that takes minutes for a large
    model: the model file here does not exist, and the refusal names the option."""
    extra = _before_the_model(tmp_path)[command]
    r = CliRunner().invoke(main, [command, str(tmp_path / "absent.gguf"), option, value, *extra])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}': {message}" in r.output


@pytest.mark.parametrize("command, option, value, message", [
    (command, "--seed", "-5", "a seed is an integer >= 0, or -1 for a fresh one; got -5") for command in ("generate", "serve")] + [
    (command, "--tensor-split", "1,1", "--tensor-split shares the layers between this host and --rpc workers: add --rpc")
    for command in ("generate", "serve")] + [
    (command, "--rpc-timeout", "30", "--rpc-timeout bounds the calls that reach --rpc workers: add --rpc")
    for command in ("generate", "serve", "bench")] + [
    # an infinite share left a worker no layers, or failed as "cannot convert float NaN to integer"
    (command, "--tensor-split", share, "shares must be finite numbers >= 0 with a positive sum")
    for command in ("generate", "serve") for share in ("1,inf", "inf,1", "1e308,1e308")] + [
    ("serve", "--rpc-timeout", "nan", "'nan' is not a finite number"),
    ("serve", "--cache-ram", "inf", "'inf' is not a finite number"),
    ("serve", "--cache-ram", "-1", "-1 (llama-server's no limit) is not taken"),
    ("serve", "--body-timeout", "nan", "'nan' is not a finite number"),       # it answered every body 408 at once
    ("serve", "--shutdown-timeout", "nan", "'nan' is not a finite number"),
    ("bench", "--seed", "-1", "-1 is not in the range x>=0"),      # it said "or None", which no command line types
] + [(command, "--threads", "99999", "99999 is not in the range 1<=x<=512")       # ggml's most; it crashed
     for command in ("generate", "serve", "bench")])
def test_the_commands_name_their_own_options(tmp_path, command, option, value, message):
    """Refusals name the option the user typed, in the command line's terms (it said
    '--prompt-cache-mib', "pass rpc='host:port'", "or None"), with click's exit 2, before
    the model (here absent) loads."""
    extra = _before_the_model(tmp_path)[command]
    r = CliRunner().invoke(main, [command, str(tmp_path / "absent.gguf"), option, value, *extra])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("options, named", [
    (["-k", "3"], "--draft-max"),
    (["--p-min", "0.5", "--accept", "exact"], "--p-min, --accept"),
    (["--draft-kv", "keep"], "--draft-kv"),
    (["--draft-vocab", "100"], "--draft-vocab"),
    (["--prediction", "-"], "--prediction"),      # its drafts: none are made
])
def test_generate_refuses_drafting_options_with_spec_none(tmp_path, options, named):
    """They did nothing, without a word; said before the model (here absent) loads."""
    r = CliRunner().invoke(main, ["generate", str(tmp_path / "absent.gguf"), "-p", "a", "--spec", "none", *options])
    assert r.exit_code == 2, r.output
    assert f"{named} set" in r.output and "--spec none decodes plainly" in r.output


def test_bench_takes_temp_as_generate_and_serve_do(dense_path, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abc"}\n')
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "-n", "4", "-k", "1", "--temp", "0.7",
                                  "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["temperature"] == 0.7


def test_generate_without_a_limit_runs_to_the_contexts_end(dense_path):
    """-n -1 is llama.cpp's "no limit": the reply ends where the context does, 512 tokens
    for --ctx-size 300 (llama.cpp sizes contexts in steps of 256)."""
    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "abc", "-n", "-1", "--ignore-eos", "-c", "300",
                                  "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    # positions 0-511 hold the prompt and every token but the last, which needs no cell
    assert len(out["tokens"]) + out["stats"]["prompt_tokens"] == 513


def test_ctx_size_0_is_the_length_the_model_was_trained_for(dense_path):
    """-c 0, as llama.cpp takes it: the fixture's 4096 trained tokens (it was refused as
    below 16), and -c 5 refused with what it may be."""
    from pymtp.server.cli import _ctx_note

    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "abc", "-n", "-1", "--ignore-eos", "-c", "0",
                                  "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert len(out["tokens"]) + out["stats"]["prompt_tokens"] == 4097
    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "abc", "-c", "5"])
    assert r.exit_code == 2 and ("'-c': 5 is too small: give 16 tokens or more, or 0 for the length the model was "
                                 "trained for") in r.output, r.output
    assert _ctx_note(0, 4096) == " (--ctx-size 0: the length the model was trained for)"
    assert _ctx_note(300, 512) == " (--ctx-size 300 rounded up: llama.cpp sizes contexts in steps of 256)"
    assert _ctx_note(512, 512) == ""


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
@pytest.mark.parametrize("option, value, message", [
    ("--draft-max", "0", "draft_max must be an integer >= 1 (or \"auto\"), got 0"),
    ("--p-min", "-0.5", "p_min must be in [0, 1], got -0.5"),
])
def test_the_commands_refuse_a_value_alike(tmp_path, dense_path, command, option, value, message):
    """One check in the library, the same refusal from every command."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    extra = {"generate": ["-p", "a"], "bench": ["--prompts", str(prompts)], "serve": ["--port", "1"]}[command]
    r = CliRunner().invoke(main, [command, str(dense_path), option, value, "--threads", "1", *extra])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}': {message}" in r.output


def test_default_model_is_embedded():
    p = _run("generate", "--prompt", "import os\n", "-n", "16", "--json", "--threads", "2")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["tokens"]) >= 1 and out["stats"]["drafted"] > 0


def test_bench_rows(dense_model, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "def f(x):"}\n{"prompt": "The quick brown fox"}\n')
    prompts = read_prompts(f)
    assert prompts == ["def f(x):", "The quick brown fox"]
    rows = run_bench(dense_model, prompts, [Setting("none"), Setting("mtp", 1), Setting("mtp", 3)],
                     max_tokens=24, reps=2, warmup=1)
    assert [r["setting"] for r in rows] == ["no-spec", "mtp k=1", "mtp k=3"]
    assert all(r["identical_to_nospec"] == "2/2" for r in rows)
    assert rows[0]["acceptance"] is None and rows[0]["speedup"] == 1.0
    assert 0 < rows[2]["acceptance"] < 1 and len(rows[2]["accepted_per_position"]) == 3
    assert all(r["runs"] == 4 for r in rows)
    table = format_table(rows)
    assert "mtp k=3" in table and "identical" in table


def test_bench_measures_each_p_min_given(dense_path, tmp_path):
    """--p-min repeats like -k: every depth at every cut-off, in the same rotation."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abc"}\n{"prompt": "hello"}\n')
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "-n", "8", "-k", "2",
                                  "--p-min", "0.5", "--p-min", "0", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    assert [(x["setting"], x["p_min"]) for x in rows] == [
        ("no-spec", 0.0), ("mtp k=2", 0.0), ("mtp k=2 p_min=0.5", 0.5)]
    assert all(x["identical_to_nospec"] == "2/2" for x in rows)


@pytest.mark.parametrize("package, command", [("pymtp", "pymtp"), ("gguf_graft", "gguf_graft")])
def test_python_dash_m_runs_the_command(package, command):
    """``python -m pymtp`` is how a venv whose scripts are not on PATH runs it (it had no __main__)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", package, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"Usage: {command} "), r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", package, "--no-such-option"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "No such option '--no-such-option'" in r.stderr, r.stderr


@pytest.mark.parametrize("text", ['{"text": "no prompt field"}\n', '{"prompt": 5}\n', '{"prompt": null}\n',
                                  '[{"x": 1}]', '["ok", ""]', '[]', '[1, ', '{"a": 1}\n{"prompt": ""}', '["ok", 1]',
                                  '[null]', '[["a"]]'])
def test_bench_rejects_bad_prompt_file(tmp_path, text):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    r = CliRunner().invoke(main, ["bench", "--prompts", str(f)])
    assert r.exit_code == 1 and r.output.startswith(f"Error: {f}") and "Traceback" not in r.output, r.output
    assert 'a "prompt" field' in r.output or "holds no prompts" in r.output or "not a JSON list" in r.output


def test_generate_decodes_plainly_on_a_model_without_mtp_unless_asked(nomtp_path):
    """As pymtp serve: the default spec is plain there, with a note; --spec mtp is refused."""
    r = CliRunner().invoke(main, ["generate", str(nomtp_path), "-p", "a", "-n", "4", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert "the model has no MTP block, so requests decode plainly" in r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 4 and json.loads(r.stdout)["stats"]["rounds"] == 0
    for ask in (["--spec", "mtp"], ["-k", "2"], ["--draft-max", "auto"]):     # a depth is for MTP, as in the API
        asked = CliRunner().invoke(main, ["generate", str(nomtp_path), "-p", "a", "-n", "4", *ask])
        assert asked.exit_code == 1 and "has no MTP block" in asked.output, (ask, asked.output)
        assert "decode with --spec none (and no --draft-max)" in asked.output and "Traceback" not in asked.output


def test_bench_on_a_model_without_mtp_says_why_it_cannot(nomtp_path, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n')
    r = CliRunner().invoke(main, ["bench", str(nomtp_path), "--prompts", str(f), "-n", "2", "--threads", "1"])
    assert r.exit_code == 1 and "bench measures MTP against plain decoding" in r.output, r.output
    assert "has no MTP block" in r.output and "gguf_graft" in r.output and "spec" not in r.output


def test_bench_names_a_prompt_too_long_before_any_run(dense_path, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n' + json.dumps({"prompt": "a b " * 400}) + "\n")
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "-n", "2", "-c", "256", "--threads", "1",
                                  "--json"])
    assert r.exit_code == 1 and r.output.startswith(f"Error: {f}: prompt 2 ('a b a b"), r.output
    assert "past the context's 256" in r.output and "bench:" not in r.stderr      # no run started


def test_bench_names_a_prompt_whose_reply_would_pass_the_context(dense_path, tmp_path):
    """A reply cut at the context's end stopped the two systems at different lengths (249
    and 248 tokens), and the table called their outputs different."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n')
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "-n", "300", "-c", "256", "--threads",
                                  "1"])
    assert r.exit_code == 1 and "prompt 1 ('a') has" in r.output and "and 300 more (--max-tokens)" in r.output, r.output
    assert "past the context's 256" in r.output and "bench:" not in r.stderr


@pytest.mark.parametrize("options, hint, says", [
    (["-n", "1"], "'--max-tokens'", "give 2 or more, got 1"),
    (["--temperature", "0", "--accept", "exact"], "'--accept'", "at temperature 0 both rules accept exactly"),
    (["--llama-server-args", "-c 99"], "'--llama-server-args'", "give that too, or drop it"),
    (["--against-llama-server", sys.executable, "--rpc", "127.0.0.1:1"], "'--rpc'", "on this host alone"),
])
def test_bench_refuses_options_that_would_measure_nothing_or_something_else(dense_path, tmp_path, options, hint,
                                                                             says):
    """A review found each of these printed a table: 0.0 tok/s everywhere, a second row
    timing the same work, arguments for no server, a split model against an unsplit one."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n')
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), *options])
    assert r.exit_code == 2 and f"Invalid value for {hint}" in r.output and says in r.output, r.output
    assert "mtp k=" not in r.output


@pytest.mark.parametrize("command, args, says", [
    ("generate", ["-p", "a", "-ngl", "99"], "no such option -ngl (a llama.cpp flag): pymtp puts every layer on the GPU"),
    ("serve", ["-m", "x.gguf"], "no such option -m (a llama.cpp flag): MODEL is positional"),
    ("generate", ["-p", "a", "--n-predict=8"], "no such option --n-predict (a llama.cpp flag): use --max-tokens"),
    ("bench", ["--prompts", "p.jsonl", "--model", "x.gguf"], "MODEL is positional"),
    # each read as a short option of ours and its value: '--threads': 'b' is not a valid integer
    ("generate", ["-p", "a", "-tb", "2"], "no such option -tb (a llama.cpp flag pymtp generate does not take)"),
    ("generate", ["-p", "a", "-np", "2"], "no such option -np (a llama.cpp flag pymtp generate does not take)"),
    ("generate", ["-p", "a", "-ctk", "q8_0"], "no such option -ctk (a llama.cpp flag pymtp generate does not take)"),
    ("serve", ["x.gguf", "-sm", "row"], "no such option -sm (a llama.cpp flag pymtp serve does not take)"),
    ("serve", ["x.gguf", "-n", "64"], "no such option -n (a llama.cpp flag): each request's max_tokens"),
    # what to do instead is the command's: serve has no --max-tokens, generate no --parallel
    ("serve", ["x.gguf", "--n-predict", "64"], "no such option --n-predict (a llama.cpp flag): each request's max_tokens"),
    ("serve", ["x.gguf", "-cb"], "no such option -cb (a llama.cpp flag): batching is always on: --parallel"),
    ("generate", ["-p", "a", "-cb"], "no such option -cb (a llama.cpp flag): pymtp decodes one prompt at a time"),
    # short flags the list lacked: "No such option '-m'", "'--threads': 'd' is not a valid integer range"
    ("serve", ["x.gguf", "-md", "d.gguf"], "no such option -md (a llama.cpp flag): pymtp drafts with the model's own"),
    ("serve", ["x.gguf", "-td", "2"], "no such option -td (a llama.cpp flag pymtp serve does not take)"),
    ("generate", ["-p", "a", "-fit", "off"], "no such option -fit (a llama.cpp flag pymtp generate does not take)"),
    ("serve", ["x.gguf", "--predict", "8"], "no such option --predict (a llama.cpp flag): each request's max_tokens"),
    ("serve", ["x.gguf", "--chat-template-file", "t.jinja"],
     "no such option --chat-template-file (a llama.cpp flag): pymtp renders the GGUF's own chat template"),
])
def test_llama_flags_pymtp_lacks_say_what_to_do(command, args, says):
    """-ngl was read as -n gl: "Invalid value for '--max-tokens': 'gl' is not a valid integer"."""
    r = CliRunner().invoke(main, [command, *args])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output


def test_an_options_value_that_looks_like_a_llama_flag_is_its_value(dense_path, dense_model):
    """``-p -m`` is the prompt "-m" (it was refused as llama.cpp's model flag)."""
    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "-m", "-n", "3", "--json", "--threads", "1"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["stats"]["prompt_tokens"] == len(dense_model.tokenize("-m"))
    assert out["tokens"] == dense_model.generate("-m", max_tokens=3).tokens
    assert out["finish_reason"] == "length"


@pytest.mark.parametrize("as_json", [False, True])
def test_a_full_disk_behind_stdout_is_one_line(dense_path, as_json):
    """/dev/full took a traceback from click.echo."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system (Linux has it)")
    cmd = [sys.executable, "-m", "pymtp.cli", "generate", str(dense_path), "-p", "a", "-n", "3", "--threads", "1"]
    with open("/dev/full", "w") as full:
        r = subprocess.run(cmd + (["--json"] if as_json else []), stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=300)
    assert r.returncode == 1
    assert "Error: could not write to standard output: No space left on device" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("module, args", [("pymtp", ["--help"]), ("pymtp", ["generate", "-h"]),
                                          ("pymtp", ["--version"]), ("gguf_graft", ["--help"])])
def test_help_to_a_full_disk_is_one_line(module, args):
    """Help and version text are the commands' output too: /dev/full took a traceback."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system (Linux has it)")
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-c", f"from {module}.cli import main; main()", *args], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (1, "Error: could not write to standard output: No space left on device\n")


def test_without_llama_cpp_help_answers_and_a_command_says_so_in_one_line():
    """llama-cpp-python not importable: ``--help`` and ``--version`` answer (serve's options
    imported the native layer, so every invocation was a 20-line traceback of imports); a
    command that needs it is one "Error:" line naming the pin, status 1."""
    import socket

    code = "import sys; sys.modules['llama_cpp'] = None; from pymtp.cli import main; main(prog_name='pymtp')"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)

    for args in (["--help"], ["--version"], ["generate", "--help"], ["serve", "--help"], ["bench", "--help"]):
        r = run(*args)
        assert (r.returncode, r.stderr) == (0, ""), (args, r.stderr)
        assert r.stdout.startswith("Usage: pymtp" if args != ["--version"] else "pymtp, version"), r.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    for args in (["generate", "-p", "hi"], ["serve", "--port", port]):
        r = run(*args)
        assert (r.returncode, r.stderr) == (1, "Error: pymtp needs llama-cpp-python==0.3.36 (pip install "
                                                "'llama-cpp-python==0.3.36'); importing it failed: import of "
                                                "llama_cpp halted; None in sys.modules\n"), (args, r.stderr)


def test_another_llama_cpp_python_than_the_pin_is_named_at_import():
    """One installed with --no-deps or upgraded since: pymtp's ctypes calls assume the pin's
    C API, so a mismatch failed later in ways that named nothing."""
    code = "import llama_cpp; llama_cpp.__version__ = '0.3.99'; import pymtp.native"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ("RuntimeWarning: pymtp is built against llama-cpp-python 0.3.36 but found 0.3.99: its C API may "
            "differ (pip install 'llama-cpp-python==0.3.36')") in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", "import pymtp.native"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "RuntimeWarning" not in r.stderr, r.stderr


def test_version_needs_no_install_record(monkeypatch):
    """--version from a source checkout (no install record, as on the GPU routine's machine)
    raised click's RuntimeError; it is the pyproject's version either way."""
    import importlib.metadata
    import re

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), encoding="utf-8") as f:
        # the [project] table's version line (tomllib is Python 3.11's; pymtp runs on 3.10)
        version = re.search(r'^version = "([^"]+)"$', f.read(), re.M).group(1)
    r = CliRunner().invoke(main, ["--version"])
    assert (r.exit_code, r.output) == (0, f"pymtp, version {version}\n"), r.output


def test_llama_short_flags_pymtp_takes(dense_path, monkeypatch):
    """-c (--ctx-size), -s (--seed) and, on serve, -fa (--flash-attn), as llama.cpp spells them."""
    import socket

    import pymtp.server.drain as drain

    long = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "a", "-n", "6", "--json", "--threads", "1",
                                     "--temperature", "0.9", "--ctx-size", "300", "--seed", "5"])
    short = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "a", "-n", "6", "--json", "--threads", "1",
                                      "--temperature", "0.9", "-c", "300", "-s", "5"])
    assert long.exit_code == short.exit_code == 0
    assert json.loads(long.stdout)["tokens"] == json.loads(short.stdout)["tokens"]
    seen = {}
    monkeypatch.setattr(drain, "serve_app", lambda app, **kw: seen.setdefault("fa", app.state.service.model.flash_attn))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--port", str(port), "--threads", "1", "-fa", "on"])
    assert r.exit_code == 0 and seen == {"fa": "on"}, r.output


def test_draft_max_takes_auto_as_help_prints_it():
    from pymtp.clitypes import DRAFT_MAX

    assert [DRAFT_MAX.convert(v, None, None) for v in ("AUTO", "Auto", "auto", "3")] == ["auto", "auto", "auto", 3]


def test_a_model_path_that_is_no_model_file_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    """An empty MODEL was "Invalid value for '--path'", a folder click's bare "is a
    directory", a 0-byte file (a failed download) was told to convert its checkpoint, and a
    model in a folder this user cannot enter a PermissionError traceback."""
    from pathlib import Path

    (tmp_path / "empty.gguf").write_bytes(b"")
    locked = tmp_path / "locked" / "m.gguf"
    real_stat = Path.stat

    def stat(self, *args, **kwargs):
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    for command in (["generate", "-p", "x"], ["serve"]):
        for model, code, says in (("", 2, "Invalid value for 'MODEL': path is empty"),
                                  (str(tmp_path), 1, f"{str(tmp_path)!r} is a directory; pass the path of a .gguf"),
                                  (str(tmp_path / "empty.gguf"), 1, "is empty (0 bytes); download or convert it again"),
                                  (str(locked), 1, f"cannot read {str(locked)!r}: Permission denied")):
            r = CliRunner().invoke(main, [command[0], model, *command[1:]])
            assert r.exit_code == code and says in r.output and "Traceback" not in r.output, (command, r.output)


def test_bench_names_a_prompt_file_that_is_not_utf8(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "a\xff"}\n')
    r = CliRunner().invoke(main, ["bench", "--prompts", str(f)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.startswith(f"Error: {f}: not UTF-8 text (byte 0xff at offset 13)"), r.output


def test_bench_refuses_what_it_cannot_finish_before_the_runs(dense_path, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abc"}\n')
    not_exe = tmp_path / "llama-server"
    not_exe.write_text("")
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "--against-llama-server", str(not_exe)])
    assert r.exit_code == 1 and "not an executable file" in r.output, r.output
    if importlib.util.find_spec("matplotlib") is None:     # the check runs before any run is measured
        r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "--plot", str(tmp_path / "x.png")])
        assert r.exit_code == 1 and "--plot needs matplotlib" in r.output and "mtp k=" not in r.output


@pytest.mark.parametrize("plot", ["nowhere/x.png", "x.pngg"])
def test_bench_checks_the_plot_path_and_server_args_before_loading(dense_path, tmp_path, plot):
    """A plot path matplotlib would fail to write (no such folder, a format it lacks), and
    --llama-server-args with an open quote, are refused before the model loads: they
    raised after every run (the plot) or after loading (the quote), with a traceback."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abc"}\n')
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "--plot", str(tmp_path / plot)])
    if plot == "x.pngg" and importlib.util.find_spec("matplotlib") is None:     # which formats, matplotlib says
        assert r.exit_code == 1 and "--plot needs matplotlib" in r.output, r.output
    else:
        assert r.exit_code == 2 and "Invalid value for '--plot'" in r.output and "mtp k=" not in r.output, r.output
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "--against-llama-server", sys.executable,
                                  "--llama-server-args", '-c "open'])
    assert r.exit_code == 2 and "'--llama-server-args'" in r.output and "No closing quotation" in r.output, r.output


@pytest.mark.parametrize("as_json", [False, True])
def test_bench_prints_its_results_and_fails_when_the_plot_cannot_be_written(dense_path, tmp_path, monkeypatch,
                                                                          as_json):
    """A full disk at the plot (made up here: matplotlib is no test extra): the measured
    results still print, and the exit status is 1, so a script that asked for the plot
    sees it missing (it was a warning and status 0)."""
    import pymtp.bench

    def full_disk(rows, path, title):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pymtp.cli._check_plot_file", lambda path: None)
    monkeypatch.setattr(pymtp.bench, "plot_depths", full_disk)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abc"}\n')
    r = CliRunner().invoke(main, ["bench", str(dense_path), "--prompts", str(f), "-n", "4", "-k", "1", "--threads", "1",
                                  "--plot", str(tmp_path / "x.png"), *(["--json"] if as_json else [])])
    assert r.exit_code == 1, r.output
    assert f"Error: no plot written to {tmp_path / 'x.png'}: [Errno 28] No space left on device" in r.output
    printed = r.output[:r.output.index("Error: no plot")]
    if as_json:
        assert len(json.loads(printed)["results"]) == 2       # no-spec and k=1
    else:
        assert "mtp k=1" in printed and "identity:" in printed


def test_generate_says_in_one_line_when_the_context_does_not_fit(dense_path, monkeypatch):
    """The contexts are made at the first generation: llama.cpp refusing one (a --ctx-size
    this host has no memory for; made up here, as a real one takes a minute to fail) was
    a NativeError traceback."""
    from pymtp.native import NativeContext, NativeError

    def no_memory(*a, **k):
        raise NativeError("llama.cpp could not create the target context (failed to allocate buffer for kv cache)")

    monkeypatch.setattr(NativeContext, "__init__", no_memory)
    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "hi", "-n", "2"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith("Error: llama.cpp could not create") and "a smaller --ctx-size" in r.output, r.output


def test_serve_refuses_what_it_cannot_do_before_loading(tmp_path, nomtp_path):
    """A host that does not resolve and a port in use are refused before the model loads
    (uvicorn said so after it, in its own words); --calibrate on a model without MTP is
    refused (it was ignored)."""
    import socket

    r = CliRunner().invoke(main, ["serve", "--host", "nonexistent.invalid", "--port", "18099"])
    assert r.exit_code == 2 and "Invalid value for '--host'" in r.output, r.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(main, ["serve", "--port", str(port)])
    assert r.exit_code == 2 and f"port {port} on 127.0.0.1 is in use" in r.output, r.output
    r = CliRunner().invoke(main, ["serve", str(nomtp_path), "--calibrate", "--port", str(port)])    # free again
    assert r.exit_code == 2 and "--calibrate searches the MTP head's depths" in r.output, r.output


def test_the_listen_check_takes_what_uvicorn_takes():
    """The check before loading refuses no address uvicorn would serve on: --host ""
    (every interface) and "::" while an IPv4 program holds the port (asyncio binds IPv6
    sockets for IPv6 alone)."""
    import socket

    import click

    from pymtp.server.cli import _check_listen

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(click.BadParameter, match=f"port {port} on 0.0.0.0 is in use"):
            _check_listen("0.0.0.0", port)
        if socket.has_ipv6:
            _check_listen("::", port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    _check_listen("", free)


def test_the_listen_check_skips_a_family_the_kernel_lacks(monkeypatch):
    """A host whose kernel has IPv6 off: "" resolves to "::" too, whose socket cannot be
    made; asyncio skips that family and serves IPv4, and so does the check."""
    import socket

    from pymtp.server.cli import _check_listen

    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *a, **k):
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real(family, *a, **k)

    with real() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setattr(socket, "socket", no_ipv6)
    _check_listen("", free)


def test_serve_says_in_one_line_when_the_slots_do_not_fit(dense_path, monkeypatch):
    """The server's engines are made after the model loads: llama.cpp refusing their
    contexts (made up here) was a NativeError traceback."""
    import socket

    from pymtp.native import NativeContext, NativeError

    def no_memory(*a, **k):
        raise NativeError("llama.cpp could not create the target context (failed to allocate buffer for kv cache)")

    monkeypatch.setattr(NativeContext, "__init__", no_memory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--port", str(port), "--parallel", "2"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith("Error: llama.cpp could not create") and "--parallel needs less memory" in r.output


@pytest.mark.parametrize("options, file, kept", [
    (["--api-key", ""], None, ()),           # `--api-key "$UNSET"` turned authentication on with an empty key
    (["--api-key", "k1"], None, ("k1",)),
    (["--api-key", "k1, k2,"], None, ("k1", "k2")),      # llama-server's comma-separated keys
    (["--api-key", "k1"], "# ours\nk3\n\nk1\n", ("k1", "k3")),
    ([], "k4\n", ("k4",)),
])
def test_serve_reads_api_keys_as_llama_server(dense_path, tmp_path, monkeypatch, options, file, kept):
    import socket

    import pymtp.server.drain as drain

    seen = {}
    monkeypatch.setattr(drain, "serve_app", lambda app, **kw: seen.setdefault("keys", app.state.service.settings.api_keys))
    if file is not None:
        (tmp_path / "keys").write_text(file)
        options = [*options, "--api-key-file", str(tmp_path / "keys")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--port", str(port), "--threads", "1", *options])
    assert r.exit_code == 0, r.output
    assert seen == {"keys": kept}


def _served(dense_path, monkeypatch, options, env=None):
    """The Service ``pymtp serve`` would serve with ``options`` and environment ``env``."""
    import socket

    import pymtp.server.drain as drain

    seen = {}
    monkeypatch.setattr(drain, "serve_app", lambda app, **kw: seen.setdefault("service", app.state.service))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--threads", "1", "--port", str(port), *options], env=env)
    assert r.exit_code == 0, r.output
    return seen["service"]


def test_serve_takes_every_repeated_key_option_as_llama_server(dense_path, tmp_path, monkeypatch):
    """Only the last --api-key and --api-key-file were kept: clients holding the others were locked out."""
    (tmp_path / "f1").write_text("k3\n")
    (tmp_path / "f2").write_text("k4\n")
    service = _served(dense_path, monkeypatch, ["--api-key", "k1", "--api-key", "k2,k5", "--api-key-file",
                                                str(tmp_path / "f1"), "--api-key-file", str(tmp_path / "f2")])
    assert service.settings.api_keys == ("k1", "k2", "k5", "k3", "k4")
    (tmp_path / "f3").write_text("# none\n")
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--port", "1", "--api-key-file", str(tmp_path / "f1"),
                                  "--api-key-file", str(tmp_path / "f3")])
    assert r.exit_code == 2 and "f3 holds no key" in r.output, r.output


def test_serve_reads_llama_servers_environment_variables(dense_path, tmp_path, monkeypatch):
    """A deployment moved over from llama-server: LLAMA_API_KEY was ignored (the server ran
    open), and so were its LLAMA_ARG_* settings."""
    (tmp_path / "keys").write_text("k9\n")
    env = {"LLAMA_API_KEY": "k7,k8", "LLAMA_ARG_API_KEY_FILE": str(tmp_path / "keys"), "LLAMA_ARG_N_PARALLEL": "2",
           "LLAMA_ARG_CTX_SIZE": "512", "LLAMA_ARG_ALIAS": "alpha, beta", "LLAMA_ARG_TEMPERATURE": "0.5",
           "LLAMA_ARG_TOP_K": "7", "LLAMA_ARG_SPEC_DRAFT_N_MAX": "2", "LLAMA_ARG_ENDPOINT_SLOTS": "0",
           "LLAMA_ARG_CORS_ORIGINS": "localhost"}
    service = _served(dense_path, monkeypatch, [], env)
    s = service.settings
    assert s.api_keys == ("k7", "k8", "k9") and s.parallel == 2 and service.model.n_ctx == 512
    assert service.model_id == "alpha" and {"alpha", "beta"} <= service.names
    assert (s.decode.temperature, s.decode.top_k, s.decode.draft_max) == (0.5, 7, 2)
    assert s.slots_endpoint is False and s.cors_origins != ("*",)
    # a flag wins over its variable, as llama-server's; pymtp's own variable over llama-server's
    s = _served(dense_path, monkeypatch, ["--parallel", "1", "--api-key", "k1", "--top-k", "3"], env).settings
    assert (s.parallel, s.api_keys[:1], s.decode.top_k) == (1, ("k1",), 3)
    assert _served(dense_path, monkeypatch, [], {"PYMTP_API_KEY": "p", "LLAMA_API_KEY": "l"}).settings.api_keys == ("p",)
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--port", "1"], env={"LLAMA_ARG_N_PARALLEL": "two"})
    assert r.exit_code == 2 and "--parallel" in r.output and "LLAMA_ARG_N_PARALLEL" in r.output, r.output
    # --reasoning-format's variable was not read; llama-server's short names and its flags
    # for what pymtp always does were "No such option"
    assert _served(dense_path, monkeypatch, [], {"LLAMA_ARG_THINK": "none"}).settings.reasoning_format == "none"
    service = _served(dense_path, monkeypatch, ["-a", "gamma", "-cram", "64", "--jinja", "--metrics"], {})
    assert service.model_id == "gamma"
    # a variable of an option pymtp lacks was ignored: LLAMA_ARG_N_PREDICT=8 ran replies to
    # the end of the context
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--port", "1"], env={"LLAMA_ARG_N_PREDICT": "8"})
    assert r.exit_code == 2 and "LLAMA_ARG_N_PREDICT is set: llama-server's -n, which pymtp serve does not take" \
        in r.output, r.output


def test_serve_alias_takes_more_names_as_llama_server(dense_path, monkeypatch):
    service = _served(dense_path, monkeypatch, ["--alias", "alpha, beta"])
    assert service.model_id == "alpha" and service.card()["id"] == "alpha"
    assert {"alpha", "beta"} <= set(service.card()["aliases"]) and "alpha, beta" not in service.names
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--port", "1", "--alias", "alpha,,beta"])
    assert r.exit_code == 2 and "has an empty name" in r.output and "--alias" in r.output, r.output


def test_serve_refuses_a_key_file_without_keys(dense_path, tmp_path):
    """An empty or commented-out key file would have served without a key."""
    (tmp_path / "keys").write_text("# none yet\n\n")
    r = CliRunner().invoke(main, ["serve", str(dense_path), "--port", "1", "--api-key-file", str(tmp_path / "keys")])
    assert r.exit_code == 2 and "holds no key (one a line; # starts a comment)" in r.output, r.output


def test_generate_takes_penalties(dense_path, dense_model):
    pen = ["--repeat-penalty", "1.5", "--frequency-penalty", "1.0", "--presence-penalty", "1.5",
           "--repeat-last-n", "16"]
    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "abc", "-n", "24", "--ignore-eos", "--json",
                                  "--threads", "1", *pen])
    assert r.exit_code == 0, r.output
    api = dense_model.generate("abc", max_tokens=24, ignore_eos=True, repeat_penalty=1.5, frequency_penalty=1.0,
                               presence_penalty=1.5, repeat_last_n=16)
    assert json.loads(r.output)["tokens"] == api.tokens
    assert api.tokens != dense_model.generate("abc", max_tokens=24, ignore_eos=True).tokens
    bad = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "a", "--repeat-last-n", "-3"])
    assert bad.exit_code == 2
    assert "Invalid value for '--repeat-last-n': repeat_last_n must be an integer >= -1" in bad.output


def test_generate_takes_a_logit_bias_as_llama_cpps_option(dense_path, dense_model):
    plain = dense_model.generate("abc", max_tokens=16, ignore_eos=True).tokens
    r = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "abc", "-n", "16", "--ignore-eos", "--json",
                                  "--threads", "1", "-l", f"{plain[0]}-inf", "--logit-bias", f"{plain[3]}+1.5",
                                  "-l", f"{plain[3]}+1.5"])
    assert r.exit_code == 0, r.output
    api = dense_model.generate("abc", max_tokens=16, ignore_eos=True,
                               logit_bias={plain[0]: float("-inf"), plain[3]: 3.0})     # repeats add up
    assert json.loads(r.output)["tokens"] == api.tokens and api.tokens[0] != plain[0]
    bad = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "a", "-l", "12=3"])
    assert bad.exit_code == 2
    assert "'12=3' is not TOKEN_ID+BIAS or TOKEN_ID-BIAS" in bad.output
    far = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "a", "-l", "99999999+1"])
    assert far.exit_code == 2 and "Invalid value for '--logit-bias': logit_bias names token 99999999" in far.output
    # each option is checked as given; a token's add up within that range (-120 was refused)
    big = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "a", "-l", "12-150"])
    assert big.exit_code == 2 and "'12-150': a bias must be in [-100, 100], or -inf to ban the token" in big.output
    two = CliRunner().invoke(main, ["generate", str(dense_path), "-p", "abc", "-n", "16", "--ignore-eos", "--json",
                                    "--threads", "1", "-l", f"{plain[0]}-60", "-l", f"{plain[0]}-60"])
    assert two.exit_code == 0, two.output
    api = dense_model.generate("abc", max_tokens=16, ignore_eos=True, logit_bias={plain[0]: -100.0})
    assert json.loads(two.output)["tokens"] == api.tokens


def test_generate_takes_a_prediction_file(tmp_path, dense_path, dense_model):
    """--prediction FILE: the output is the run's without it, and its drafts are counted."""
    kw = dict(max_tokens=24, draft_max=3, ignore_eos=True)
    plain = dense_model.generate("def f(x):", **kw)
    path = tmp_path / "prediction.txt"
    path.write_text(plain.text, encoding="utf-8")
    args = ["generate", str(dense_path), "-p", "def f(x):", "-n", "24", "-k", "3", "--ignore-eos",
            "--prediction", str(path)]
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    api = dense_model.generate("def f(x):", prediction=plain.text, **kw)
    assert out["tokens"] == api.tokens
    if exact_kernels():       # on a GPU MTP output can part from plain decoding at a near-tie (conftest)
        assert api.tokens == plain.tokens
    assert (out["stats"]["predicted_drafted"], out["stats"]["predicted_accepted"]) == \
        (api.stats.predicted_drafted, api.stats.predicted_accepted)
    assert out["stats"]["predicted_accepted"] > 0
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert f"prediction: {api.stats.predicted_accepted} of {api.stats.predicted_drafted} drafts kept" in r.output
    # the head's acceptance where it drafted: with the prediction's drafts only, it read
    # "acceptance 0.00, 0.00 tokens/round"
    assert ("acceptance" in r.output) == (api.stats.rounds > 0), (r.output, api.stats)
    bad = CliRunner().invoke(main, [*args[:-1], str(tmp_path / "missing.txt")])
    assert bad.exit_code == 2 and "missing.txt" in bad.output
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    bad = CliRunner().invoke(main, [*args[:-1], str(tmp_path / "latin1.txt")])
    assert bad.exit_code == 2 and "latin1.txt is not UTF-8 text" in bad.output, bad.output


def test_generate_reads_its_prompt_from_a_file_or_stdin(tmp_path, dense_path, dense_model):
    """--file / -f, as llama.cpp's: a prompt from a pipe needed -p "$(cat f)", and -p - was
    the text "-"."""
    prompt = "def f(x):\n    return"
    api = dense_model.generate(prompt, max_tokens=8, ignore_eos=True)
    path = tmp_path / "prompt.txt"
    path.write_text(prompt, encoding="utf-8")
    base = ["generate", str(dense_path), "-n", "8", "--ignore-eos", "--json", "--threads", "1"]
    for args, stdin in ((["--file", str(path)], None), (["-f", "-"], prompt)):
        r = CliRunner().invoke(main, [*base, *args], input=stdin)
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["tokens"] == api.tokens
    for args in ([], ["-p", "x", "-f", str(path)]):
        r = CliRunner().invoke(main, [*base, *args])
        assert r.exit_code == 2 and "give the prompt as --prompt TEXT or --file FILE" in r.output, r.output
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    r = CliRunner().invoke(main, [*base, "-f", str(tmp_path / "latin1.txt")])
    assert r.exit_code == 2 and "latin1.txt is not UTF-8 text" in r.output, r.output


@pytest.mark.parametrize("cmd", ["generate", "bench"])
@pytest.mark.parametrize("k, words", [("0", "draft_max must be"), ("-2", "draft_max must be"),
                                      ("600", "draft_max must be at most 510")])
def test_a_depth_no_run_can_take_is_refused_before_loading(tmp_path, cmd, k, words):
    """-k 0 passed the check before the load (read as plain decoding) and was refused once
    the model had loaded; -k 600 was refused after it, naming n_batch and draft_limit,
    options these commands do not have. A file that is not there shows the order."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abc"}\n')
    args = ["-p", "hi"] if cmd == "generate" else ["--prompts", str(f)]
    r = CliRunner().invoke(main, [cmd, str(tmp_path / "none.gguf"), *args, "-k", k])
    assert r.exit_code == 2 and words in r.output and "not found" not in r.output, r.output


@pytest.mark.parametrize("cmd", ["generate", "bench", "serve"])
def test_a_depth_the_context_cannot_batch_is_refused_before_loading(tmp_path, cmd):
    """llama.cpp caps a batch at the context: -k 15 -c 16 aborted the process in its first
    round (a GGML_ASSERT and a gdb backtrace), as the check knew only n_batch's 512."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abc"}\n')
    args = {"generate": ["-p", "hi"], "bench": ["--prompts", str(f)], "serve": []}[cmd]
    r = CliRunner().invoke(main, [cmd, str(tmp_path / "none.gguf"), *args, "-k", "15", "-c", "16"])
    assert r.exit_code == 2 and "not found" not in r.output, r.output
    assert "draft_max must be at most 14 (one verify batch holds draft_max + 2 tokens, and llama.cpp caps a " \
           "batch at the context's 16), got 15" in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("args", [["-h"], ["generate", "-h"], ["bench", "-h"], ["serve", "-h"]])
def test_h_is_help_as_in_llama_cpps_tools(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and r.output.startswith("Usage: "), r.output


def test_every_option_says_what_it_does_and_help_lists_commands_whole():
    """Options printed with no text and command summaries cut at "..." left users to guess."""
    import click
    bare = [(name, p.opts[0]) for name, command in main.commands.items() for p in command.params
            if isinstance(p, click.Option) and not p.hidden and not p.help]
    assert bare == []
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "..." not in r.output.partition("Commands:")[2], r.output
    assert {"bench", "generate", "serve"} <= set(main.commands)


def test_ctrl_c_exits_130_as_a_shells_interrupt(dense_path):
    """click's "Aborted!" exited 1, which a script reads as a failure (gguf_graft and
    llama.cpp's tools exit 130)."""
    p = subprocess.Popen([sys.executable, "-m", "pymtp.cli", "generate", str(dense_path), "-p", "abc", "-n", "-1",
                          "--ignore-eos", "-c", "100000", "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "OMP_NUM_THREADS": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.read(1)          # generating
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert b"interrupted" in err and b"Traceback" not in err and b"Aborted" not in err


def test_a_closed_standard_output_is_no_traceback(dense_path):
    """``pymtp generate ... >&-``: nothing to write the text to; the run still ends cleanly."""
    r = subprocess.run([sys.executable, "-m", "pymtp.cli", "generate", str(dense_path), "-p", "abc", "-n", "4", "-t", "1"],
                       stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1), timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("[4 tokens"), r.stderr
