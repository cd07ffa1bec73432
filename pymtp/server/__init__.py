"""``pymtp serve``: an OpenAI-compatible HTTP server over pymtp sessions.

Imports are lazy so that ``pymtp.server.cli`` (registered on the ``pymtp`` command) does
not load FastAPI for every other subcommand.
"""

from __future__ import annotations

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "ServerSettings":
        from .settings import ServerSettings
        return ServerSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
