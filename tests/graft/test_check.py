"""--check: the runtime run behind it, and what the command prints."""

from __future__ import annotations

import subprocess
import sys

import gguf_graft.check
import pytest
from gguf_graft import graft
from gguf_graft.check import CHECK_TOKENS, CheckResult, run_check

from .helpers import needs_llama, run_cli


@needs_llama
def test_a_fitting_block_is_mostly_accepted(fx, tmp_path):
    out = tmp_path / "o.gguf"
    graft(fx(with_mtp=False), fx(), out)
    r = run_check(out, threads=1)  # one thread: a busy 2-core box starves llama.cpp's spinning workers
    assert r.drafted > 0 and r.acceptance_rate > 0.3 and not r.near_zero
    assert r.tokens == CHECK_TOKENS     # the whole run, past any end token


@needs_llama
def test_the_check_runs_past_an_end_token(fx, tmp_path, monkeypatch):
    """A reply that ends at once drafts nothing to judge: the check asks for its tokens
    whatever the model writes (an end token is banned, as llama-server's ignore_eos)."""
    out = tmp_path / "o.gguf"
    graft(fx(with_mtp=False), fx(), out)
    import pymtp

    asked, load = [], pymtp.load

    def spying_load(path, **options):
        model = load(path, **options)
        generate = model.generate
        model.generate = lambda *a, **kw: asked.append(kw) or generate(*a, **kw)
        return model

    monkeypatch.setattr(pymtp, "load", spying_load)
    r = run_check(out, threads=1)
    assert [kw.get("ignore_eos") for kw in asked] == [True] and r.tokens == CHECK_TOKENS


@needs_llama
def test_a_block_from_elsewhere_is_near_zero(fx, tmp_path):
    out = tmp_path / "o.gguf"
    graft(fx(with_mtp=False), fx(mtp_noise=5.0), out)  # an MTP head that mostly disagrees with the trunk
    assert run_check(out, threads=1).near_zero


@pytest.mark.parametrize("rate, failed", [(0.6, False), (0.03, True)])
def test_cli_prints_the_rate_and_fails_near_zero(fx, tmp_path, monkeypatch, rate, failed):
    """A block that does not fit is a failed check: exit status 1 (it was 0 with a
    warning, which a script could not see); OUT stays written."""
    monkeypatch.setattr(gguf_graft.check, "run_check", lambda path: CheckResult(100, int(rate * 100), rate, ""))
    out = tmp_path / "o.gguf"
    result = run_cli(fx(with_mtp=False), fx(), "-o", out, "-q", "--check")
    assert result.exit_code == (1 if failed else 0), result.output
    assert f"acceptance rate {rate:.1%}" in result.output and out.exists()
    assert ("Error: acceptance rate 3.0% is near zero" in result.output) == failed


def test_a_check_that_drafted_nothing_fails(fx, tmp_path, monkeypatch):
    """0 of 0 drafts is no rate: said as such, and a failed check (it printed 0.0%)."""
    monkeypatch.setattr(gguf_graft.check, "run_check", lambda path: CheckResult(0, 0, 0.0, "", 64))
    out = tmp_path / "o.gguf"
    result = run_cli(fx(with_mtp=False), fx(), "-o", out, "-q", "--check")
    assert result.exit_code == 1 and "drafted nothing in 64 tokens" in result.output, result.output
    assert "%" not in result.output and out.exists()


def test_check_without_the_runtime(fx, tmp_path, monkeypatch):
    from gguf_graft.cli import main  # noqa: F401  (before pymtp is hidden: the command's options are pymtp's)

    monkeypatch.setitem(sys.modules, "pymtp", None)
    out = tmp_path / "o.gguf"
    result = run_cli(fx(with_mtp=False), fx(), "-o", out, "-q", "--check")
    assert result.exit_code == 1, result.output
    assert result.output.splitlines()[-1] == (f"Error: {out} was written, but --check could not run it: "
                                              "it needs the pymtp runtime (pip install pymtp)")
    assert out.exists()  # written, just not checked


def test_check_without_llama_cpp_names_it(fx, tmp_path):
    """pymtp installed, llama-cpp-python not importable: the check says that (it blamed
    pymtp, which was there). A fresh interpreter, as pymtp's native layer is loaded here."""
    out = tmp_path / "o.gguf"
    code = "import sys; sys.modules['llama_cpp'] = None; from gguf_graft.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, str(fx(with_mtp=False)), str(fx()), "-o", str(out), "-q",
                        "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"Error: {out} was written, but --check could not run it: pymtp needs llama-cpp-python==0.3.36 "
        "(pip install 'llama-cpp-python==0.3.36'); importing it failed: import of llama_cpp halted; "
        "None in sys.modules"), r.stderr
    assert out.exists()
