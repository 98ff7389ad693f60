//! The ledger writer: one background worker per database, the only process that
//! inserts into `quota.ledger`. It commits each charge in its own transaction, so the
//! charge survives the caller's rollback (I2), and it is on disk before the caller's
//! `start()` returns (I6). Being the single inserter, it re-checks the limits exactly
//! inside its own transaction before every insert (core::batch), which keeps I1 true
//! whatever settings the requesting sessions run with, and for a caller that was
//! cancelled after handing over its request.
//!
//! Protocol: a caller fills its own slot (see shmem.rs), marks it PENDING, sets the
//! writer's latch and sleeps on its own. The writer claims every PENDING slot of its
//! database, handles them all in one transaction (group commit: one WAL flush for the
//! lot), then marks them DONE and sets each caller's latch.
//!
//! Nothing is ever answered with an error it did not cause: a request whose batch did
//! not commit (the writer was cancelled, terminated, or another request of the batch
//! failed) is retried, or handed back as PENDING to the next writer.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;

use std::collections::HashMap;

use crate::compat;
use crate::core::batch::{self, BatchRequest, Counted};
use crate::core::{uuid_v7, Decision, Limits, QuotaError, RefusalKind, Usage};
use crate::counts::{self, Key, Latest, Reader};
use crate::error::raise;
use crate::heap::OpenRel;
use crate::shmem::{self, *};

/// How often a waiting caller or an idle writer looks around without being woken.
const POLL_MS: i64 = 250;
/// How often a waiting caller makes sure its writer is still there.
const LIVENESS_EVERY: Duration = Duration::from_millis(500);
/// How many writers a caller starts for one request before it gives up: a writer
/// that keeps exiting before it serves anything will not do better the next time.
const MAX_WRITER_STARTS: u32 = 3;
/// The most requests one writer transaction commits together.
const MAX_BATCH: usize = 256;
/// How often the writer writes down the leases that ran out (see `sweep_expired`).
const SWEEP_EVERY: Duration = Duration::from_millis(250);
/// How often a batch is retried after the writer's statement was cancelled
/// (pg_cancel_backend on the writer): the requests did nothing wrong.
const MAX_CANCEL_RETRIES: u32 = 3;
/// How long a new writer waits for its predecessor to release the twin guard.
const TWIN_GUARD_WAIT: Duration = Duration::from_secs(5);
/// The writer never waits longer than this for a lock: a caller holding a lock the
/// writer needs would otherwise deadlock with it unseen by the deadlock detector.
const WRITER_LOCK_TIMEOUT: &std::ffi::CStr = c"5s";
/// How often the writer tries again to purge the tickets of dropped roles after a
/// purge failed (a lock held by maintenance, say).
const PURGE_RETRY: Duration = Duration::from_secs(1);
/// How long DROP DATABASE waits for the database's writer to leave by itself before it
/// terminates it, and as long again for it to be gone (see `stop`).
const STOP_WAIT: Duration = Duration::from_secs(5);

/// The twin guard: a session lock that only one writer per database can hold. Its
/// field4 is private to pg_quota, so no SQL advisory lock call can produce it (I4).
pub const WRITER_LOCK_FIELD4: u16 = 0x5157; // "QW"

// ---------------------------------------------------------------------------------
// Caller side
// ---------------------------------------------------------------------------------

/// The writer's answer to one start.
pub enum Answer {
    /// The ticket (new, or the one the request's idempotency key already had).
    Admitted([u8; 16]),
    Refused(RefusalKind, Usage, Option<pg_sys::TimestampTz>),
}

// Single-threaded backend state.
static mut EXIT_CALLBACK_REGISTERED: bool = false;

/// Runs at backend exit, FATAL included (pg_terminate_backend, idle_session_timeout,
/// client_connection_check_interval), where no Rust destructor runs: a request the
/// writer has not claimed yet is withdrawn, so it can never become a ticket that
/// nobody holds. A claimed one is the writer's to finish (over-count at worst).
#[pg_guard]
unsafe extern "C-unwind" fn withdraw_at_exit(_code: i32, _arg: pg_sys::Datum) {
    if !shmem::available() {
        return;
    }
    let me = shmem::my_procno();
    if me < shmem::n_slots() {
        let _ = shmem::slot(me).state.compare_exchange(
            SLOT_PENDING,
            SLOT_FREE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// Hands one start request to this database's writer. The caller then calls `wait`.
pub fn enqueue(fill: impl FnOnce(&mut Request)) {
    let me = shmem::my_procno();
    if me >= shmem::n_slots() {
        pgrx::error!("pg_quota: process number {me} has no request slot");
    }
    // SAFETY: single-threaded backend state; the callback is registered once.
    unsafe {
        if !EXIT_CALLBACK_REGISTERED {
            pg_sys::before_shmem_exit(Some(withdraw_at_exit), pg_sys::Datum::from(0));
            EXIT_CALLBACK_REGISTERED = true;
        }
    }
    let slot = shmem::slot(me);
    reclaim(slot);

    // SAFETY: the slot is FREE and ours (indexed by our PGPROC number), so nobody
    // else reads its payload until we publish it with the Release store below.
    unsafe { fill(&mut *slot.request.get()) };
    slot.dboid
        .store(u32::from(shmem::my_db()), Ordering::Relaxed);
    // SAFETY: a plain read of backend state.
    let role = unsafe { pg_sys::GetUserId() };
    slot.role.store(u32::from(role), Ordering::Relaxed);
    // The common case, a running writer, needs only the shared lock. Callers publish
    // under the table lock, so a writer deciding to leave (exclusively) sees every
    // request queued for it.
    let db = shmem::my_db();
    {
        let _shared = shmem::TableLock::acquire_shared();
        if let Some(i) = shmem::writer_of(db) {
            publish(slot, i);
            return;
        }
    }
    let _exclusive = shmem::TableLock::acquire();
    let i = shmem::writer_of(db).unwrap_or_else(start_writer);
    publish(slot, i);
}

fn publish(slot: &Slot, idx: usize) {
    slot.state.store(SLOT_PENDING, Ordering::Release);
    if let Ok(p) = usize::try_from(shmem::writer(idx).procno) {
        shmem::wake(p);
    }
}

/// How many requests of `role` in this database are in the writer's hands: handed
/// over and not yet answered. Callers hold the scope lock, so none of their scope can
/// be added meanwhile; a read that races with a slot being reused only miscounts a
/// request that is not of this scope, and the writer's own check is exact in any case.
pub fn inflight(role: pg_sys::Oid) -> i64 {
    let db = shmem::my_db();
    (0..shmem::n_slots())
        .filter(|&i| {
            let s = shmem::slot(i);
            let st = load_state(s);
            (st == SLOT_PENDING || st == SLOT_CLAIMED) && s.dboid() == db && s.role() == role
        })
        .count() as i64
}

/// How many requests of any role in this database are in the writer's hands: what
/// the database cap must count besides the committed tickets. Unlike `inflight`, no
/// lock keeps other scopes from adding to it; the writer's check is the exact one.
pub fn inflight_db() -> i64 {
    let db = shmem::my_db();
    (0..shmem::n_slots())
        .filter(|&i| {
            let s = shmem::slot(i);
            let st = load_state(s);
            (st == SLOT_PENDING || st == SLOT_CLAIMED) && s.dboid() == db
        })
        .count() as i64
}

/// Sleeps up to `ms` milliseconds on our latch, reporting `wait` meanwhile, then checks
/// for interrupts. Returns true if the time ran out, false if the latch was set.
pub fn nap(ms: i64, wait: compat::Wait) -> bool {
    // SAFETY: our own latch; WL_EXIT_ON_PM_DEATH ends us with the postmaster.
    let rc = unsafe {
        let rc = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            ms,
            compat::wait_event(wait),
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        rc
    };
    pgrx::check_for_interrupts!();
    rc & pg_sys::WL_TIMEOUT as i32 != 0
}

/// What a caller knows of this database's writer while it waits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum WriterState {
    /// Registered and starting, or running.
    Alive,
    /// Gone after it had started serving.
    Gone,
    /// Gone before it started serving: it could not connect, or failed at start.
    NeverStarted,
}

/// Checks this database's writer. Frees the entry of a writer that is gone, so that
/// the table never fills up with dead entries.
fn writer_state() -> WriterState {
    let db = shmem::my_db();
    let _lock = shmem::TableLock::acquire();
    let Some(i) = shmem::writer_of(db) else {
        return WriterState::Gone;
    };
    let w = shmem::writer(i);
    let mut pid = 0;
    let mut h = w.handle;
    // SAFETY: `h` has the layout of BackgroundWorkerHandle (see WorkerHandle).
    let status =
        unsafe { pg_sys::GetBackgroundWorkerPid(&mut h as *mut WorkerHandle as *mut _, &mut pid) };
    if status == pg_sys::BgwHandleStatus::BGWH_STOPPED
        || status == pg_sys::BgwHandleStatus::BGWH_POSTMASTER_DIED
    {
        let never = w.procno == -1;
        w.dboid = pg_sys::InvalidOid;
        w.procno = -1;
        return if never {
            WriterState::NeverStarted
        } else {
            WriterState::Gone
        };
    }
    WriterState::Alive
}

/// A caller's wait for the writer: every LIVENESS_EVERY it makes sure a writer is
/// there for the requests of this database, starting a new one when the last one is
/// gone, and gives up with a clear error when writers keep failing to start.
pub struct Patience {
    last_check: Instant,
    starts: u32,
    never_started: u32,
}

impl Patience {
    pub fn new() -> Patience {
        Patience {
            last_check: Instant::now(),
            starts: 0,
            never_started: 0,
        }
    }

    /// Returns true if it found the writer gone (and started a new one).
    pub fn check_writer(&mut self) -> bool {
        if self.last_check.elapsed() < LIVENESS_EVERY {
            return false;
        }
        self.last_check = Instant::now();
        match writer_state() {
            WriterState::Alive => return false,
            WriterState::Gone => {}
            WriterState::NeverStarted => self.never_started += 1,
        }
        if self.never_started >= 2 || self.starts >= MAX_WRITER_STARTS {
            let gave_up = if self.never_started >= 2 {
                QuotaError::WriterDidNotStart {
                    db: database_name(shmem::my_db()),
                }
            } else {
                QuotaError::WriterGone
            };
            withdraw_mine();
            raise(gave_up);
        }
        // Requests of this database may be waiting for a writer: ours, or others'
        // that this caller's scope waits on. Bring one up.
        self.starts += 1;
        let _lock = shmem::TableLock::acquire();
        if shmem::writer_of(shmem::my_db()).is_none() {
            start_writer();
        }
        true
    }
}

/// Withdraws our own request if the writer has not claimed it.
fn withdraw_mine() {
    let slot = shmem::slot(shmem::my_procno());
    let _ =
        slot.state
            .compare_exchange(SLOT_PENDING, SLOT_FREE, Ordering::AcqRel, Ordering::Acquire);
}

pub fn database_name(db: pg_sys::Oid) -> String {
    // SAFETY: a syscache lookup; NULL if the database is gone.
    unsafe {
        let p = pg_sys::get_database_name(db);
        if p.is_null() {
            u32::from(db).to_string()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Waits for the writer's answer to the request `enqueue` handed over.
pub fn wait() -> Answer {
    let slot = shmem::slot(shmem::my_procno());

    // Until DONE, an ERROR (cancel, statement_timeout) withdraws the request if the
    // writer has not claimed it yet. If it has, the writer finishes it and the next
    // request from this backend reclaims the slot: the charge, if any, stays counted
    // (over-count, never under-count). FATAL is covered by withdraw_at_exit.
    struct Withdraw;
    impl Drop for Withdraw {
        fn drop(&mut self) {
            withdraw_mine();
        }
    }
    let guard = Withdraw;
    let mut patience = Patience::new();
    loop {
        if load_state(slot) == SLOT_DONE {
            std::mem::forget(guard);
            return take_reply(slot);
        }
        nap(POLL_MS, compat::Wait::WriterReply);
        if load_state(slot) != SLOT_DONE {
            patience.check_writer();
        }
    }
}

/// Frees this backend's slot if it holds an answer nobody took back: that of a
/// request abandoned while the writer had it (a cancel, or a previous backend with
/// our PGPROC number). Waiters call it, so that their slot looks free and they count
/// as waiting in line (see waiters::ahead). Only the owner moves DONE to FREE.
pub fn drop_abandoned_answer() {
    let me = shmem::my_procno();
    if me < shmem::n_slots() {
        let _ = shmem::slot(me).state.compare_exchange(
            SLOT_DONE,
            SLOT_FREE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// Waits for an answer owed to a request this backend abandoned (it was cancelled
/// after the writer claimed it), then frees the slot. The answer is dropped. A claim
/// is always answered: a writer that exits answers or hands back every request it
/// claimed (on_exit), and a crash resets shared memory. The request may belong to
/// another database (a previous backend with our PGPROC number), so its writer is not
/// ours to judge.
fn reclaim(slot: &'static Slot) {
    loop {
        match load_state(slot) {
            SLOT_FREE => return,
            SLOT_DONE => {
                slot.state.store(SLOT_FREE, Ordering::Release);
                return;
            }
            SLOT_PENDING => {
                // Ours, from a call that errored out between enqueue and wait.
                withdraw_mine();
            }
            _ => {
                nap(POLL_MS, compat::Wait::WriterReply);
            }
        }
    }
}

fn take_reply(slot: &'static Slot) -> Answer {
    // SAFETY: DONE was stored with Release after the writer wrote the reply, and we
    // loaded it with Acquire; the slot is ours until we store FREE.
    let answer = unsafe {
        let r = &*slot.reply.get();
        match r.kind {
            REPLY_ADMITTED => Ok(Answer::Admitted(r.ticket)),
            REPLY_REFUSED => {
                let kind = match r.refusal_kind {
                    1 => RefusalKind::Active,
                    2 => RefusalKind::Retained,
                    _ => RefusalKind::Database,
                };
                Ok(Answer::Refused(
                    kind,
                    Usage {
                        active: r.active,
                        retained: r.retained,
                        db_active: r.db_active,
                        ahead: 0,
                    },
                    r.next_ageout,
                ))
            }
            REPLY_ERROR => Err((
                r.sqlerrcode,
                String::from_utf8_lossy(&r.error[..r.error_len]).into_owned(),
            )),
            _ => Err((0, String::new())),
        }
    };
    if matches!(answer, Ok(Answer::Admitted(_))) {
        // Admitted: leave the line before the slot looks free, so that nobody counts
        // this start both as an active ticket and as a start waiting ahead of them.
        crate::waiters::leave();
    }
    slot.state.store(SLOT_FREE, Ordering::Release);
    let (code, msg) = match answer {
        Ok(a) => return a,
        Err((0, _)) => raise(QuotaError::WriterGone),
        Err(e) => e,
    };
    pg_sys::panic::ErrorReport::new(
        PgSqlErrorCode::from(code),
        format!("pg_quota ledger writer failed: {msg}"),
        "pg_quota",
    )
    .set_hint("No charge was recorded for this call.")
    .report(PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}

/// Claims a free writer entry for this database and registers a writer for it.
/// Called with the table lock held exclusively, when the database has no entry. Dead
/// entries are swept first, so the table cannot fill up with them.
fn start_writer() -> usize {
    let db = shmem::my_db();
    if shmem::writer_of(pg_sys::InvalidOid).is_none() {
        sweep_dead_entries();
    }
    let Some(i) = shmem::writer_of(pg_sys::InvalidOid) else {
        raise(QuotaError::NoWorkerSlot);
    };
    let handle = register_worker(i, db).unwrap_or_else(|| raise(QuotaError::NoWorkerSlot));
    let w = shmem::writer(i);
    w.dboid = db;
    w.procno = -1;
    w.handle = handle;
    w.exit_requested.store(false, Ordering::Relaxed);
    w.leave_when_idle.store(false, Ordering::Relaxed);
    w.rebuild_summary.store(false, Ordering::Relaxed);
    i
}

/// Frees the entries of writers that are no longer running. Table lock held.
fn sweep_dead_entries() {
    for i in 0..shmem::n_writers() {
        let w = shmem::writer(i);
        if w.dboid == pg_sys::InvalidOid {
            continue;
        }
        let mut pid = 0;
        let mut h = w.handle;
        // SAFETY: see writer_state.
        let status = unsafe {
            pg_sys::GetBackgroundWorkerPid(&mut h as *mut WorkerHandle as *mut _, &mut pid)
        };
        if status == pg_sys::BgwHandleStatus::BGWH_STOPPED {
            w.dboid = pg_sys::InvalidOid;
            w.procno = -1;
        }
    }
}

fn register_worker(idx: usize, db: pg_sys::Oid) -> Option<WorkerHandle> {
    fn fill(dst: &mut [std::ffi::c_char], src: &str) {
        for (d, s) in dst.iter_mut().zip(src.bytes().chain(std::iter::once(0))) {
            *d = s as std::ffi::c_char;
        }
    }
    // SAFETY: a zeroed BackgroundWorker is valid; the postmaster copies it.
    unsafe {
        let mut w: pg_sys::BackgroundWorker = std::mem::zeroed();
        fill(
            &mut w.bgw_name,
            &format!("pg_quota ledger writer for database {}", u32::from(db)),
        );
        fill(&mut w.bgw_type, "pg_quota ledger writer");
        fill(&mut w.bgw_library_name, "pg_quota");
        fill(&mut w.bgw_function_name, "pg_quota_writer_main");
        w.bgw_flags =
            (pg_sys::BGWORKER_SHMEM_ACCESS | pg_sys::BGWORKER_BACKEND_DATABASE_CONNECTION) as i32;
        w.bgw_start_time = pg_sys::BgWorkerStartTime::BgWorkerStart_RecoveryFinished;
        w.bgw_restart_time = pg_sys::BGW_NEVER_RESTART;
        w.bgw_main_arg = pg_sys::Datum::from(((idx as u64) << 32) | u64::from(u32::from(db)));
        w.bgw_notify_pid = pg_sys::MyProcPid;
        let mut handle: *mut pg_sys::BackgroundWorkerHandle = std::ptr::null_mut();
        if !pg_sys::RegisterDynamicBackgroundWorker(&mut w, &mut handle) {
            return None;
        }
        // SAFETY: see WorkerHandle: same layout as PostgreSQL's private struct.
        Some(*(handle as *const WorkerHandle))
    }
}

// ---------------------------------------------------------------------------------
// Writer side
// ---------------------------------------------------------------------------------

// The slots of the batch in progress and the transaction that records them: the exit
// callback needs both to answer callers truthfully if the writer is terminated. A
// background worker is single-threaded, so plain statics suffice.
thread_local! {
    /// The group of slots whose transaction is in progress.
    static BATCH: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Slots claimed by this writer and waiting for their turn in the same batch (after
    /// a failed group was split into single requests).
    static QUEUED: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}
static mut BATCH_XID: pg_sys::TransactionId = pg_sys::InvalidTransactionId;
/// Set once this writer has given up its entry; the exit callback then leaves the
/// table alone, because a new writer may already own the entry and its requests.
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
        let _lock = shmem::TableLock::acquire();
        let w = shmem::writer(idx);
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
    let roles_dropped = shmem::roles_dropped().load(Ordering::Acquire);
    let purge_due = (!purge_dropped_roles_and_counters()).then(|| Instant::now() + PURGE_RETRY);
    try_in_transaction("rebuild the summary", rebuild_summary);
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
        nap(50, compat::Wait::WriterStart);
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
    let mut last_work = Instant::now();
    let mut last_sweep = Instant::now() - SWEEP_EVERY;
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
        let w = shmem::writer(idx);
        if w.exit_requested.load(Ordering::Acquire) {
            leave(idx, db, true);
            return;
        }
        let dropped = shmem::roles_dropped().load(Ordering::Acquire);
        let due = |t: Option<Instant>| t.is_some_and(|t| Instant::now() >= t);
        if dropped != roles_dropped || due(purge_again) || due(purge_due) {
            if dropped != roles_dropped {
                purge_again = Some(Instant::now() + Duration::from_secs(1));
            } else if due(purge_again) {
                purge_again = None;
            }
            roles_dropped = dropped;
            purge_due = (!purge_dropped_roles_and_counters()).then(|| Instant::now() + PURGE_RETRY);
        }
        if w.rebuild_summary.swap(false, Ordering::AcqRel) {
            try_in_transaction("rebuild the summary", rebuild_summary);
        }
        if last_sweep.elapsed() >= SWEEP_EVERY {
            last_sweep = Instant::now();
            sweep_expired_and_wake();
        }
        let batch = claim(db);
        if !batch.is_empty() {
            process(batch);
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

/// Claims up to MAX_BATCH PENDING requests of database `db`. The claim is checked
/// after the compare-and-swap: a slot withdrawn and reused by a backend of another
/// database between our read of its database and the swap is handed back.
fn claim(db: pg_sys::Oid) -> Vec<usize> {
    let mut batch = Vec::new();
    // A batch publishes one counter change per role (see scopes.rs): at most as many
    // roles as fit; the others wait for the next batch.
    let mut roles: Vec<pg_sys::Oid> = Vec::new();
    for i in 0..shmem::n_slots() {
        let s = shmem::slot(i);
        if load_state(s) != SLOT_PENDING || s.dboid() != db {
            continue;
        }
        if !roles.contains(&s.role()) && roles.len() == crate::scopes::PENDING_PER_SLOT {
            continue;
        }
        if s.state
            .compare_exchange(
                SLOT_PENDING,
                SLOT_CLAIMED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            continue;
        }
        let claimed_db = s.dboid();
        if claimed_db != db {
            s.state.store(SLOT_PENDING, Ordering::Release);
            let _lock = shmem::TableLock::acquire_shared();
            if let Some(w) = shmem::writer_of(claimed_db) {
                if let Ok(p) = usize::try_from(shmem::writer(w).procno) {
                    shmem::wake(p);
                }
            }
            continue;
        }
        if !roles.contains(&s.role()) {
            roles.push(s.role());
        }
        batch.push(i);
        if batch.len() == MAX_BATCH {
            break;
        }
    }
    batch
}

/// Runs `f` in a transaction of its own, as a background worker does.
fn in_transaction<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: the standard transaction bracket of a background worker; an ERROR in
    // `f` aborts the transaction through the worker's error handling.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        // I6: a charge is on disk before start() returns, even where the server runs
        // with synchronous_commit = off. Set for this transaction only, so that the
        // server's setting, reloaded or not, applies otherwise; stronger settings
        // (remote_apply, …) are kept.
        if pg_sys::synchronous_commit
            < pg_sys::SyncCommitLevel::SYNCHRONOUS_COMMIT_LOCAL_FLUSH as i32
        {
            pg_sys::set_config_option(
                c"synchronous_commit".as_ptr(),
                c"local".as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_LOCAL,
                true,
                pg_sys::PGERROR as i32,
                false,
            );
        }
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    let r = f();
    let commit = Instant::now();
    // SAFETY: closes the bracket opened above.
    unsafe {
        pg_sys::PopActiveSnapshot();
        pg_sys::CommitTransactionCommand();
    }
    LAST_COMMIT_US.set(commit.elapsed().as_micros() as u64);
    r
}

thread_local! {
    /// How long the last commit of `in_transaction` took, for quota.writer_stats.
    static LAST_COMMIT_US: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Handles one batch, then answers every caller in it. A group whose transaction
/// fails is retried when the failure was not the requests' doing (a cancel), or split
/// into single requests when one of them may be the cause, so that one request's
/// failure never fails another's.
fn process(batch: Vec<usize>) {
    QUEUED.with_borrow_mut(|q| q.clone_from(&batch));
    let mut groups = vec![(batch, 0u32)];
    while let Some((group, retries)) = groups.pop() {
        QUEUED.with_borrow_mut(|q| q.retain(|i| !group.contains(i)));
        BATCH.with_borrow_mut(|b| b.clone_from(&group));
        // SAFETY: single-threaded worker state, read by the exit callback.
        unsafe { BATCH_XID = pg_sys::InvalidTransactionId };
        let outcome = PgTryBuilder::new(|| {
            let overflow = in_transaction(|| {
                let changes = handle_batch(&group);
                // SAFETY: the transaction id our writes got, if any; the exit callback
                // asks the commit log about it.
                unsafe { BATCH_XID = pg_sys::GetTopTransactionIdIfAny() };
                // Published before the commit, applied after it (see scopes.rs).
                crate::scopes::publish(&changes)
            });
            // Before anyone is answered: a caller that no longer counts its request as
            // in flight must find it in the counter.
            crate::scopes::apply_mine();
            crate::scopes::invalidate(&overflow);
            Ok(())
        })
        .catch_others(|e| Err(caught_error(e)))
        .execute();
        match outcome {
            Ok(()) => {
                crate::stats::writer_batch(group.len(), Some(LAST_COMMIT_US.get()));
                count_admitted(&group);
                answer(&group)
            }
            Err((code, msg)) => {
                // SAFETY: pgrx flushed the error state when it caught the error; abort
                // the failed transaction as a worker's error recovery does.
                unsafe {
                    pg_sys::AbortCurrentTransaction();
                    BATCH_XID = pg_sys::InvalidTransactionId;
                }
                crate::stats::writer_error(&msg);
                crate::scopes::apply_mine();
                let cancelled = code == PgSqlErrorCode::ERRCODE_QUERY_CANCELED as i32;
                if cancelled && retries < MAX_CANCEL_RETRIES {
                    QUEUED.with_borrow_mut(|q| q.extend(&group));
                    groups.push((group, retries + 1));
                } else if group.len() > 1 && may_be_one_requests_fault(code) {
                    QUEUED.with_borrow_mut(|q| q.extend(&group));
                    groups.extend(group.iter().map(|&i| (vec![i], retries)));
                } else {
                    log!(
                        "pg_quota ledger writer: {} request(s) failed: {msg}",
                        group.len()
                    );
                    for &i in &group {
                        set_error(i, code, &msg);
                    }
                    crate::stats::writer_batch(group.len(), None);
                    answer(&group);
                }
            }
        }
    }
    BATCH.with_borrow_mut(Vec::clear);
    QUEUED.with_borrow_mut(Vec::clear);
    // SAFETY: reports the worker as idle in pg_stat_activity.
    unsafe { pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_IDLE, std::ptr::null()) };
}

/// Errors that a single request's data could cause (a constraint a DBA added, a
/// value a type rejects). Anything else, such as a lock timeout, would fail every
/// request alike, so retrying them one by one would only multiply the wait.
fn may_be_one_requests_fault(code: i32) -> bool {
    let class = |c: PgSqlErrorCode| (c as i32) & 0xfff; // the two-character class
    let ours = code & 0xfff;
    ours == class(PgSqlErrorCode::ERRCODE_INTEGRITY_CONSTRAINT_VIOLATION)
        || ours == class(PgSqlErrorCode::ERRCODE_DATA_EXCEPTION)
}

/// quota.stats: the tickets a committed batch handed out, and the idempotent repeats
/// it answered, counted here rather than by the callers, since a caller cancelled
/// after we claimed its request never hears of its ticket, which still counts.
fn count_admitted(group: &[usize]) {
    for &i in group {
        let s = shmem::slot(i);
        // SAFETY: the slot is CLAIMED by us, and its reply written by us.
        let r = unsafe { &*s.reply.get() };
        if r.kind == REPLY_ADMITTED {
            let counter = if r.reused {
                crate::core::stats::Counter::IdempotentHits
            } else {
                crate::core::stats::Counter::Admitted
            };
            crate::stats::add_in(s.dboid(), s.role(), counter, 1);
        }
    }
}

fn answer(group: &[usize]) {
    for &i in group {
        // CLAIMED by us until now; nobody else moves a claimed slot.
        let _ = shmem::slot(i).state.compare_exchange(
            SLOT_CLAIMED,
            SLOT_DONE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        shmem::wake(i);
    }
}

fn caught_error(e: pg_sys::panic::CaughtError) -> (i32, String) {
    use pg_sys::panic::CaughtError;
    match e {
        CaughtError::PostgresError(r)
        | CaughtError::ErrorReport(r)
        | CaughtError::RustPanic { ereport: r, .. } => {
            (r.sql_error_code() as i32, r.message().to_string())
        }
    }
}

fn set_error(i: usize, code: i32, msg: &str) {
    // SAFETY: the slot is CLAIMED by us.
    let r = unsafe { &mut *shmem::slot(i).reply.get() };
    r.kind = REPLY_ERROR;
    r.sqlerrcode = code;
    let mut n = msg.len().min(ERROR_TEXT_BYTES);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    r.error[..n].copy_from_slice(&msg.as_bytes()[..n]);
    r.error_len = n;
}

/// Decides every request of the batch and records the admitted ones. Runs inside the
/// batch transaction; the writer is the only process that inserts, so counts taken
/// here plus this batch's own admissions are exact (I1).
fn handle_batch(batch: &[usize]) -> Vec<(pg_sys::Oid, i64, i64)> {
    let reader = Reader::open();
    let rels = reader.rels;
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let snap = Latest::take();
    // SAFETY: the slots are CLAIMED by us; their callers do not touch them until DONE.
    let requests: Vec<&Request> = batch
        .iter()
        .map(|&i| unsafe { &*shmem::slot(i).request.get() })
        .collect();
    let roles: Vec<pg_sys::Oid> = batch.iter().map(|&i| shmem::slot(i).role()).collect();
    let breqs: Vec<BatchRequest> = requests
        .iter()
        .zip(&roles)
        .map(|(r, role)| BatchRequest {
            role: u32::from(*role),
            limits: Limits {
                max_active: r.max_active,
                max_retained: r.max_retained,
                max_db: if rels.v2() { r.max_db } else { 0 },
            },
            retention_secs: r.retention_secs,
            exempt: r.exempt,
        })
        .collect();

    // Idempotent starts: a request whose key names a ticket its role still retains
    // gets that ticket and is charged nothing; so does a request repeating a key
    // admitted earlier in this batch. Only the writer inserts, and it handles one
    // batch at a time, so eight sessions sending one key at once get one ticket.
    let mut reused: Vec<Option<[u8; 16]>> = vec![None; batch.len()];
    if rels.v2() {
        for (k, req) in requests.iter().enumerate() {
            let Some(key) = req.key() else { continue };
            let cutoff = crate::admission::cutoff(now, req.retention_secs);
            reused[k] =
                crate::admission::retained_with_key(&rels, &snap, roles[k], key, now, cutoff);
        }
    }
    let fresh: Vec<usize> = (0..batch.len()).filter(|&k| reused[k].is_none()).collect();
    let fresh_reqs: Vec<BatchRequest> = fresh.iter().map(|&k| breqs[k]).collect();

    // Count each role once, from its scope counter (see scopes.rs), and only what its
    // requests are limited by. The counter is exact for us: we are the only process
    // that adds admissions to it, right after each commit. Leases that ran out are
    // subtracted, under a snapshot taken after the counter was read.
    let counted: HashMap<u32, Counted> = batch::needs(&fresh_reqs)
        .into_iter()
        .map(|(role, needs)| {
            let oid = pg_sys::Oid::from(role);
            let (active, rows) = counts::scope(&reader, &snap, oid);
            let after = Latest::take();
            let lapsed = counts::lapsed(&rels, &after, oid, now);
            let retained = needs
                .retentions
                .iter()
                .map(|&ret| {
                    let cutoff = crate::admission::cutoff(now, ret);
                    (
                        ret,
                        rows - counts::expired(&rels, &after, oid, cutoff)
                            - lapsed.aged_out(cutoff),
                    )
                })
                .collect();
            (
                role,
                Counted {
                    active: active - lapsed.expired(),
                    retained,
                },
            )
        })
        .collect();
    // The database cap: every role's active tickets together, counted once.
    let db_active =
        batch::db_cap(&fresh_reqs).map_or(0, |cap| counts::db_active(&rels, &snap, now, cap));
    let fresh_decisions = batch::decide_batch(&fresh_reqs, &counted, db_active);
    let mut decisions: Vec<Option<Decision>> = vec![None; batch.len()];
    for (&k, d) in fresh.iter().zip(fresh_decisions) {
        decisions[k] = Some(d);
    }

    let mut admitted: Vec<Admitted> = Vec::new();
    let mut pending: HashMap<u32, i64> = HashMap::new();
    for (k, ((&i, req), breq)) in batch.iter().zip(&requests).zip(&breqs).enumerate() {
        // SAFETY: as above; the reply belongs to the writer while the slot is CLAIMED.
        let reply = unsafe { &mut *shmem::slot(i).reply.get() };
        let role = pg_sys::Oid::from(breq.role);
        // A key admitted earlier in this batch, by this role.
        let repeated = req.key().and_then(|key| {
            admitted
                .iter()
                .find(|a| a.role == role && a.key == Some(key))
                .map(|a| *a.id.as_bytes())
        });
        if let Some(id) = reused[k].or(repeated) {
            reply.kind = REPLY_ADMITTED;
            reply.ticket = id;
            reply.reused = true;
            continue;
        }
        match decisions[k].expect("decided") {
            Decision::Admit => {
                let id = new_ticket_id(now);
                admitted.push(Admitted {
                    id: pgrx::Uuid::from_bytes(id),
                    role,
                    label: req.has_label.then(|| &req.label[..req.label_len]),
                    key: req.key(),
                    lease_until: req.lease_until,
                    pid: req.pid,
                });
                *pending.entry(breq.role).or_default() += 1;
                reply.kind = REPLY_ADMITTED;
                reply.ticket = id;
                reply.reused = false;
            }
            Decision::Refuse(r) => {
                // Only a caller cancelled after handing over its request, sessions
                // with different settings, or roles racing for the database cap get
                // here: callers count their own scope's in-flight requests.
                let cutoff = crate::admission::cutoff(now, req.retention_secs);
                let (full, next) = crate::admission::refusal_numbers(
                    &reader,
                    &snap,
                    role,
                    now,
                    cutoff,
                    req.retention_secs,
                    r.kind,
                );
                let p = pending.get(&breq.role).copied().unwrap_or(0);
                reply.kind = REPLY_REFUSED;
                reply.refusal_kind = match r.kind {
                    RefusalKind::Active => 1,
                    RefusalKind::Retained => 2,
                    RefusalKind::Database => 3,
                };
                reply.active = full.active + p;
                reply.retained = full.retained + p;
                reply.db_active = r.usage.db_active;
                reply.next_ageout = next;
            }
        }
    }
    drop(snap);
    if admitted.is_empty() {
        return Vec::new();
    }
    // `reader` stays until the end: its locks keep the indexes chosen above from being
    // dropped (REINDEX or DROP INDEX CONCURRENTLY waits for the tables' lockers).

    // Purge what is past retention in the roles that grow, so that the expired count
    // each admission reads stays small. A ticket is kept as long as any session of its
    // role could count it: the longest retention among the batch's requests, the
    // writer's own setting, and every value configured for the role or the database.
    let mut longest: HashMap<u32, i64> = HashMap::new();
    for b in &breqs {
        let e = longest.entry(b.role).or_insert(b.retention_secs);
        *e = (*e).max(b.retention_secs);
    }
    let configured = configured_retentions();
    for (role, l) in longest.iter_mut() {
        *l = (*l).max(crate::gucs::retention_secs()).max(
            configured
                .iter()
                .filter(|(r, _)| *r == pg_sys::InvalidOid || u32::from(*r) == *role)
                .map(|&(_, secs)| secs)
                .max()
                .unwrap_or(0),
        );
    }
    let ledger = OpenRel::open(rels.ledger, "ledger", counts::COL_ID);
    let mut delta: Vec<(pg_sys::Oid, i64)> = Vec::new();
    let mut changes = Vec::new();
    for (&role, &n) in &pending {
        let oid = pg_sys::Oid::from(role);
        let cutoff = crate::admission::cutoff(now, longest[&role]);
        let purged = delete_where(
            &ledger,
            rels.ledger_idx,
            &[Key::OidEq(oid), Key::TsLess(cutoff)],
            |_| true,
        );
        delta.push((oid, n - purged));
        changes.push((oid, n, n - purged));
    }
    record(&ledger, rels.ncols, now, &admitted);
    drop(ledger);

    let summary = OpenRel::open(rels.summary, "summary", 1);
    for (role, n) in delta {
        add_to_summary(&rels, &summary, role, n);
    }
    drop(summary);
    drop(reader);
    changes
}

/// Every quota.retention configured in pg_db_role_setting that applies in this
/// database (ALTER ROLE … SET, ALTER DATABASE … SET, ALTER ROLE … IN DATABASE … SET),
/// as (role, seconds); InvalidOid stands for every role. Values that do not parse are
/// skipped: PostgreSQL checked them when they were set.
fn configured_retentions() -> Vec<(pg_sys::Oid, i64)> {
    /// pg_db_role_setting, whose OID has been fixed since PostgreSQL 9.0.
    const DB_ROLE_SETTING: pg_sys::Oid = pg_sys::Oid::from_u32(2964);
    let db = shmem::my_db();
    let mut out = Vec::new();
    // SAFETY: a catalog scan under the catalog snapshot, as PostgreSQL's own readers of
    // this catalog do; every datum is read while the tuple is current.
    unsafe {
        let rel = pg_sys::table_open(DB_ROLE_SETTING, pg_sys::AccessShareLock as i32);
        let desc = (*rel).rd_att;
        let scan = pg_sys::systable_beginscan(
            rel,
            pg_sys::InvalidOid,
            false,
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
        );
        loop {
            let tup = pg_sys::systable_getnext(scan);
            if tup.is_null() {
                break;
            }
            let mut isnull = false;
            let setdb =
                pg_sys::Oid::from(pg_sys::heap_getattr(tup, 1, desc, &mut isnull).value() as u32);
            let role =
                pg_sys::Oid::from(pg_sys::heap_getattr(tup, 2, desc, &mut isnull).value() as u32);
            let config = pg_sys::heap_getattr(tup, 3, desc, &mut isnull);
            if isnull || (setdb != db && setdb != pg_sys::InvalidOid) {
                continue;
            }
            let arr = pg_sys::pg_detoast_datum(config.cast_mut_ptr()) as *mut pg_sys::ArrayType;
            let mut elems: *mut pg_sys::Datum = std::ptr::null_mut();
            let mut nulls: *mut bool = std::ptr::null_mut();
            let mut n = 0;
            pg_sys::deconstruct_array(
                arr,
                pg_sys::TEXTOID,
                -1,
                false,
                b'i' as _,
                &mut elems,
                &mut nulls,
                &mut n,
            );
            for k in 0..n as usize {
                if *nulls.add(k) {
                    continue;
                }
                let item = std::ffi::CStr::from_ptr(pg_sys::text_to_cstring(
                    (*elems.add(k)).cast_mut_ptr(),
                ));
                let Some(value) = item.to_bytes().strip_prefix(b"quota.retention=") else {
                    continue;
                };
                let Ok(value) = std::ffi::CString::new(value) else {
                    continue;
                };
                let mut secs = 0;
                if pg_sys::parse_int(
                    value.as_ptr(),
                    &mut secs,
                    pg_sys::GUC_UNIT_S as i32,
                    std::ptr::null_mut(),
                ) {
                    out.push((role, i64::from(secs)));
                }
            }
        }
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as i32);
    }
    out
}

/// Deletes the rows of `rel` that `keys` select on its index `index` and `wanted`
/// accepts, under the latest snapshot, directly in the heap: no SQL, so no trigger or
/// rule a DBA added fires, as for every other write pg_quota makes. Returns how many
/// it deleted.
fn delete_where(
    rel: &OpenRel,
    index: pg_sys::Oid,
    keys: &[Key],
    wanted: impl Fn(*mut pg_sys::TupleTableSlot) -> bool,
) -> i64 {
    // SAFETY: makes our earlier writes in this transaction visible to the snapshot.
    unsafe { pg_sys::CommandCounterIncrement() };
    let snap = Latest::take();
    let mut tids = Vec::new();
    counts::scan_open(rel.heap, rel.index(index), &snap, keys, |slot| {
        if wanted(slot) {
            // SAFETY: the slot holds a visible tuple of `rel`.
            tids.push(unsafe { (*slot).tts_tid });
        }
        true
    });
    drop(snap);
    let mut n = 0;
    for tid in tids {
        match rel.delete(tid) {
            pg_sys::TM_Result::TM_Ok => n += 1,
            // Changed or deleted meanwhile (a superuser's SQL, say): leave it; a
            // later purge sees its new version.
            pg_sys::TM_Result::TM_Updated
            | pg_sys::TM_Result::TM_Deleted
            | pg_sys::TM_Result::TM_SelfModified => {}
            other => pgrx::error!("pg_quota: unexpected result {other} deleting a row"),
        }
    }
    n
}

/// A ticket the batch admits.
struct Admitted<'a> {
    id: pgrx::Uuid,
    role: pg_sys::Oid,
    label: Option<&'a [u8]>,
    key: Option<&'a [u8]>,
    lease_until: Option<pg_sys::TimestampTz>,
    pid: i32,
}

/// Inserts the admitted tickets. Labels and keys are stored as the caller's bytes in
/// the database encoding, which is also the writer's: no conversion, so every encoding
/// works. With 0.1.x's schema (`ncols` = NCOLS_V1) leases, keys and pids have no
/// columns and are not recorded.
fn record(ledger: &OpenRel, ncols: usize, now: pg_sys::TimestampTz, admitted: &[Admitted]) {
    let text = |bytes: Option<&[u8]>| bytes.map(counts::text_datum);
    for a in admitted {
        let mut values = vec![pg_sys::Datum::from(0); ncols];
        let mut nulls = vec![true; ncols];
        let mut set = |col: usize, v: Option<pg_sys::Datum>| {
            if let Some(v) = v {
                values[col - 1] = v;
                nulls[col - 1] = false;
            }
        };
        set(counts::COL_ID, a.id.into_datum());
        set(counts::COL_ROLE, Some(a.role.into()));
        set(counts::COL_LABEL, text(a.label));
        set(counts::COL_STARTED_AT, Some(now.into()));
        if ncols == counts::NCOLS_V2 {
            set(
                counts::COL_LEASE_UNTIL,
                a.lease_until.map(pg_sys::Datum::from),
            );
            set(counts::COL_KEY, text(a.key));
            set(counts::COL_PID, Some(a.pid.into()));
        }
        ledger.insert(&mut values, &mut nulls);
    }
}

/// Adds `n` to `role`'s summary row. A missing row means "unknown": the role never had
/// one, or SQL-level writes to the ledger made the summary forget it (see the triggers
/// in sql/schema.sql); we then count the role's rows, ours included, and store that.
/// The writer is the only process that writes summary rows, so a concurrent change
/// means someone edited the table by hand; we then count again from the latest version.
fn add_to_summary(rels: &counts::Rels, summary: &OpenRel, role: pg_sys::Oid, n: i64) {
    loop {
        // SAFETY: makes our writes in this transaction visible to the snapshot below.
        unsafe { pg_sys::CommandCounterIncrement() };
        let snap = Latest::take();
        let mut current = None;
        counts::scan_open(
            summary.heap,
            summary.index(rels.summary_idx),
            &snap,
            &[Key::OidEq(role)],
            |slot| {
                // SAFETY: the slot holds a summary tuple (role, tickets), pinned meanwhile.
                let tickets = unsafe { pg_sys::slot_getattr(slot, 2, &mut false).value() as i64 };
                // SAFETY: as above.
                current = Some((unsafe { (*slot).tts_tid }, tickets));
                false
            },
        );
        let Some((tid, tickets)) = current else {
            let rows = counts::ledger_rows(rels, &snap, role);
            summary.insert(&mut [role.into(), rows.into()], &mut [false, false]);
            return;
        };
        let tickets = if tickets + n >= 0 {
            tickets + n
        } else {
            counts::ledger_rows(rels, &snap, role)
        };
        let tuple = summary.form(&mut [role.into(), tickets.into()], &mut [false, false]);
        match summary.update(tid, tuple, &[2]) {
            pg_sys::TM_Result::TM_Ok => return,
            pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted => continue,
            other => pgrx::error!(
                "pg_quota: unexpected result {other} updating the summary of role {}",
                u32::from(role)
            ),
        }
    }
}

thread_local! {
    /// Roles whose tickets the last expiry sweep ended, and how many each.
    static SWEPT: std::cell::RefCell<Vec<(pg_sys::Oid, i64, i64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `sweep_expired` in a transaction of its own; then the scope counters drop by what it
/// ended, and the starts waiting in those scopes look again.
fn sweep_expired_and_wake() {
    SWEPT.with_borrow_mut(Vec::clear);
    OVERFLOWED.with_borrow_mut(Vec::clear);
    let committed = try_in_transaction("end expired tickets", sweep_expired);
    crate::scopes::apply_mine();
    let swept = SWEPT.with_borrow_mut(std::mem::take);
    if !committed {
        return;
    }
    crate::scopes::invalidate(&OVERFLOWED.with_borrow_mut(std::mem::take));
    for (role, ended, _) in swept {
        crate::stats::add(
            role,
            crate::core::stats::Counter::Expired,
            ended.unsigned_abs(),
        );
        crate::waiters::wake(shmem::my_db(), role);
    }
}

/// Writes down the leases that ran out: each unfinished ticket whose lease_until has
/// passed ends at its lease_until with outcome `expired`. Counting does not wait for
/// this (admission subtracts such tickets as soon as their lease runs out, see
/// counts::lapsed); the sweep keeps that set short, so that admission stays one
/// probe, gives the scope counters their true active count, and lets the retention
/// purge find the tickets. A ticket that a finish() or renew() is changing right now
/// is left for a later sweep: the writer never waits for a caller's transaction.
fn sweep_expired() {
    let rels = counts::rels();
    if !rels.v2() {
        return;
    }
    let reader = Reader::open();
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let snap = Latest::take();
    let mut due: Vec<(pg_sys::ItemPointerData, pg_sys::Oid, pg_sys::TimestampTz)> = Vec::new();
    counts::scan_index(
        rels.ledger,
        rels.ledger_open_idx,
        &snap,
        &[Key::IsNull, Key::TsLess(now.saturating_add(1))],
        |slot| {
            let role = counts::attr(slot, counts::COL_ROLE as i32)
                .map(|d| pg_sys::Oid::from(d.value() as u32));
            let until =
                counts::attr(slot, counts::COL_LEASE_UNTIL as i32).map(|d| d.value() as i64);
            if let (Some(role), Some(until)) = (role, until) {
                // SAFETY: the slot holds a visible ledger tuple.
                due.push((unsafe { (*slot).tts_tid }, role, until));
            }
            due.len() < MAX_BATCH * 4
        },
    );
    drop(snap);
    if due.is_empty() {
        return;
    }
    let ledger = OpenRel::open(rels.ledger, "ledger", counts::COL_ID);
    let mut ended: Vec<(pg_sys::Oid, i64, i64)> = Vec::new();
    for (tid, role, until) in due {
        // A finish() or renew() of the ticket in an open transaction: leave it to a
        // later sweep rather than wait for that transaction.
        if !ledger.lock_nowait(tid) {
            continue;
        }
        let Some(tuple) = expired_version(&ledger, rels.ncols, tid, until) else {
            continue;
        };
        if ledger.update(tid, tuple, &[counts::COL_ENDED_AT, counts::COL_OUTCOME])
            == pg_sys::TM_Result::TM_Ok
        {
            match ended.iter_mut().find(|(r, _, _)| *r == role) {
                Some(e) => e.1 -= 1,
                None => ended.push((role, -1, 0)),
            }
        }
    }
    drop(ledger);
    drop(reader);
    // Published before the commit, applied after it (see scopes.rs).
    let overflow = crate::scopes::publish(&ended);
    // The counters of roles that did not fit are rebuilt from the ledger instead.
    OVERFLOWED.with_borrow_mut(|o| *o = overflow);
    SWEPT.with_borrow_mut(|s| *s = ended);
}

thread_local! {
    static OVERFLOWED: std::cell::RefCell<Vec<pg_sys::Oid>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The version of the ticket at `tid` that ends it at `until` with outcome
/// `expired`, formed from the row as it is now; None if it is no longer unfinished.
fn expired_version(
    ledger: &OpenRel,
    ncols: usize,
    tid: pg_sys::ItemPointerData,
    until: pg_sys::TimestampTz,
) -> Option<pg_sys::HeapTuple> {
    // SAFETY: fetches the version at `tid` under SnapshotAny into a palloc'd copy that
    // we deform at once; the row is then replaced under heap_update's own checks.
    unsafe {
        let mut tuple: pg_sys::HeapTupleData = std::mem::zeroed();
        tuple.t_self = tid;
        let mut buffer: pg_sys::Buffer = 0;
        if !pg_sys::heap_fetch(
            ledger.heap,
            std::ptr::addr_of_mut!(pg_sys::SnapshotAnyData),
            &mut tuple,
            &mut buffer,
            false,
        ) {
            return None;
        }
        let mut values = vec![pg_sys::Datum::from(0); ncols];
        let mut nulls = vec![false; ncols];
        pg_sys::heap_deform_tuple(
            &mut tuple,
            (*ledger.heap).rd_att,
            values.as_mut_ptr(),
            nulls.as_mut_ptr(),
        );
        let unfinished = nulls[counts::COL_ENDED_AT - 1];
        let out = unfinished.then(|| {
            values[counts::COL_ENDED_AT - 1] = until.into();
            nulls[counts::COL_ENDED_AT - 1] = false;
            values[counts::COL_OUTCOME - 1] = "expired".into_datum().unwrap();
            nulls[counts::COL_OUTCOME - 1] = false;
            ledger.form(&mut values, &mut nulls)
        });
        pg_sys::ReleaseBuffer(buffer);
        out
    }
}

thread_local! {
    /// Roles whose tickets the last purge deleted; their counters are forgotten once
    /// that purge has committed (a rebuild before would count the deleted rows).
    static DROPPED: std::cell::RefCell<Vec<pg_sys::Oid>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `purge_dropped_roles` in a transaction of its own, then forgets the counters of the
/// roles it purged. Returns whether the purge committed.
fn purge_dropped_roles_and_counters() -> bool {
    DROPPED.with_borrow_mut(Vec::clear);
    let committed = try_in_transaction("purge the tickets of dropped roles", purge_dropped_roles);
    let gone = DROPPED.with_borrow_mut(std::mem::take);
    if committed && !gone.is_empty() {
        crate::scopes::forget(shmem::my_db(), Some(&gone));
    }
    committed
}

/// Runs `f` in a transaction of its own; returns whether it committed. A failure (a
/// lock held too long by maintenance, say) is logged as a warning and does not stop
/// the writer: admissions go on, and the caller says when the work is tried again.
fn try_in_transaction(what: &str, f: fn()) -> bool {
    let failed = PgTryBuilder::new(|| {
        in_transaction(f);
        None
    })
    .catch_others(|e| Some(caught_error(e).1))
    .execute();
    if let Some(msg) = failed {
        // SAFETY: pgrx flushed the error state; abort the failed transaction.
        unsafe { pg_sys::AbortCurrentTransaction() };
        crate::stats::writer_error(&format!("could not {what}: {msg}"));
        pgrx::warning!("pg_quota ledger writer: could not {what}: {msg}");
        return false;
    }
    true
}

/// Gives every role that has ledger rows but no summary row (after SQL-level writes to
/// the ledger, a restore, or ALTER EXTENSION UPDATE) its summary row back, so that
/// admission stops counting its history row by row.
fn rebuild_summary() {
    let reader = Reader::open();
    let rels = reader.rels;
    let snap = Latest::take();
    let missing = counts::roles_where(&rels, &snap, |role| {
        counts::summary_rows(&rels, &snap, role).is_none()
    });
    drop(snap);
    if missing.is_empty() {
        return;
    }
    let summary = OpenRel::open(rels.summary, "summary", 1);
    for role in missing {
        add_to_summary(&rels, &summary, role, 0);
    }
}

/// Deletes the tickets and summary rows of roles that no longer exist, so that they
/// count for nobody: not for a future role that gets the same OID, and not, after a
/// dump, for whatever role has that OID in another cluster. One index probe per role.
fn purge_dropped_roles() {
    let reader = Reader::open();
    let rels = reader.rels;
    let snap = Latest::take();
    let mut gone = counts::roles_where(&rels, &snap, |role| !role_exists(role));
    // Roles whose summary row outlived their tickets.
    counts::scan(rels.summary, rels.summary_idx, &snap, &[], |slot| {
        if let Some(d) = counts::attr(slot, 1) {
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
    let ledger = OpenRel::open(rels.ledger, "ledger", counts::COL_ID);
    for &role in &gone {
        delete_where(&ledger, rels.ledger_idx, &[Key::OidEq(role)], |_| true);
    }
    drop(ledger);
    let summary = OpenRel::open(rels.summary, "summary", 1);
    delete_where(&summary, rels.summary_idx, &[], |slot| {
        counts::attr(slot, 1).is_some_and(|d| gone.contains(&pg_sys::Oid::from(d.value() as u32)))
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

fn new_ticket_id(now: pg_sys::TimestampTz) -> [u8; 16] {
    thread_local! {
        /// The last id this writer issued; ids of one batch share `now`.
        static LAST_ID: std::cell::Cell<Option<[u8; 16]>> = const { std::cell::Cell::new(None) };
    }
    let mut random = [0u8; 8];
    // SAFETY: fills the buffer we pass; returns false only if the OS source fails.
    if !unsafe { pg_sys::pg_strong_random(random.as_mut_ptr().cast(), random.len()) } {
        pgrx::error!("pg_quota: could not generate random bytes for a ticket id");
    }
    // TimestampTz counts microseconds from 2000-01-01; UUIDv7 wants Unix time.
    const PG_EPOCH_UNIX_US: i64 = 946_684_800_000_000;
    let unix_us = (now + PG_EPOCH_UNIX_US).max(0) as u64;
    let id = uuid_v7(unix_us, random, LAST_ID.get());
    LAST_ID.set(Some(id));
    id
}

/// Gives up this writer's entry. Unless `force`, only when no request of its database
/// is waiting (checked under the table lock, which callers hold to enqueue). Requests
/// still waiting are left PENDING: their callers start a new writer.
fn leave(idx: usize, db: pg_sys::Oid, force: bool) -> bool {
    let _lock = shmem::TableLock::acquire();
    if !force {
        let waiting = (0..shmem::n_slots()).any(|i| {
            let s = shmem::slot(i);
            load_state(s) == SLOT_PENDING && s.dboid() == db
        });
        if waiting {
            return false;
        }
    }
    // quota.writer_stats: a clean exit, recorded before a successor can start.
    crate::stats::writer_exits(true);
    // The guard first: a new writer may take the entry the moment it is free.
    release_twin_guard(db);
    let w = shmem::writer(idx);
    w.left_db = db;
    w.left_handle = w.handle;
    w.dboid = pg_sys::InvalidOid;
    w.procno = -1;
    w.exit_requested.store(false, Ordering::Release);
    w.leave_when_idle.store(false, Ordering::Release);
    w.rebuild_summary.store(false, Ordering::Release);
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
        let committed =
            BATCH_XID != pg_sys::InvalidTransactionId && pg_sys::TransactionIdDidCommit(BATCH_XID);
        // Before the table lock: the scope lock is never taken while holding it. Each
        // published change is judged by its own transaction: the last one may have been
        // the expiry sweep's, not the batch's.
        crate::scopes::apply_mine();
        let _lock = shmem::TableLock::acquire();
        let hand_back = |i: usize, done: bool| {
            let s = shmem::slot(i);
            let to = if done { SLOT_DONE } else { SLOT_PENDING };
            if s.state
                .compare_exchange(SLOT_CLAIMED, to, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                shmem::wake(i);
            }
        };
        if committed {
            BATCH.with_borrow(|b| count_admitted(b));
        }
        BATCH.with_borrow(|b| b.iter().for_each(|&i| hand_back(i, committed)));
        QUEUED.with_borrow(|q| q.iter().for_each(|&i| hand_back(i, false)));
        let w = shmem::writer(MY_ENTRY);
        if w.dboid == db && w.procno == shmem::my_procno() as i32 {
            w.dboid = pg_sys::InvalidOid;
            w.procno = -1;
        }
        // Callers still waiting for this database notice at once that we are gone,
        // and start a new writer.
        for i in 0..shmem::n_slots() {
            let s = shmem::slot(i);
            if load_state(s) == SLOT_PENDING && s.dboid() == db {
                shmem::wake(i);
            }
        }
    }
}

/// Asks the writer of database `db`, if any, to leave: now (`force`, for DROP
/// DATABASE and DROP EXTENSION), or as soon as no request waits (before commands that
/// need the database to themselves, which fail anyway while sessions are connected).
/// See hooks.rs.
pub fn request_exit(db: pg_sys::Oid, force: bool) {
    if !shmem::available() {
        return;
    }
    let _lock = shmem::TableLock::acquire();
    if let Some(i) = shmem::writer_of(db) {
        let w = shmem::writer(i);
        if force {
            w.exit_requested.store(true, Ordering::Release);
        } else {
            w.leave_when_idle.store(true, Ordering::Release);
        }
        if let Ok(p) = usize::try_from(w.procno) {
            shmem::wake(p);
        }
    }
}

/// Makes the writer of database `db` leave and waits until its process is gone, for
/// DROP DATABASE (hooks.rs). WITH (FORCE), PostgreSQL then terminates the database's
/// other sessions with the dropping user's rights; those do not reach a background
/// worker unless the user is a superuser, so every writer connected to the database
/// must be gone before the hook returns, not merely asked to leave:
/// - the running writer leaves at its next look around (within a batch's lock wait at
///   worst), and is terminated after STOP_WAIT;
/// - one that is still starting (its entry has no PGPROC number yet) has served nothing
///   and may already be connected: it is terminated at once. One that is not connected
///   yet cannot connect while the drop holds the database's lock, and finds the
///   database gone afterwards;
/// - one that gave up its entry a moment ago (an idle exit) may still be connected
///   while it exits: it is waited for too.
pub fn stop(db: pg_sys::Oid) {
    if !shmem::available() {
        return;
    }
    let mut handles: Vec<(WorkerHandle, bool)> = Vec::new();
    {
        let _lock = shmem::TableLock::acquire();
        for i in 0..shmem::n_writers() {
            let w = shmem::writer(i);
            if w.dboid == db {
                w.exit_requested.store(true, Ordering::Release);
                match usize::try_from(w.procno) {
                    Ok(p) => {
                        shmem::wake(p);
                        handles.push((w.handle, false));
                    }
                    Err(_) => handles.push((w.handle, true)),
                }
            }
            if w.left_db == db {
                handles.push((w.left_handle, false));
            }
        }
    }
    let began = Instant::now();
    for (handle, starting) in handles {
        let mut terminated = false;
        loop {
            let mut pid = 0;
            let mut h = handle;
            // SAFETY: `h` has the layout of BackgroundWorkerHandle (see WorkerHandle);
            // the postmaster's slot generation tells a reused slot apart.
            let status = unsafe {
                pg_sys::GetBackgroundWorkerPid(&mut h as *mut WorkerHandle as *mut _, &mut pid)
            };
            if status == pg_sys::BgwHandleStatus::BGWH_STOPPED
                || status == pg_sys::BgwHandleStatus::BGWH_POSTMASTER_DIED
                || (starting && status == pg_sys::BgwHandleStatus::BGWH_NOT_YET_STARTED)
                || began.elapsed() >= STOP_WAIT * 2
            {
                // Gone, or not forked yet; or, at worst, PostgreSQL's own check reports
                // the session left.
                break;
            }
            if !terminated && (starting || began.elapsed() >= STOP_WAIT) {
                // SAFETY: as above; the postmaster sends the worker SIGTERM.
                unsafe { pg_sys::TerminateBackgroundWorker(&mut h as *mut WorkerHandle as *mut _) };
                terminated = true;
            }
            nap(10, compat::Wait::WriterExit);
        }
    }
}

/// Asks this database's writer, if it runs, to rebuild missing summary rows.
pub fn request_summary_rebuild() {
    let _lock = shmem::TableLock::acquire_shared();
    if let Some(i) = shmem::writer_of(shmem::my_db()) {
        let w = shmem::writer(i);
        if !w.rebuild_summary.swap(true, Ordering::AcqRel) {
            if let Ok(p) = usize::try_from(w.procno) {
                shmem::wake(p);
            }
        }
    }
}

/// Wakes every running writer (after a role was dropped).
pub fn wake_all() {
    let _lock = shmem::TableLock::acquire_shared();
    for i in 0..shmem::n_writers() {
        let w = shmem::writer(i);
        if w.dboid != pg_sys::InvalidOid {
            if let Ok(p) = usize::try_from(w.procno) {
                shmem::wake(p);
            }
        }
    }
}

impl Default for Patience {
    fn default() -> Self {
        Self::new()
    }
}
