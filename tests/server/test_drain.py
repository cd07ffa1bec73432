"""The draining server's last step on its own: a client that stopped reading a response
is disconnected, so the response ends as for any departed client instead of being
cancelled by uvicorn (which logs a CancelledError traceback)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn

from pymtp.server.drain import DrainingServer
from pymtp.server.slots import SlotPool
from pymtp.testing.processes import free_port

MB = 1 << 20


def test_a_client_that_stopped_reading_is_disconnected_not_cancelled(caplog):
    sending = threading.Event()
    outcome: list[str] = []

    async def app(scope, receive, send):
        # 64 MB in 1 MB writes: the first fills the transport's buffer, the second waits
        await send({"type": "http.response.start", "status": 200, "headers": []})
        sending.set()
        try:
            for _ in range(64):
                await send({"type": "http.response.body", "body": b"x" * MB, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        outcome.append("ended")

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_config=None,
                            timeout_graceful_shutdown=30)   # uvicorn's own cut would come much later
    server = DrainingServer(config, SlotPool(["s0"], max_queue=0), shutdown_timeout=1, retry_after=1)
    thread = threading.Thread(target=server.run, daemon=True)   # no signals off the main thread
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock, \
            caplog.at_level(logging.INFO):
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert sending.wait(30)
        time.sleep(0.2)                       # the app is now blocked on its second write
        assert outcome == []
        server.should_exit = True             # what a signal does
        thread.join(30)
        assert not thread.is_alive()
    assert outcome == ["ended"]
    assert "stopped reading" in caplog.text and "Traceback" not in caplog.text
    assert "Exception in ASGI application" not in caplog.text   # "ended": not uvicorn's 30 s cut
