"""``python -m pymtp``: the ``pymtp`` command, for a venv whose scripts are not on PATH."""

from .cli import main

main(prog_name="pymtp")
