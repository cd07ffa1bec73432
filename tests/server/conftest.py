"""Fixtures for the server tests: in-process apps on the dense fixture, and real
``pymtp serve`` processes on loopback ports (always killed at teardown)."""

from __future__ import annotations

import pytest

from .helpers import app_client, live_server


@pytest.fixture(scope="module")
def client(dense_model):
    with app_client(dense_model) as c:
        yield c


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """The embedded demo model (no chat template), 4 slots."""
    with live_server(["--parallel", "4", "--ctx-size", "512", "--threads", "1"],
                     tmp_path_factory.mktemp("demo-server")) as s:
        yield s


@pytest.fixture(scope="session")
def dense_server(dense_path, tmp_path_factory):
    """The dense fixture (it has a ChatML template), 2 slots."""
    with live_server([str(dense_path), "--parallel", "2", "--ctx-size", "512", "--threads", "1"],
                     tmp_path_factory.mktemp("dense-server")) as s:
        yield s
