"""The GPU routine's test slices (conftest.deal, PYMTP_TEST_SLICE): every file runs in
exactly one slice, and the slices stay balanced."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, SECONDS_PER_TEST, SLOW_FILES, deal, weight


def test_deal_covers_every_file_once_and_balances():
    sizes = {"a": 40, "b": 30, "c": 20, "d": 10, "e": 10, "f": 5}
    slices = deal(sizes, 3)
    assert sorted(k for s in slices for k in s) == sorted(sizes)
    assert [sum(sizes[k] for k in s) for s in slices] == [40, 40, 35]
    assert slices[0] == {"a"} and slices[1] == {"b", "e"} and slices[2] == {"c", "d", "f"}


def test_more_slices_than_files_leaves_some_empty():
    assert deal({"a": 3}, 2) == [{"a"}, set()]


def _collected(spec: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYMTP_TEST_SLICE"}
    if spec is not None:
        env["PYMTP_TEST_SLICE"] = spec
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                           "tests/test_slices.py", "tests/test_acceptance.py"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def test_slices_of_a_run_partition_its_tests():
    ids = lambda p: {ln for ln in p.stdout.splitlines() if "::" in ln}   # noqa: E731
    whole, first, second = ids(_collected(None)), ids(_collected("0/2")), ids(_collected("1/2"))
    assert whole and first and second and not first & second and first | second == whole


def test_a_bad_slice_is_a_usage_error_naming_the_variable():
    p = _collected("2/2")
    assert p.returncode == 4 and "PYMTP_TEST_SLICE='2/2': need 0 <= i < n" in p.stdout + p.stderr


def test_slow_files_weigh_their_measured_seconds():
    assert weight(REPO / "tests" / "test_stochastic.py", 27) == SLOW_FILES["test_stochastic.py"]
    assert weight(REPO / "tests" / "server" / "test_soak.py", 3) == SLOW_FILES["server/test_soak.py"]
    assert weight(REPO / "tests" / "test_depth.py", 10) == 10 * SECONDS_PER_TEST
    for name in SLOW_FILES:                      # the table names files that exist
        assert (REPO / "tests" / name).is_file(), name
