//! Layer 5: the ledger writer's expiry sweep. Unfinished tickets whose lease ran out
//! are written down as ended, at their lease_until, with outcome `expired`; the scope
//! counters drop by what it ended, and the starts waiting in those scopes look again.
//!
//! 0.6.1: no index of quota.active has lease_until (a renewal is then a heap-only
//! update), so a sweep walks all of quota.active, the database's unended tickets. It
//! does so only when a lease may have run out: the database's lease floor
//! (workers::WriterEntry::lease_floor) is what the last walk found still to come,
//! lowered by every change that committed since with a lease (scopes::apply_mine); and
//! at least once a minute, and when pg_quota's tables changed under the counters (a
//! superuser's SQL write, which no change reports). Before 0.6.1's schema, an index in
//! lease order finds the lapsed leases in one probe, every quarter of a second.

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

use pgrx::pg_sys;

use crate::ledger::leases::each_unended;
use crate::ledger::rels::{self, Reader, Tags};
use crate::ledger::scan::{attr, text_attr, weight_attr, Latest};
use crate::ledger::write::expired_version;
use crate::ledger::write::Tables;
use crate::ledger::{COL_ENDED_AT, COL_LEASE_UNTIL, COL_OUTCOME, COL_ROLE, COL_TENANT};
use crate::scopes::{tenant_key, ScopeKey, LEASE_NONE};
use crate::shmem;

use super::txn::try_in_transaction;

/// The most expired tickets one sweep writes down; the next sweep takes the rest.
const MAX_DUE: usize = 1024;
/// The same for a sweep that walks all of quota.active (0.6.1), which the writer does
/// at a pace set by the walk's length: a burst of leases that ran out (a pool of
/// workers gone) is written down in fewer, larger steps.
const MAX_DUE_WALKING: usize = 4 * MAX_DUE;

thread_local! {
    /// The roles whose tickets the last expiry sweep ended, and how many each.
    static SWEPT: std::cell::RefCell<Vec<(pg_sys::Oid, u64)>> = const { std::cell::RefCell::new(Vec::new()) };
    /// This writer's lease floor (see the module's comment), for `sweep_expired`.
    static FLOOR: Cell<Option<&'static AtomicI64>> = const { Cell::new(None) };
    /// When the last walk of all of quota.active began, and the tags of pg_quota's
    /// tables then.
    static WALKED: Cell<Option<(Instant, Option<Tags>)>> = const { Cell::new(None) };
    /// How long this sweep's walk of all of quota.active took, if it walked (its lock
    /// waits and its writes left out).
    static WALKED_NOW: Cell<Option<std::time::Duration>> = const { Cell::new(None) };
}

/// At least this often a sweep walks all of quota.active, whatever the lease floor says.
const WALK_AT_LEAST_EVERY: std::time::Duration = crate::core::lease::SWEEP_PAUSE_MAX;

/// `sweep_expired` in a transaction of its own; then the scope counters drop by what it
/// ended, and the starts waiting in those scopes look again. `floor` is this writer's
/// lease floor. Returns how long its walk of all of quota.active took, if it walked
/// (0.6.1), for the pace of the next sweeps (writer::SWEEP_SHARE).
pub fn sweep_expired_and_wake(floor: &'static AtomicI64) -> Option<std::time::Duration> {
    SWEPT.with_borrow_mut(Vec::clear);
    OVERFLOWED.with_borrow_mut(Vec::clear);
    FLOOR.set(Some(floor));
    WALKED_NOW.set(None);
    let committed = try_in_transaction("end expired tickets", sweep_expired);
    if !committed {
        // What the walk found was not written down: walk again next time.
        floor.fetch_min(i64::MIN, Ordering::AcqRel);
    }
    let walked = WALKED_NOW.get();
    crate::scopes::apply_mine();
    let swept = SWEPT.with_borrow_mut(std::mem::take);
    if !committed {
        return walked;
    }
    crate::scopes::invalidate(&OVERFLOWED.with_borrow_mut(std::mem::take));
    // Statistics and waiters are per role (a tenant's tickets are its role's too), and
    // quota.stats counts tickets, whatever their weight.
    for (role, tickets) in swept {
        crate::stats::add(role, crate::core::stats::Counter::Expired, tickets);
        crate::waiters::wake(shmem::my_db(), role);
    }
    walked
}

/// Writes down the leases that ran out: each unfinished ticket whose lease_until has
/// passed ends at its lease_until with outcome `expired`. Counting does not wait for
/// this (admission subtracts such tickets as soon as their lease runs out, see
/// counts::lapsed); the sweep keeps that set empty, so that a refusal need not look for
/// lapsed leases (a walk of the scope's unended tickets), gives the scope counters
/// their true active count, and lets the retention purge find the tickets (see the
/// module's comment for when it walks all of quota.active). A ticket that a finish()
/// or renew() is changing right now is left for a later sweep: the writer never waits
/// for a caller's transaction.
fn sweep_expired() {
    if !rels::rels().v2() {
        return;
    }
    let reader = Reader::open();
    let rels = reader.rels;
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    // 0.6.1: no index in lease order; walk all of quota.active, if anything may be due.
    let whole = rels.ledger_open_idx == pg_sys::InvalidOid;
    let floor = FLOOR.get().filter(|_| whole);
    if whole {
        let stale = WALKED
            .get()
            .is_none_or(|(at, tags)| at.elapsed() >= WALK_AT_LEAST_EVERY || tags != reader.tags);
        if !stale && floor.is_some_and(|f| f.load(Ordering::Acquire) > now) {
            return;
        }
        // Before the snapshot: a change applied from here on lowers it again, and one
        // applied before is one this walk sees.
        if let Some(f) = floor {
            f.store(LEASE_NONE, Ordering::Release);
        }
        WALKED.set(Some((Instant::now(), reader.tags)));
    }
    let walk_began = Instant::now();
    let max_due = if whole { MAX_DUE_WALKING } else { MAX_DUE };
    let snap = Latest::take();
    // (location, scope, lease end, weight) of each ticket to end.
    let mut due: Vec<(pg_sys::ItemPointerData, ScopeKey, pg_sys::TimestampTz, i64)> = Vec::new();
    // The earliest lease still to come among the tickets the walk saw.
    let mut next = LEASE_NONE;
    let v5 = rels.v5();
    each_unended(&rels, &snap, (!whole).then_some(now), |slot| {
        let role = attr(slot, COL_ROLE as i32).map(|d| pg_sys::Oid::from(d.value() as u32));
        let until = attr(slot, COL_LEASE_UNTIL as i32).map(|d| d.value() as i64);
        if let Some(until) = until.filter(|&u| u > now) {
            next = next.min(until);
            return true;
        }
        if let (Some(role), Some(until)) = (role, until) {
            let tenant = if v5 {
                text_attr(slot, COL_TENANT).map_or(0, |t| tenant_key(&t))
            } else {
                0
            };
            // SAFETY: the slot holds a visible ledger tuple.
            let tid = unsafe { (*slot).tts_tid };
            due.push((tid, ScopeKey { role, tenant }, until, weight_attr(slot)));
        }
        due.len() < max_due
    });
    drop(snap);
    if whole {
        WALKED_NOW.set(Some(walk_began.elapsed()));
    }
    if let Some(f) = floor {
        // Where it stopped at max_due, the rest is unknown: the next sweep walks again.
        let seen_all = due.len() < max_due;
        f.fetch_min(if seen_all { next } else { i64::MIN }, Ordering::AcqRel);
    }
    if due.is_empty() {
        return;
    }
    let tables = Tables::open(&rels);
    let ledger = &tables.ledger;
    // quota.history (0.6.0) before any row lock: no lock wait while holding one.
    tables.history();
    let mut ended = Vec::new();
    // The tickets ended, by role (quota.stats counts tickets; `ended` has units).
    let mut tickets: std::collections::HashMap<pg_sys::Oid, u64> = Default::default();
    for (tid, key, until, weight) in due {
        // A finish() or renew() of the ticket in an open transaction: leave it to a
        // later sweep rather than wait for that transaction.
        // Left for a later sweep, which the lease floor then calls for.
        let left = || {
            if let Some(f) = floor {
                f.fetch_min(until, Ordering::AcqRel);
            }
        };
        if !ledger.lock_nowait(tid) {
            left();
            continue;
        }
        let Some(tuple) = expired_version(ledger, rels.ncols, tid, until) else {
            left();
            continue;
        };
        if tables.end(tid, tuple, &[COL_ENDED_AT, COL_OUTCOME]) == pg_sys::TM_Result::TM_Ok {
            crate::scopes::add_change(&mut ended, key, -weight, 0, None);
            *tickets.entry(key.role).or_default() += 1;
        } else {
            left();
        }
    }
    drop(tables);
    drop(reader);
    // Published before the commit, applied after it (see scopes.rs).
    let overflow = crate::scopes::publish(&ended);
    // The counters of roles that did not fit are rebuilt from the ledger instead.
    OVERFLOWED.with_borrow_mut(|o| *o = overflow);
    SWEPT.with_borrow_mut(|s| *s = tickets.into_iter().collect());
}

thread_local! {
    static OVERFLOWED: std::cell::RefCell<Vec<ScopeKey>> = const { std::cell::RefCell::new(Vec::new()) };
}
