//! The ledger writer: one background worker per database, the only process that
//! inserts into `quota.ledger`. It commits each charge in its own transaction, so the
//! charge survives the caller's rollback (I2), and it is on disk before the caller's
//! `start()` returns (I6). Being the single inserter, it re-checks the limits exactly
//! inside its own transaction before every insert, which keeps I1 true even for a
//! caller that was cancelled after handing over its request.
//!
//! Protocol: a caller fills its own slot (see shmem.rs), marks it PENDING, sets the
//! writer's latch and sleeps on its own. The writer claims every PENDING slot of its
//! database, handles them all in one transaction (group commit: one WAL flush for the
//! lot), then marks them DONE and sets each caller's latch.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;

use std::collections::HashMap;

use crate::core::{decide, uuid_v7, Decision, Limits, QuotaError, RefusalKind, Usage};
use crate::counts;
use crate::error::raise;
use crate::heap::OpenRel;
use crate::ledger::{self, Stmt};
use crate::shmem::{self, *};

/// A writer with nothing to do leaves after this long; the next start brings it back.
const IDLE_EXIT: Duration = Duration::from_secs(10);
/// How often a waiting caller or an idle writer looks around without being woken.
const POLL_MS: i64 = 1000;
/// The most requests one writer transaction commits together.
const MAX_BATCH: usize = 256;
/// The writer never waits longer than this for a lock: a caller holding a lock the
/// writer needs would otherwise deadlock with it unseen by the deadlock detector.
const WRITER_LOCK_TIMEOUT: &std::ffi::CStr = c"5s";

/// The twin guard: a session lock that only one writer per database can hold. Its
/// field4 is private to pg_quota, so no SQL advisory lock call can produce it (I4).
pub const WRITER_LOCK_FIELD4: u16 = 0x5157; // "QW"

// ---------------------------------------------------------------------------------
// Caller side
// ---------------------------------------------------------------------------------

/// The writer's answer to one start.
pub enum Answer {
    Admitted([u8; 16]),
    Refused(RefusalKind, Usage, Option<pg_sys::TimestampTz>),
}

thread_local! {
    /// The writer entry our pending request went to (see `enqueue` and `wait`).
    static MY_WRITER: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// Hands one start request to this database's writer. The caller then calls `wait`.
pub fn enqueue(fill: impl FnOnce(&mut Request)) {
    let me = shmem::my_procno();
    if me >= shmem::n_slots() {
        pgrx::error!("pg_quota: process number {me} has no request slot");
    }
    let slot = shmem::slot(me);
    reclaim(slot);

    // SAFETY: the slot is FREE and ours (indexed by our PGPROC number), so nobody
    // else reads or writes its payload until we publish it with the Release below.
    unsafe {
        let r = &mut *slot.request.get();
        r.dboid = shmem::my_db();
        fill(r);
    }
    // The common case, a running writer, needs only the shared lock.
    let (_lock, idx) = match find_writer(shmem::TableLock::acquire_shared()) {
        Ok(found) => found,
        Err(shared) => {
            drop(shared);
            let lock = shmem::TableLock::acquire();
            let idx = find_or_start_writer();
            (lock, idx)
        }
    };
    slot.state.store(SLOT_PENDING, Ordering::Release);
    if let Ok(p) = usize::try_from(shmem::writer(idx).procno) {
        shmem::wake(p);
    }
    MY_WRITER.set(idx);
}

/// How many requests of `role` in this database are in the writer's hands: handed
/// over and not yet answered. Callers hold the scope lock, so none can be added
/// meanwhile; a read that races with a slot being reused only miscounts a request
/// that is not of this scope, and the writer's own check is exact in any case.
pub fn inflight(role: pg_sys::Oid) -> i64 {
    let db = shmem::my_db();
    (0..shmem::n_slots())
        .filter(|&i| {
            let s = shmem::slot(i);
            let st = load_state(s);
            // SAFETY: the payload was published with the slot's Release store.
            (st == SLOT_PENDING || st == SLOT_CLAIMED)
                && unsafe {
                    let r = &*s.request.get();
                    r.dboid == db && r.role == role
                }
        })
        .count() as i64
}

/// Sleeps up to `ms` milliseconds on our latch, then checks for interrupts. Returns
/// true if the time ran out, false if the latch was set.
pub fn nap(ms: i64) -> bool {
    // SAFETY: our own latch; WL_EXIT_ON_PM_DEATH ends us with the postmaster.
    let rc = unsafe {
        let rc = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            ms,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        rc
    };
    pgrx::check_for_interrupts!();
    rc & pg_sys::WL_TIMEOUT as i32 != 0
}

/// Waits for the writer's answer to the request `enqueue` handed over.
pub fn wait() -> Answer {
    let slot = shmem::slot(shmem::my_procno());
    let writer_idx = MY_WRITER.get();

    // Until DONE, an ERROR (cancel, statement_timeout) withdraws the request if the
    // writer has not claimed it yet. If it has, the writer finishes it and the next
    // request from this backend reclaims the slot: the charge, if any, stays counted
    // (over-count, never under-count).
    struct Withdraw(&'static Slot);
    impl Drop for Withdraw {
        fn drop(&mut self) {
            let _ = self.0.state.compare_exchange(
                SLOT_PENDING,
                SLOT_FREE,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }
    let guard = Withdraw(slot);
    loop {
        if load_state(slot) == SLOT_DONE {
            std::mem::forget(guard);
            return take_reply(slot);
        }
        if nap(POLL_MS) && load_state(slot) != SLOT_DONE && !writer_alive(writer_idx) {
            // The writer is gone and its exit callback did not answer us: it never
            // started, or it died before it claimed our request.
            if slot
                .state
                .compare_exchange(SLOT_PENDING, SLOT_FREE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                std::mem::forget(guard);
                raise(QuotaError::WriterGone);
            }
        }
    }
}

/// Waits for an answer owed to a request this backend abandoned (it was cancelled
/// after the writer claimed it), then frees the slot. The answer is dropped.
fn reclaim(slot: &'static Slot) {
    loop {
        match load_state(slot) {
            SLOT_FREE => return,
            SLOT_DONE => {
                slot.state.store(SLOT_FREE, Ordering::Release);
                return;
            }
            _ => {
                nap(POLL_MS);
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
                let kind = if r.refusal_kind == 1 {
                    RefusalKind::Active
                } else {
                    RefusalKind::Retained
                };
                Ok(Answer::Refused(
                    kind,
                    Usage {
                        active: r.active,
                        retained: r.retained,
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

/// This database's writer entry, if there is one; hands the lock back either way.
fn find_writer(lock: shmem::TableLock) -> Result<(shmem::TableLock, usize), shmem::TableLock> {
    match shmem::writer_of(shmem::my_db()) {
        Some(i) => Ok((lock, i)),
        None => Err(lock),
    }
}

/// Finds this database's writer entry, or claims a free one and registers a writer
/// for it. Called with the table lock held exclusively.
fn find_or_start_writer() -> usize {
    let db = shmem::my_db();
    if let Some(i) = shmem::writer_of(db) {
        return i;
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
    i
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

/// Whether writer entry `idx` still has a live (or starting) worker behind it.
fn writer_alive(idx: usize) -> bool {
    let _lock = shmem::TableLock::acquire();
    let w = shmem::writer(idx);
    if w.dboid != shmem::my_db() {
        return false;
    }
    let mut pid = 0;
    let mut h = w.handle;
    // SAFETY: `h` has the layout of BackgroundWorkerHandle (see WorkerHandle).
    let status =
        unsafe { pg_sys::GetBackgroundWorkerPid(&mut h as *mut WorkerHandle as *mut _, &mut pid) };
    if status == pg_sys::BgwHandleStatus::BGWH_STOPPED {
        // Never started, or died without its exit callback: free the entry.
        w.dboid = pg_sys::InvalidOid;
        w.procno = -1;
        fail_pending(shmem::my_db());
        return false;
    }
    true
}

/// Answers every PENDING or CLAIMED request of database `db` with an error. Called with
/// the table lock held, when the writer of `db` is gone.
fn fail_pending(db: pg_sys::Oid) {
    for i in 0..shmem::n_slots() {
        let s = shmem::slot(i);
        let st = load_state(s);
        if st != SLOT_PENDING && st != SLOT_CLAIMED {
            continue;
        }
        // SAFETY: dboid was published with the slot's Release store.
        if unsafe { (*s.request.get()).dboid } != db {
            continue;
        }
        if st == SLOT_PENDING
            && s.state
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
        // SAFETY: we own the CLAIMED slot now (the writer that claimed it is gone).
        unsafe { (*s.reply.get()).kind = 0 };
        s.state.store(SLOT_DONE, Ordering::Release);
        shmem::wake(i);
    }
}

// ---------------------------------------------------------------------------------
// Writer side
// ---------------------------------------------------------------------------------

// Slots claimed by the batch in progress, and whether that batch has committed; the
// exit callback needs both to answer callers truthfully if the writer is terminated.
// A background worker is single-threaded, so plain statics suffice.
thread_local! {
    static BATCH: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}
static mut BATCH_COMMITTED: bool = false;
/// Set once this writer has given up its entry; the exit callback then leaves the
/// table alone, because a new writer may already own the entry and its requests.
static mut LEFT: bool = false;
static mut MY_ENTRY: usize = usize::MAX;

unsafe extern "C-unwind" {
    /// PostgreSQL's SIGTERM handler for backends (postgres.c). pgrx's binding wraps it
    /// in a Rust function, but a signal handler must be the C symbol itself.
    fn die(signal: std::ffi::c_int);
}

/// Entry point of the ledger writer, named in its BackgroundWorker registration.
#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn pg_quota_writer_main(arg: pg_sys::Datum) {
    let raw = arg.value() as u64;
    let idx = (raw >> 32) as usize;
    let db = pg_sys::Oid::from(raw as u32);

    // SAFETY: standard background worker start-up: `die` turns SIGTERM into a FATAL
    // at the next CHECK_FOR_INTERRUPTS, which runs our before_shmem_exit callback.
    unsafe {
        pg_sys::pqsignal(libc::SIGTERM, Some(die));
        pg_sys::BackgroundWorkerUnblockSignals();
        pg_sys::BackgroundWorkerInitializeConnectionByOid(db, pg_sys::InvalidOid, 0);
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
            "pg_quota: another ledger writer already serves database {}",
            u32::from(db)
        );
        return;
    }
    configure_session();
    main_loop(idx, db);
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
/// database cannot get it and leaves.
fn take_twin_guard(db: pg_sys::Oid) -> bool {
    // SAFETY: a conditional session lock, released in `leave` or at process exit.
    let r = unsafe {
        pg_sys::LockAcquire(
            &twin_guard_tag(db),
            pg_sys::ExclusiveLock as i32,
            true,
            true,
        )
    };
    r != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
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
    set(c"search_path", c"pg_catalog, pg_temp");
    // The writer's exact count relies on a fresh snapshot per statement.
    set(c"default_transaction_isolation", c"read committed");
    set(c"default_transaction_read_only", c"off");
    // I6: a charge is on disk before start() returns, even where the server runs with
    // synchronous_commit = off. Stronger settings (remote_apply, …) are kept.
    // SAFETY: reading a GUC variable.
    if unsafe { pg_sys::synchronous_commit }
        < pg_sys::SyncCommitLevel::SYNCHRONOUS_COMMIT_LOCAL_FLUSH as i32
    {
        set(c"synchronous_commit", c"local");
    }
    // SAFETY: reports the worker as idle in pg_stat_activity.
    unsafe { pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_IDLE, std::ptr::null()) };
}

fn main_loop(idx: usize, db: pg_sys::Oid) {
    let mut last_work = Instant::now();
    loop {
        // SAFETY: our own latch; reset before looking for work so no wake-up is lost.
        unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
        pgrx::check_for_interrupts!();
        if shmem::writer(idx).exit_requested.load(Ordering::Acquire) {
            leave(idx, db, true);
            return;
        }
        let batch = claim(db);
        if !batch.is_empty() {
            process(batch);
            last_work = Instant::now();
            continue;
        }
        if last_work.elapsed() >= IDLE_EXIT && leave(idx, db, false) {
            return;
        }
        // SAFETY: our own latch; WL_EXIT_ON_PM_DEATH ends us with the postmaster.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                POLL_MS,
                pg_sys::PG_WAIT_EXTENSION,
            );
        }
    }
}

/// Claims up to MAX_BATCH PENDING requests of database `db`.
fn claim(db: pg_sys::Oid) -> Vec<usize> {
    let mut batch = Vec::new();
    for i in 0..shmem::n_slots() {
        let s = shmem::slot(i);
        if load_state(s) != SLOT_PENDING {
            continue;
        }
        // SAFETY: the payload was published by the caller's Release store of PENDING.
        if unsafe { (*s.request.get()).dboid } != db {
            continue;
        }
        if s.state
            .compare_exchange(
                SLOT_PENDING,
                SLOT_CLAIMED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            batch.push(i);
            if batch.len() == MAX_BATCH {
                break;
            }
        }
    }
    batch
}

/// Handles one batch in one transaction, then answers every caller in it.
fn process(batch: Vec<usize>) {
    // SAFETY: single-threaded worker state, read by the exit callback.
    BATCH.with_borrow_mut(|b| b.clone_from(&batch));
    unsafe { BATCH_COMMITTED = false };
    let outcome = PgTryBuilder::new(|| {
        // SAFETY: the standard transaction bracket of a background worker.
        unsafe {
            pg_sys::SetCurrentStatementStartTimestamp();
            pg_sys::StartTransactionCommand();
            pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        }
        ledger::connect(|| handle_batch(&batch));
        // SAFETY: closes the bracket opened above.
        unsafe {
            pg_sys::PopActiveSnapshot();
            pg_sys::CommitTransactionCommand();
        }
        Ok(())
    })
    .catch_others(|e| Err(caught_error(e)))
    .execute();
    match outcome {
        // SAFETY: single-threaded worker state.
        Ok(()) => unsafe { BATCH_COMMITTED = true },
        Err((code, msg)) => {
            // SAFETY: pgrx flushed the error state when it caught the error; abort the
            // failed transaction as a worker's error recovery does.
            unsafe { pg_sys::AbortCurrentTransaction() };
            log!(
                "pg_quota ledger writer: batch of {} failed: {msg}",
                batch.len()
            );
            for &i in &batch {
                set_error(i, code, &msg);
            }
        }
    }
    for &i in &batch {
        shmem::slot(i).state.store(SLOT_DONE, Ordering::Release);
        shmem::wake(i);
    }
    // SAFETY: single-threaded worker state.
    BATCH.with_borrow_mut(Vec::clear);
    unsafe {
        BATCH_COMMITTED = false;
        pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_IDLE, std::ptr::null());
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

/// One scope's state while a batch is decided: counted once, then kept up to date
/// as the batch admits tickets, so requests of one batch count each other.
struct ScopeCounts {
    usage: Usage,
    expired: i64,
    cutoff: pg_sys::TimestampTz,
    admitted: i64,
}

/// Decides every request of the batch and records the admitted ones with one
/// statement. Runs inside the batch transaction; the writer is the only process that
/// inserts, so counts taken here plus this batch's own admissions are exact (I1).
fn handle_batch(batch: &[usize]) {
    let rels = counts::rels();
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let snap = counts::Latest::take();
    // SAFETY: the slots are CLAIMED by us; their callers do not touch them until DONE.
    let requests: Vec<&Request> = batch
        .iter()
        .map(|&i| unsafe { &*shmem::slot(i).request.get() })
        .collect();

    // Count each scope once, and only what its requests are limited by: the active
    // count up to the highest active limit among them, the retained count if any of
    // them has a retained limit. Keyed by role and retention: two sessions of one
    // role may run with different quota.retention settings.
    let mut scopes: HashMap<(pg_sys::Oid, i64), ScopeCounts> = HashMap::new();
    for req in &requests {
        if req.exempt {
            continue;
        }
        let key = (req.role, req.retention_secs);
        let max_active = requests
            .iter()
            .filter(|r| !r.exempt && (r.role, r.retention_secs) == key)
            .map(|r| r.max_active)
            .fold(None, |acc: Option<i64>, m| {
                if m > 0 {
                    Some(acc.map_or(m, |a| a.max(m)))
                } else {
                    acc
                }
            });
        let count_retained = requests
            .iter()
            .any(|r| !r.exempt && (r.role, r.retention_secs) == key && r.max_retained > 0);
        scopes.entry(key).or_insert_with(|| {
            let cutoff = crate::admission::cutoff(now, req.retention_secs);
            let expired = counts::expired(&rels, &snap, req.role, cutoff);
            ScopeCounts {
                usage: Usage {
                    active: max_active
                        .map_or(0, |m| counts::active(&rels, &snap, req.role, Some(m))),
                    retained: if count_retained {
                        counts::rows(&rels, &snap, req.role) - expired
                    } else {
                        0
                    },
                },
                expired,
                cutoff,
                admitted: 0,
            }
        });
    }

    let (mut ids, mut roles, mut labels) = (Vec::new(), Vec::new(), Vec::new());
    for (&i, req) in batch.iter().zip(&requests) {
        // SAFETY: as above; the reply belongs to the writer while the slot is CLAIMED.
        let reply = unsafe { &mut *shmem::slot(i).reply.get() };
        let limits = Limits {
            max_active: req.max_active,
            max_retained: req.max_retained,
        };
        let sc = scopes.get_mut(&(req.role, req.retention_secs));
        let usage = sc.as_ref().map_or(Usage::default(), |sc| sc.usage);
        match decide(limits, usage, req.exempt) {
            Decision::Admit => {
                let id = new_ticket_id(now);
                ids.push(pgrx::Uuid::from_bytes(id));
                roles.push(req.role);
                labels
                    .push(req.has_label.then(|| {
                        String::from_utf8_lossy(&req.label[..req.label_len]).into_owned()
                    }));
                if let Some(sc) = sc {
                    sc.usage.active += 1;
                    sc.usage.retained += 1;
                    sc.admitted += 1;
                }
                reply.kind = REPLY_ADMITTED;
                reply.ticket = id;
            }
            Decision::Refuse(r) => {
                // Only a caller cancelled after handing over its request, or sessions
                // with different limits, get here: callers count in-flight requests.
                let cutoff = crate::admission::cutoff(now, req.retention_secs);
                let (full, next) = crate::admission::refusal_numbers(
                    &rels,
                    &snap,
                    req.role,
                    cutoff,
                    req.retention_secs,
                    r.kind,
                );
                let pending = sc.map_or(0, |sc| sc.admitted);
                reply.kind = REPLY_REFUSED;
                reply.refusal_kind = if r.kind == RefusalKind::Active { 1 } else { 2 };
                reply.active = full.active + pending;
                reply.retained = full.retained + pending;
                reply.next_ageout = next;
            }
        }
    }
    drop(snap);

    // Purge what is past retention in the scopes that grow, so that the expired
    // count each admission reads stays small.
    for (&(role, _), sc) in &scopes {
        if sc.admitted > 0 && sc.expired > 0 {
            PURGE_STMT.run(&mut [role.into(), sc.cutoff.into()], &[false, false]);
        }
    }
    if !ids.is_empty() {
        record(&rels, now, &ids, &roles, &labels);
    }
}

/// Inserts the admitted tickets and adds them to their roles' summary rows.
fn record(
    rels: &counts::Rels,
    now: pg_sys::TimestampTz,
    ids: &[pgrx::Uuid],
    roles: &[pg_sys::Oid],
    labels: &[Option<String>],
) {
    let ledger = OpenRel::open(rels.ledger);
    let mut added: Vec<(pg_sys::Oid, i64)> = Vec::new();
    for ((id, &role), label) in ids.iter().zip(roles).zip(labels) {
        let mut values = [pg_sys::Datum::from(0); counts::NCOLS];
        let mut nulls = [false; counts::NCOLS];
        values[counts::COL_ID - 1] = id.into_datum().unwrap();
        values[counts::COL_ROLE - 1] = role.into();
        match label {
            Some(l) => values[counts::COL_LABEL - 1] = l.as_str().into_datum().unwrap(),
            None => nulls[counts::COL_LABEL - 1] = true,
        }
        values[counts::COL_STARTED_AT - 1] = now.into();
        nulls[counts::COL_ENDED_AT - 1] = true;
        nulls[counts::COL_OUTCOME - 1] = true;
        ledger.insert(&mut values, &mut nulls);
        match added.iter_mut().find(|(r, _)| *r == role) {
            Some((_, n)) => *n += 1,
            None => added.push((role, 1)),
        }
    }
    drop(ledger);

    let summary = OpenRel::open(rels.summary);
    for (role, n) in added {
        add_to_summary(rels, &summary, role, n);
    }
}

/// Adds `n` to `role`'s summary row, creating it if needed. The writer is the only
/// process that writes summary rows, so a concurrent change means someone edited the
/// table by hand; we then count again from the latest version.
fn add_to_summary(rels: &counts::Rels, summary: &OpenRel, role: pg_sys::Oid, n: i64) {
    loop {
        // SAFETY: makes our purges in this transaction visible to the snapshot below.
        unsafe { pg_sys::CommandCounterIncrement() };
        let snap = counts::Latest::take();
        let mut current = None;
        counts::scan_open(
            summary.heap,
            summary.index(rels.summary_idx),
            &snap,
            &[counts::Key::OidEq(role)],
            |slot| {
                // SAFETY: the slot holds a summary tuple (role, tickets), pinned meanwhile.
                let tickets = unsafe { pg_sys::slot_getattr(slot, 2, &mut false).value() as i64 };
                // SAFETY: as above.
                current = Some((unsafe { (*slot).tts_tid }, tickets));
                false
            },
        );
        let Some((tid, tickets)) = current else {
            summary.insert(&mut [role.into(), n.into()], &mut [false, false]);
            return;
        };
        let tuple = summary.form(
            &mut [role.into(), (tickets + n).into()],
            &mut [false, false],
        );
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

static PURGE_STMT: Stmt = Stmt::new(ledger::PURGE, &[pg_sys::OIDOID, pg_sys::TIMESTAMPTZOID]);

/// Gives up this writer's entry. Unless `force`, only when no request of its database
/// is waiting (checked under the table lock, which callers hold to enqueue).
fn leave(idx: usize, db: pg_sys::Oid, force: bool) -> bool {
    let _lock = shmem::TableLock::acquire();
    if !force {
        let waiting = (0..shmem::n_slots()).any(|i| {
            let s = shmem::slot(i);
            // SAFETY: payload published by the caller's Release store.
            load_state(s) == SLOT_PENDING && unsafe { (*s.request.get()).dboid } == db
        });
        if waiting {
            return false;
        }
    }
    fail_pending(db);
    // SAFETY: the guard taken in take_twin_guard; a new writer may take it at once.
    unsafe { pg_sys::LockRelease(&twin_guard_tag(db), pg_sys::ExclusiveLock as i32, true) };
    let w = shmem::writer(idx);
    w.dboid = pg_sys::InvalidOid;
    w.procno = -1;
    w.exit_requested.store(false, Ordering::Release);
    // SAFETY: single-threaded worker state.
    unsafe { LEFT = true };
    true
}

/// Runs when the writer exits for any reason, FATAL included (pg_terminate_backend).
#[pg_guard]
unsafe extern "C-unwind" fn on_exit(_code: i32, _arg: pg_sys::Datum) {
    // SAFETY: single-threaded worker state; shared state is changed under the lock.
    unsafe {
        if LEFT || MY_ENTRY == usize::MAX || !shmem::available() {
            return;
        }
        // A FATAL can arrive while we hold LWLocks; ShutdownPostgres, which would
        // release them, runs after this callback.
        pg_sys::LWLockReleaseAll();
        let _lock = shmem::TableLock::acquire();
        if BATCH_COMMITTED {
            // The charges are durable: hand the callers their tickets.
            BATCH.with_borrow(|b| {
                for &i in b {
                    shmem::slot(i).state.store(SLOT_DONE, Ordering::Release);
                    shmem::wake(i);
                }
            });
        }
        let w = shmem::writer(MY_ENTRY);
        let db = shmem::my_db();
        if w.dboid == db && w.procno == shmem::my_procno() as i32 {
            w.dboid = pg_sys::InvalidOid;
            w.procno = -1;
        }
        fail_pending(db);
    }
}

/// Asks the writer of database `db`, if any, to leave now. Used by the DROP hook.
pub fn request_exit(db: pg_sys::Oid) {
    if !shmem::available() {
        return;
    }
    let _lock = shmem::TableLock::acquire();
    if let Some(i) = shmem::writer_of(db) {
        let w = shmem::writer(i);
        w.exit_requested.store(true, Ordering::Release);
        if let Ok(p) = usize::try_from(w.procno) {
            shmem::wake(p);
        }
    }
}
