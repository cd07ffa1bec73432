"""Test helpers: tiny synthetic Qwen3.5 GGUF fixtures with an MTP block."""

from pymtp.testing.fixtures import bigram_map, fixture_path, write_fixture
from pymtp.testing.layout import HPARAMS, Hparams

__all__ = ["HPARAMS", "Hparams", "bigram_map", "fixture_path", "write_fixture"]
