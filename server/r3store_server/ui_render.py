"""The status page's pages as HTML, from plain values: no I/O, no script, no asset from
anywhere else. `ui.py` gathers the values and serves the pages; `ui_analytics` makes
the namespace page's charts and tables, `ui_html` what every page shares."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from r3store.catalog_types import NamespaceInfo, NamespaceUsage
from r3store.engine.analytics import VersionAgreement, VersionDrift, VersionLoad
from r3store.leases import Checkpoint, Lease
from r3store.policy import Retention
from r3store_server.ui_analytics import (
    agreement_section,
    drift_section,
    heatmap_section,
    imbalance_section,
)
from r3store_server.ui_charts import e
from r3store_server.ui_html import duration, or_none, page, remaining, size, table, when

# ends the login form's session (the browser forgets its cookie)
SIGN_OUT = (
    "<form class=out method=post action='/ui/logout'><button type=submit>Sign out</button></form>"
)


@dataclass(frozen=True)
class NamespaceRow:
    info: NamespaceInfo
    usage: NamespaceUsage


@dataclass(frozen=True)
class Consumption:
    """A namespace's consumption by trainers: its epoch, step checkpoints (by step) and
    open leases (oldest first), as of `now`."""

    epoch: int = 0
    checkpoints: Sequence[Checkpoint] = ()
    leases: Sequence[Lease] = ()
    now: float = 0.0


@dataclass(frozen=True)
class NamespaceDetail:
    row: NamespaceRow
    loads: dict[str, list[VersionLoad]]  # by source
    agreements: dict[tuple[str, str], list[VersionAgreement]]
    drift: dict[str, list[VersionDrift]]  # by source
    consumption: Consumption = field(default_factory=Consumption)


@dataclass(frozen=True)
class Activity:
    """Retention and compaction since the server started (None: maintenance is off)."""

    totals: dict[str, int] = field(default_factory=dict)


def overview(rows: Sequence[NamespaceRow], activity: Activity | None, version: str) -> str:
    """The front page: every namespace the key may read, and maintenance activity."""
    listed = table(
        [
            "namespace",
            "trajectories",
            "shards",
            "stored",
            "dead",
            "policy version",
            "versions held",
            "max lag",
            "samplings",
            "sampled",
        ],
        [
            [
                f"<a href='/ui/namespaces/{e(r.info.name)}'>{e(r.info.name)}</a>",
                str(r.usage.trajectories),
                str(r.usage.shards),
                size(r.usage.shard_bytes),
                size(r.usage.dead_route_bytes),
                str(r.info.policy_version),
                _versions(r.usage.by_policy_version),
                or_none(r.info.settings.max_policy_lag),
                str(r.usage.samplings),
                str(r.usage.sampled),
            ]
            for r in rows
        ],
        "namespaces",
    )
    body = (
        f"{SIGN_OUT}<h1>r3store</h1><div class=muted>version {e(version)} · "
        f"{when(time.time())}</div><h2>Namespaces</h2>"
        + (listed if rows else "<p>No namespace yet.</p>")
        + _activity(activity)
    )
    return page("r3store", body)


def _versions(counts: dict[int, int]) -> str:
    if not counts:
        return "-"
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


def _activity(activity: Activity | None) -> str:
    if activity is None:
        return "<h2>Retention and compaction</h2><p class=muted>Maintenance is off.</p>"
    labels = {
        "trajectories_dropped": "trajectories dropped by retention",
        "trajectories_kept": "trajectories retention kept for a lease or a checkpoint",
        "leases_forgotten": "closed leases forgotten",
        "shards_compacted": "shards compacted",
        "objects_deleted": "objects deleted",
        "orphans_deleted": "orphaned uploads deleted",
        "tombstones_deleted": "tombstones deleted",
        "live_bytes": "live route bytes",
        "dead_bytes": "dead route bytes",
    }
    rows = [
        [labels[k], size(n) if k.endswith("_bytes") else str(n)]
        for k in labels
        for n in [activity.totals.get(k, 0)]
    ]
    return "<h2>Retention and compaction (since start)</h2>" + table(
        ["", "count"], rows, "activity"
    )


def _retention(retention: Retention) -> str:
    parts = []
    if retention.keep_versions is not None:
        parts.append(f"the last {retention.keep_versions} policy versions")
    if retention.ttl_seconds is not None:
        parts.append(f"for {duration(retention.ttl_seconds)}")
    if retention.evict_after_sampled:
        parts.append("until sampled the most times allowed")
    return "keeps " + ", ".join(parts) if parts else "keeps everything (never drops)"


def _kept_checkpoints(retention: Retention) -> str:
    if retention.keep_checkpoints is None:
        return "every one"
    return f"the newest {retention.keep_checkpoints}"


def _consumption(held: Consumption) -> str:
    """The trainer's checkpoints and open leases."""
    points = (
        table(
            ["step", "consumed", "policy version", "epoch", "when"],
            [
                [
                    str(c.step),
                    str(c.consumed),
                    str(c.policy_version),
                    str(c.epoch),
                    when(c.created_at),
                ]
                for c in held.checkpoints
            ],
            "checkpoints",
        )
        if held.checkpoints
        else "<p class=muted>No checkpoint.</p>"
    )
    leases = (
        table(
            ["lease", "holder", "trajectories", "expires in"],
            [
                [
                    f"<code title='{e(lease.lease_id)}'>{e(lease.lease_id[:8])}</code>",
                    e(lease.holder or "-"),
                    str(len(lease.trajectory_ids)),
                    remaining(lease.expires_at - held.now),
                ]
                for lease in held.leases
            ],
            "leases",
        )
        if held.leases
        else "<p class=muted>No open lease.</p>"
    )
    return (
        f"<p>Epoch {held.epoch} (one more at each resume).</p>"
        f"<h3>Checkpoints</h3>{points}<h3>Open leases</h3>{leases}"
    )


def namespace_page(detail: NamespaceDetail, last: int) -> str:
    """One namespace: its figures; agreement between sources, drift across versions
    and load imbalance per layer as charts and tables; expert-load heatmaps of its last
    `last` policy versions per source."""
    info, usage = detail.row.info, detail.row.usage
    spec, settings = info.spec, info.settings
    facts = table(
        ["", ""],
        [
            [
                "route spec",
                f"{spec.num_layers} layers x {spec.num_experts} experts, top-{spec.top_k}",
            ],
            ["created", when(info.created_at)],
            ["trajectories", str(usage.trajectories)],
            ["shards", f"{usage.shards} ({size(usage.shard_bytes)})"],
            [
                "live / dead route bytes",
                f"{size(usage.live_route_bytes)} / {size(usage.dead_route_bytes)}",
            ],
            ["policy version", str(info.policy_version)],
            ["versions held", _versions(usage.by_policy_version)],
            ["max policy lag", or_none(settings.max_policy_lag, "none (never stale)")],
            ["max times sampled", or_none(settings.max_times_sampled, "none (no limit)")],
            ["retention", e(_retention(settings.retention))],
            ["checkpoints kept", e(_kept_checkpoints(settings.retention))],
            ["epoch", str(detail.consumption.epoch)],
            ["samplings / sampled", f"{usage.samplings} / {usage.sampled}"],
            ["read sources", e(", ".join(settings.read_sources))],
        ],
        "facts",
    )
    body = (
        f"{SIGN_OUT}<p><a href='/ui'>all namespaces</a></p><h1>{e(info.name)}</h1>{facts}"
        "<h2>Trainer checkpoints and leases</h2>"
        + _consumption(detail.consumption)
        + "<h2>Agreement between route sources</h2>"
        + agreement_section(detail.agreements)
        + "<h2>Router drift</h2>"
        + drift_section(detail.drift)
        + "<h2>Load imbalance</h2>"
        + imbalance_section(detail.loads)
        + f"<h2>Expert load per policy version (the last {last})</h2>"
        + heatmap_section(detail.loads, last)
    )
    return page(f"r3store · {info.name}", body)


def login_page(message: str, then: str = "/ui") -> str:
    """What a browser without a key gets: a form for the key (kept in a cookie for
    /ui), and where a key comes from."""
    body = (
        f"<h1>r3store</h1><p>{e(message)}</p>"
        "<form method=post action='/ui/login'><label>API key "
        "<input type=password name=key autocomplete=off autofocus required></label> "
        f"<input type=hidden name=then value='{e(then)}'>"
        "<button type=submit>Sign in</button></form>"
        "<p class=note>The status page takes any API key with the read right. An operator "
        "makes one on the server's machine with <code>r3store keys create NAME --role "
        "reader</code> (add <code>--namespace NS</code> to limit it to one namespace); the "
        "command shows the key once. The browser keeps a session signed by the server (not "
        "the key) in a cookie for this page only, for 8 hours or until you sign out.</p>"
    )
    return page("r3store · sign in", body)


def message_page(message: str) -> str:
    """A page saying `message`, with the way back to the namespaces."""
    return page(
        "r3store", f"<p><a href='/ui'>all namespaces</a></p><h1>r3store</h1><p>{e(message)}</p>"
    )
