//! Layer 4: what a scope holds, as admission and the writer need it: from its counter
//! (see mod.rs), or from the ledger where there is none, plus the scope's uncommitted
//! transactional charges (0.5.0), which only its counter holds.
//!
//! Every count here is made under `others_view()`: this transaction's own uncommitted
//! changes are the counter's business (its finishes are applied when it commits, its
//! transactional charges are open charges until then), not the ledger's.

use pgrx::pg_sys;

use super::{get, open, others_view, ScopeKey};
use crate::core::lease::earliest;
use crate::core::{Limits, RefusalKind, Usage};
use crate::ledger::count::{
    active, expired, lapsed, oldest_ended, rows, summary_rows, tenant_active, tenant_ended_since,
    tenant_lapsed, tenant_oldest_ended,
};
use crate::ledger::rels::Reader;
use crate::workers;

/// A tenant of a role: the key that stands for it in shared memory, and its text (a
/// text datum in the server encoding) for the ledger.
#[derive(Clone, Copy, Debug)]
pub struct Tenant {
    pub key: u128,
    pub text: pg_sys::Datum,
}

/// (active tickets, ledger rows) of `role`, committed: from its scope counter, which
/// is built from the ledger if missing or stale, or, where it has none (see `get`),
/// counted from the ledger under a snapshot taken now.
pub fn role_counts(reader: &Reader, role: pg_sys::Oid) -> (i64, i64) {
    let r = &reader.rels;
    reader
        .tags
        .and_then(|tags| {
            let has_numbers = || summary_rows(r, &others_view(), role).is_some();
            get(ScopeKey::role(role), tags, has_numbers, |s| {
                // A rebuild holds the counters' lock: never count a whole history
                // under it. Without a summary row, count this once without a
                // counter; the writer rebuilds the summary row meanwhile.
                let (rows, _) = rows(r, s, role, false)?;
                Some((active(r, s, role, None), rows))
            })
        })
        .unwrap_or_else(|| {
            // Counted as a counter would be (see `others_view`), in a snapshot taken
            // now: after whatever the caller read before (its requests in flight).
            let own = others_view();
            let (rows, rebuild) = rows(r, &own, role, true).expect("counted from the ledger");
            if rebuild {
                workers::request_summary_rebuild();
            }
            (active(r, &own, role, None), rows)
        })
}

/// The committed active tickets of tenant `t` of `role`: from its counter, built from
/// the ledger (its active tickets, never its history) if missing or stale, or counted
/// from the ledger.
pub fn tenant_counts(reader: &Reader, role: pg_sys::Oid, t: Tenant) -> i64 {
    let r = &reader.rels;
    let key = ScopeKey {
        role,
        tenant: t.key,
    };
    reader
        .tags
        .and_then(|tags| {
            get(
                key,
                tags,
                || true,
                |s| Some((tenant_active(r, s, role, t.text, None), 0)),
            )
        })
        .map_or_else(
            || tenant_active(r, &others_view(), role, t.text, None),
            |(a, _)| a,
        )
}

/// The usage of `role` (and of its tenant `tenant`, for a start with one) as
/// admission needs it: each count only where a limit of `limits` needs it. Tickets
/// whose lease ran out by `now` are neither active nor, once past `cutoff`, retained.
/// Open charges count as active and retained.
pub fn usage(
    reader: &Reader,
    role: pg_sys::Oid,
    tenant: Option<Tenant>,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    limits: Limits,
) -> Usage {
    let mut u = Usage::default();
    let r = &reader.rels;
    if limits.max_active > 0 || limits.max_retained > 0 {
        let (active, rows) = role_counts(reader, role);
        let open = open(ScopeKey::role(role));
        // A snapshot taken after the counter was read: it sees every purge and every
        // expiry sweep the counter already reflects, so nothing is subtracted twice.
        let after = others_view();
        let lapsed = lapsed(r, &after, role, now);
        if limits.max_active > 0 {
            u.active = active + open - lapsed.expired();
        }
        if limits.max_retained > 0 {
            u.retained = rows + open - expired(r, &after, role, cutoff) - lapsed.aged_out(cutoff);
        }
    }
    if let Some(t) = tenant {
        if limits.tenant_active > 0 || limits.tenant_retained > 0 {
            let (active, retained) =
                of_tenant(reader, role, t, now, cutoff, limits.tenant_retained > 0);
            u.tenant_active = active;
            u.tenant_retained = retained;
        }
    }
    u
}

/// (active, retained) of tenant `t`, open charges included; retained only if asked
/// for (a tenant's history is counted from the ledger: there is no summary row per
/// tenant, as there can be 100,000 of them).
pub fn of_tenant(
    reader: &Reader,
    role: pg_sys::Oid,
    t: Tenant,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    count_retained: bool,
) -> (i64, i64) {
    let r = &reader.rels;
    let active = tenant_counts(reader, role, t);
    let open = open(ScopeKey {
        role,
        tenant: t.key,
    });
    let after = others_view();
    let lapsed = tenant_lapsed(r, &after, role, t.text, now);
    let retained = if count_retained {
        tenant_active(r, &after, role, t.text, None)
            + tenant_ended_since(r, &after, role, t.text, cutoff)
            + open
            - lapsed.aged_out(cutoff)
    } else {
        0
    };
    (active + open - lapsed.expired(), retained)
}

/// The full numbers for a refusal's message, and when capacity returns if a retained
/// limit is the one reached.
#[allow(clippy::too_many_arguments)]
pub fn refusal_numbers(
    reader: &Reader,
    role: pg_sys::Oid,
    tenant: Option<Tenant>,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    retention_secs: i64,
    kind: RefusalKind,
) -> (Usage, Option<pg_sys::TimestampTz>) {
    let r = &reader.rels;
    let (active, rows) = role_counts(reader, role);
    let open = open(ScopeKey::role(role));
    // As in `usage`: a snapshot that sees every purge and sweep the counter reflects.
    let after = others_view();
    let lapsed = lapsed(r, &after, role, now);
    let mut usage = Usage {
        active: active + open - lapsed.expired(),
        retained: rows + open - expired(r, &after, role, cutoff) - lapsed.aged_out(cutoff),
        ..Usage::default()
    };
    let mut next = None;
    if kind == RefusalKind::Retained {
        next = earliest(
            oldest_ended(r, &after, role, cutoff),
            lapsed.oldest_retained(cutoff),
        );
    }
    if let Some(t) = tenant {
        let (ta, tr) = of_tenant(reader, role, t, now, cutoff, true);
        usage.tenant_active = ta;
        usage.tenant_retained = tr;
        if kind == RefusalKind::TenantRetained {
            let lapsed = tenant_lapsed(r, &after, role, t.text, now);
            next = earliest(
                tenant_oldest_ended(r, &after, role, t.text, cutoff),
                lapsed.oldest_retained(cutoff),
            );
        }
    }
    let next = next.map(|t| t.saturating_add(retention_secs.saturating_mul(1_000_000)));
    (usage, next)
}
