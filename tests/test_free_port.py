"""free_port: a port the kernel says is free, and never one another caller was just given
(parallel test slices start servers that bind seconds after choosing their port)."""

from __future__ import annotations

import os
import time

from pymtp.testing import processes
from pymtp.testing.processes import free_port


class _Kernel:
    """A socket stand-in whose bind(0) hands out the given ports in turn."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = iter(ports)

    def __call__(self):
        kernel = self

        class Sock:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def bind(self, addr):
                self.port = next(kernel.ports)

            def getsockname(self):
                return ("127.0.0.1", self.port)

        return Sock()


def test_a_port_given_to_one_caller_is_not_given_to_the_next(monkeypatch, tmp_path):
    monkeypatch.setattr(processes, "RESERVED_PORTS", tmp_path / "ports")
    monkeypatch.setattr(processes.socket, "socket", _Kernel([40001, 40001, 40001, 40002]))
    assert free_port() == 40001
    assert free_port() == 40002        # the kernel offered 40001 twice more: passed over
    assert sorted(p.name for p in (tmp_path / "ports").iterdir()) == ["40001", "40002"]


def test_a_reservation_expires(monkeypatch, tmp_path):
    monkeypatch.setattr(processes, "RESERVED_PORTS", tmp_path / "ports")
    monkeypatch.setattr(processes.socket, "socket", _Kernel([40001, 40001]))
    assert free_port() == 40001
    old = time.time() - processes.RESERVE_SECONDS - 5
    os.utime(tmp_path / "ports" / "40001", (old, old))
    assert free_port() == 40001


def test_without_a_writable_folder_the_kernels_port_is_used(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(processes, "RESERVED_PORTS", blocker / "ports")    # under a file: mkdir fails
    monkeypatch.setattr(processes.socket, "socket", _Kernel([40003]))
    assert free_port() == 40003


def test_real_ports_are_free_and_distinct():
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(1024 <= p < 65536 for p in ports)
