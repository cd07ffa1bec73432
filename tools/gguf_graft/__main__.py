"""``python -m gguf_graft``: the ``gguf_graft`` command, for a venv whose scripts are not on PATH."""

from .cli import main

main(prog_name="gguf_graft")
