"""Measure what a round costs on this model, machine and backend, for the depth policy.

A few decodes on scratch sequences, before any request uses the contexts: the target
with 1..per_seq rows of one sequence (a verify batch: every row an output), then whole
verify batches of 2..n_seqs sequences, and the MTP head with one output row for each of
1..n_seqs drafting sequences. The fastest of ``reps`` passes counts (the first pass also
warms the kernels up). Rounds then correct the target curve online (``Rounds._verify``).
"""

from __future__ import annotations

import time

import numpy as np

from .depth import CostModel, Curve
from .native import Batch, NativeContext


def _timed(ctx: NativeContext, batch: Batch, read_hidden: bool) -> float:
    t0 = time.perf_counter()
    ctx.decode(batch)
    ctx.logits(batch.n_outputs).sum()          # a read waits for the device, as a round's does
    if read_hidden:
        ctx.hidden(batch.n).sum()
    return time.perf_counter() - t0


def _fill(batch: Batch, rows: int, per_seq: int, embd: int = 0) -> list[int]:
    """``rows`` output rows in chunks of ``per_seq`` on seq ids 0, 1, ...; the ids used."""
    batch.clear()
    seqs = []
    while rows > 0:
        n = min(rows, per_seq)
        batch.add(np.zeros(n, dtype=np.int32), 0, len(seqs), outputs="all",
                  embd=np.zeros((n, embd), dtype=np.float32) if embd else None)
        seqs.append(len(seqs))
        rows -= n
    return seqs


def _measure(ctx: NativeContext, points: list[int], per_seq: int, reps: int, embd: int,
             read_hidden: bool) -> Curve:
    best: dict[int, float] = {}
    batch = Batch(max(points), embd_width=embd)
    for _ in range(reps):
        for rows in points:
            seqs = _fill(batch, rows, per_seq, embd)
            dt = _timed(ctx, batch, read_hidden)
            for s in seqs:
                ctx.seq_rm(s, -1, -1)
            best[rows] = min(best.get(rows, dt), dt)
    curve = Curve()
    for rows, dt in best.items():
        curve.observe(rows, dt)
    return curve


def calibrate(target: NativeContext, mtp: NativeContext | None, per_seq: int, n_seqs: int = 1,
              reps: int = 3) -> tuple[CostModel, float]:
    """(cost model, seconds it took). Seq ids 0..n_seqs-1 must hold nothing the caller
    needs: everything decoded here is dropped again. ``per_seq`` is the most verify rows
    of one sequence (draft_limit + 1)."""
    t_start = time.perf_counter()
    points = sorted(set(range(1, per_seq + 1)) | {per_seq * m for m in range(2, n_seqs + 1)})
    target_curve = _measure(target, points, per_seq, reps, 0, read_hidden=mtp is not None)
    if mtp is not None:
        step = _measure(mtp, list(range(1, n_seqs + 1)), 1, reps, mtp.n_embd_out, read_hidden=False)
    else:
        step = Curve({1: 1e-9})
    return CostModel(target_curve, step), time.perf_counter() - t_start
