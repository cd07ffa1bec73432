"""A Hugging Face repo id as SOURCE: only config.json, the index and the MTP shard(s) are
fetched. huggingface_hub is replaced by a fake serving a local directory (no network)."""

from __future__ import annotations

import json
import shutil
import sys
import types

import numpy as np
import pytest
from gguf_graft import graft
from safetensors.numpy import save_file

from .helpers import export_mtp_hf, gguf_contents


@pytest.fixture
def repo(fx, tmp_path):
    """A sharded HF checkpoint of the dense fixture: shard 1 the trunk, shard 2 the MTP block."""
    d = tmp_path / "repo"
    d.mkdir()
    full = fx("dense")
    trunk = {"model.language_model.embed_tokens.weight": np.zeros((4, 64), np.float32)}
    mtp = export_mtp_hf(full, prefix="model.language_model.mtp.")
    save_file(trunk, d / "model-00001-of-00002.safetensors")
    save_file(mtp, d / "model-00002-of-00002.safetensors")
    weight_map = {**{n: "model-00001-of-00002.safetensors" for n in trunk},
                  **{n: "model-00002-of-00002.safetensors" for n in mtp}}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 64, "num_hidden_layers": 4}}))
    (d / "README.md").write_text("not needed")
    return d, full


def test_repo_id_fetches_only_what_the_graft_needs(fx, repo, tmp_path, monkeypatch):
    d, full = repo
    cache = tmp_path / "cache"
    cache.mkdir()
    fetched = []

    def hf_hub_download(repo_id, filename, revision=None):
        assert repo_id == "org/model"
        fetched.append(filename)
        return str(shutil.copy(d / filename, cache / filename))

    fake = types.ModuleType("huggingface_hub")
    fake.list_repo_files = lambda repo_id, revision=None: sorted(p.name for p in d.iterdir())
    fake.hf_hub_download = hf_hub_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)

    out = tmp_path / "out.gguf"
    graft(fx("dense", with_mtp=False), "org/model", out)
    assert fetched == ["config.json", "model.safetensors.index.json", "model-00002-of-00002.safetensors"]
    assert gguf_contents(out)[1] == gguf_contents(full)[1]


def test_repo_id_without_huggingface_hub(fx, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    base = fx("dense", with_mtp=False)
    with pytest.raises(ValueError, match="pip install huggingface-hub"):
        graft(base, "Qwen/Qwen3.5-27B", dry_run=True)
