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
}

/// `purge_dropped_roles` in a transaction of its own, then forgets the counters of the
/// roles it purged. Returns whether the purge committed.
pub fn purge_dropped_roles_and_counters() -> bool {
    DROPPED.with_borrow_mut(Vec::clear);
    let committed = try_in_transaction("purge the tickets of dropped roles", purge_dropped_roles);
    let gone = DROPPED.with_borrow_mut(std::mem::take);
    if committed && !gone.is_empty() {
        crate::scopes::forget(shmem::my_db(), Some(&gone));
    }
    committed
}

/// Deletes the tickets and summary rows of roles that no longer exist, so that they
/// count for nobody: not for a future role that gets the same OID, and not, after a
/// dump, for whatever role has that OID in another cluster. One loose index scan.
fn purge_dropped_roles() {
    let reader = Reader::open();
    let rels = reader.rels;
    let snap = Latest::take();
    let mut gone = roles_where(&rels, &snap, |role| !role_exists(role));
    // Roles whose summary row outlived their tickets.
    scan(rels.summary, rels.summary_idx, &snap, &[], |slot| {
        if let Some(d) = attr(slot, 1) {
            let role = pg_sys::Oid::from(d.value() as u32);
            if !role_exists(role) && !gone.contains(&role) {
                gone.push(role);
            }
        }
        true
    });
    drop(snap);
    drop(reader);
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
        attr(slot, 1).is_some_and(|d| gone.contains(&pg_sys::Oid::from(d.value() as u32)))
    });
    DROPPED.with_borrow_mut(|d| d.clone_from(&gone));
    log!(
        "pg_quota ledger writer: removed the tickets of {} dropped role(s)",
        gone.len()
    );
}

fn role_exists(role: pg_sys::Oid) -> bool {
    // SAFETY: a syscache probe of pg_authid.
    unsafe {
        pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::AUTHOID as i32,
            role.into(),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
}
