//! Layer 5, the paths: the ledger writer, one background worker per database, the only
//! process that inserts into `quota.ledger`. It commits each charge in its own
//! transaction, so the charge survives the caller's rollback (I2), and it is on disk
//! before the caller's `start()` returns (I6). Being the single inserter, it re-checks
//! the limits exactly inside its own transaction before every insert (core::batch),
//! which keeps I1 true whatever settings the requesting sessions run with, and for a
//! caller that was cancelled after handing over its request.
//!
//! Protocol: a caller fills its own slot (see queue/), marks it PENDING, sets the
//! writer's latch and sleeps on its own. The writer claims every PENDING slot of its
//! database, handles them all in one transaction (group commit: one WAL flush for the
//! lot), then marks them DONE and sets each caller's latch.
//!
//! Nothing is ever answered with an error it did not cause: a request whose batch did
//! not commit (the writer was cancelled, terminated, or another request of the batch
//! failed) is retried, or handed back as PENDING to the next writer.
//!
//! This file holds the worker's lifecycle and its loop; the batch (batch.rs), the
//! expiry sweep (sweep.rs), the purge of dropped roles (purge.rs) and the summary
//! rebuild (summary.rs) each have a file, and txn.rs the transaction bracket they share.

mod batch;
mod fold;
mod purge;
mod summary;
mod sweep;
mod txn;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::compat;
use crate::queue::serve;
use crate::shmem;
use crate::workers::{self, TableLock};
use txn::try_in_transaction;

/// The most requests one writer transaction commits together.
const MAX_BATCH: usize = 256;
/// How often the writer writes down the leases that ran out (see sweep.rs), at most.
const SWEEP_EVERY: Duration = Duration::from_millis(250);
/// And, after a sweep that walked all of quota.active (0.6.1: no index of it has
/// lease_until; see sweep.rs for when it does), at most once in this many times as
/// long as that walk took: a queue with a backlog of millions of unended tickets whose
/// leases keep running out spends at most about a twentieth of its writer's time on
/// those walks (see core::lease::sweep_pause).
const SWEEP_SHARE: u32 = 20;
/// How often the writer folds transactional tickets into their roles' summary rows
/// and purges those roles (see fold.rs).
const FOLD_EVERY: Duration = Duration::from_secs(1);
/// How long a new writer waits for its predecessor to release the twin guard.
const TWIN_GUARD_WAIT: Duration = Duration::from_secs(5);
/// The writer never waits longer than this for a lock: a caller holding a lock the
/// writer needs would otherwise deadlock with it unseen by the deadlock detector.
const WRITER_LOCK_TIMEOUT: &std::ffi::CStr = c"5s";
/// How often the writer tries again to purge the tickets of dropped roles after a
/// purge failed (a lock held by maintenance, say).
const PURGE_RETRY: Duration = Duration::from_secs(1);
/// How often an idle writer looks around without being woken.
const POLL_MS: i64 = 250;
/// How long a writer serves before it gives its slot up to a caller of another
/// database that waits for one: a new writer costs a process start, so it should
/// serve more than one batch.
const MIN_TENURE: Duration = Duration::from_millis(50);

/// The twin guard: a session lock that only one writer per database can hold. Its
/// field4 is private to pg_quota, so no SQL advisory lock call can produce it (I4).
pub const WRITER_LOCK_FIELD4: u16 = 0x5157; // "QW"

/// Set once this writer has given up its entry; the exit callback then leaves the
/// table alone, because a new writer may already own the entry and its requests.
/// A background worker is single-threaded, so plain statics suffice.
static mut LEFT: bool = false;
static mut MY_ENTRY: usize = usize::MAX;
static mut HOLDS_GUARD: bool = false;

unsafe extern "C-unwind" {
    /// PostgreSQL's SIGTERM handler for backends (postgres.c). pgrx's binding wraps it
    /// in a Rust function, but a signal handler must be the C symbol itself.
    fn die(signal: std::ffi::c_int);
    /// The standard SIGHUP handler (postmaster/interrupt.c), for the same reason.
    fn SignalHandlerForConfigReload(signal: std::ffi::c_int);
}

/// Entry point of the ledger writer, named in its BackgroundWorker registration.
#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn pg_quota_writer_main(arg: pg_sys::Datum) {
    let raw = arg.value() as u64;
    let idx = (raw >> 32) as usize;
    let db = pg_sys::Oid::from(raw as u32);

    // SAFETY: standard background worker start-up: `die` turns SIGTERM into a FATAL
    // at the next CHECK_FOR_INTERRUPTS, which runs our before_shmem_exit callback;
    // SIGHUP sets ConfigReloadPending, which the main loop acts on.
    //
    // BGWORKER_BYPASS_ALLOWCONN: the writer is part of the database's machinery,
    // like autovacuum. After ALTER DATABASE … ALLOW_CONNECTIONS false, sessions that
    // are still connected keep calling start(), and only a writer can answer them.
    unsafe {
        compat::pqsignal(libc::SIGTERM, Some(die));
        compat::pqsignal(libc::SIGHUP, Some(SignalHandlerForConfigReload));
        pg_sys::BackgroundWorkerUnblockSignals();
        pg_sys::BackgroundWorkerInitializeConnectionByOid(
            db,
            pg_sys::InvalidOid,
            pg_sys::BGWORKER_BYPASS_ALLOWCONN,
        );
        MY_ENTRY = idx;
        pg_sys::before_shmem_exit(Some(on_exit), pg_sys::Datum::from(0));
    }
    {
        let _lock = TableLock::acquire();
        // SAFETY: the table lock is held exclusively; no other reference to the entry.
        let w = unsafe { workers::writer_mut(idx) };
        if w.dboid != db || w.procno != -1 {
            // The entry was freed or taken over while we started: not ours to serve.
            // SAFETY: single-threaded worker state.
            unsafe { LEFT = true };
            return;
        }
        w.procno = shmem::my_procno() as i32;
    }
    if !take_twin_guard(db) {
        log!(
            "pg_quota: another ledger writer still serves database {}",
            u32::from(db)
        );
        return;
    }
    crate::stats::writer_started(db);
    configure_session();
    // Before anything is admitted: tickets of roles dropped while no writer ran.
    let roles_dropped = workers::roles_dropped().load(Ordering::Acquire);
    let purge_due =
        (!purge::purge_dropped_roles_and_counters()).then(|| Instant::now() + PURGE_RETRY);
    try_in_transaction("rebuild the summary", summary::rebuild_summary);
    main_loop(idx, db, roles_dropped, purge_due);
}

/// The tag of the twin guard of database `db`. It lives in the user lock method, as
/// advisory locks do, because that is the method whose session locks PostgreSQL
/// releases when a process exits (ShutdownPostgres); its field4 is still private.
fn twin_guard_tag(db: pg_sys::Oid) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        locktag_field1: u32::from(db),
        locktag_field2: 0,
        locktag_field3: 0,
        locktag_field4: WRITER_LOCK_FIELD4,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

/// A session-level lock on a tag only pg_quota uses: a second writer for the same
/// database cannot get it. A predecessor that is still exiting releases it within
/// moments, so we wait for it rather than give up, and give up only on a twin that
/// keeps it (which the entry table makes impossible; this is the belt to its braces).
fn take_twin_guard(db: pg_sys::Oid) -> bool {
    let began = Instant::now();
    loop {
        // SAFETY: a conditional session lock, released in `leave` or `on_exit`.
        let r = unsafe {
            pg_sys::LockAcquire(
                &twin_guard_tag(db),
                pg_sys::ExclusiveLock as i32,
                true,
                true,
            )
        };
        if r != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL {
            // SAFETY: single-threaded worker state.
            unsafe { HOLDS_GUARD = true };
            return true;
        }
        if began.elapsed() >= TWIN_GUARD_WAIT {
            return false;
        }
        compat::nap(50, compat::Wait::WriterStart);
    }
}

fn release_twin_guard(db: pg_sys::Oid) {
    // SAFETY: single-threaded worker state; the lock was taken in take_twin_guard.
    unsafe {
        if HOLDS_GUARD {
            pg_sys::LockRelease(&twin_guard_tag(db), pg_sys::ExclusiveLock as i32, true);
            HOLDS_GUARD = false;
        }
    }
}

fn configure_session() {
    let set = |name: &std::ffi::CStr, value: &std::ffi::CStr| {
        // SAFETY: plain GUC assignment in the worker's own session.
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_OVERRIDE,
            )
        }
    };
    set(c"lock_timeout", WRITER_LOCK_TIMEOUT);
    // A database's or role's timeouts reach background workers too (PostgreSQL 17's
    // transaction_timeout ends the worker with FATAL). The writer bounds its own waits
    // with lock_timeout and fails just the batch; nothing else may end it.
    for name in crate::compat::SESSION_TIMEOUTS {
        set(name, c"0");
    }
    set(c"search_path", c"pg_catalog, pg_temp");
    // The writer's exact count relies on a fresh snapshot per batch, and it never
    // takes part in SSI.
    set(c"default_transaction_isolation", c"read committed");
    set(c"default_transaction_read_only", c"off");
    // SAFETY: reports the worker as idle in pg_stat_activity.
    unsafe { pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_IDLE, std::ptr::null()) };
}

fn main_loop(idx: usize, db: pg_sys::Oid, mut roles_dropped: u64, mut purge_due: Option<Instant>) {
    let started = Instant::now();
    let mut last_work = Instant::now();
    let mut next_sweep = Instant::now();
    let mut last_fold = Instant::now();
    // The last fold left restored tickets to adopt (see fold.rs): fold again at once.
    let mut fold_again = false;
    // A role drop is purged twice: at once, and a second later. The dropping backend
    // wakes us before it sends its catalog invalidations, so the first purge may still
    // see the role in our syscache. A purge that fails is tried again every
    // PURGE_RETRY until one commits.
    let mut purge_again: Option<Instant> = None;
    loop {
        // SAFETY: our own latch; reset before looking for work so no wake-up is lost.
        unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
        // pg_cancel_backend on an idle writer cancels nothing: a batch in progress
        // retries on cancel (see process), and outside a batch there is no statement.
        // SAFETY: a backend flag, as ProcessInterrupts reads it.
        unsafe { pg_sys::QueryCancelPending = 0 };
        pgrx::check_for_interrupts!();
        // SAFETY: the flag is set by our SIGHUP handler; reloading the configuration
        // file is what every background process does with it.
        unsafe {
            if pg_sys::ConfigReloadPending != 0 {
                pg_sys::ConfigReloadPending = 0;
                pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP);
                configure_session();
            }
        }
        let w = workers::writer(idx);
        if w.exit_requested.load(Ordering::Acquire) {
            leave(idx, db, true);
            return;
        }
        let dropped = workers::roles_dropped().load(Ordering::Acquire);
        let due = |t: Option<Instant>| t.is_some_and(|t| Instant::now() >= t);
        if dropped != roles_dropped || due(purge_again) || due(purge_due) {
            if dropped != roles_dropped {
                purge_again = Some(Instant::now() + Duration::from_secs(1));
            } else if due(purge_again) {
                purge_again = None;
            }
            roles_dropped = dropped;
            purge_due =
                (!purge::purge_dropped_roles_and_counters()).then(|| Instant::now() + PURGE_RETRY);
        }
        if w.rebuild_summary.swap(false, Ordering::AcqRel) {
            try_in_transaction("rebuild the summary", summary::rebuild_summary);
        }
        if Instant::now() >= next_sweep {
            let began = Instant::now();
            let walk = sweep::sweep_expired_and_wake(&w.lease_floor);
            next_sweep = began
                + walk.map_or(SWEEP_EVERY, |took| {
                    crate::core::lease::sweep_pause(took, SWEEP_EVERY, SWEEP_SHARE)
                });
        }
        if fold_again || last_fold.elapsed() >= FOLD_EVERY {
            last_fold = Instant::now();
            fold_again = fold::fold_and_purge();
        }
        let batch = serve::claim(db, MAX_BATCH, crate::scopes::PENDING_PER_SLOT);
        if !batch.is_empty() || fold_again {
            if !batch.is_empty() {
                batch::process(batch);
            }
            report_stats();
            last_work = Instant::now();
            continue;
        }
        // Table statistics (pg_stat_user_tables, and so autovacuum) see our writes
        // while we live, not only when we exit.
        report_stats();
        let idle_long = last_work.elapsed() >= crate::gucs::writer_idle_timeout();
        if (idle_long || w.leave_when_idle.load(Ordering::Acquire)) && leave(idx, db, false) {
            return;
        }
        // A caller of another database waits for a writer slot: give ours up while we
        // have nothing to do; our next caller waits for a slot in turn. One writer
        // answers each request; one that cannot leave (a request came in, or it has
        // served less than MIN_TENURE) passes it on; a request nobody waits for any
        // more is dropped.
        if workers::take_yield() && crate::queue::caller::line_head() != 0 {
            if started.elapsed() >= MIN_TENURE && leave(idx, db, false) {
                return;
            }
            workers::want_yield();
        }
        // SAFETY: our own latch; WL_EXIT_ON_PM_DEATH ends us with the postmaster.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                POLL_MS,
                compat::wait_event(compat::Wait::WriterMain),
            );
        }
    }
}

fn report_stats() {
    // SAFETY: outside any transaction; flushes at most once a second unless forced.
    unsafe { pg_sys::pgstat_report_stat(false) };
}

/// Gives up this writer's entry. Unless `force`, only when no request of its database
/// is waiting (checked under the table lock, which callers hold to enqueue). Requests
/// still waiting are left PENDING: their callers start a new writer.
fn leave(idx: usize, db: pg_sys::Oid, force: bool) -> bool {
    let _lock = TableLock::acquire();
    if !force {
        if serve::pending_in(db) {
            return false;
        }
    }
    // quota.writer_stats: a clean exit, recorded before a successor can start.
    crate::stats::writer_exits(true);
    // The guard first: a new writer may take the entry the moment it is free.
    release_twin_guard(db);
    // SAFETY: the table lock is held exclusively; no other reference to the entry.
    let w = unsafe { workers::writer_mut(idx) };
    workers::record_exit(w, db);
    w.dboid = pg_sys::InvalidOid;
    w.procno = -1;
    w.exit_requested.store(false, Ordering::Release);
    w.leave_when_idle.store(false, Ordering::Release);
    w.rebuild_summary.store(false, Ordering::Release);
    workers::note_left();
    crate::queue::caller::wake_line_head();
    // SAFETY: single-threaded worker state.
    unsafe { LEFT = true };
    true
}

/// Runs when the writer exits for any reason, FATAL included (pg_terminate_backend).
/// A batch that committed is answered; one that did not is handed back as PENDING,
/// for the next writer: its requests did nothing wrong.
#[pg_guard]
unsafe extern "C-unwind" fn on_exit(_code: i32, _arg: pg_sys::Datum) {
    // SAFETY: single-threaded worker state; shared state is changed under the lock.
    unsafe {
        if shmem::available() {
            // quota.writer_stats: a writer that did not give up its entry left uncleanly.
            crate::stats::writer_exits(LEFT);
        }
        if LEFT || MY_ENTRY == usize::MAX || !shmem::available() {
            return;
        }
        // A FATAL can arrive while we hold LWLocks; ShutdownPostgres, which would
        // release them, runs after this callback.
        pg_sys::LWLockReleaseAll();
        let db = shmem::my_db();
        release_twin_guard(db);
        let committed = batch::committed();
        // Before the table lock: the scope lock is never taken while holding it. Each
        // published change is judged by its own transaction: the last one may have been
        // the expiry sweep's, not the batch's.
        crate::scopes::apply_mine();
        let _lock = TableLock::acquire();
        batch::hand_back_at_exit(committed);
        // The table lock is held exclusively; no other reference to the entry.
        let w = workers::writer_mut(MY_ENTRY);
        if w.dboid == db && w.procno == shmem::my_procno() as i32 {
            // This process stays connected to the database for a moment after this
            // callback: DROP DATABASE waits for it (workers::stop).
            workers::record_exit(w, db);
            w.dboid = pg_sys::InvalidOid;
            w.procno = -1;
        }
        // Callers still waiting for this database notice at once that we are gone,
        // and start a new writer.
        serve::wake_pending(db);
    }
}
