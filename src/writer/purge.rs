//! Layer 5: the ledger writer's purge of dropped roles. Once a DROP ROLE commits,
//! every writer deletes the role's tickets and summary row, so that they count for
//! nobody: not for a future role that gets the same OID, and not, after a dump, for
//! whatever role has that OID in another cluster.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::ledger::count::roles_where;
use crate::ledger::heap::OpenRel;
use crate::ledger::rels::Reader;
use crate::ledger::scan::{attr, scan, Key, Latest};
use crate::ledger::write::{delete_where, Tables};
use crate::shmem;

use super::txn::try_in_transaction;

thread_local! {
    /// Roles whose tickets the last purge deleted; their counters are forgotten once
    /// that purge has committed (a rebuild before would count the deleted rows).
    static DROPPED: std::cell::RefCell<Vec<pg_sys::Oid>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Whether the last purge left the tenants' own limits of dropped roles for later:
    /// maintenance held their table (see purge_dropped_roles).
    static OVERRIDES_LEFT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `purge_dropped_roles` in a transaction of its own, then forgets the counters of the
/// roles it purged. Returns whether the purge committed and left nothing for later.
pub fn purge_dropped_roles_and_counters() -> bool {
    DROPPED.with_borrow_mut(Vec::clear);
    OVERRIDES_LEFT.set(false);
    let committed = try_in_transaction("purge the tickets of dropped roles", purge_dropped_roles);
    let gone = DROPPED.with_borrow_mut(std::mem::take);
    if committed && !gone.is_empty() {
        crate::scopes::forget(shmem::my_db(), Some(&gone));
    }
    committed && !OVERRIDES_LEFT.get()
}

/// Deletes the tickets and summary rows of roles that no longer exist, so that they
/// count for nobody: not for a future role that gets the same OID, and not, after a
/// dump, for whatever role has that OID in another cluster. One loose index scan.
fn purge_dropped_roles() {
    let reader = Reader::open();
    let rels = reader.rels;
    let snap = Latest::take();
    let mut gone = roles_where(&rels, &snap, |role| !crate::catalog::role_exists(role));
    let with_tickets = gone.len();
    // Roles whose summary row outlived their tickets.
    let mut add_dropped = |role: Option<pg_sys::Oid>| {
        if let Some(role) = role.filter(|&r| !crate::catalog::role_exists(r) && !gone.contains(&r))
        {
            gone.push(role);
        }
        true
    };
    scan(rels.summary, rels.summary_idx, &snap, &[], |slot| {
        add_dropped(role_at(slot, 1))
    });
    drop(snap);
    drop(reader);
    // 0.7.0: the tenants' own limits of dropped roles, which a future role with the
    // same OID must not inherit.
    let overrides = crate::ledger::overrides::find();
    if let Some((heap, pkey)) = overrides {
        let mut locks = crate::ledger::locks::Locks::new();
        locks.take(heap, pg_sys::AccessShareLock);
        locks.take(pkey, pg_sys::AccessShareLock);
        let snap = Latest::take();
        scan(heap, pkey, &snap, &[], |slot| {
            add_dropped(role_at(slot, crate::ledger::overrides::COL_ROLE))
        });
    }
    if gone.is_empty() {
        return;
    }
    // Opened as the relations are once locked: the Reader's locks are gone, and an
    // ALTER EXTENSION UPDATE may have committed since.
    let (tables, rels) = Tables::open_current();
    for &role in &gone {
        delete_where(&tables.ledger, rels.ledger_idx, &[Key::OidEq(role)], |_| {
            true
        });
        if rels.split() {
            delete_where(
                tables.history(),
                rels.history_idx,
                &[Key::OidEq(role)],
                |_| true,
            );
        }
    }
    drop(tables);
    let summary = OpenRel::open(rels.summary, "summary", 1);
    delete_where(&summary, rels.summary_idx, &[], |slot| {
        role_at(slot, 1).is_some_and(|r| gone.contains(&r))
    });
    // Only if the table is free at once (maintenance that holds it, a VACUUM FULL or a
    // CREATE INDEX, is not waited for while starts queue behind the writer): left for
    // the next try (PURGE_RETRY) otherwise.
    // SAFETY: a plain lock request, kept to the end of the transaction.
    let free =
        |heap| unsafe { pg_sys::ConditionalLockRelationOid(heap, pg_sys::RowExclusiveLock as i32) };
    if let Some((heap, pkey)) = overrides.filter(|&(heap, _)| {
        let got = free(heap);
        OVERRIDES_LEFT.set(!got);
        got
    }) {
        let rel = OpenRel::open_lazy(heap, "tenant_overrides", 0);
        let n = delete_where(&rel, pkey, &[], |slot| {
            role_at(slot, crate::ledger::overrides::COL_ROLE).is_some_and(|r| gone.contains(&r))
        });
        if n > 0 {
            // Written below SQL, so the table's trigger does not fire: every backend's
            // cache of these rows is invalidated when this purge commits.
            // SAFETY: the table exists and is locked.
            unsafe { pg_sys::CacheInvalidateRelcacheByRelid(heap) };
        }
    }
    DROPPED.with_borrow_mut(|d| d.clone_from(&gone));
    // Not again for roles whose rows were all gone but their tenants' limits, left
    // while the table was held.
    if with_tickets > 0 {
        log!(
            "pg_quota ledger writer: removed the tickets of {} dropped role(s)",
            with_tickets
        );
    }
    if !OVERRIDES_LEFT.get() && gone.len() > with_tickets {
        log!(
            "pg_quota ledger writer: removed what was left of {} dropped role(s)",
            gone.len() - with_tickets
        );
    }
}

/// The role in column `col` (regrole or oid) of the tuple in `slot`.
fn role_at(slot: *mut pg_sys::TupleTableSlot, col: usize) -> Option<pg_sys::Oid> {
    attr(slot, col as i32).map(|d| pg_sys::Oid::from(d.value() as u32))
}
