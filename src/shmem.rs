//! Layer 2: reserving and attaching shared memory, and the process facts every layer
//! above asks for (which database, which PGPROC number, waking a process).
//!
//! Each subsystem declares its segment: a name, a size, how many LWLocks it needs, and
//! how to attach it. `_PG_init` lists the segments with `reserve`; this file requests
//! their space and locks from PostgreSQL and attaches each in every process that
//! starts up, and knows none of their types. The LWLocks of all segments come from one
//! tranche named "pg_quota", handed out in the order the segments were reserved, so
//! that pg_stat_activity names every pg_quota LWLock wait alike.

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use pgrx::pg_sys;

/// A shared-memory segment of one subsystem.
pub struct Segment {
    /// Its name in PostgreSQL's index of shared memory (pg_shmem_allocations).
    pub name: &'static CStr,
    /// Its size in bytes. Asked when the server sizes shared memory, when MaxBackends
    /// and max_worker_processes are known.
    pub size: fn() -> usize,
    /// Space the subsystem allocates itself while it attaches (a shared hash table),
    /// requested on top of `size`.
    pub extra: fn() -> usize,
    /// How many LWLocks it needs.
    pub locks: usize,
    /// Attaches the segment in this process. `found` is false in the process that
    /// creates it (the postmaster), which gets it zeroed and initialises it, with its
    /// `locks` LWLocks at `locks`.
    ///
    /// # Safety
    /// Called only from the shared-memory startup hook, under AddinShmemInitLock.
    pub attach: unsafe fn(base: *mut u8, found: bool, locks: *mut pg_sys::LWLockPadded),
}

/// No extra space.
pub fn nothing() -> usize {
    0
}

const TRANCHE: &CStr = c"pg_quota";

// Postmaster state before fork, read-only afterwards: the reserved segments.
static mut SEGMENTS: Vec<&'static Segment> = Vec::new();
static ATTACHED: AtomicBool = AtomicBool::new(false);
static mut PREV_SHMEM_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;

/// Reserves `seg`. Called from _PG_init, once per segment; installs the hooks on the
/// first call.
pub fn reserve(seg: &'static Segment) {
    // SAFETY: _PG_init runs once in the postmaster, before any hook can fire, so the
    // hook chain and the segment list are not read concurrently.
    unsafe {
        let segments = &mut *std::ptr::addr_of_mut!(SEGMENTS);
        if segments.is_empty() {
            PREV_SHMEM_REQUEST_HOOK = pg_sys::shmem_request_hook;
            pg_sys::shmem_request_hook = Some(shmem_request);
            PREV_SHMEM_STARTUP_HOOK = pg_sys::shmem_startup_hook;
            pg_sys::shmem_startup_hook = Some(shmem_startup);
        }
        segments.push(seg);
    }
}

fn segments() -> &'static [&'static Segment] {
    // SAFETY: filled in _PG_init, never changed afterwards.
    unsafe { &*std::ptr::addr_of!(SEGMENTS) }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    // SAFETY: called by the postmaster in shmem_request_hook, the one place where
    // PostgreSQL 15+ accepts these requests.
    unsafe {
        if let Some(prev) = PREV_SHMEM_REQUEST_HOOK {
            prev();
        }
        for seg in segments() {
            // ShmemInitStruct rounds each allocation up to a cache line.
            let size = (seg.size)().next_multiple_of(pg_sys::PG_CACHE_LINE_SIZE as usize);
            pg_sys::RequestAddinShmemSpace(size + (seg.extra)());
        }
        let locks: usize = segments().iter().map(|s| s.locks).sum();
        pg_sys::RequestNamedLWLockTranche(TRANCHE.as_ptr(), locks as i32);
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
    // a segment is zeroed and initialised only by whoever created it (`found ==
    // false`).
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP_HOOK {
            prev();
        }
        pg_sys::LWLockAcquire(addin_shmem_init_lock(), pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut locks = pg_sys::GetNamedLWLockTranche(TRANCHE.as_ptr());
        for seg in segments() {
            let size = (seg.size)();
            let mut found = false;
            // ShmemInitStruct hands out whole cache lines (shmem_request asks for them).
            let base = pg_sys::ShmemInitStruct(seg.name.as_ptr(), size, &mut found) as *mut u8;
            if !found {
                std::ptr::write_bytes(base, 0, size);
            }
            (seg.attach)(base, found, locks);
            locks = locks.add(seg.locks);
        }
        ATTACHED.store(true, Ordering::Release);
        pg_sys::LWLockRelease(addin_shmem_init_lock());
    }
}

/// True when the library was preloaded and its shared memory exists.
pub fn available() -> bool {
    ATTACHED.load(Ordering::Acquire)
}

/// Raises 55000 and the hint to preload the library unless its shared memory exists.
pub fn require_preloaded() {
    if !available() {
        crate::error::raise(crate::core::QuotaError::NotPreloaded);
    }
}

/// The checks every pg_quota function that changes something makes first: the library
/// is preloaded, and we are not in a parallel operation. A parallel worker cannot
/// write, nor hand a request to the writer on the leader's behalf, so pg_quota refuses
/// there as nextval() does (25000), even when a user's wrapper function is wrongly
/// marked PARALLEL SAFE.
pub fn require_callable(name: &CStr) {
    require_preloaded();
    // SAFETY: raises ERROR or returns.
    unsafe { pg_sys::PreventCommandIfParallelMode(name.as_ptr()) };
}

/// The database this backend is connected to.
pub fn my_db() -> pg_sys::Oid {
    // SAFETY: MyDatabaseId is set once a backend or worker connects, before any
    // pg_quota code that calls this runs, and never changes afterwards.
    unsafe { pg_sys::MyDatabaseId }
}

/// This backend's PGPROC number, which also indexes its entries in the segments that
/// have one per backend.
pub fn my_procno() -> usize {
    // SAFETY: MyProc points into ProcGlobal->allProcs in every backend.
    unsafe { (pg_sys::MyProc).offset_from((*pg_sys::ProcGlobal).allProcs) as usize }
}

/// How many PGPROC numbers backends and background workers use: the entries a segment
/// needs for one per backend.
pub fn max_backends() -> usize {
    // SAFETY: a plain int, fixed before shmem_request_hook runs.
    unsafe { pg_sys::MaxBackends as usize }
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

/// A segment's layout: a header of type H followed by arrays, each at an offset this
/// computes with the alignment of its element type. Used by the subsystems to lay out
/// their own segments.
pub struct Layout {
    size: usize,
}

impl Layout {
    /// A segment that starts with a header of type H.
    pub fn of<H>() -> Layout {
        Layout {
            size: std::mem::size_of::<H>(),
        }
    }

    /// Appends `n` elements of type T; returns their offset.
    pub fn array<T>(&mut self, n: usize) -> usize {
        let align = std::mem::align_of::<T>();
        let offset = self.size.div_ceil(align) * align;
        self.size = offset + n * std::mem::size_of::<T>();
        offset
    }

    pub fn size(&self) -> usize {
        self.size
    }
}

/// Where a segment is attached in this process: set by its `attach`, and inherited by
/// the processes the postmaster forks.
pub struct Base(AtomicPtr<u8>);

impl Base {
    pub const fn new() -> Base {
        Base(AtomicPtr::new(std::ptr::null_mut()))
    }

    /// Called by the segment's `attach`.
    pub fn set(&self, base: *mut u8) {
        self.0.store(base, Ordering::Release);
    }

    fn get(&self) -> *mut u8 {
        assert!(available(), "pg_quota shared memory is not initialized");
        // Set before any fork, never changed: a plain load suffices.
        let base = self.0.load(Ordering::Relaxed);
        assert!(
            !base.is_null(),
            "a pg_quota segment was not reserved in _PG_init"
        );
        base
    }

    /// The segment's header, of type H. Fields that more than one process changes are
    /// atomics, or guarded by the segment's lock.
    ///
    /// # Safety
    /// The segment's layout starts with an H (Layout::of::<H>).
    pub unsafe fn header<H>(&self) -> &'static H {
        // SAFETY: per the contract above; the segment lives as long as the server.
        unsafe { &*(self.get() as *const H) }
    }

    /// The `n` elements of type T at `offset`.
    ///
    /// # Safety
    /// The segment's layout put `n` elements of T at `offset` (Layout::array), in a
    /// state the segment's owner made valid (zeroed at creation, then initialised).
    pub unsafe fn slice<T>(&self, offset: usize, n: usize) -> &'static [T] {
        // SAFETY: per the contract above.
        unsafe { std::slice::from_raw_parts(self.get().add(offset) as *const T, n) }
    }

    /// Element `i` of type T at `offset`, for writing (the writer table's entries,
    /// whose fields but the atomics its lock guards).
    ///
    /// # Safety
    /// The caller holds what guards the element, and `i` is in bounds.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn element_mut<T>(&self, offset: usize, i: usize) -> &'static mut T {
        // SAFETY: per the contract above.
        unsafe { &mut *(self.get().add(offset) as *mut T).add(i) }
    }
}
