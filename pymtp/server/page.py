"""The chat page on ``GET /`` and ``GET /pymtp/stats``, the JSON its live panel polls.

The page is static files in ``webui/`` (no build step), read once at start. It
talks only to its own origin, and its Content-Security-Policy says so to the browser:
scripts and styles from this server only (no inline ones), requests to this server
only, nothing from elsewhere. The page itself holds no secret: with ``--api-key`` it asks
for the key and keeps it in the tab's sessionStorage at most. Model text is put in the
page as text (``textContent``), never parsed as HTML.
"""

from __future__ import annotations

from collections import defaultdict
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ..config import shown_draft_max
from .service import Service

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
ASSETS = {"app.js": "text/javascript; charset=utf-8", "thinking.js": "text/javascript; charset=utf-8",
          "stream.js": "text/javascript; charset=utf-8", "reply.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}


def page_files() -> dict[str, bytes]:
    """index.html and its assets, from the installed package."""
    root = resources.files("pymtp.server") / "webui"
    return {name: (root / name).read_bytes() for name in ("index.html", *ASSETS)}


def install_webui(app: FastAPI, service: Service, guarded: list) -> None:
    """Add the stats route, and the page unless ``settings.webui`` is off."""

    @app.get("/pymtp/stats", dependencies=guarded)
    async def stats() -> JSONResponse:
        return JSONResponse(live_stats(service))

    if not service.settings.webui:
        return
    files = page_files()

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return Response(files["index.html"], media_type="text/html; charset=utf-8", headers=HEADERS)

    @app.get("/webui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return JSONResponse({"error": {"message": f"no page file {name!r}", "type": "not_found_error"}},
                                status_code=404)
        return Response(files[name], media_type=ASSETS[name], headers=HEADERS)


def live_stats(service: Service) -> dict:
    """Slots, queue and what every generation so far did, from the same counters as /metrics."""
    samples = _samples(service.metrics)

    def total(name: str) -> float:      # over every label value
        return sum(samples[name].values())

    drafted, accepted, rounds = total("pymtp_draft_tokens_total"), total("pymtp_draft_tokens_accepted_total"), \
        total("pymtp_verify_rounds_total")
    drafted_at = _by_int(samples["pymtp_draft_position_drafted_total"], "position")
    accepted_at = _by_int(samples["pymtp_draft_position_accepted_total"], "position")
    tps_n, tps_sum = total("pymtp_generation_tokens_per_second_count"), \
        total("pymtp_generation_tokens_per_second_sum")
    pool, s, m = service.pool, service.settings, service.model
    out = {
        "model": service.model_id,
        "slots": {"total": pool.size, "busy": pool.busy},
        "queue": {"waiting": pool.waiting, "max": s.max_queue},
        "defaults": {"spec": s.decode.spec, "draft_max": shown_draft_max(s.decode.draft_max), "draft_limit": m.draft_limit},
        "generations": int(total("pymtp_generations_total")),
        "generated_tokens": int(total("pymtp_generated_tokens_total")),
        "drafted": int(drafted),
        "accepted": int(accepted),
        "rounds": int(rounds),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0,
        "drafted_at": [int(drafted_at.get(i, 0)) for i in range(len(drafted_at))],
        "accepted_at": [int(accepted_at.get(i, 0)) for i in range(len(drafted_at))],
        "accepted_per_position": [accepted_at.get(i, 0) / d if d else 0.0 for i, d in
                                  sorted(drafted_at.items())],
        "depths": {str(k): int(v) for k, v in sorted(
            _by_int(samples["pymtp_draft_depth_rounds_total"], "depth").items())},
        "tokens_per_second": tps_sum / tps_n if tps_n else 0.0,     # mean over generations
    }
    if service.workers:
        ms = service.batch_metrics()
        rounds = sum(m.rounds for m in ms)
        seqs = sum(k * n for m in ms for k, n in dict(m.batch_sizes).items())   # a copy: engines add sizes
        out["batch"] = {"rounds": rounds, "mean_batch_size": seqs / rounds if rounds else 0.0,
                        "rows": sum(m.rows for m in ms), "engines": len(ms)}
    return out


def _samples(metrics) -> dict[str, dict[tuple, float]]:
    """Every sample of the app's registry: name -> {sorted label pairs: value}."""
    out: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in metrics.registry.collect():
        for sample in family.samples:
            out[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _by_int(samples: dict[tuple, float], label: str) -> dict[int, float]:
    return {int(dict(labels)[label]): value for labels, value in samples.items()}
