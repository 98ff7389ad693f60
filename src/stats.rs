//! Admission statistics in shared memory (0.3.0): quota.stats, quota.stats_info and
//! quota.writer_stats.
//!
//! One entry per (database, role), `quota.stats_max` of them, in a segment of their own,
//! and a shared hash table (dynahash) from (database, role) to the entry's index.
//! Counting takes no lock: a backend remembers where its entries are (a backend-local
//! cache), pins the entry, checks that it still holds its key, adds with atomic
//! fetch_add, and unpins. Only a backend that does not know where its entry is looks it
//! up in the hash table, under the table's LWLock in shared mode, once; creating an
//! entry, evicting entries and resets take the lock exclusively. Those change an
//! entry's key: to take an entry away, they first mark its key BUSY and then wait until
//! nobody pins it. With sequentially consistent pin and key operations on both sides,
//! either the counter sees BUSY and looks again, or the remover sees the pin and waits
//! for it to go; so an increment never lands in an entry that has been given to
//! another (database, role). Readers pin entries too, so a row they return is never
//! half of one key and half of another.
//!
//! What an entry counted is never lost from its database's totals: an entry taken away
//! by eviction, by stats_reset(role) or because its role was dropped is added to its
//! database's entry for roles no longer listed (role 0, shown with role NULL, never
//! evicted). So the sums per database that monitoring reads only ever grow, until
//! stats_reset() of everything or a dropped database. When the table is full, a new
//! (database, role) evicts the 5 % of the role entries used least recently;
//! `quota.stats_info.evicted` counts them.
//!
//! The postmaster writes the table to `pg_stat/pg_quota.stat` when it shuts down
//! cleanly (pg_control says so), and reads and removes the file when it starts; after
//! a crash or an immediate shutdown the file is gone and counting starts over, as
//! pg_stat_statements does.
//!
//! The writer table (`quota.writer_stats`) is a small array of per-database entries,
//! written by each database's ledger writer; not kept across restarts.

use std::cell::RefCell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;

use crate::core::stats::{
    self as core_stats, Counter, Saved, SavedStats, N_COUNTERS, N_WAIT_BUCKETS,
};

const SHMEM_NAME: &CStr = c"pg_quota stats";
const INDEX_NAME: &CStr = c"pg_quota stats index";
const FILE: &str = "pg_stat/pg_quota.stat";
const FILE_TMP: &str = "pg_stat/pg_quota.stat.tmp";
const FREE: u64 = 0;
const BUSY: u64 = u64::MAX;
/// The role of a database's entry for roles no longer listed.
const OTHER_ROLES: u32 = 0;
/// The share of entries evicted at once, in percent.
const EVICT_PERCENT: usize = 5;
pub const ERROR_BYTES: usize = 256;

#[repr(C)]
pub struct Entry {
    /// (database << 32) | role; FREE or BUSY.
    key: AtomicU64,
    pins: AtomicU32,
    /// When counting began for this entry.
    since: AtomicI64,
    last_used: AtomicI64,
    log_last: AtomicI64,
    log_suppressed: AtomicU64,
    counters: [AtomicU64; N_COUNTERS],
    /// Waits by duration (core::stats::WAIT_BUCKETS_MS), not cumulative.
    wait_buckets: [AtomicU64; N_WAIT_BUCKETS],
}

#[repr(C)]
pub struct WriterStats {
    /// The database; 0 = free. Changed under the lock.
    db: AtomicU32,
    pid: AtomicI32,
    started_at: AtomicI64,
    batches: AtomicU64,
    requests: AtomicU64,
    commit_us: AtomicU64,
    restarts: AtomicU64,
    /// A writer runs, or the last one left without saying goodbye.
    unclean: AtomicBool,
    /// Guarded by the lock.
    error: std::cell::UnsafeCell<ErrorText>,
}

struct ErrorText {
    at: i64,
    len: usize,
    text: [u8; ERROR_BYTES],
}

#[repr(C)]
struct Header {
    lock: *mut pg_sys::LWLock,
    n_entries: usize,
    n_writers: usize,
    reset_at: AtomicI64,
    evicted: AtomicU64,
    log_suppressed: AtomicU64,
    /// The server-wide log budget: the second it counts, and lines written in it.
    log_second: AtomicI64,
    log_lines: AtomicU32,
    /// Entries in use (role entries and the per-database ones); guarded by the lock.
    used: usize,
    /// Where the search for a free entry goes on; guarded by the lock.
    cursor: usize,
}

/// An entry of the hash table from (database, role) to the index of its entry.
#[repr(C)]
struct Indexed {
    key: u64,
    slot: usize,
}

static mut HEADER: *mut Header = std::ptr::null_mut();
static mut INDEX: *mut pg_sys::HTAB = std::ptr::null_mut();

fn layout() -> (usize, usize, usize) {
    let n_entries = crate::gucs::stats_max();
    // SAFETY: a plain int fixed before shmem_request_hook runs.
    let n_writers = unsafe { pg_sys::max_worker_processes.max(1) as usize } + 8;
    let size = std::mem::size_of::<Header>()
        + n_entries * std::mem::size_of::<Entry>()
        + n_writers * std::mem::size_of::<WriterStats>();
    (n_entries, n_writers, size)
}

/// The shared memory to request: the entries and the hash table.
pub fn shmem_size() -> usize {
    let (n_entries, _, size) = layout();
    // SAFETY: a pure size computation.
    size + unsafe { pg_sys::hash_estimate_size(n_entries as _, std::mem::size_of::<Indexed>()) }
}

/// Creates (or attaches to) the segment; in the postmaster, loads the stats file and
/// arranges for it to be written at shutdown. Called under AddinShmemInitLock, with
/// `lock` from the extension's LWLock tranche.
///
/// # Safety
/// Only from shmem_startup_hook.
pub unsafe fn shmem_startup(lock: *mut pg_sys::LWLock) {
    let (n_entries, n_writers, size) = layout();
    let mut found = false;
    // SAFETY: see the function's contract; the struct is zeroed and filled only by its
    // creator (`found == false`). ShmemInitHash attaches to the hash table or creates it.
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
        let h = pg_sys::ShmemInitStruct(SHMEM_NAME.as_ptr(), size, &mut found) as *mut Header;
        HEADER = h;
        if found {
            return;
        }
        std::ptr::write_bytes(h as *mut u8, 0, size);
        (*h).lock = lock;
        (*h).n_entries = n_entries;
        (*h).n_writers = n_writers;
        (*h).reset_at
            .store(pg_sys::GetCurrentTimestamp(), Ordering::Relaxed);
        if !pg_sys::IsUnderPostmaster {
            load();
            pg_sys::on_shmem_exit(Some(save_at_exit), pg_sys::Datum::from(0));
        }
    }
}

fn header() -> &'static Header {
    // SAFETY: set at startup, inherited by fork; callers checked shmem::available().
    unsafe { &*HEADER }
}

/// The fields guarded by the lock. The caller holds it exclusively.
fn header_locked() -> &'static mut Header {
    // SAFETY: as in header(); the lock serializes every writer of these fields.
    unsafe { &mut *HEADER }
}

fn entries() -> &'static [Entry] {
    let h = header();
    // SAFETY: the entries follow the header, n_entries of them, zeroed at creation
    // (all atomics: a valid state).
    unsafe { std::slice::from_raw_parts((h as *const Header).add(1) as *const Entry, h.n_entries) }
}

fn writers() -> &'static [WriterStats] {
    let h = header();
    // SAFETY: the writer entries follow the stats entries.
    unsafe {
        std::slice::from_raw_parts(
            entries().as_ptr().add(h.n_entries) as *const WriterStats,
            h.n_writers,
        )
    }
}

struct Locked;

impl Locked {
    fn acquire(mode: pg_sys::LWLockMode::Type) -> Locked {
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

fn key(db: pg_sys::Oid, role: pg_sys::Oid) -> u64 {
    (u64::from(u32::from(db)) << 32) | u64::from(u32::from(role))
}

/// Looks `k` up in the hash table. The caller holds the lock (either mode).
fn index_find(k: u64) -> Option<usize> {
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
fn index_set(k: u64, slot: Option<usize>) -> bool {
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
fn lookup(k: u64) -> Option<usize> {
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_SHARED);
    index_find(k)
}

thread_local! {
    /// Where this backend last found its entries: (key, index).
    static CACHE: RefCell<Vec<(u64, usize)>> = const { RefCell::new(Vec::new()) };
}

fn cached(k: u64) -> Option<usize> {
    CACHE.with_borrow(|c| c.iter().find(|e| e.0 == k).map(|e| e.1))
}

fn remember(k: u64, i: usize) {
    CACHE.with_borrow_mut(|c| {
        c.retain(|e| e.0 != k);
        if c.len() >= 16 {
            c.remove(0);
        }
        c.push((k, i));
    });
}

/// Pins entry `i` if it holds `k`. Unpin with `unpin`.
fn pin(i: usize, k: u64) -> Option<&'static Entry> {
    let e = &entries()[i];
    e.pins.fetch_add(1, Ordering::SeqCst);
    if e.key.load(Ordering::SeqCst) == k {
        Some(e)
    } else {
        unpin(e);
        None
    }
}

fn unpin(e: &Entry) {
    e.pins.fetch_sub(1, Ordering::SeqCst);
}

/// Runs `f` on the pinned entry of (db, role); creates the entry if `create` (taking
/// the lock, and evicting if the table is full). False if there was none to use.
fn with_entry(db: pg_sys::Oid, role: pg_sys::Oid, create: bool, f: impl FnOnce(&Entry)) -> bool {
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
fn insert_locked(k: u64) -> Option<usize> {
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
fn evict_locked() {
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
fn take_away_locked(i: usize, fold: bool) {
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

fn now() -> i64 {
    // SAFETY: plain clock read.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Adds `n` to `counter` of (this database, role).
pub fn add(role: pg_sys::Oid, counter: Counter, n: u64) {
    add_in(crate::shmem::my_db(), role, counter, n);
}

/// Adds `n` to `counter` of (db, role).
pub fn add_in(db: pg_sys::Oid, role: pg_sys::Oid, counter: Counter, n: u64) {
    if n == 0 {
        return;
    }
    let t = now();
    with_entry(db, role, true, |e| {
        e.counters[counter as usize].fetch_add(n, Ordering::Relaxed);
        e.last_used.store(t, Ordering::Relaxed);
    });
}

/// Makes sure (this database, role) has an entry.
pub fn ensure(role: pg_sys::Oid) {
    let t = now();
    with_entry(crate::shmem::my_db(), role, true, |e| {
        e.last_used.store(t, Ordering::Relaxed);
    });
}

/// Counts a wait of `us` microseconds that ended: in waits, wait_time and its
/// histogram bucket, together. Only if the entry exists: this runs on an error's
/// unwind too, where taking a lock to create one is not wanted.
pub fn waited(role: pg_sys::Oid, us: u64) {
    with_entry(crate::shmem::my_db(), role, false, |e| {
        e.counters[Counter::Waits as usize].fetch_add(1, Ordering::Relaxed);
        e.counters[Counter::WaitTime as usize].fetch_add(us, Ordering::Relaxed);
        e.wait_buckets[core_stats::wait_bucket(us)].fetch_add(1, Ordering::Relaxed);
    });
}

/// Counts a refusal of `role` in this database, and returns the line to log if
/// `quota.log_refusals` is on and the rate limit lets it through.
pub fn refused(role: pg_sys::Oid, counter: Counter, log: bool) -> Option<u64> {
    let t = now();
    let mut line = None;
    with_entry(crate::shmem::my_db(), role, true, |e| {
        e.counters[counter as usize].fetch_add(1, Ordering::Relaxed);
        e.last_used.store(t, Ordering::Relaxed);
        if !log {
            return;
        }
        let last = e.log_last.load(Ordering::Relaxed);
        let mine = core_stats::may_log(last, t)
            && e.log_last
                .compare_exchange(last, t, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
        if mine && server_budget(t) {
            line = Some(e.log_suppressed.swap(0, Ordering::AcqRel));
        } else {
            e.log_suppressed.fetch_add(1, Ordering::AcqRel);
            header().log_suppressed.fetch_add(1, Ordering::Relaxed);
        }
    });
    line
}

/// Whether the server-wide budget of refusal lines has room in the second of `t`.
fn server_budget(t: i64) -> bool {
    let h = header();
    let second = t.div_euclid(1_000_000);
    let seen = h.log_second.load(Ordering::Acquire);
    // Only forward: a caller that read the clock just before the second turned must
    // not start the budget of the new second again.
    if second > seen
        && h.log_second
            .compare_exchange(seen, second, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    {
        h.log_lines.store(0, Ordering::Release);
    }
    h.log_lines.fetch_add(1, Ordering::AcqRel) < core_stats::LOG_LINES_PER_SECOND
}

/// One row of quota.stats.
pub struct Row {
    pub db: u32,
    pub role: u32,
    pub since: i64,
    pub counters: [u64; N_COUNTERS],
    pub wait_buckets: [u64; N_WAIT_BUCKETS],
}

/// The entries `visible` lets through, as they are now: each counter is read
/// atomically, not all of a row at one instant, as in pg_stat views. Each entry is
/// pinned while it is read, so it cannot be cleared or given to another key meanwhile.
pub fn rows(visible: impl Fn(u32) -> bool) -> Vec<Row> {
    let mut out = Vec::new();
    for (i, e) in entries().iter().enumerate() {
        let k = e.key.load(Ordering::Acquire);
        if k == FREE || k == BUSY || !visible(k as u32) {
            continue;
        }
        let Some(e) = pin(i, k) else { continue };
        out.push(Row {
            db: (k >> 32) as u32,
            role: k as u32,
            since: e.since.load(Ordering::Relaxed),
            counters: std::array::from_fn(|i| e.counters[i].load(Ordering::Relaxed)),
            wait_buckets: std::array::from_fn(|i| e.wait_buckets[i].load(Ordering::Relaxed)),
        });
        unpin(e);
    }
    out
}

/// quota.stats_info: (max, entries, evicted, log_suppressed, stats_reset).
pub fn info() -> (i32, i64, i64, i64, i64) {
    let h = header();
    let used = entries()
        .iter()
        .filter(|e| !matches!(e.key.load(Ordering::Relaxed), FREE | BUSY))
        .count();
    (
        h.n_entries as i32,
        used as i64,
        h.evicted.load(Ordering::Relaxed) as i64,
        h.log_suppressed.load(Ordering::Relaxed) as i64,
        h.reset_at.load(Ordering::Relaxed),
    )
}

/// Empties quota.stats: with a role, that role's entries in every database, whose
/// counts go to their databases' entries for roles no longer listed (so totals per
/// database never go down); without, every entry, the server-wide figures and the
/// writers' counters. Returns the time of the reset.
pub fn reset(role: Option<pg_sys::Oid>) -> i64 {
    if !crate::shmem::available() {
        return now();
    }
    let t = now();
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    for i in 0..entries().len() {
        let k = entries()[i].key.load(Ordering::Acquire);
        match role {
            Some(r) if k as u32 == u32::from(r) => take_away_locked(i, true),
            Some(_) => {}
            None => take_away_locked(i, false),
        }
    }
    if role.is_none() {
        let h = header();
        h.evicted.store(0, Ordering::Relaxed);
        h.log_suppressed.store(0, Ordering::Relaxed);
        h.reset_at.store(t, Ordering::Relaxed);
        for w in writers() {
            // An entry whose writer is gone is freed, unless that writer did not leave
            // cleanly: the next one must still count a restart.
            if w.pid.load(Ordering::Relaxed) == 0 && !w.unclean.load(Ordering::Relaxed) {
                w.db.store(0, Ordering::Relaxed);
            }
            for c in [&w.batches, &w.requests, &w.commit_us, &w.restarts] {
                c.store(0, Ordering::Relaxed);
            }
            // SAFETY: the lock is held exclusively; the error text is guarded by it.
            unsafe { (*w.error.get()).len = 0 };
        }
    }
    t
}

/// A dropped database: its entries and its writer's go, counts and all.
pub fn forget_database(db: pg_sys::Oid) {
    if !crate::shmem::available() {
        return;
    }
    let d = u32::from(db);
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    for i in 0..entries().len() {
        if (entries()[i].key.load(Ordering::Acquire) >> 32) as u32 == d {
            take_away_locked(i, false);
        }
    }
    for w in writers() {
        if w.db.load(Ordering::Relaxed) == d && w.pid.load(Ordering::Relaxed) == 0 {
            w.db.store(0, Ordering::Relaxed);
        }
    }
}

// ---------------------------------------------------------------------------------
// The stats file
// ---------------------------------------------------------------------------------

fn load() {
    let Ok(bytes) = std::fs::read(FILE) else {
        return;
    };
    // Read once: a crash from here on starts over.
    let _ = std::fs::remove_file(FILE);
    let Some(saved) = SavedStats::decode(&bytes) else {
        pgrx::log!("pg_quota: ignoring the unreadable statistics file \"{FILE}\"");
        return;
    };
    let h = header();
    h.reset_at.store(saved.reset_at, Ordering::Relaxed);
    h.evicted.store(saved.evicted, Ordering::Relaxed);
    h.log_suppressed
        .store(saved.log_suppressed, Ordering::Relaxed);
    let n = entries().len();
    // Most recently used first, so that a smaller quota.stats_max keeps those; the
    // entries that no longer fit count as evicted.
    let mut kept = saved.entries;
    kept.sort_by_key(|e| std::cmp::Reverse(e.last_used));
    if kept.len() > n {
        h.evicted
            .fetch_add((kept.len() - n) as u64, Ordering::Relaxed);
    }
    for s in kept.into_iter().take(n) {
        let k = (u64::from(s.db) << 32) | u64::from(s.role);
        if k == FREE || k == BUSY {
            continue;
        }
        // The postmaster, before any backend exists: nobody else holds the lock.
        let Some(i) = insert_locked(k) else { break };
        let e = &entries()[i];
        e.since.store(s.since, Ordering::Relaxed);
        e.last_used.store(s.last_used, Ordering::Relaxed);
        for (c, v) in e.counters.iter().zip(s.counters) {
            c.store(v, Ordering::Relaxed);
        }
        for (c, v) in e.wait_buckets.iter().zip(s.wait_buckets) {
            c.store(v, Ordering::Relaxed);
        }
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn save_at_exit(code: i32, _arg: pg_sys::Datum) {
    // Not after a crash, nor when the postmaster resets shared memory after one, nor
    // after an immediate shutdown (which exits with code 0, but leaves pg_control
    // saying "in production"): then counting starts over, as crash recovery resets
    // PostgreSQL's own statistics.
    // SAFETY: a read of the pointer set at startup.
    if code != 0 || unsafe { HEADER.is_null() } {
        return;
    }
    let clean = std::fs::read("global/pg_control").is_ok_and(|b| core_stats::shut_down_cleanly(&b));
    if !clean {
        return;
    }
    let h = header();
    let saved = SavedStats {
        reset_at: h.reset_at.load(Ordering::Relaxed),
        evicted: h.evicted.load(Ordering::Relaxed),
        log_suppressed: h.log_suppressed.load(Ordering::Relaxed),
        entries: entries()
            .iter()
            .filter_map(|e| {
                let k = e.key.load(Ordering::Relaxed);
                (k != FREE && k != BUSY).then(|| Saved {
                    db: (k >> 32) as u32,
                    role: k as u32,
                    since: e.since.load(Ordering::Relaxed),
                    last_used: e.last_used.load(Ordering::Relaxed),
                    counters: std::array::from_fn(|i| e.counters[i].load(Ordering::Relaxed)),
                    wait_buckets: std::array::from_fn(|i| {
                        e.wait_buckets[i].load(Ordering::Relaxed)
                    }),
                })
            })
            .collect(),
    };
    let written = (|| -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(FILE_TMP)?;
        f.write_all(&saved.encode())?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(FILE_TMP);
        pgrx::log!("pg_quota: could not write the statistics file \"{FILE_TMP}\": {e}");
        return;
    }
    // SAFETY: durable_rename fsyncs both names and the directory; at LOG level it
    // reports a failure and returns nonzero instead of raising.
    unsafe {
        let tmp = std::ffi::CString::new(FILE_TMP).expect("no NUL");
        let file = std::ffi::CString::new(FILE).expect("no NUL");
        if pg_sys::durable_rename(tmp.as_ptr(), file.as_ptr(), pg_sys::LOG as i32) != 0 {
            let _ = std::fs::remove_file(FILE_TMP);
        }
    }
}

// ---------------------------------------------------------------------------------
// quota.writer_stats
// ---------------------------------------------------------------------------------

// Single-threaded worker state: this writer's entry.
static mut MY_WRITER: usize = usize::MAX;

fn my_writer() -> Option<&'static WriterStats> {
    // SAFETY: single-threaded worker state.
    let i = unsafe { MY_WRITER };
    writers().get(i)
}

/// A ledger writer for `db` starts: it takes the database's entry (or a free one, or
/// that of a database whose writer is gone and ran least recently), and counts a
/// restart if the previous writer did not leave cleanly.
pub fn writer_started(db: pg_sys::Oid) {
    if !crate::shmem::available() {
        return;
    }
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    let table = writers();
    let d = u32::from(db);
    let i = (0..table.len())
        .find(|&i| table[i].db.load(Ordering::Relaxed) == d)
        .or_else(|| (0..table.len()).find(|&i| table[i].db.load(Ordering::Relaxed) == 0))
        .or_else(|| {
            (0..table.len())
                .filter(|&i| table[i].pid.load(Ordering::Relaxed) == 0)
                .min_by_key(|&i| table[i].started_at.load(Ordering::Relaxed))
        });
    let Some(i) = i else { return };
    let w = &table[i];
    if w.db.load(Ordering::Relaxed) != d {
        for c in [&w.batches, &w.requests, &w.commit_us, &w.restarts] {
            c.store(0, Ordering::Relaxed);
        }
        w.unclean.store(false, Ordering::Relaxed);
        // SAFETY: the lock is held exclusively; the error text is guarded by it.
        unsafe { (*w.error.get()).len = 0 };
        w.db.store(d, Ordering::Relaxed);
    }
    if w.unclean.swap(true, Ordering::AcqRel) {
        w.restarts.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: a plain read of process state, and this worker's own static.
    unsafe {
        w.pid.store(pg_sys::MyProcPid, Ordering::Relaxed);
        MY_WRITER = i;
    }
    w.started_at.store(now(), Ordering::Relaxed);
}

/// The writer exits: cleanly (it gave up its writer entry, called before it lets a
/// successor start) or not (from its exit callback). Only while the stats entry still
/// names this process: a successor's is left alone.
pub fn writer_exits(clean: bool) {
    let Some(w) = my_writer() else { return };
    // SAFETY: a plain read of process state.
    let me = unsafe { pg_sys::MyProcPid };
    if w.pid
        .compare_exchange(me, 0, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
        && clean
    {
        w.unclean.store(false, Ordering::Release);
    }
}

/// The writer answered `requests`: in a batch that committed in `commit_us`, or with
/// an error (None).
pub fn writer_batch(requests: usize, commit_us: Option<u64>) {
    if let Some(w) = my_writer() {
        w.requests.fetch_add(requests as u64, Ordering::Relaxed);
        if let Some(us) = commit_us {
            w.batches.fetch_add(1, Ordering::Relaxed);
            w.commit_us.fetch_add(us, Ordering::Relaxed);
        }
    }
}

/// The writer caught an error.
pub fn writer_error(msg: &str) {
    let Some(w) = my_writer() else { return };
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    let mut n = msg.len().min(ERROR_BYTES);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: the lock is held exclusively; the error text is guarded by it.
    let e = unsafe { &mut *w.error.get() };
    e.text[..n].copy_from_slice(&msg.as_bytes()[..n]);
    e.len = n;
    e.at = now();
}

/// One row of quota.writer_stats.
pub struct WriterRow {
    pub db: u32,
    pub pid: i32,
    pub started_at: i64,
    pub batches: u64,
    pub requests: u64,
    pub commit_us: u64,
    pub restarts: u64,
    pub last_error: Option<(String, i64)>,
}

pub fn writer_rows() -> Vec<WriterRow> {
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_SHARED);
    writers()
        .iter()
        .filter(|w| w.db.load(Ordering::Relaxed) != 0)
        .map(|w| WriterRow {
            db: w.db.load(Ordering::Relaxed),
            pid: w.pid.load(Ordering::Relaxed),
            started_at: w.started_at.load(Ordering::Relaxed),
            batches: w.batches.load(Ordering::Relaxed),
            requests: w.requests.load(Ordering::Relaxed),
            commit_us: w.commit_us.load(Ordering::Relaxed),
            restarts: w.restarts.load(Ordering::Relaxed),
            last_error: {
                // SAFETY: the lock is held (shared); writers of the text hold it
                // exclusively.
                let e = unsafe { &*w.error.get() };
                (e.len > 0).then(|| (String::from_utf8_lossy(&e.text[..e.len]).into_owned(), e.at))
            },
        })
        .collect()
}
