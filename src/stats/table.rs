//! Layer 4: the statistics' table in shared memory: its layout, the hash table from
//! (database, role) to an entry, pinning, and what creating, evicting and taking away
//! entries do (see mod.rs for the protocol).

use std::cell::RefCell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;

use crate::core::stats::{self as core_stats, N_COUNTERS, N_WAIT_BUCKETS};

pub(super) const SHMEM_NAME: &CStr = c"pg_quota stats";
pub(super) const INDEX_NAME: &CStr = c"pg_quota stats index";
pub(super) const FILE: &str = "pg_stat/pg_quota.stat";
pub(super) const FILE_TMP: &str = "pg_stat/pg_quota.stat.tmp";
pub(super) const FREE: u64 = 0;
pub(super) const BUSY: u64 = u64::MAX;
/// The role of a database's entry for roles no longer listed.
pub(super) const OTHER_ROLES: u32 = 0;
/// The share of entries evicted at once, in percent.
pub(super) const EVICT_PERCENT: usize = 5;
pub const ERROR_BYTES: usize = 256;

#[repr(C)]
pub struct Entry {
    /// (database << 32) | role; FREE or BUSY.
    pub(super) key: AtomicU64,
    pub(super) pins: AtomicU32,
    /// When counting began for this entry.
    pub(super) since: AtomicI64,
    pub(super) last_used: AtomicI64,
    pub(super) log_last: AtomicI64,
    pub(super) log_suppressed: AtomicU64,
    pub(super) counters: [AtomicU64; N_COUNTERS],
    /// Waits by duration (core::stats::WAIT_BUCKETS_MS), not cumulative.
    pub(super) wait_buckets: [AtomicU64; N_WAIT_BUCKETS],
}

#[repr(C)]
pub struct WriterStats {
    /// The database; 0 = free. Changed under the lock.
    pub(super) db: AtomicU32,
    pub(super) pid: AtomicI32,
    pub(super) started_at: AtomicI64,
    pub(super) batches: AtomicU64,
    pub(super) requests: AtomicU64,
    pub(super) commit_us: AtomicU64,
    pub(super) restarts: AtomicU64,
    /// A writer runs, or the last one left without saying goodbye.
    pub(super) unclean: AtomicBool,
    /// Guarded by the lock.
    pub(super) error: std::cell::UnsafeCell<ErrorText>,
}

pub(super) struct ErrorText {
    pub(super) at: i64,
    pub(super) len: usize,
    pub(super) text: [u8; ERROR_BYTES],
}

#[repr(C)]
pub(super) struct Header {
    pub(super) lock: *mut pg_sys::LWLock,
    pub(super) n_entries: usize,
    pub(super) n_writers: usize,
    pub(super) reset_at: AtomicI64,
    pub(super) evicted: AtomicU64,
    pub(super) log_suppressed: AtomicU64,
    /// The server-wide log budget: the second it counts, and lines written in it.
    pub(super) log_second: AtomicI64,
    pub(super) log_lines: AtomicU32,
    /// Entries in use (role entries and the per-database ones); guarded by the lock.
    pub(super) used: usize,
    /// Where the search for a free entry goes on; guarded by the lock.
    pub(super) cursor: usize,
}

/// An entry of the hash table from (database, role) to the index of its entry.
#[repr(C)]
pub(super) struct Indexed {
    pub(super) key: u64,
    pub(super) slot: usize,
}

pub(super) static mut HEADER: *mut Header = std::ptr::null_mut();
pub(super) static mut INDEX: *mut pg_sys::HTAB = std::ptr::null_mut();

pub(super) fn layout() -> (usize, usize, usize) {
    let n_entries = crate::gucs::stats_max();
    // SAFETY: a plain int fixed before shmem_request_hook runs.
    let n_writers = unsafe { pg_sys::max_worker_processes.max(1) as usize } + 8;
    let size = std::mem::size_of::<Header>()
        + n_entries * std::mem::size_of::<Entry>()
        + n_writers * std::mem::size_of::<WriterStats>();
    (n_entries, n_writers, size)
}

pub(super) fn size() -> usize {
    layout().2
}

/// The hash table's space, which ShmemInitHash takes itself.
pub(super) fn extra() -> usize {
    let (n_entries, _, _) = layout();
    // SAFETY: a pure size computation.
    unsafe { pg_sys::hash_estimate_size(n_entries as _, std::mem::size_of::<Indexed>()) }
}

pub(super) fn header() -> &'static Header {
    // SAFETY: set at startup, inherited by fork; callers checked shmem::available().
    unsafe { &*HEADER }
}

/// The fields guarded by the lock. The caller holds it exclusively.
pub(super) fn header_locked() -> &'static mut Header {
    // SAFETY: as in header(); the lock serializes every writer of these fields.
    unsafe { &mut *HEADER }
}

pub(super) fn entries() -> &'static [Entry] {
    let h = header();
    // SAFETY: the entries follow the header, n_entries of them, zeroed at creation
    // (all atomics: a valid state).
    unsafe { std::slice::from_raw_parts((h as *const Header).add(1) as *const Entry, h.n_entries) }
}

pub(super) fn writers() -> &'static [WriterStats] {
    let h = header();
    // SAFETY: the writer entries follow the stats entries.
    unsafe {
        std::slice::from_raw_parts(
            entries().as_ptr().add(h.n_entries) as *const WriterStats,
            h.n_writers,
        )
    }
}

pub(super) struct Locked;

impl Locked {
    pub(super) fn acquire(mode: pg_sys::LWLockMode::Type) -> Locked {
        // SAFETY: the lock was set up at startup; abort releases it after an ERROR.
        unsafe { pg_sys::LWLockAcquire(header().lock, mode) };
        Locked
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        // SAFETY: held since `acquire`, unless an abort released it already.
        unsafe {
            if pg_sys::LWLockHeldByMe(header().lock) {
                pg_sys::LWLockRelease(header().lock);
            }
        }
    }
}

pub(super) fn key(db: pg_sys::Oid, role: pg_sys::Oid) -> u64 {
    (u64::from(u32::from(db)) << 32) | u64::from(u32::from(role))
}

/// Looks `k` up in the hash table. The caller holds the lock (either mode).
pub(super) fn index_find(k: u64) -> Option<usize> {
    let mut found = false;
    // SAFETY: the hash table lives in shared memory, guarded by the lock we hold.
    unsafe {
        let e = pg_sys::hash_search(
            INDEX,
            &k as *const u64 as *const std::ffi::c_void,
            pg_sys::HASHACTION::HASH_FIND,
            &mut found,
        ) as *const Indexed;
        (found && !e.is_null()).then(|| (*e).slot)
    }
}

/// Records (or with None removes) where `k` lives. The caller holds the lock
/// exclusively. False if the hash table had no room.
pub(super) fn index_set(k: u64, slot: Option<usize>) -> bool {
    let mut found = false;
    let action = match slot {
        Some(_) => pg_sys::HASHACTION::HASH_ENTER_NULL,
        None => pg_sys::HASHACTION::HASH_REMOVE,
    };
    // SAFETY: as in index_find, with the lock held exclusively.
    unsafe {
        let e = pg_sys::hash_search(
            INDEX,
            &k as *const u64 as *const std::ffi::c_void,
            action,
            &mut found,
        ) as *mut Indexed;
        match slot {
            Some(i) if !e.is_null() => {
                (*e).slot = i;
                true
            }
            Some(_) => false,
            None => true,
        }
    }
}

/// Where `k` lives, as the hash table says; the lock is taken in shared mode.
pub(super) fn lookup(k: u64) -> Option<usize> {
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_SHARED);
    index_find(k)
}

thread_local! {
    /// Where this backend last found its entries: (key, index).
    static CACHE: RefCell<Vec<(u64, usize)>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn cached(k: u64) -> Option<usize> {
    CACHE.with_borrow(|c| c.iter().find(|e| e.0 == k).map(|e| e.1))
}

pub(super) fn remember(k: u64, i: usize) {
    CACHE.with_borrow_mut(|c| {
        c.retain(|e| e.0 != k);
        if c.len() >= 16 {
            c.remove(0);
        }
        c.push((k, i));
    });
}

/// Pins entry `i` if it holds `k`. Unpin with `unpin`.
pub(super) fn pin(i: usize, k: u64) -> Option<&'static Entry> {
    let e = &entries()[i];
    e.pins.fetch_add(1, Ordering::SeqCst);
    if e.key.load(Ordering::SeqCst) == k {
        Some(e)
    } else {
        unpin(e);
        None
    }
}

pub(super) fn unpin(e: &Entry) {
    e.pins.fetch_sub(1, Ordering::SeqCst);
}

/// Runs `f` on the pinned entry of (db, role); creates the entry if `create` (taking
/// the lock, and evicting if the table is full). False if there was none to use.
pub(super) fn with_entry(
    db: pg_sys::Oid,
    role: pg_sys::Oid,
    create: bool,
    f: impl FnOnce(&Entry),
) -> bool {
    if !crate::shmem::available() || header().n_entries == 0 {
        return false;
    }
    let k = key(db, role);
    for _ in 0..3 {
        let found = cached(k)
            .and_then(|i| pin(i, k).map(|e| (i, e)))
            .or_else(|| lookup(k).and_then(|i| pin(i, k).map(|e| (i, e))));
        if let Some((i, e)) = found {
            remember(k, i);
            f(e);
            unpin(e);
            return true;
        }
        if !create {
            return false;
        }
        let _lock = Locked::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
        insert_locked(k);
    }
    false
}

/// The index of the entry for `k`, created if missing: in a free entry, or, when the
/// table is full, in one freed by evicting the least recently used role entries.
/// The caller holds the lock exclusively. None if no entry could be had.
pub(super) fn insert_locked(k: u64) -> Option<usize> {
    if let Some(i) = index_find(k) {
        return Some(i);
    }
    let table = entries();
    let n = table.len();
    if header().used >= n {
        evict_locked();
    }
    let h = header_locked();
    let start = h.cursor;
    let i = (0..n)
        .map(|j| (start + j) % n)
        .find(|&j| table[j].key.load(Ordering::Acquire) == FREE)?;
    if !index_set(k, Some(i)) {
        return None;
    }
    h.cursor = (i + 1) % n;
    h.used += 1;
    let e = &table[i];
    let t = now();
    e.since.store(t, Ordering::Relaxed);
    e.last_used.store(t, Ordering::Relaxed);
    // Published last: a counter that finds the key finds a fresh entry.
    e.key.store(k, Ordering::SeqCst);
    Some(i)
}

/// Evicts the EVICT_PERCENT least recently used role entries (never a database's entry
/// for roles no longer listed), folding what they counted into that entry.
pub(super) fn evict_locked() {
    let table = entries();
    let roles: Vec<(usize, i64)> = (0..table.len())
        .filter(|&i| {
            let k = table[i].key.load(Ordering::Acquire);
            k != FREE && k != BUSY && k as u32 != OTHER_ROLES
        })
        .map(|i| (i, table[i].last_used.load(Ordering::Relaxed)))
        .collect();
    let victims = core_stats::victims(roles, EVICT_PERCENT);
    header()
        .evicted
        .fetch_add(victims.len() as u64, Ordering::Relaxed);
    for i in victims {
        take_away_locked(i, true);
    }
}

/// The counts of an entry, as (counters, wait buckets).
type Counts = ([u64; N_COUNTERS], [u64; N_WAIT_BUCKETS]);

/// Takes entry `i` away: marks it BUSY, waits until nobody pins it, clears it, and
/// with `fold` adds what it counted to its database's entry for roles no longer
/// listed. The caller holds the lock exclusively.
pub(super) fn take_away_locked(i: usize, fold: bool) {
    let e = &entries()[i];
    let k = e.key.load(Ordering::SeqCst);
    if k == FREE || k == BUSY {
        return;
    }
    e.key.store(BUSY, Ordering::SeqCst);
    let mut spins = 0u32;
    while e.pins.load(Ordering::SeqCst) != 0 {
        // A pin is held for a few atomic operations, never across anything that waits;
        // its holder may have lost the CPU, though.
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    let counts: Counts = (
        std::array::from_fn(|c| e.counters[c].swap(0, Ordering::Relaxed)),
        std::array::from_fn(|b| e.wait_buckets[b].swap(0, Ordering::Relaxed)),
    );
    e.log_last.store(0, Ordering::Relaxed);
    e.log_suppressed.store(0, Ordering::Relaxed);
    index_set(k, None);
    let h = header_locked();
    h.used = h.used.saturating_sub(1);
    e.key.store(FREE, Ordering::SeqCst);
    if fold && k as u32 != OTHER_ROLES {
        let other = (k & !0xFFFF_FFFF) | u64::from(OTHER_ROLES);
        if let Some(j) = insert_locked(other) {
            let o = &entries()[j];
            for (c, v) in o.counters.iter().zip(counts.0) {
                c.fetch_add(v, Ordering::Relaxed);
            }
            for (c, v) in o.wait_buckets.iter().zip(counts.1) {
                c.fetch_add(v, Ordering::Relaxed);
            }
            o.last_used.store(now(), Ordering::Relaxed);
        }
    }
}

pub(super) fn now() -> i64 {
    // SAFETY: plain clock read.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Attaches the segment and its hash table (`attach` in mod.rs); the creator, which gets
/// it zeroed, sets it up. Returns whether this process created it.
///
/// # Safety
/// See shmem::Segment::attach.
pub(super) unsafe fn init(base: *mut u8, found: bool, locks: *mut pg_sys::LWLockPadded) -> bool {
    let (n_entries, n_writers, _) = layout();
    // SAFETY: see the function's contract; the struct is zeroed by shmem and filled only
    // by its creator (`found == false`). ShmemInitHash attaches to the hash table or
    // creates it.
    unsafe {
        let mut info = pg_sys::HASHCTL {
            keysize: std::mem::size_of::<u64>(),
            entrysize: std::mem::size_of::<Indexed>(),
            ..Default::default()
        };
        INDEX = pg_sys::ShmemInitHash(
            INDEX_NAME.as_ptr(),
            n_entries as _,
            n_entries as _,
            &mut info,
            (pg_sys::HASH_ELEM | pg_sys::HASH_BLOBS) as i32,
        );
        let h = base as *mut Header;
        HEADER = h;
        if found {
            return false;
        }
        (*h).lock = &mut (*locks).lock;
        (*h).n_entries = n_entries;
        (*h).n_writers = n_writers;
        (*h).reset_at
            .store(pg_sys::GetCurrentTimestamp(), Ordering::Relaxed);
        true
    }
}
