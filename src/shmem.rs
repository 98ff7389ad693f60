//! Shared memory: one request slot per backend and one entry per ledger writer.
//!
//! A caller owns the slot whose index is its PGPROC number, so no two callers ever
//! share a slot and the slot array needs no lock of its own: ownership hand-offs go
//! through the slot's atomic `state` (FREE → PENDING by the caller, PENDING → CLAIMED
//! and CLAIMED → DONE by the writer, DONE → FREE by the caller). The writer table is
//! small and changes only when a writer starts or leaves; one LWLock guards it.

use std::cell::UnsafeCell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;

use crate::core::ticket::{MAX_KEY_BYTES, MAX_LABEL_BYTES};

pub const SLOT_FREE: u32 = 0;
pub const SLOT_PENDING: u32 = 1;
pub const SLOT_CLAIMED: u32 = 2;
pub const SLOT_DONE: u32 = 3;

/// What a caller asks of the writer. Written by the caller while the slot is FREE.
/// The database and the role live in the slot as atomics, because the writer and
/// other callers read them from slots that are not theirs (see `Slot`).
#[repr(C)]
pub struct Request {
    pub exempt: bool,
    pub max_active: i64,
    pub max_retained: i64,
    pub retention_secs: i64,
    pub has_label: bool,
    pub label_len: usize,
    pub label: [u8; MAX_LABEL_BYTES],
    /// `quota.max_active_per_database` of the calling session; 0 = none.
    pub max_db: i64,
    /// When the lease runs out, if the ticket has one (0.2.0's schema).
    pub lease_until: Option<pg_sys::TimestampTz>,
    /// The idempotency key, in the server encoding, if any.
    pub has_key: bool,
    pub key_len: usize,
    pub key: [u8; MAX_KEY_BYTES],
    /// The starting backend's process id, recorded in the ledger (0.2.0's schema).
    pub pid: i32,
}

impl Request {
    pub fn key(&self) -> Option<&[u8]> {
        self.has_key.then(|| &self.key[..self.key_len])
    }
}

pub const REPLY_ADMITTED: u32 = 1;
pub const REPLY_REFUSED: u32 = 2;
pub const REPLY_ERROR: u32 = 3;

pub const ERROR_TEXT_BYTES: usize = 512;

/// The writer's answer. Written by the writer while the slot is CLAIMED.
#[repr(C)]
pub struct Reply {
    pub kind: u32,
    pub ticket: [u8; 16],
    /// For refusals: 1 = active limit, 2 = retained limit, 3 = database cap.
    pub refusal_kind: u32,
    pub active: i64,
    pub retained: i64,
    pub db_active: i64,
    /// For admissions: the ticket already existed under the request's idempotency key,
    /// and nothing was charged.
    pub reused: bool,
    /// For refusals at the retained limit: when the oldest ended ticket ages out.
    pub next_ageout: Option<pg_sys::TimestampTz>,
    /// For errors: the writer's SQLSTATE (as PostgreSQL encodes it) and message.
    pub sqlerrcode: i32,
    pub error_len: usize,
    pub error: [u8; ERROR_TEXT_BYTES],
}

#[repr(C)]
pub struct Slot {
    pub state: AtomicU32,
    /// The request's database and role. Written by the owner before its Release store
    /// of PENDING; read by writers to claim and by callers to count requests in flight,
    /// who must check `state` again after reading them (the slot may be reused).
    pub dboid: AtomicU32,
    pub role: AtomicU32,
    pub request: UnsafeCell<Request>,
    pub reply: UnsafeCell<Reply>,
}

impl Slot {
    pub fn dboid(&self) -> pg_sys::Oid {
        pg_sys::Oid::from(self.dboid.load(Ordering::Acquire))
    }

    pub fn role(&self) -> pg_sys::Oid {
        pg_sys::Oid::from(self.role.load(Ordering::Acquire))
    }
}

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
    /// The database and handle of the last writer that gave up this entry: it may still
    /// be connected while it exits, and DROP DATABASE waits for it (writer::stop).
    pub left_db: pg_sys::Oid,
    pub left_handle: WorkerHandle,
}

#[repr(C)]
struct Header {
    lock: *mut pg_sys::LWLock,
    /// Guards the scope counters (see scopes.rs).
    scope_lock: *mut pg_sys::LWLock,
    n_writers: usize,
    n_slots: usize,
    /// Bumped when a transaction that dropped a role commits; writers purge dropped
    /// roles' tickets when it moves (see hooks.rs and writer.rs).
    roles_dropped: AtomicU64,
    /// The last place handed to a waiting start() (see waiters.rs).
    wait_seq: AtomicU64,
    /// How many backends are in the line of waiting starts right now.
    waiting: AtomicU64,
    /// Random bytes drawn when the server starts, which the scope lock's tag is made
    /// from (see `scope_tag`).
    secret: [u64; 2],
}

const SHMEM_NAME: &CStr = c"pg_quota";
const TRANCHE: &CStr = c"pg_quota";

static mut HEADER: *mut Header = std::ptr::null_mut();
static mut PREV_SHMEM_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;

fn layout() -> (usize, usize, usize) {
    // SAFETY: both are plain ints fixed before shmem_request_hook runs.
    let (n_writers, n_slots) = unsafe {
        (
            pg_sys::max_worker_processes.max(1) as usize,
            pg_sys::MaxBackends as usize,
        )
    };
    let size = std::mem::size_of::<Header>()
        + n_writers * std::mem::size_of::<WriterEntry>()
        + n_slots * std::mem::size_of::<Slot>()
        + crate::scopes::N_SCOPES * std::mem::size_of::<crate::scopes::Scope>()
        + n_slots * crate::scopes::PENDING_PER_SLOT * std::mem::size_of::<crate::scopes::Pending>()
        + n_slots * std::mem::size_of::<crate::waiters::Waiter>();
    (n_writers, n_slots, size)
}

pub fn init() {
    // SAFETY: _PG_init runs once in the postmaster, before any hook can fire, so the
    // hook chain is not read concurrently.
    unsafe {
        PREV_SHMEM_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(shmem_request);
        PREV_SHMEM_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    // SAFETY: called by the postmaster in shmem_request_hook, the one place where
    // PostgreSQL 15+ accepts these requests.
    unsafe {
        if let Some(prev) = PREV_SHMEM_REQUEST_HOOK {
            prev();
        }
        pg_sys::RequestAddinShmemSpace(layout().2);
        pg_sys::RequestAddinShmemSpace(crate::stats::shmem_size());
        pg_sys::RequestNamedLWLockTranche(TRANCHE.as_ptr(), 3);
    }
}

/// AddinShmemInitLock is a C macro for slot 21 of the main LWLock array (see
/// lwlocknames.txt through 17, lwlocklist.h in 18; slot 21 in 15 through 18).
unsafe fn addin_shmem_init_lock() -> *mut pg_sys::LWLock {
    // SAFETY: MainLWLockArray is set up before any shmem_startup_hook runs.
    unsafe { &mut (*pg_sys::MainLWLockArray.add(21)).lock }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_startup() {
    // SAFETY: AddinShmemInitLock serializes ShmemInitStruct against other processes;
    // the struct is zeroed and filled only by whoever created it (`found == false`).
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP_HOOK {
            prev();
        }
        let (n_writers, n_slots, size) = layout();
        pg_sys::LWLockAcquire(addin_shmem_init_lock(), pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let header = pg_sys::ShmemInitStruct(SHMEM_NAME.as_ptr(), size, &mut found) as *mut Header;
        if !found {
            std::ptr::write_bytes(header as *mut u8, 0, size);
            let locks = pg_sys::GetNamedLWLockTranche(TRANCHE.as_ptr());
            (*header).lock = &mut (*locks).lock;
            (*header).scope_lock = &mut (*locks.add(1)).lock;
            (*header).n_writers = n_writers;
            (*header).n_slots = n_slots;
            if !pg_sys::pg_strong_random(
                (*header).secret.as_mut_ptr().cast(),
                std::mem::size_of::<[u64; 2]>(),
            ) {
                pgrx::error!("pg_quota: could not generate random bytes for its lock tags");
            }
            for i in 0..n_writers {
                (*writer_ptr(header, i)).procno = -1;
            }
        }
        HEADER = header;
        let locks = pg_sys::GetNamedLWLockTranche(TRANCHE.as_ptr());
        crate::stats::shmem_startup(&mut (*locks.add(2)).lock);
        pg_sys::LWLockRelease(addin_shmem_init_lock());
    }
}

/// True when the library was preloaded and its shared memory exists.
pub fn available() -> bool {
    // SAFETY: a pointer read; HEADER is set once at startup and inherited by fork.
    unsafe { !HEADER.is_null() }
}

unsafe fn writer_ptr(header: *mut Header, i: usize) -> *mut WriterEntry {
    // SAFETY: the caller passes i < n_writers; the entries follow the header.
    unsafe { (header.add(1) as *mut WriterEntry).add(i) }
}

fn header() -> *mut Header {
    assert!(available(), "pg_quota shared memory is not initialized");
    // SAFETY: checked non-null above.
    unsafe { HEADER }
}

pub fn n_writers() -> usize {
    // SAFETY: immutable after startup.
    unsafe { (*header()).n_writers }
}

pub fn n_slots() -> usize {
    // SAFETY: immutable after startup.
    unsafe { (*header()).n_slots }
}

/// The writer entry `i`. Callers hold the lock for every field but `exit_requested`.
pub fn writer(i: usize) -> &'static mut WriterEntry {
    assert!(i < n_writers());
    // SAFETY: in bounds; the memory lives as long as the server.
    unsafe { &mut *writer_ptr(header(), i) }
}

pub fn slot(i: usize) -> &'static Slot {
    assert!(i < n_slots());
    // SAFETY: in bounds; the slots follow the writer entries.
    unsafe {
        let first = writer_ptr(header(), n_writers()) as *mut Slot;
        &*first.add(i)
    }
}

/// The scope counters, N_SCOPES of them, after the slots.
pub fn scopes() -> &'static [crate::scopes::Scope] {
    // SAFETY: in bounds of the segment laid out by `layout`; zeroed at creation, which
    // is a valid state of every field (all atomics).
    unsafe {
        let first = (writer_ptr(header(), n_writers()) as *mut Slot).add(n_slots())
            as *const crate::scopes::Scope;
        std::slice::from_raw_parts(first, crate::scopes::N_SCOPES)
    }
}

/// The pending counter changes published by backend `procno` (see scopes.rs).
pub fn pending(procno: usize) -> &'static [crate::scopes::Pending] {
    assert!(procno < n_slots());
    // SAFETY: in bounds of the segment laid out by `layout`; zeroed at creation.
    unsafe {
        let first = scopes().as_ptr().add(crate::scopes::N_SCOPES) as *const crate::scopes::Pending;
        std::slice::from_raw_parts(
            first.add(procno * crate::scopes::PENDING_PER_SLOT),
            crate::scopes::PENDING_PER_SLOT,
        )
    }
}

/// The waiting starts, one entry per backend (see waiters.rs), after the pending
/// counter changes.
pub fn waiters() -> &'static [crate::waiters::Waiter] {
    // SAFETY: in bounds of the segment laid out by `layout`; zeroed at creation, which
    // is a valid state of every field (all atomics).
    unsafe {
        let first = pending(0)
            .as_ptr()
            .add(n_slots() * crate::scopes::PENDING_PER_SLOT)
            as *const crate::waiters::Waiter;
        std::slice::from_raw_parts(first, n_slots())
    }
}

/// How many backends wait in line (see waiters.rs).
pub fn waiting() -> &'static AtomicU64 {
    // SAFETY: the header lives as long as the server; the field is atomic.
    unsafe { &(*header()).waiting }
}

/// The counter that orders waiting starts.
pub fn wait_seq() -> &'static AtomicU64 {
    // SAFETY: the header lives as long as the server; the field is atomic.
    unsafe { &(*header()).wait_seq }
}

/// The scope counters' LWLock.
pub fn scope_lock() -> *mut pg_sys::LWLock {
    // SAFETY: set at startup.
    unsafe { (*header()).scope_lock }
}

/// The two lock tag fields that stand for scope (db, role) in the scope lock: a keyed
/// hash of the pair, the key drawn at server start. pg_locks, which every role can
/// read, shows lock tags; the role's OID there would tell any tenant which roles are
/// being admitted right now, which the rest of pg_quota shows no tenant. Two scopes
/// whose hashes collide (a chance of one in 2^64) would only share a lock.
pub fn scope_tag(db: pg_sys::Oid, role: pg_sys::Oid) -> (u32, u32) {
    use std::hash::{Hash, Hasher};
    // DefaultHasher::new() is SipHash with fixed keys, the same in every process of
    // this build; the secret, hashed first, is what keys it.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    // SAFETY: the header lives as long as the server; the secret never changes.
    unsafe { (*header()).secret }.hash(&mut h);
    (u32::from(db), u32::from(role)).hash(&mut h);
    let v = h.finish();
    (v as u32, (v >> 32) as u32)
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
        unsafe { pg_sys::LWLockAcquire((*header()).lock, mode) };
        TableLock(())
    }
}

impl Drop for TableLock {
    fn drop(&mut self) {
        // SAFETY: we hold the lock unless abort already released it, which
        // LWLockHeldByMe tells.
        unsafe {
            let lock = (*header()).lock;
            if pg_sys::LWLockHeldByMe(lock) {
                pg_sys::LWLockRelease(lock);
            }
        }
    }
}

/// How many role-dropping transactions have committed since the server started.
pub fn roles_dropped() -> &'static AtomicU64 {
    // SAFETY: the header lives as long as the server; the field is atomic.
    unsafe { &(*header()).roles_dropped }
}

/// The writer entry serving database `db`, if any. Callers hold the table lock.
pub fn writer_of(db: pg_sys::Oid) -> Option<usize> {
    (0..n_writers()).find(|&i| writer(i).dboid == db)
}

/// The database this backend is connected to.
pub fn my_db() -> pg_sys::Oid {
    // SAFETY: MyDatabaseId is set once a backend or worker connects, before any
    // pg_quota code that calls this runs, and never changes afterwards.
    unsafe { pg_sys::MyDatabaseId }
}

/// This backend's PGPROC number, which is also its slot index.
pub fn my_procno() -> usize {
    // SAFETY: MyProc points into ProcGlobal->allProcs in every backend.
    unsafe { (pg_sys::MyProc).offset_from((*pg_sys::ProcGlobal).allProcs) as usize }
}

/// Wakes the process with PGPROC number `procno`.
pub fn wake(procno: usize) {
    // SAFETY: procLatch of a PGPROC is a shared latch in shared memory; setting it is
    // safe from any process, even if the owner has exited.
    unsafe {
        let proc_ = (*pg_sys::ProcGlobal).allProcs.add(procno);
        pg_sys::SetLatch(&mut (*proc_).procLatch);
    }
}

/// Ordering helper: the payload written before a Release store is seen after the
/// matching Acquire load.
pub fn load_state(s: &Slot) -> u32 {
    s.state.load(Ordering::Acquire)
}
