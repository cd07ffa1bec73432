"""Worker for tests/test_fuzz_gguf.py: runs fuzz cases one after another in this process.

    python tests/gguf_fuzz_worker.py SPEC.json START

SPEC holds the pristine input files and a list of cases; each case makes its mutated
input(s) (a truncation, byte flips, or a ready-made file), then either loads it with
``pymtp.load`` and generates two tokens, or grafts with ``gguf_graft.graft``. One JSON
line per finished case goes to stdout. A case that kills the process with a signal is
the one after the last line: the parent records it and starts a new worker after it.

Outcomes use the command line's rules: ``error`` is an exception the CLI turns into
"Error: message" (so the user gets a message), ``unclear`` is any other exception (the
user would get a traceback), ``ok`` is a normal end.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path


def materialize(spec: dict, data: dict[str, bytes], dest: Path) -> Path:
    """The mutated file a case describes, written to ``dest`` (or a ready-made file)."""
    if "file" in spec:
        return Path(spec["file"])
    raw = bytearray(data[spec["src"]])
    if spec.get("trunc") is not None:
        del raw[spec["trunc"]:]
    for pos, xor in spec.get("flips") or ():
        raw[pos] ^= xor
    dest.write_bytes(raw)
    return dest


def run_load(path: Path) -> dict:
    import pymtp
    from pymtp.gguf_info import ModelFileError
    from pymtp.native import NativeError

    try:
        m = pymtp.load(path, threads=1, n_ctx=64)
    except (ModelFileError, ValueError, NativeError) as exc:     # what `pymtp generate` reports
        return {"outcome": "error", "stage": "load", "type": type(exc).__name__, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a traceback for the user: the finding
        return {"outcome": "unclear", "stage": "load", "type": type(exc).__name__, "message": str(exc)}
    try:
        m.generate("hi", max_tokens=2, spec="mtp" if m.has_mtp else "none")
    except (ModelFileError, ValueError) as exc:                  # what `pymtp generate` reports
        return {"outcome": "error", "stage": "generate", "type": type(exc).__name__, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001
        return {"outcome": "unclear", "stage": "generate", "type": type(exc).__name__, "message": str(exc)}
    finally:
        m.close()
    return {"outcome": "ok"}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_graft(base: Path, source: Path, out_dir: Path) -> dict:
    from gguf_graft import GraftError, graft

    before = {p: digest(p) for p in (base, source)}
    out = out_dir / "out.gguf"
    try:
        graft(base, source, out, progress=False)
        result = {"outcome": "ok"}
    except (GraftError, OSError) as exc:                         # what `gguf_graft` reports
        result = {"outcome": "error", "type": type(exc).__name__, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001
        result = {"outcome": "unclear", "type": type(exc).__name__, "message": str(exc)}
    result["inputs_changed"] = [str(p) for p, d in before.items() if digest(p) != d]
    result["left_behind"] = sorted(set(os.listdir(out_dir)) - ({"out.gguf"} if result["outcome"] == "ok" else set()))
    return result


# A corrupted length can make a reader allocate without end; on a shared machine that
# must fail here (a MemoryError, or the worker's death) long before it starves the others.
MEMORY_LIMIT = 6 << 30


def main() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    spec = json.loads(Path(sys.argv[1]).read_text())
    start = int(sys.argv[2])
    work = Path(spec["work"])
    data = {name: Path(p).read_bytes() for name, p in spec["sources"].items()}
    for i in range(start, len(spec["cases"])):
        case = spec["cases"][i]
        scratch = work / f"w{i % 2}"        # alternate, so a case never sees the last one's files
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        if case["op"] == "load":
            result = run_load(materialize(case["input"], data, scratch / "model.gguf"))
        else:
            out_dir = scratch / "out"
            out_dir.mkdir()
            base = materialize(case["base"], data, scratch / "base.gguf")
            suffix = Path(spec["sources"].get(case["source"].get("src", ""), case["source"].get("file", "x"))).suffix
            source = materialize(case["source"], data, scratch / f"source{suffix}")
            result = run_graft(base, source, out_dir)
        result["message"] = result.get("message", "")[:300]
        print(json.dumps({"i": i, **result}), flush=True)


if __name__ == "__main__":
    main()
