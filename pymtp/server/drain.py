"""Graceful shutdown of ``pymtp serve``: drain on SIGTERM/SIGINT, then end what is left politely.

Behind a load balancer a SIGTERM means "finish up and go". The server then:

1. stops taking work: generation requests get a 503 with ``Retry-After``, ``/health``
   answers 503 ``{"status": "draining"}``, and requests waiting for a slot get the 503 at
   once (they have not started, so their clients can retry elsewhere right away);
2. lets the running generations finish, for up to ``--shutdown-timeout`` seconds (a second
   signal cuts this wait short);
3. ends the rest with an OpenAI-shaped error: a final SSE ``error`` event and ``[DONE]``
   for a stream, a JSON 503 for a non-streaming request;
4. hands over to uvicorn's own shutdown, and exits with status 0.

Uvicorn alone would cancel the running requests after its grace period (a plain-text 500,
streams cut without ``[DONE]``, a CancelledError traceback in the log) and re-raise the
signal at exit, so the exit status was the signal's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from .errors import APIError
from .slots import SlotPool

log = logging.getLogger("pymtp.server")

# After the running generations are ended: how long their last bytes may take to go out
# before a client that is not reading them is disconnected.
FLUSH_SECONDS = 2.0
# How long an ended generation may take to stop (one decode round; a long prompt more).
STOP_SECONDS = 30.0


def shutting_down(retry_after: int) -> APIError:
    """The 503 of a server that is going away; ``Connection: close`` so clients reconnect."""
    return APIError(503, "The server is shutting down; retry the request (on another server "
                    "behind a load balancer)", type="unavailable_error", code="server_shutting_down",
                    headers={"Retry-After": str(retry_after), "Connection": "close"})


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains ``pool`` before uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, pool: SlotPool, *, shutdown_timeout: float,
                 retry_after: int) -> None:
        super().__init__(config)
        self.pool = pool
        self.shutdown_timeout = shutdown_timeout
        self.retry_after = retry_after
        self.hurry = False        # a second signal: end the running requests now

    def error(self) -> APIError:
        return shutting_down(self.retry_after)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.hurry = True
        self.should_exit = True   # uvicorn's main loop sees this within 0.1 s, then calls shutdown

    @contextlib.contextmanager
    def capture_signals(self):
        """Uvicorn's, without re-raising the signal at the end: a drained exit is a clean one."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        await self.drain()
        await super().shutdown(sockets)

    async def drain(self) -> None:
        """Steps 1-3 of the module docstring; the listener stays open throughout, answering 503."""
        pool = self.pool
        pool.refuse(self.error)
        loop = asyncio.get_running_loop()
        if pool.running:
            log.info("draining: waiting up to %g s for %d running request(s)",
                     self.shutdown_timeout, pool.running)
        deadline = loop.time() + self.shutdown_timeout
        while pool.running and not self.hurry and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if pool.running:
            log.warning("shutdown: ending %d request(s) still running", pool.running)
            pool.abort_all(self.error)
            if not await pool.wait_idle(STOP_SECONDS):
                log.error("shutdown: %d generation(s) did not stop in %g s", pool.running, STOP_SECONDS)
        await self._flush()

    async def _flush(self) -> None:
        """Let the ended requests send their last bytes; then disconnect clients that do not read.

        A response blocked on a client that stopped reading would otherwise be cancelled
        by uvicorn (a traceback in the log). Closing its connection makes the write return
        at once, as for any client that went away.
        """
        state = self.server_state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FLUSH_SECONDS
        while state.tasks and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not state.tasks:
            return
        log.warning("shutdown: closing %d connection(s) whose client stopped reading", len(state.tasks))
        stuck = list(state.connections)
        for conn in stuck:
            conn.transport.abort()
        await asyncio.sleep(0)          # connection_lost runs: the writes see the disconnect
        for conn in stuck:
            conn.resume_writing()       # wake a write waiting for buffer space


def log_config(log_level: str) -> dict:
    """Uvicorn's logging set-up with pymtp's loggers added: without a handler of their own,
    the drain's progress (INFO) was dropped and its warnings came out bare."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["pymtp"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    return config


def serve_app(app: FastAPI, *, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Run ``app`` (from ``create_app``) until a signal, then drain as described above."""
    service = app.state.service
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=log_config(log_level),
                            timeout_graceful_shutdown=FLUSH_SECONDS)
    server = DrainingServer(config, service.pool, shutdown_timeout=shutdown_timeout,
                            retry_after=service.settings.retry_after)
    server.run()
