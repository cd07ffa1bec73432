"""Fetch just the MTP part of an HF checkpoint: config.json, the index, and the shard(s)
that hold `mtp.*` tensors, never the whole model. huggingface-hub is imported on use only.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from .errors import GraftError
from .mapping import INDEX, SINGLE, mtp_shards


def fetch(repo_id: str, revision: str | None = None) -> Path:
    """Download what the graft needs from `repo_id` into the HF cache; return the snapshot dir."""
    hf = _import_hub()
    try:
        files = set(hf.list_repo_files(repo_id, revision=revision))

        def get(name: str) -> Path:
            return Path(hf.hf_hub_download(repo_id, name, revision=revision))

        if "config.json" in files:
            get("config.json")
        if INDEX in files:
            index = get(INDEX)
            with open(index, encoding="utf-8") as f:
                shards = mtp_shards(json.load(f).get("weight_map", {}))
            if not shards:
                raise GraftError(f"Hugging Face repo {repo_id!r} has no mtp.* tensors in its {INDEX}: "
                                 "this checkpoint ships without the MTP block")
            for shard in shards:
                get(shard)
            return index.parent
        if SINGLE in files:
            return get(SINGLE).parent
    except GraftError:
        raise
    except Exception as e:  # network, auth, missing repo: huggingface-hub's own exception types vary by version
        raise GraftError(f"SOURCE {repo_id!r} is no local file or directory, so it was taken as a Hugging Face "
                         f"repo id, and fetching it failed: {e} (check the name and the network; for a gated "
                         "repo, log in with `hf auth login` or set HF_TOKEN)") from e
    raise GraftError(f"Hugging Face repo {repo_id!r} has neither {INDEX} nor {SINGLE}; "
                     "it is not a safetensors checkpoint")


def _import_hub() -> ModuleType:
    try:
        import huggingface_hub
    except ImportError as e:
        raise GraftError("SOURCE is no local file or directory (check the path), so it was taken as a Hugging "
                         "Face repo id; fetching one needs huggingface-hub: pip install huggingface-hub") from e
    return huggingface_hub
