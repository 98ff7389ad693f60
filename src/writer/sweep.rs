//! Layer 5: the ledger writer's expiry sweep. Unfinished tickets whose lease ran out
//! are written down as ended, at their lease_until, with outcome `expired`; the scope
//! counters drop by what it ended, and the starts waiting in those scopes look again.

use pgrx::pg_sys;

use crate::ledger::count::each_unended;
use crate::ledger::rels::{self, Reader};
use crate::ledger::scan::{attr, text_attr, Latest};
use crate::ledger::write::expired_version;
use crate::ledger::write::Tables;
use crate::ledger::{COL_ENDED_AT, COL_LEASE_UNTIL, COL_OUTCOME, COL_ROLE, COL_TENANT};
use crate::scopes::{tenant_key, ScopeKey};
use crate::shmem;

use super::txn::try_in_transaction;

/// The most expired tickets one sweep writes down; the next sweep takes the rest.
const MAX_DUE: usize = 1024;

thread_local! {
    /// Scopes whose tickets the last expiry sweep ended, and how many each.
    static SWEPT: std::cell::RefCell<Vec<crate::scopes::Change>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `sweep_expired` in a transaction of its own; then the scope counters drop by what it
/// ended, and the starts waiting in those scopes look again.
pub fn sweep_expired_and_wake() {
    SWEPT.with_borrow_mut(Vec::clear);
    OVERFLOWED.with_borrow_mut(Vec::clear);
    let committed = try_in_transaction("end expired tickets", sweep_expired);
    crate::scopes::apply_mine();
    let swept = SWEPT.with_borrow_mut(std::mem::take);
    if !committed {
        return;
    }
    crate::scopes::invalidate(&OVERFLOWED.with_borrow_mut(std::mem::take));
    for crate::scopes::Change {
        key, active: ended, ..
    } in swept
    {
        // Statistics and waiters are per role: a tenant's count is its role's too.
        if key.is_tenant() {
            continue;
        }
        crate::stats::add(
            key.role,
            crate::core::stats::Counter::Expired,
            ended.unsigned_abs(),
        );
        crate::waiters::wake(shmem::my_db(), key.role);
    }
}

/// Writes down the leases that ran out: each unfinished ticket whose lease_until has
/// passed ends at its lease_until with outcome `expired`. Counting does not wait for
/// this (admission subtracts such tickets as soon as their lease runs out, see
/// counts::lapsed); the sweep keeps that set empty, so that a refusal need not look for
/// lapsed leases (a walk of the scope's unended tickets), gives the scope counters
/// their true active count, and lets the retention purge find the tickets. It reads
/// all of quota.active, the database's unended tickets (0.6.1: no index has
/// lease_until), and the writer spaces sweeps out as they grow long (writer::SWEEP_SHARE). A ticket that a finish() or renew() is changing right now
/// is left for a later sweep: the writer never waits for a caller's transaction.
fn sweep_expired() {
    if !rels::rels().v2() {
        return;
    }
    let reader = Reader::open();
    let rels = reader.rels;
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let snap = Latest::take();
    let mut due: Vec<(pg_sys::ItemPointerData, ScopeKey, pg_sys::TimestampTz)> = Vec::new();
    let v5 = rels.v5();
    each_unended(&rels, &snap, Some(now), |slot| {
        let role = attr(slot, COL_ROLE as i32).map(|d| pg_sys::Oid::from(d.value() as u32));
        let until = attr(slot, COL_LEASE_UNTIL as i32).map(|d| d.value() as i64);
        if let (Some(role), Some(until)) = (role, until) {
            let tenant = if v5 {
                text_attr(slot, COL_TENANT).map_or(0, |t| tenant_key(&t))
            } else {
                0
            };
            // SAFETY: the slot holds a visible ledger tuple.
            due.push((unsafe { (*slot).tts_tid }, ScopeKey { role, tenant }, until));
        }
        due.len() < MAX_DUE
    });
    drop(snap);
    if due.is_empty() {
        return;
    }
    let tables = Tables::open(&rels);
    let ledger = &tables.ledger;
    // quota.history (0.6.0) before any row lock: no lock wait while holding one.
    tables.history();
    let mut ended = Vec::new();
    for (tid, key, until) in due {
        // A finish() or renew() of the ticket in an open transaction: leave it to a
        // later sweep rather than wait for that transaction.
        if !ledger.lock_nowait(tid) {
            continue;
        }
        let Some(tuple) = expired_version(ledger, rels.ncols, tid, until) else {
            continue;
        };
        if tables.end(tid, tuple, &[COL_ENDED_AT, COL_OUTCOME]) == pg_sys::TM_Result::TM_Ok {
            crate::scopes::add_change(&mut ended, key, -1, 0, None);
        }
    }
    drop(tables);
    drop(reader);
    // Published before the commit, applied after it (see scopes.rs).
    let overflow = crate::scopes::publish(&ended);
    // The counters of roles that did not fit are rebuilt from the ledger instead.
    OVERFLOWED.with_borrow_mut(|o| *o = overflow);
    SWEPT.with_borrow_mut(|s| *s = ended);
}

thread_local! {
    static OVERFLOWED: std::cell::RefCell<Vec<ScopeKey>> = const { std::cell::RefCell::new(Vec::new()) };
}
