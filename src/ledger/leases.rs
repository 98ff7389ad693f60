//! Layer 3, the ledger: leases. A scope's tickets whose lease ran out, the next lease
//! to run out, and the database's unended tickets (the database cap, the expiry sweep,
//! quota.usage_totals()), under a snapshot the caller takes (see scan.rs). Before
//! 0.6.1 an index in lease order made each of them a probe; 0.6.1 takes lease_until
//! out of quota.active's indexes, so that a renewal is a heap-only update, and they
//! read the scope's (or the database's) unended tickets, where the scope counters
//! cannot answer instead (see scopes::counts and writer/sweep.rs).

use pgrx::pg_sys;

use crate::core::lease::Lapsed;
use crate::ledger::count::being_changed;
use crate::ledger::rels::Rels;
use crate::ledger::scan::{attr, scan, scan_index, ts_attr, weight_attr, Key, Latest};
use crate::ledger::{COL_ENDED_AT, COL_LEASE_UNTIL, COL_ROLE};

/// `role`'s unfinished tickets whose lease ran out by `now` (0.2.0's schema only):
/// one probe of (role, ended_at IS NULL, lease_until <= now) where the index has
/// lease_until next (0.2.0 to 0.6.0), else a walk of the role's unfinished tickets
/// (0.6.1: no index of quota.active has lease_until, so that a renewal is a heap-only
/// update; callers look only where the role's counter cannot tell that none lapsed,
/// see scopes::counts). Also, where it walked them all, the earliest lease end among
/// them (LEASE_NONE as i64::MAX where none ends; None after a probe), for the role's
/// counter (scopes::counts). Their counter and their unfinished rows still include them until the sweep
/// ends them. Take `snap` after reading the role's counter, so that it sees every sweep
/// the counter reflects and nothing is subtracted twice. The result serves every
/// retention cutoff (see core::lease::Lapsed).
pub fn lapsed(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    now: pg_sys::TimestampTz,
) -> (Lapsed, Option<i64>) {
    if !r.v2() {
        return (Lapsed::new(Vec::new()), None);
    }
    lapsed_on(
        r.ledger_idx,
        r.ledger_idx_leased,
        r,
        snap,
        &[Key::OidEq(role)],
        now,
    )
}

/// The unfinished tickets that the `scope` keys select on `index` (whose next column
/// is ended_at, then lease_until if `leased`) and whose lease ran out by `now`; and,
/// where the scan read every unfinished ticket of the scope (not `leased`), the
/// earliest lease end among them all, lapsed or being changed or not (i64::MAX where
/// none ends).
fn lapsed_on(
    index: pg_sys::Oid,
    leased: bool,
    r: &Rels,
    snap: &Latest,
    scope: &[Key],
    now: pg_sys::TimestampTz,
) -> (Lapsed, Option<i64>) {
    let mut expiries = Vec::new();
    let mut earliest = i64::MAX;
    let mut keys = scope.to_vec();
    keys.push(Key::IsNull);
    if leased {
        keys.push(Key::TsLess(now.saturating_add(1)));
    }
    scan(r.ledger, index, snap, &keys, |slot| {
        let lease = ts_attr(slot, COL_LEASE_UNTIL);
        earliest = earliest.min(lease.unwrap_or(i64::MAX));
        let lease = lease.filter(|&l| l <= now);
        if lease.is_some() && !being_changed(slot) {
            expiries.extend(lease.map(|l| (l, weight_attr(slot))));
        }
        true
    });
    (Lapsed::new(expiries), (!leased).then_some(earliest))
}

/// Hands the database's unfinished tickets visible to `snap` to `visit` until it
/// returns false (0.2.0's schema on); with `lapsed_by`, only those whose lease ran out
/// by then. quota.active (0.6.0) holds nothing else, and is read whole through its
/// role index; the one table of older schemas through its index on (ended_at,
/// lease_until), which skips its history (and, with `lapsed_by`, the active tickets
/// whose lease runs on).
pub fn each_unended(
    r: &Rels,
    snap: &Latest,
    lapsed_by: Option<pg_sys::TimestampTz>,
    mut visit: impl FnMut(*mut pg_sys::TupleTableSlot) -> bool,
) {
    if !r.v2() {
        return;
    }
    let lapsed =
        |slot| lapsed_by.is_none_or(|by| ts_attr(slot, COL_LEASE_UNTIL).is_some_and(|l| l <= by));
    if r.ledger_open_idx != pg_sys::InvalidOid {
        let mut keys = vec![Key::IsNull];
        keys.extend(lapsed_by.map(|by| Key::TsLess(by.saturating_add(1))));
        scan_index(r.ledger, r.ledger_open_idx, snap, &keys, |slot| {
            !lapsed(slot) || visit(slot)
        });
    } else {
        // Every row is unfinished (active_unended_check); a row a DBA wrote past a
        // dropped check is not one of them.
        scan_index(r.ledger, r.ledger_idx, snap, &[], |slot| {
            ts_attr(slot, COL_ENDED_AT).is_some() || !lapsed(slot) || visit(slot)
        });
    }
}

/// Tenant `tenant`'s unfinished tickets whose lease ran out by `now`, as `lapsed` for
/// a role.
pub fn tenant_lapsed(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    tenant: pg_sys::Datum,
    now: pg_sys::TimestampTz,
) -> (Lapsed, Option<i64>) {
    if !r.v5() {
        return (Lapsed::new(Vec::new()), None);
    }
    // The index is locked by the Reader (see rels.rs).
    lapsed_on(
        r.ledger_tenant_idx,
        r.ledger_tenant_idx_leased,
        r,
        snap,
        &[Key::OidEq(role), Key::TextEq(tenant)],
        now,
    )
}

/// The database's active units (0.7.0: the sum of its active tickets' weights), all
/// roles together, counting until at least `stop_at` (0.2.0's schema only): the
/// unfinished rows whose lease has not run out.
pub fn db_active(r: &Rels, snap: &Latest, now: pg_sys::TimestampTz, stop_at: i64) -> i64 {
    let mut n = 0;
    each_unended(r, snap, None, |slot| {
        let active = ts_attr(slot, COL_LEASE_UNTIL).is_none_or(|l| l > now) || being_changed(slot);
        if active {
            n += weight_attr(slot);
        }
        n < stop_at
    });
    n
}

/// The earliest lease that runs out after `now` among the active tickets of `role`, or
/// of the whole database when `role` is None: when a waiter should look again.
pub fn next_expiry(
    r: &Rels,
    snap: &Latest,
    role: Option<pg_sys::Oid>,
    now: pg_sys::TimestampTz,
) -> Option<pg_sys::TimestampTz> {
    if !r.v2() {
        return None;
    }
    let mut first: Option<pg_sys::TimestampTz> = None;
    let after = Key::TsAtLeast(now.saturating_add(1));
    let in_lease_order = match role {
        Some(role) if r.ledger_idx_leased => {
            Some((r.ledger_idx, vec![Key::OidEq(role), Key::IsNull, after]))
        }
        None if r.ledger_open_idx != pg_sys::InvalidOid => {
            Some((r.ledger_open_idx, vec![Key::IsNull, after]))
        }
        _ => None,
    };
    if let Some((index, keys)) = in_lease_order {
        // The first one after `now` is the one.
        scan_index(r.ledger, index, snap, &keys, |slot| {
            first = ts_attr(slot, COL_LEASE_UNTIL);
            first.is_none()
        });
        return first;
    }
    let earliest = |slot| {
        if let Some(l) = ts_attr(slot, COL_LEASE_UNTIL).filter(|&l| l > now) {
            first = Some(first.map_or(l, |f| f.min(l)));
        }
        true
    };
    match role {
        Some(role) => scan_index(
            r.ledger,
            r.ledger_idx,
            snap,
            &[Key::OidEq(role), Key::IsNull],
            earliest,
        ),
        None => each_unended(r, snap, None, earliest),
    }
    first
}

/// The database's unfinished tickets (0.5.1, for quota.usage_totals), sorted as
/// quota.usage sorts them at `now` for a caller whose retention starts at `cutoff`, in
/// units (0.7.0: each counts its weight).
pub struct Open {
    /// Those whose lease has not run out (or that have none).
    pub active: i64,
    /// Those whose lease ran out before `cutoff`: they count as ended at lease_until,
    /// so no longer as retained.
    pub gone: i64,
    /// Every unfinished ticket, by role.
    pub by_role: std::collections::HashMap<u32, i64>,
}

/// One walk of the database's unfinished tickets (0.2.0's schema only, see
/// `each_unended`): the active ones, and those whose lease the writer's sweep has not ended yet.
pub fn db_open(
    r: &Rels,
    snap: &Latest,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
) -> Open {
    let mut open = Open {
        active: 0,
        gone: 0,
        by_role: std::collections::HashMap::new(),
    };
    each_unended(r, snap, None, |slot| {
        let lease_until = ts_attr(slot, COL_LEASE_UNTIL);
        let weight = weight_attr(slot);
        if let Some(role) = attr(slot, COL_ROLE as i32) {
            *open.by_role.entry(role.value() as u32).or_insert(0) += weight;
        }
        if lease_until.is_none_or(|l| l > now) {
            open.active += weight;
        }
        if lease_until.is_some_and(|l| l < cutoff) {
            open.gone += weight;
        }
        true
    });
    open
}
