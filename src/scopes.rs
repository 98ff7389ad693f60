//! Scope counters in shared memory: each (database, role)'s active tickets and ledger
//! rows, so that admission does not walk row versions.
//!
//! Counting with index scans under the latest snapshot is exact but walks every dead
//! row version that an old snapshot keeps alive (a `pg_dump`, an idle REPEATABLE READ
//! session): the index entry that each finished ticket leaves behind, and each version
//! of a role's summary row. Admission slowed down by 3x to 10x while one was open. The
//! counters make admission cost independent of that. The ledger stays the truth: a
//! counter is built from it (`rebuild`) when missing or stale, and kept up to date by
//! the changes that commit:
//!
//! - the writer's batch adds its admissions (and subtracts its purges) to `active` and
//!   `rows` right after it commits, before it answers anyone;
//! - a transaction that finished tickets subtracts them from `active` when it commits.
//!
//! A rebuild counts under a snapshot S, while such changes may commit around it. Each
//! change is therefore published before its transaction commits (`publish`), with the
//! transaction's id, and applied after (`apply_mine`). A rebuild holds the lock
//! exclusively, so no change is applied while it runs; it marks every published change
//! whose transaction S already sees as absorbed, and those are not applied again. A
//! change whose transaction S does not see yet is applied to the rebuilt value. So
//! nothing is counted twice or lost. Between a commit and its application a counter is
//! one behind: it over-counts active tickets for a moment (a finish not yet applied),
//! which is allowed; admissions not yet applied are still in the callers' in-flight
//! count, since the writer answers only after applying them.
//!
//! A counter is valid only for the relations it was built from: each carries the
//! relfilenodes of the ledger and the summary. TRUNCATE of either (the triggers
//! truncate the summary after any SQL-level write to the ledger), VACUUM FULL or a
//! reinstall gives them new ones, and the next reader rebuilds. If the table is full,
//! a role has no counter and admission counts from the ledger as before.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::core::stats::Counter;
use crate::counts::Latest;
use crate::shmem;

/// Counters for this many scopes across the cluster.
pub const N_SCOPES: usize = 16384;
/// Pending changes one backend can publish for one transaction: one per role. A
/// transaction that touches more roles invalidates the others' counters instead.
pub const PENDING_PER_SLOT: usize = 64;

const FREE_KEY: u32 = 0;
/// A removed entry: probing goes on past it; inserting may reuse it.
const TOMBSTONE: u32 = u32::MAX;

#[repr(C)]
pub struct Scope {
    db: AtomicU32,
    role: AtomicU32,
    valid: AtomicBool,
    ledger_node: AtomicU32,
    summary_node: AtomicU32,
    active: AtomicI64,
    rows: AtomicI64,
}

const PENDING_FREE: u32 = 0;
const PENDING_SET: u32 = 1;
const PENDING_ABSORBED: u32 = 2;

#[repr(C)]
pub struct Pending {
    state: AtomicU32,
    db: AtomicU32,
    role: AtomicU32,
    xid: AtomicU32,
    d_active: AtomicI64,
    d_rows: AtomicI64,
}

/// The relfilenodes a counter was built from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Tags {
    pub ledger: u32,
    pub summary: u32,
}

/// Holds the scope lock. Lock order: never take it while holding the writer-table
/// lock (shmem::TableLock); taking the table lock while holding this one is allowed (a
/// rebuild may ask the writer to rebuild summary rows).
struct Held;

impl Held {
    fn acquire(mode: pg_sys::LWLockMode::Type) -> Held {
        // SAFETY: the lock was set up at startup; abort releases it after an ERROR.
        unsafe { pg_sys::LWLockAcquire(shmem::scope_lock(), mode) };
        Held
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: held since `acquire`, unless an abort released it already.
        unsafe {
            if pg_sys::LWLockHeldByMe(shmem::scope_lock()) {
                pg_sys::LWLockRelease(shmem::scope_lock());
            }
        }
    }
}

fn home(db: u32, role: u32) -> usize {
    let h = (u64::from(db).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        ^ u64::from(role).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    (h >> 17) as usize % N_SCOPES
}

/// The entry of (db, role). The caller holds the lock.
fn find(db: u32, role: u32) -> Option<&'static Scope> {
    let table = shmem::scopes();
    let start = home(db, role);
    for k in 0..N_SCOPES {
        let e = &table[(start + k) % N_SCOPES];
        match e.db.load(Ordering::Relaxed) {
            FREE_KEY => return None,
            d if d == db && e.role.load(Ordering::Relaxed) == role => return Some(e),
            _ => {}
        }
    }
    None
}

/// The entry of (db, role), created (invalid) if missing. The caller holds the lock
/// exclusively. None when the table is full.
fn find_or_insert(db: u32, role: u32) -> Option<&'static Scope> {
    if let Some(e) = find(db, role) {
        return Some(e);
    }
    let table = shmem::scopes();
    let start = home(db, role);
    (0..N_SCOPES)
        .map(|k| &table[(start + k) % N_SCOPES])
        .find(|e| matches!(e.db.load(Ordering::Relaxed), FREE_KEY | TOMBSTONE))
        .inspect(|e| {
            e.valid.store(false, Ordering::Relaxed);
            e.role.store(role, Ordering::Relaxed);
            e.db.store(db, Ordering::Relaxed);
        })
}

fn current(e: &Scope, tags: Tags) -> Option<(i64, i64)> {
    (e.valid.load(Ordering::Acquire)
        && e.ledger_node.load(Ordering::Relaxed) == tags.ledger
        && e.summary_node.load(Ordering::Relaxed) == tags.summary)
        .then(|| {
            (
                e.active.load(Ordering::Acquire),
                e.rows.load(Ordering::Acquire),
            )
        })
}

/// (active, rows) of (db, role): from its counter, rebuilt first with `count` (the
/// ledger's numbers under the snapshot it is given) if missing or stale. None if the
/// table is full; the caller then counts from the ledger itself.
pub fn get(
    db: pg_sys::Oid,
    role: pg_sys::Oid,
    tags: Tags,
    count: impl FnOnce(&Latest) -> Option<(i64, i64)>,
) -> Option<(i64, i64)> {
    let (db, role) = (u32::from(db), u32::from(role));
    {
        let _s = Held::acquire(pg_sys::LWLockMode::LW_SHARED);
        if let Some(v) = find(db, role).and_then(|e| current(e, tags)) {
            return Some(v);
        }
    }
    let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    let e = find_or_insert(db, role)?;
    if let Some(v) = current(e, tags) {
        return Some(v);
    }
    // The snapshot is taken under the exclusive lock: no change is applied until we
    // are done, and every change that S sees committed was published before that.
    let snap = Latest::take();
    // Count as every other backend sees the ledger: without this transaction's own
    // uncommitted changes. A ticket it finished is still active until it commits, and
    // its finish is applied then (it is published only at commit, so no rebuild can
    // absorb it); counting it as ended here would count that finish twice.
    // SAFETY: `take` registered a private copy of the snapshot.
    unsafe { (*snap.0).curcid = pg_sys::FirstCommandId };
    let (active, rows) = count(&snap)?;
    for procno in 0..shmem::n_slots() {
        for p in shmem::pending(procno) {
            if p.state.load(Ordering::Acquire) == PENDING_SET
                && p.db.load(Ordering::Relaxed) == db
                && p.role.load(Ordering::Relaxed) == role
                // SAFETY: a snapshot check; the snapshot is registered.
                && !unsafe { pg_sys::XidInMVCCSnapshot(pg_sys::TransactionId::from_inner(p.xid.load(Ordering::Relaxed)), snap.0) }
            {
                let _ = p.state.compare_exchange(
                    PENDING_SET,
                    PENDING_ABSORBED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        }
    }
    e.active.store(active, Ordering::Release);
    e.rows.store(rows, Ordering::Release);
    e.ledger_node.store(tags.ledger, Ordering::Relaxed);
    e.summary_node.store(tags.summary, Ordering::Relaxed);
    e.valid.store(true, Ordering::Release);
    Some((active, rows))
}

/// Publishes this backend's changes of the transaction that is about to commit, as
/// (role, Δactive, Δrows). Returns the roles that did not fit; their counters must be
/// invalidated once the transaction has committed (`invalidate`).
pub fn publish(changes: &[(pg_sys::Oid, i64, i64)]) -> Vec<pg_sys::Oid> {
    let mine = shmem::pending(shmem::my_procno());
    // SAFETY: plain reads of backend state; the transaction wrote, so it has an id.
    let (db, xid) = unsafe { (shmem::my_db(), pg_sys::GetTopTransactionIdIfAny()) };
    let mut overflow = Vec::new();
    for (k, &(role, d_active, d_rows)) in changes.iter().enumerate() {
        let Some(p) = mine.get(k) else {
            overflow.push(role);
            continue;
        };
        p.db.store(u32::from(db), Ordering::Relaxed);
        p.role.store(u32::from(role), Ordering::Relaxed);
        p.xid.store(xid.into_inner(), Ordering::Relaxed);
        p.d_active.store(d_active, Ordering::Relaxed);
        p.d_rows.store(d_rows, Ordering::Relaxed);
        p.state.store(PENDING_SET, Ordering::Release);
    }
    overflow
}

/// After a transaction of this backend ended: applies each of its published changes
/// whose transaction committed (those a rebuild absorbed are not applied again), and
/// clears them all. Each change is judged by the transaction id it was published with,
/// not by what the caller believes ended: the writer's exit callback cannot know
/// whether its last change was a batch's or the expiry sweep's, and a transaction
/// still in progress (a FATAL in the middle of it) has not committed. Never raises an
/// error: it runs inside commit.
pub fn apply_mine() {
    if !shmem::available() {
        return;
    }
    let mine = shmem::pending(shmem::my_procno());
    if mine
        .iter()
        .all(|p| p.state.load(Ordering::Acquire) == PENDING_FREE)
    {
        return;
    }
    let _s = Held::acquire(pg_sys::LWLockMode::LW_SHARED);
    for p in mine {
        let set = p
            .state
            .compare_exchange(
                PENDING_SET,
                PENDING_FREE,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        // SAFETY: a commit log lookup of a transaction that has ended or is ours.
        let committed = set
            && unsafe {
                pg_sys::TransactionIdDidCommit(pg_sys::TransactionId::from_inner(
                    p.xid.load(Ordering::Relaxed),
                ))
            };
        if committed {
            if let Some(e) = find(p.db.load(Ordering::Relaxed), p.role.load(Ordering::Relaxed)) {
                e.active
                    .fetch_add(p.d_active.load(Ordering::Relaxed), Ordering::AcqRel);
                e.rows
                    .fetch_add(p.d_rows.load(Ordering::Relaxed), Ordering::AcqRel);
            }
        }
        p.state.store(PENDING_FREE, Ordering::Release);
    }
}

/// Marks the counters of `roles` in this database as stale.
pub fn invalidate(roles: &[pg_sys::Oid]) {
    if roles.is_empty() || !shmem::available() {
        return;
    }
    let db = u32::from(shmem::my_db());
    let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    for &r in roles {
        if let Some(e) = find(db, u32::from(r)) {
            e.valid.store(false, Ordering::Release);
        }
    }
}

/// Removes the counters of `db` (all roles if `roles` is None), for dropped roles and
/// databases, so that the table does not fill up with them.
pub fn forget(db: pg_sys::Oid, roles: Option<&[pg_sys::Oid]>) {
    if !shmem::available() {
        return;
    }
    let db = u32::from(db);
    let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    for e in shmem::scopes() {
        if e.db.load(Ordering::Relaxed) != db {
            continue;
        }
        let role = pg_sys::Oid::from(e.role.load(Ordering::Relaxed));
        if roles.is_none_or(|rs| rs.contains(&role)) {
            e.valid.store(false, Ordering::Release);
            e.db.store(TOMBSTONE, Ordering::Relaxed);
        }
    }
}

// ---------------------------------------------------------------------------------
// finish(): a backend's finished tickets, applied when its transaction commits
// ---------------------------------------------------------------------------------

// Single-threaded backend state: the tickets finished by the current transaction, as
// (role, subtransaction nesting level), and the roles that did not fit when published.
static mut FINISHED: Vec<(pg_sys::Oid, i32)> = Vec::new();
static mut OVERFLOW: Vec<pg_sys::Oid> = Vec::new();
/// The statistics the current transaction owes quota.stats when it commits: finishes
/// by outcome and renewals, as ((role, counter), subtransaction nesting level).
static mut STATS_OWED: Vec<((pg_sys::Oid, Counter), i32)> = Vec::new();
static mut CALLBACKS_REGISTERED: bool = false;

fn nest_level() -> i32 {
    // SAFETY: single-threaded backend state; the callbacks are registered once.
    unsafe {
        if !CALLBACKS_REGISTERED {
            pg_sys::RegisterXactCallback(Some(xact_event), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(subxact_event), std::ptr::null_mut());
            CALLBACKS_REGISTERED = true;
        }
        pg_sys::GetCurrentTransactionNestLevel()
    }
}

/// Records that this transaction ended a ticket of `role` with `outcome`; its scope's
/// counter drops, and quota.stats counts the finish, when (and only if) the
/// transaction commits.
pub fn note_finish(role: pg_sys::Oid, outcome: crate::core::Outcome) {
    let level = nest_level();
    // SAFETY: single-threaded backend state.
    unsafe {
        (*std::ptr::addr_of_mut!(FINISHED)).push((role, level));
        (*std::ptr::addr_of_mut!(STATS_OWED)).push(((role, Counter::finished(outcome)), level));
    }
}

/// Records that this transaction renewed a ticket of `role`: quota.stats counts it
/// when (and only if) the transaction commits.
pub fn note_renew(role: pg_sys::Oid) {
    let level = nest_level();
    // SAFETY: single-threaded backend state.
    unsafe { (*std::ptr::addr_of_mut!(STATS_OWED)).push(((role, Counter::Renewed), level)) };
}

#[pg_guard]
unsafe extern "C-unwind" fn xact_event(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    // SAFETY: single-threaded backend state.
    unsafe {
        let finished = &mut *std::ptr::addr_of_mut!(FINISHED);
        let overflow = &mut *std::ptr::addr_of_mut!(OVERFLOW);
        let owed = &mut *std::ptr::addr_of_mut!(STATS_OWED);
        match event {
            pg_sys::XactEvent::XACT_EVENT_COMMIT => {
                for ((role, counter), _) in owed.drain(..) {
                    crate::stats::add(role, counter, 1);
                }
            }
            // A prepared renew commits elsewhere, later: not counted. Aborted work is
            // not counted either.
            pg_sys::XactEvent::XACT_EVENT_PREPARE | pg_sys::XactEvent::XACT_EVENT_ABORT => {
                owed.clear();
            }
            _ => {}
        }
        match event {
            pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT if !finished.is_empty() => {
                let mut per_role: Vec<(pg_sys::Oid, i64, i64)> = Vec::new();
                for &(role, _) in finished.iter() {
                    match per_role.iter_mut().find(|(r, _, _)| *r == role) {
                        Some(c) => c.1 -= 1,
                        None => per_role.push((role, -1, 0)),
                    }
                }
                *overflow = publish(&per_role);
            }
            pg_sys::XactEvent::XACT_EVENT_PRE_PREPARE if !finished.is_empty() => {
                // COMMIT PREPARED runs elsewhere, later: its finish could not be
                // applied to the counters.
                pgrx::pg_sys::panic::ErrorReport::new(
                    PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                    "cannot PREPARE a transaction that has finished pg_quota tickets",
                    "pg_quota",
                )
                .set_hint("Finish tickets in transactions that commit directly.")
                .report(PgLogLevel::ERROR);
            }
            pg_sys::XactEvent::XACT_EVENT_COMMIT => {
                apply_mine();
                invalidate(overflow);
                // Freed slots: starts waiting in this scope or for the database cap
                // look again (see waiters.rs).
                let mut woken: Vec<pg_sys::Oid> = Vec::new();
                for &(role, _) in finished.iter() {
                    if !woken.contains(&role) {
                        woken.push(role);
                        crate::waiters::wake(shmem::my_db(), role);
                    }
                }
                finished.clear();
                overflow.clear();
            }
            pg_sys::XactEvent::XACT_EVENT_ABORT => {
                apply_mine();
                finished.clear();
                overflow.clear();
            }
            _ => {}
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn subxact_event(
    event: pg_sys::SubXactEvent::Type,
    _my_subid: pg_sys::SubTransactionId,
    _parent_subid: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    // SAFETY: single-threaded backend state.
    unsafe {
        let finished = &mut *std::ptr::addr_of_mut!(FINISHED);
        let owed = &mut *std::ptr::addr_of_mut!(STATS_OWED);
        // A rolled-back savepoint (or a caught error) undoes its finishes and renewals.
        at_subxact_end(finished, event);
        at_subxact_end(owed, event);
    }
}

/// Keeps a list of what a transaction did, each item with the subtransaction nesting
/// level that did it, in step with the subtransaction that ends: what a rolled-back
/// one did is forgotten, what a committed one did becomes its parent's.
pub fn at_subxact_end<T>(items: &mut Vec<(T, i32)>, event: pg_sys::SubXactEvent::Type) {
    // SAFETY: a plain read of transaction state.
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    match event {
        pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => items.retain(|(_, l)| *l < level),
        pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => {
            for item in items.iter_mut().filter(|i| i.1 >= level) {
                item.1 = level - 1;
            }
        }
        _ => {}
    }
}
