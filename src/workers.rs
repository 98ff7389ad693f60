//! Layer 4, shared state: the table of ledger writers, one entry per database whose
//! writer runs or starts, in a segment of its own. Callers find their database's
//! writer here (and register one when there is none); hooks ask writers to leave or
//! wait for them to be gone; the writer path takes and gives up its entry.
//!
//! The table is small and changes only when a writer starts or leaves; one LWLock
//! guards it (`TableLock`). Lock order: never take the scope counters' lock while
//! holding it (see scopes.rs).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pgrx::pg_sys;

use crate::compat;
use crate::shmem::{self, Base, Layout, Segment};

/// How long DROP DATABASE waits for the database's writer to leave by itself before it
/// terminates it, and as long again for it to be gone (see `stop`).
const STOP_WAIT: Duration = Duration::from_secs(5);

/// A copy of PostgreSQL's private `BackgroundWorkerHandle` (bgworker.c: an `int slot`
/// and a `uint64 generation`, unchanged since 9.4), so that every backend, not only
/// the one that registered the writer, can ask the postmaster whether it is alive.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct WorkerHandle {
    pub slot: i32,
    pub generation: u64,
}

/// One ledger writer. All fields but `exit_requested` are guarded by `Shared::lock`.
#[repr(C)]
pub struct WriterEntry {
    /// The database this writer serves; InvalidOid marks a free entry.
    pub dboid: pg_sys::Oid,
    /// The writer's PGPROC number once it runs, or -1 while it starts.
    pub procno: i32,
    pub handle: WorkerHandle,
    /// Set by DROP DATABASE / DROP EXTENSION (see hooks.rs) to make the writer leave.
    pub exit_requested: AtomicBool,
    /// Set before commands that need the database to themselves (CREATE DATABASE …
    /// TEMPLATE, ALTER DATABASE … RENAME or SET TABLESPACE): leave once nothing waits.
    pub leave_when_idle: AtomicBool,
    /// Set by a caller that found a role without a summary row and a long history:
    /// the writer rebuilds missing summary rows.
    pub rebuild_summary: AtomicBool,
    /// The database and handle of the last writer that gave up this entry, by itself
    /// or from its exit callback (terminated, FATAL): it may still be connected while
    /// it exits, and DROP DATABASE waits for it (`stop`). The entry is not taken again
    /// until that process is gone (`free_entry`), so no exit is ever overwritten before
    /// it is over. InvalidOid once it is known to be gone.
    pub left_db: pg_sys::Oid,
    pub left_handle: WorkerHandle,
    /// 0.6.1: no unended ticket of the database has a lease that ends before this
    /// (TimestampTz), as far as the changes applied since the writer's last expiry sweep
    /// tell (`lower_lease_floor`): the sweep, which reads all of quota.active, walks it
    /// only once this has passed (see writer/sweep.rs). i64::MIN where something it
    /// cannot follow happened; a new entry starts there.
    pub lease_floor: AtomicI64,
}

/// Lowers the lease floor of database `db`'s writer, if it has one, to `floor` (see
/// WriterEntry::lease_floor): after a commit whose changes start or renew tickets with
/// leases. A database without a writer needs nothing: a new writer sweeps at once.
/// Takes the table lock shared; never raises an error (it runs inside commit).
pub fn lower_lease_floor(db: pg_sys::Oid, floor: i64) {
    if db == pg_sys::InvalidOid {
        return;
    }
    let _l = TableLock::acquire_shared();
    if let Some(i) = writer_of(db) {
        writer(i).lease_floor.fetch_min(floor, Ordering::AcqRel);
    }
}

#[repr(C)]
struct Header {
    lock: *mut pg_sys::LWLock,
    n_writers: usize,
    /// Bumped when a transaction that dropped a role commits; writers purge dropped
    /// roles' tickets when it moves (see hooks.rs and writer/).
    roles_dropped: AtomicU64,
    /// Set by a caller that found no writer slot (every entry taken, or no background
    /// worker slot): the next writer with nothing to do takes it back and gives its slot
    /// up (`take_yield`), so that databases share the slots in turn.
    yield_wanted: AtomicBool,
    /// When a writer last gave its entry up (ms, `now_ms`): its process frees the
    /// background worker slot a moment later, so a caller that finds no slot then waits
    /// for that one instead of asking another writer to go.
    last_left_ms: AtomicU64,
}

static BASE: Base = Base::new();

fn n_writers_configured() -> usize {
    // SAFETY: a plain int fixed before shmem_request_hook runs.
    unsafe { pg_sys::max_worker_processes.max(1) as usize }
}

/// The segment's layout for `n` writers: the header, then the entries.
fn layout(n: usize) -> (Layout, usize) {
    let mut l = Layout::of::<Header>();
    let entries = l.array::<WriterEntry>(n);
    (l, entries)
}

fn size() -> usize {
    layout(n_writers_configured()).0.size()
}

/// # Safety
/// See shmem::Segment::attach.
unsafe fn attach(base: *mut u8, found: bool, locks: *mut pg_sys::LWLockPadded) {
    // SAFETY: the segment is ours and zeroed when not `found`.
    unsafe {
        if !found {
            let n = n_writers_configured();
            let h = base as *mut Header;
            (*h).lock = &mut (*locks).lock;
            (*h).n_writers = n;
            let (_, entries) = layout(n);
            for i in 0..n {
                (*(base.add(entries) as *mut WriterEntry).add(i)).procno = -1;
            }
        }
    }
    BASE.set(base);
}

/// The writer table's segment (see shmem.rs).
pub static SEGMENT: Segment = Segment {
    name: c"pg_quota writers",
    size,
    extra: shmem::nothing,
    locks: 1,
    attach,
};

fn header() -> &'static Header {
    // SAFETY: the segment starts with a Header (see `layout`).
    unsafe { BASE.header::<Header>() }
}

pub fn n_writers() -> usize {
    header().n_writers
}

/// Writer entry `i`, to read: its atomics at any time, its other fields under the
/// table lock (shared or exclusive).
pub fn writer(i: usize) -> &'static WriterEntry {
    let n = n_writers();
    // SAFETY: `layout` put `n` entries there, each set to "free" at creation.
    unsafe { &BASE.slice::<WriterEntry>(layout(n).1, n)[i] }
}

/// Writer entry `i`, to change.
///
/// # Safety
/// The caller holds the table lock exclusively, and holds no other reference to the
/// entry while it uses this one.
#[allow(clippy::mut_from_ref)]
pub unsafe fn writer_mut(i: usize) -> &'static mut WriterEntry {
    assert!(i < n_writers());
    // SAFETY: in bounds; per the contract above, nothing else refers to the entry.
    unsafe { BASE.element_mut::<WriterEntry>(layout(n_writers()).1, i) }
}

/// The writer entry serving database `db`, if any. Callers hold the table lock.
pub fn writer_of(db: pg_sys::Oid) -> Option<usize> {
    debug_assert!(
        db != pg_sys::InvalidOid,
        "free entries are found with free_entry"
    );
    (0..n_writers()).find(|&i| writer(i).dboid == db)
}

/// The status of the writer process behind `handle`.
fn status(handle: WorkerHandle) -> pg_sys::BgwHandleStatus::Type {
    let mut pid = 0;
    let mut h = handle;
    // SAFETY: `h` has the layout of BackgroundWorkerHandle (see WorkerHandle); the
    // postmaster's slot generation tells a reused slot apart. STOPPED comes only once
    // the postmaster has reaped the process, which is out of the ProcArray by then.
    unsafe { pg_sys::GetBackgroundWorkerPid(&mut h as *mut WorkerHandle as *mut _, &mut pid) }
}

/// Records in entry `w` that its writer of `db` gives it up now: what `stop` waits for.
/// Table lock held exclusively.
pub fn record_exit(w: &mut WriterEntry, db: pg_sys::Oid) {
    w.left_db = db;
    w.left_handle = w.handle;
}

/// Whether entry `w` is free for a new writer: no writer serves it, and the last one's
/// process is gone. Table lock held.
fn takeable(w: &WriterEntry) -> bool {
    w.dboid == pg_sys::InvalidOid
        && (w.left_db == pg_sys::InvalidOid
            || status(w.left_handle) == pg_sys::BgwHandleStatus::BGWH_STOPPED)
}

/// A free writer entry that a new writer may take (see `takeable`). Table lock held
/// exclusively.
fn free_entry() -> Option<usize> {
    let i = (0..n_writers()).find(|&i| takeable(writer(i)))?;
    // SAFETY: the table lock is held exclusively; no other reference to the entry.
    unsafe { writer_mut(i) }.left_db = pg_sys::InvalidOid;
    Some(i)
}

/// Whether a new writer could take an entry now. Table lock held, shared at least.
pub fn has_free_entry() -> bool {
    (0..n_writers()).any(|i| takeable(writer(i)))
}

/// How many role-dropping transactions have committed since the server started.
pub fn roles_dropped() -> &'static AtomicU64 {
    &header().roles_dropped
}

/// Holds the writer-table LWLock; released on drop, including during an unwind.
pub struct TableLock(());

impl TableLock {
    /// Exclusive: for changing writer entries.
    pub fn acquire() -> TableLock {
        Self::acquire_mode(pg_sys::LWLockMode::LW_EXCLUSIVE)
    }

    /// Shared: for reading writer entries. Callers enqueue under it, so that a writer
    /// deciding to leave (exclusively) sees every request queued for it.
    pub fn acquire_shared() -> TableLock {
        Self::acquire_mode(pg_sys::LWLockMode::LW_SHARED)
    }

    fn acquire_mode(mode: pg_sys::LWLockMode::Type) -> TableLock {
        // SAFETY: the lock pointer was set at startup; an ERROR while held is cleaned
        // up by LWLockReleaseAll at abort, and Drop covers the Rust unwind.
        unsafe { pg_sys::LWLockAcquire(header().lock, mode) };
        TableLock(())
    }
}

impl Drop for TableLock {
    fn drop(&mut self) {
        // SAFETY: we hold the lock unless abort already released it, which
        // LWLockHeldByMe tells.
        unsafe {
            let lock = header().lock;
            if pg_sys::LWLockHeldByMe(lock) {
                pg_sys::LWLockRelease(lock);
            }
        }
    }
}

/// What a caller knows of this database's writer while it waits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WriterState {
    /// Registered and starting, or running.
    Alive,
    /// Gone after it had started serving.
    Gone,
    /// Gone before it started serving: it could not connect, or failed at start.
    NeverStarted,
}

/// Checks this database's writer. Frees the entry of a writer that is gone, so that
/// the table never fills up with dead entries.
pub fn writer_state() -> WriterState {
    let db = shmem::my_db();
    let _lock = TableLock::acquire();
    let Some(i) = writer_of(db) else {
        return WriterState::Gone;
    };
    // SAFETY: the table lock is held exclusively; no other reference to the entry.
    let w = unsafe { writer_mut(i) };
    let status = status(w.handle);
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

/// A slot that a writer gave up this recently is still held by its exiting process.
const LEFT_JUST_NOW_MS: u64 = 200;

/// Milliseconds on the monotonic clock, which every process of the server shares and
/// no clock step moves.
fn now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: fills the struct we pass; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec.max(0) as u64) * 1000 + (ts.tv_nsec.max(0) as u64) / 1_000_000
}

/// Claims a free writer entry for this database and registers a writer for it.
/// Called with the table lock held exclusively, when the database has no entry. Dead
/// entries are swept first, so the table cannot fill up with them. None when there is
/// no free entry or no background worker slot: then the next writer of another
/// database with nothing to do is asked to give its slot up (unless one just did), and
/// the caller tries again (queue/caller.rs), for at most `quota.writer_start_wait`.
pub fn try_start_writer() -> Option<usize> {
    let db = shmem::my_db();
    let Some((i, handle)) = register_in_free_entry(db) else {
        let h = header();
        let left = now_ms().saturating_sub(h.last_left_ms.load(Ordering::Acquire));
        if left >= LEFT_JUST_NOW_MS && !h.yield_wanted.swap(true, Ordering::AcqRel) {
            wake_others(db);
        }
        return None;
    };
    // The slot a writer gave up is taken: the next caller may ask for another at once.
    header().yield_wanted.store(false, Ordering::Release);
    header().last_left_ms.store(0, Ordering::Release);
    take_entry(i, db, handle);
    Some(i)
}

/// Registers a writer for `db` in a free entry, if there is one and a background worker
/// slot is free. Table lock held exclusively.
fn register_in_free_entry(db: pg_sys::Oid) -> Option<(usize, WorkerHandle)> {
    let free = free_entry().or_else(|| {
        sweep_dead_entries();
        free_entry()
    });
    free.and_then(|i| Some((i, register_worker(i, db)?)))
}

/// Entry `i` is the new writer of `db`'s. Table lock held exclusively.
fn take_entry(i: usize, db: pg_sys::Oid, handle: WorkerHandle) {
    // SAFETY: called with the table lock held exclusively; no other reference to it.
    let w = unsafe { writer_mut(i) };
    w.dboid = db;
    w.procno = -1;
    w.handle = handle;
    w.exit_requested.store(false, Ordering::Relaxed);
    w.leave_when_idle.store(false, Ordering::Relaxed);
    w.rebuild_summary.store(false, Ordering::Relaxed);
    w.lease_floor.store(i64::MIN, Ordering::Relaxed);
}

/// Starts a writer for this database if none runs and one can start at once, without
/// waiting and without asking another database's writer to give its slot up: for the
/// housekeeping nobody waits for (the fold of transactional tickets, writer/fold.rs).
/// Looks at most once a second per backend.
pub fn start_soon() {
    // Single-threaded backend state.
    static mut LAST_LOOK: Option<Instant> = None;
    // SAFETY: single-threaded backend state.
    unsafe {
        let last = &mut *std::ptr::addr_of_mut!(LAST_LOOK);
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        *last = Some(Instant::now());
    }
    let db = shmem::my_db();
    {
        let _shared = TableLock::acquire_shared();
        if writer_of(db).is_some() {
            return;
        }
    }
    let _lock = TableLock::acquire();
    if writer_of(db).is_none() {
        if let Some((i, handle)) = register_in_free_entry(db) {
            take_entry(i, db, handle);
        }
    }
}

/// For a writer with nothing to do: whether a caller waits for a writer slot, taking
/// the request (at most one writer answers each). A writer that then cannot leave
/// (a request came in) puts it back with `want_yield`.
pub fn take_yield() -> bool {
    header().yield_wanted.swap(false, Ordering::AcqRel)
}

pub fn want_yield() {
    header().yield_wanted.store(true, Ordering::Release);
}

/// Notes that a writer gave its entry up now. Table lock held.
pub fn note_left() {
    header().last_left_ms.store(now_ms(), Ordering::Release);
}

/// Wakes the writers of databases other than `db`, so that an idle one sees a yield
/// request at once. Table lock held.
fn wake_others(db: pg_sys::Oid) {
    for i in 0..n_writers() {
        let w = writer(i);
        if w.dboid != pg_sys::InvalidOid && w.dboid != db {
            if let Ok(p) = usize::try_from(w.procno) {
                shmem::wake(p);
            }
        }
    }
}

/// Frees the entries of writers that are no longer running. Table lock held.
fn sweep_dead_entries() {
    for i in 0..n_writers() {
        // SAFETY: the table lock is held exclusively; no other reference to it.
        let w = unsafe { writer_mut(i) };
        if w.dboid == pg_sys::InvalidOid {
            continue;
        }
        if status(w.handle) == pg_sys::BgwHandleStatus::BGWH_STOPPED {
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

/// Asks the writer of database `db`, if any, to leave: now (`force`, for DROP
/// DATABASE and DROP EXTENSION), or as soon as no request waits (before commands that
/// need the database to themselves, which fail anyway while sessions are connected).
/// See hooks.rs.
pub fn request_exit(db: pg_sys::Oid, force: bool) {
    if !shmem::available() {
        return;
    }
    let _lock = TableLock::acquire();
    if let Some(i) = writer_of(db) {
        let w = writer(i);
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
/// - one that gave up its entry a moment ago (an idle exit, or a terminated writer whose
///   exit callback freed it) may still be connected while it exits: it is waited for
///   too, until its process is gone (`record_exit`; 0.4.0 recorded only clean exits,
///   and only the last of each entry).
pub fn stop(db: pg_sys::Oid) {
    if !shmem::available() {
        return;
    }
    let mut handles: Vec<(WorkerHandle, bool)> = Vec::new();
    {
        let _lock = TableLock::acquire();
        for i in 0..n_writers() {
            let w = writer(i);
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
            let status = status(handle);
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
                let mut h = handle;
                // SAFETY: `h` has the layout of BackgroundWorkerHandle; the postmaster
                // sends the worker SIGTERM.
                unsafe { pg_sys::TerminateBackgroundWorker(&mut h as *mut WorkerHandle as *mut _) };
                terminated = true;
            }
            compat::nap(10, compat::Wait::WriterExit);
        }
    }
}

/// Asks this database's writer, if it runs, to rebuild missing summary rows.
pub fn request_summary_rebuild() {
    let _lock = TableLock::acquire_shared();
    if let Some(i) = writer_of(shmem::my_db()) {
        let w = writer(i);
        if !w.rebuild_summary.swap(true, Ordering::AcqRel) {
            if let Ok(p) = usize::try_from(w.procno) {
                shmem::wake(p);
            }
        }
    }
}

/// Wakes every running writer (after a role was dropped).
pub fn wake_all() {
    let _lock = TableLock::acquire_shared();
    for i in 0..n_writers() {
        let w = writer(i);
        if w.dboid != pg_sys::InvalidOid {
            if let Ok(p) = usize::try_from(w.procno) {
                shmem::wake(p);
            }
        }
    }
}
