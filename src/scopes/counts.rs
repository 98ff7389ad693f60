//! Layer 4: what a scope holds, as admission and the writer need it: from its counter
//! (see mod.rs), or from the ledger where there is none, plus the scope's uncommitted
//! transactional charges (0.5.0), which only its counter holds.
//!
//! Every count here is made under `others_view()`: this transaction's own uncommitted
//! changes are the counter's business (its finishes are applied when it commits, its
//! transactional charges are open charges until then), not the ledger's.

use pgrx::pg_sys;

use super::{get, others_view, Counted, Open, ScopeKey};
use crate::core::lease::{capacity, Capacity, Lapsed};
use crate::core::{Limits, RefusalKind, Usage};
use crate::ledger::count::{
    active_and_earliest, expired, oldest_ended, rows, summary_rows, tenant_active_and_earliest,
    tenant_ended_since, tenant_oldest_ended, tenant_unended,
};
use crate::ledger::leases::{lapsed, tenant_lapsed};
use crate::ledger::rels::Reader;
use crate::ledger::scan::Latest;
use crate::workers;

/// A tenant of a role: the key that stands for it in shared memory, and its text (a
/// text datum in the server encoding) for the ledger.
#[derive(Clone, Copy, Debug)]
pub struct Tenant {
    pub key: u128,
    pub text: pg_sys::Datum,
}

/// (active units, ledger rows, open charges) of `role`: the committed numbers from
/// its scope counter, which is built from the ledger if missing or stale, or, where it
/// has none (see `get`), counted from the ledger under a snapshot taken now; and its
/// uncommitted transactional charges, read before either (see `get`), so a charge
/// that commits meanwhile is counted at least once.
pub fn role_counts(reader: &Reader, role: pg_sys::Oid) -> (i64, i64, Open) {
    let r = &reader.rels;
    let mut open = Open::default();
    let counted = reader.tags.and_then(|tags| {
        let has_numbers = || summary_rows(r, &others_view(), role, false).is_some();
        get(ScopeKey::role(role), tags, &mut open, has_numbers, |s| {
            // A rebuild holds the counters' lock: never count a whole history
            // under it. Without a summary row, count this once without a
            // counter; the writer rebuilds the summary row meanwhile.
            let (rows, _) = rows(r, s, role, false)?;
            let (active, earliest) = active_and_earliest(r, s, role);
            Some(Counted {
                active,
                rows,
                earliest,
            })
        })
    });
    if reader.tags.is_none() {
        open = super::open(ScopeKey::role(role));
    }
    let (active, rows) = counted.unwrap_or_else(|| {
        // Counted as a counter would be (see `others_view`), in a snapshot taken
        // now: after whatever the caller read before (its requests in flight, the
        // open charges).
        let own = others_view();
        let (rows, rebuild) = rows(r, &own, role, true).expect("counted from the ledger");
        if rebuild {
            workers::request_summary_rebuild();
        }
        (active_and_earliest(r, &own, role).0, rows)
    });
    (active, rows, open)
}

/// (committed active units, open charges) of tenant `t` of `role`: from its counter,
/// built from the ledger (its active tickets, never its history) if missing or stale,
/// or counted from the ledger; open charges read first, as in `role_counts`.
pub fn tenant_counts(reader: &Reader, role: pg_sys::Oid, t: Tenant) -> (i64, Open) {
    let r = &reader.rels;
    let key = ScopeKey {
        role,
        tenant: t.key,
    };
    let mut open = Open::default();
    let counted = reader.tags.and_then(|tags| {
        get(
            key,
            tags,
            &mut open,
            || true,
            |s| {
                let (active, earliest) = tenant_active_and_earliest(r, s, role, t.text);
                Some(Counted {
                    active,
                    rows: 0,
                    earliest,
                })
            },
        )
    });
    if reader.tags.is_none() {
        open = super::open(key);
    }
    let active = counted.map_or_else(
        || tenant_active_and_earliest(r, &others_view(), role, t.text).0,
        |(a, _)| a,
    );
    (active, open)
}

/// The usage of `role` (and of its tenant `tenant`, for a start with one) as
/// admission needs it: each count only where a limit of `limits` needs it. Tickets
/// whose lease ran out by `now` are neither active nor, once past `cutoff`, retained.
/// Open charges count as active and retained.
///
/// The counters give an upper bound at once: every lapsed ticket still counted. If
/// `fits` accepts that bound it is returned as it is, since fewer tickets would fit
/// too; only a start that the bound would refuse pays for the ledger scans that find
/// what lapsed (a start far from its limits, the common case, never does).
pub fn usage(
    reader: &Reader,
    role: pg_sys::Oid,
    tenant: Option<Tenant>,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    limits: Limits,
    fits: impl FnOnce(Usage) -> bool,
) -> Usage {
    let mut u = Usage::default();
    let r = &reader.rels;
    let of_role = limits.max_active > 0 || limits.max_retained > 0;
    if of_role {
        let (active, rows, open) = role_counts(reader, role);
        if limits.max_active > 0 {
            u.active = active + open.units;
        }
        if limits.max_retained > 0 {
            u.retained = rows + open.units;
        }
    }
    let of_tenant = tenant.filter(|_| limits.tenant_active > 0 || limits.tenant_retained > 0);
    let role_key = ScopeKey::role(role);
    // The counters as read after the counts, and before the snapshot that the looks for
    // lapsed leases take (see Seen), if they look.
    let seen = || {
        let role_seen = of_role.then(|| Seen::peek(reader, role_key, now));
        let tenant_seen = of_tenant.map(|t| {
            let key = ScopeKey {
                role,
                tenant: t.key,
            };
            (key, Seen::peek(reader, key, now))
        });
        (role_seen, tenant_seen)
    };
    let mut seen_before = None;
    // A snapshot taken after the counters were read: it sees every purge and every
    // expiry sweep they already reflect, so nothing is subtracted twice.
    let mut after = None;
    if let Some(t) = of_tenant {
        let (active, open) = tenant_counts(reader, role, t);
        u.tenant_active = active + open.units;
        if limits.tenant_retained > 0 {
            seen_before = Some(seen());
            // A tenant's history is counted from the ledger (see `tenant_exact`), in
            // units.
            let snap = after.insert(others_view());
            u.tenant_retained = tenant_unended(r, snap, role, t.text)
                + tenant_ended_since(r, snap, role, t.text, cutoff)
                + open.units;
        }
    }
    if fits(u) {
        return u;
    }
    let (role_seen, tenant_seen) = seen_before.unwrap_or_else(seen);
    let after = after.get_or_insert_with(others_view);
    if let Some(seen) = role_seen {
        let lapsed = seen.lapsed(role_key, now, || lapsed(r, after, role, now));
        if limits.max_active > 0 {
            u.active -= lapsed.expired();
        }
        if limits.max_retained > 0 {
            u.retained -= expired(r, after, role, cutoff) + lapsed.aged_out(cutoff);
        }
    }
    if let (Some(t), Some((key, seen))) = (of_tenant, tenant_seen) {
        let lapsed = seen.lapsed(key, now, || tenant_lapsed(r, after, role, t.text, now));
        u.tenant_active -= lapsed.expired();
        if limits.tenant_retained > 0 {
            u.tenant_retained -= lapsed.aged_out(cutoff);
        }
    }
    u
}

/// A scope's counter as read before its lapsed leases are looked for (`Seen::lapsed`),
/// after the counts it qualifies and before the look's snapshot: None where it is not
/// live.
#[derive(Clone, Copy)]
struct Seen {
    peeked: Option<super::Peeked>,
}

impl Seen {
    /// Reads scope `key`'s counter, after the counts it qualifies and before the
    /// snapshot of the look, if it looks.
    fn peek(reader: &Reader, key: ScopeKey, now: pg_sys::TimestampTz) -> Seen {
        Seen {
            peeked: reader.tags.and_then(|tags| super::peek(key, tags, now)),
        }
    }

    /// The scope's tickets whose lease ran out by `now`: none, without reading the
    /// ledger, where its counter knows that none did (its `earliest` lease end is still
    /// to come); else `walk`'s. Read after the counts they are subtracted from: a
    /// ticket those counts include whose lease ran out keeps `earliest` at or below its
    /// lease until it is gone from the counter (only `refresh_earliest` raises it, from
    /// the ledger, and only above `now`), so what the counter knows holds for those
    /// counts, or over-counts (a ticket ended since), which is allowed.
    ///
    /// 0.6.1: where quota.active's indexes have no lease_until, the walk reads all of
    /// the scope's unended tickets, and returns the earliest lease end among them; if
    /// that is still to come, the counter learns it, or the earliest lease applied to
    /// it since it last learnt one, which the walk's snapshot may have missed
    /// (scopes::refresh_earliest; a lease applied before the look began that has
    /// passed since costs one more walk, whose store then holds). A counter's
    /// `earliest` only goes down as tickets come and are renewed, so without this the
    /// first lease to pass would send every later look for this scope (the writer's
    /// batches, the numbers of refusals) on a walk of its backlog.
    fn lapsed(
        self,
        key: ScopeKey,
        now: pg_sys::TimestampTz,
        walk: impl FnOnce() -> (Lapsed, Option<i64>),
    ) -> Lapsed {
        if self.peeked.is_some_and(|p| p.earliest > now) {
            return Lapsed::new(Vec::new());
        }
        let (lapsed, earliest) = walk();
        if let (Some(p), Some(e)) = (self.peeked, earliest) {
            if e > now {
                super::refresh_earliest(key, p.look, e);
            }
        }
        lapsed
    }
}

/// A scope's counts with its lapsed leases subtracted: its active tickets, and its
/// retained ones at each cutoff asked for (in that order), open charges included; with
/// the lapsed leases and the snapshot they were counted under (taken after the counter
/// was read: it sees every purge and sweep the counter reflects), for what the caller
/// asks next.
pub struct Exact {
    pub active: i64,
    pub retained: Vec<i64>,
    pub lapsed: Lapsed,
    pub after: Latest,
}

/// `role`'s exact counts (see Exact).
pub fn role_exact(
    reader: &Reader,
    role: pg_sys::Oid,
    now: pg_sys::TimestampTz,
    cutoffs: &[pg_sys::TimestampTz],
) -> Exact {
    let r = &reader.rels;
    let (active, rows, open) = role_counts(reader, role);
    let key = ScopeKey::role(role);
    let seen = Seen::peek(reader, key, now);
    let after = others_view();
    let lapsed = seen.lapsed(key, now, || lapsed(r, &after, role, now));
    let retained = cutoffs
        .iter()
        .map(|&c| rows + open.units - expired(r, &after, role, c) - lapsed.aged_out(c))
        .collect();
    Exact {
        active: active + open.units - lapsed.expired(),
        retained,
        lapsed,
        after,
    }
}

/// Tenant `t`'s exact counts (see Exact). A tenant's history is counted from the
/// ledger, at each cutoff: there is no summary row per tenant, as there can be 100,000
/// of them.
pub fn tenant_exact(
    reader: &Reader,
    role: pg_sys::Oid,
    t: Tenant,
    now: pg_sys::TimestampTz,
    cutoffs: &[pg_sys::TimestampTz],
) -> Exact {
    let r = &reader.rels;
    let (active, open) = tenant_counts(reader, role, t);
    let key = ScopeKey {
        role,
        tenant: t.key,
    };
    let seen = Seen::peek(reader, key, now);
    let after = others_view();
    let lapsed = seen.lapsed(key, now, || tenant_lapsed(r, &after, role, t.text, now));
    let unfinished = if cutoffs.is_empty() {
        0
    } else {
        tenant_unended(r, &after, role, t.text)
    };
    let retained = cutoffs
        .iter()
        .map(|&c| {
            unfinished + tenant_ended_since(r, &after, role, t.text, c) + open.units
                - lapsed.aged_out(c)
        })
        .collect();
    Exact {
        active: active + open.units - lapsed.expired(),
        retained,
        lapsed,
        after,
    }
}

/// The full numbers for a refusal's message, and how capacity returns if a retained
/// limit is the one reached (see core::lease::capacity): when enough of the scope's
/// retained units have aged out for `more` units (the start's weight, and those of
/// starts ahead of it that the counts leave out) to fit below `limit` (0.7.0; for a
/// start of weight 1 at its limit, when the oldest ages out).
#[allow(clippy::too_many_arguments)]
pub fn refusal_numbers(
    reader: &Reader,
    role: pg_sys::Oid,
    tenant: Option<Tenant>,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    retention_secs: i64,
    kind: RefusalKind,
    more: i64,
    limit: i64,
) -> (Usage, Option<Capacity>) {
    let r = &reader.rels;
    let of_role = role_exact(reader, role, now, &[cutoff]);
    let mut usage = Usage {
        active: of_role.active,
        retained: of_role.retained[0],
        ..Usage::default()
    };
    // The units that must age out, what the count and `more` take past the limit,
    // from the ended ones (the count less the active ones), read oldest first.
    let returns = |count: i64,
                   active: i64,
                   read: &dyn Fn(i64) -> (Vec<(i64, i64)>, bool),
                   lapsed: &Lapsed| {
        let need = count.saturating_add(more).saturating_sub(limit);
        let ended_units = count.saturating_sub(active);
        capacity(need, ended_units, read, lapsed.retained_from(cutoff)).after(retention_secs)
    };
    let mut next = None;
    if kind == RefusalKind::Retained {
        next = Some(returns(
            usage.retained,
            usage.active,
            &|need| oldest_ended(r, &of_role.after, role, cutoff, need),
            &of_role.lapsed,
        ));
    }
    if let Some(t) = tenant {
        let of_tenant = tenant_exact(reader, role, t, now, &[cutoff]);
        usage.tenant_active = of_tenant.active;
        usage.tenant_retained = of_tenant.retained[0];
        if kind == RefusalKind::TenantRetained {
            next = Some(returns(
                usage.tenant_retained,
                usage.tenant_active,
                &|need| tenant_oldest_ended(r, &of_tenant.after, role, t.text, cutoff, need),
                &of_tenant.lapsed,
            ));
        }
    }
    (usage, next)
}

/// After a refusal at `kind`, an active limit, that had to probe for lapsed leases
/// because the scope's counter knew of none still to come (0.6.0): finds the earliest
/// lease end among the scope's active tickets, and gives it to the counter, so that the
/// next refusals read the counter alone again. Nothing where the counter is not live,
/// already knows a lease end still to come, or a ticket lapsed or is being changed.
pub fn refresh_earliest(
    reader: &Reader,
    role: pg_sys::Oid,
    tenant: Option<Tenant>,
    kind: RefusalKind,
    now: pg_sys::TimestampTz,
) {
    let r = &reader.rels;
    let Some(tags) = reader.tags else { return };
    let (key, text) = match (kind, tenant) {
        (RefusalKind::TenantActive, Some(t)) => (
            ScopeKey {
                role,
                tenant: t.key,
            },
            Some(t.text),
        ),
        (RefusalKind::Active, _) => (ScopeKey::role(role), None),
        _ => return,
    };
    // 0.6.1: the refusal's own look for lapsed leases walked the scope's tickets
    // already, and told the counter what it found (`Seen::lapsed`).
    let walked = match text {
        Some(_) => !r.ledger_tenant_idx_leased,
        None => !r.ledger_idx_leased,
    };
    if walked {
        return;
    }
    let Some(p) = super::peek(key, tags, now) else {
        return;
    };
    if p.earliest > now {
        return;
    }
    // Under a snapshot taken after the look began (see scopes::Peeked::look).
    let snap = others_view();
    let (_, earliest) = match text {
        Some(text) => tenant_active_and_earliest(r, &snap, role, text),
        None => active_and_earliest(r, &snap, role),
    };
    if earliest > now {
        super::refresh_earliest(key, p.look, earliest);
    }
}
