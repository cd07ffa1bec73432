"""What the user reads: the plan as a summary and a table (the whole of --dry-run)."""

from __future__ import annotations

from .plan import Plan


def summary(plan: Plan) -> list[str]:
    """Where the block comes from and goes, the type chosen and why, the metadata changes."""
    base, mtp = plan.base, plan.mtp
    split = f", split in {len(base.parts)} parts" if base.is_split else ""
    if len(plan.parts) > 1:
        layout = f", in {len(plan.parts)} parts as BASE's, the MTP block in the last"
    else:
        layout = ", in one file" if base.is_split else ""
    lines = [
        f"BASE    {base.path} ({base.arch}, {base.n_trunk} trunk blocks{split})",
        f"SOURCE  {plan.source.label}",
        f"MTP block -> blk.{base.n_trunk}: {len(mtp)} tensors, {size_text(sum(t.nbytes for t in mtp))}",
        f"type    {plan.type_reason}; norms and routers stay F32",
        f"OUT     {len(plan.tensors)} tensors, {size_text(sum(t.nbytes for t in plan.tensors))} of tensor data{layout}",
    ]
    lines += [f"note    {t.name}: {t.note}" for t in mtp if t.note]
    if plan.replaced:
        lines.append(f"replace {len(plan.replaced)} tensors of the base's own MTP block (--force)")
    lines += [f"meta    {c}" for c in plan.metadata.changes]
    lines += [f"note    {n}" for n in plan.metadata.notes]
    return lines


def table(plan: Plan) -> list[str]:
    """One row per tensor of the MTP block, and one for everything copied from BASE."""
    rows = [("tensor", "shape (ggml)", "type", "bytes", "from")]
    rows += [(t.name, _shape(t.ne), t.qtype.name, f"{t.nbytes:,}", t.origin) for t in plan.mtp]
    kept = [t for t in plan.tensors if t.file_range is not None]
    rows.append((f"({len(kept)} base tensors)", "", "as is", f"{sum(t.nbytes for t in kept):,}", "BASE, copied"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = "  ".join(f"{{:{'>' if i == 3 else '<'}{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*r).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def _shape(ne: tuple[int, ...]) -> str:
    return "{" + ", ".join(str(n) for n in ne) + "}"


def size_text(n: float) -> str:
    """A byte count as people read it (1.5 MiB)."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")
