"""Write a synthetic Qwen3.5 GGUF (with its MTP block) as large as a real checkpoint.

The shared trained models have 19M and 78M parameters: on an H100 their k=3 round takes
about 3 ms, mostly kernel launches, so any fixed host cost per round is a large share of
it. A real Qwen3.5 has hundreds of millions to billions of parameters. This writes the
test fixtures' noisy-bigram model (pymtp/testing/weights.py: the MTP head drafts what
the target tends to emit, so drafts are accepted) at the sizes given, its matrices in
float16, so a round's host share (round_profile.py) can be measured at a realistic
decode cost. Widen its vocabulary with pad_vocab.py afterwards.

    python benchmarks/sized_model.py /tmp/models/sized-1b.gguf
    python benchmarks/pad_vocab.py /tmp/models/sized-1b.gguf /tmp/models/sized-1b-248k.gguf

The defaults (width 1024, 24 blocks, 16 GDN key heads of 128, 8 query heads of 256)
give about 0.5B parameters at the fixture's 384-token vocabulary, about 1B once widened
to 248,320. The weights are not trained: acceptance and text mean nothing beyond the
bigram map's; only the decode's cost is realistic.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pymtp.testing import fixtures, layout  # noqa: E402

SIZES = (  # flag, Hparams field, default, what it is
    ("--n-embd", "n_embd", 1024, "hidden width"),
    ("--n-trunk", "n_trunk", 24, "trunk blocks (every 4th full attention)"),
    ("--n-ff", "n_ff", 3584, "FFN width"),
    ("--n-head", "n_head", 8, "attention query heads"),
    ("--n-head-kv", "n_head_kv", 2, "attention key/value heads"),
    ("--head-dim", "head_dim", 256, "attention head width"),
    ("--ssm-d-state", "ssm_d_state", 128, "GDN head width (keys and values)"),
    ("--ssm-n-group", "ssm_n_group", 16, "GDN key heads"),
    ("--ssm-dt-rank", "ssm_dt_rank", 16, "GDN value heads"),
    ("--n-vocab", "n_vocab", layout.DENSE.n_vocab, "vocabulary (pad_vocab.py widens it)"),
)


def hparams(args: argparse.Namespace) -> layout.Hparams:
    """The dense fixture's hyperparameters at the sizes asked for; rope covers a quarter
    of each head, split over the sections as the fixture splits it."""
    hp = replace(layout.DENSE, **{field: getattr(args, field) for _, field, _, _ in SIZES})
    n_rot = hp.head_dim // 4
    half = n_rot // 2
    return replace(hp, n_rot=n_rot, rope_sections=(half - 2 * (half // 4), half // 4, half // 4, 0))


def n_params(hp: layout.Hparams) -> int:
    total = 0
    for _, ne, _, _ in layout.tensor_plan(hp, with_mtp=True):
        n = 1
        for d in ne:
            n *= d
        total += n
    return total


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, metavar="OUT.gguf")
    for flag, field, default, what in SIZES:
        ap.add_argument(flag, dest=field, type=int, default=default, help=f"{what} (default {default})")
    ap.add_argument("--f32", action="store_true", help="keep the matrices in float32")
    ap.add_argument("--seed", type=int, default=fixtures.DEFAULT_SEED)
    ap.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.out.exists() and not args.force:
        ap.error(f"{args.out} exists: pass --force to overwrite it")
    for flag, field, _, _ in SIZES:
        if getattr(args, field) <= 0:
            ap.error(f"{flag} must be positive, got {getattr(args, field)}")
    if args.head_dim % 8:
        ap.error(f"--head-dim must be a multiple of 8 (rope takes a quarter of it in sections), got {args.head_dim}")
    hp = hparams(args)
    print(f"{n_params(hp) / 1e6:.0f}M parameters, width {hp.n_embd}, {hp.n_trunk} blocks + MTP, "
          f"vocabulary {hp.n_vocab}", file=sys.stderr)
    part = args.out.with_name(args.out.name + ".part")
    try:
        fixtures.write_fixture(part, "dense", seed=args.seed, hp=hp, f16=not args.f32)
        part.replace(args.out)
    finally:
        part.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
