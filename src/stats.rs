//! Admission statistics in shared memory (0.3.0): quota.stats, quota.stats_info and
//! quota.writer_stats.
//!
//! One entry per (database, role), `quota.stats_max` of them, in a segment of their own.
//! Counting takes no lock: a backend finds its entry (a backend-local cache remembers
//! where), pins it, checks that the entry still holds its key, adds with atomic
//! fetch_add, and unpins. Only creating an entry, evicting entries and resets take the
//! table's LWLock, exclusively. Those change an entry's key: to take an entry away,
//! they first mark its key BUSY and then wait until nobody pins it. With sequentially
//! consistent pin and key operations on both sides, either the counter sees BUSY and
//! looks again, or the remover sees the pin and waits for it to go; so an increment
//! never lands in an entry that has been given to another (database, role).
//!
//! When the table is full, a new (database, role) evicts the 5 % of the entries used
//! least recently; `quota.stats_info.evicted` counts them.
//!
//! The postmaster writes the table to `pg_stat/pg_quota.stat` when it shuts down
//! cleanly, and reads and removes the file when it starts; after a crash the file is
//! gone and counting starts over, as pg_stat_statements does.
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
const FILE: &str = "pg_stat/pg_quota.stat";
const FREE: u64 = 0;
const BUSY: u64 = u64::MAX;
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
}

static mut HEADER: *mut Header = std::ptr::null_mut();

fn layout() -> (usize, usize, usize) {
    let n_entries = crate::gucs::stats_max();
    // SAFETY: a plain int fixed before shmem_request_hook runs.
    let n_writers = unsafe { pg_sys::max_worker_processes.max(1) as usize } + 8;
    let size = std::mem::size_of::<Header>()
        + n_entries * std::mem::size_of::<Entry>()
        + n_writers * std::mem::size_of::<WriterStats>();
    (n_entries, n_writers, size)
}

/// The shared memory to request.
pub fn shmem_size() -> usize {
    layout().2
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
    // creator (`found == false`).
    unsafe {
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

fn home(k: u64, n: usize) -> usize {
    (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) as usize % n
}

/// The index of the entry holding `k`, looking from its home position on.
fn scan(k: u64) -> Option<usize> {
    let table = entries();
    let n = table.len();
    let start = home(k, n);
    (0..n)
        .map(|i| (start + i) % n)
        .find(|&i| table[i].key.load(Ordering::Acquire) == k)
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

/// Pins entry `i` if it holds `k`.
fn pin(i: usize, k: u64) -> Option<&'static Entry> {
    let e = &entries()[i];
    e.pins.fetch_add(1, Ordering::SeqCst);
    if e.key.load(Ordering::SeqCst) == k {
        Some(e)
    } else {
        e.pins.fetch_sub(1, Ordering::SeqCst);
        None
    }
}

/// Runs `f` on the pinned entry of (db, role); creates the entry if `create` (taking
/// the lock, and evicting if the table is full). False if there was none to use.
fn with_entry(
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
            .or_else(|| scan(k).and_then(|i| pin(i, k).map(|e| (i, e))));
        if let Some((i, e)) = found {
            remember(k, i);
            f(e);
            e.pins.fetch_sub(1, Ordering::SeqCst);
            return true;
        }
        if !create {
            return false;
        }
        insert(k);
    }
    false
}

/// Creates the entry for `k` unless it exists, evicting the least recently used
/// entries if none is free.
fn insert(k: u64) {
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    if scan(k).is_some() {
        return;
    }
    let table = entries();
    let n = table.len();
    let start = home(k, n);
    let free = |table: &[Entry]| {
        (0..n)
            .map(|i| (start + i) % n)
            .find(|&i| table[i].key.load(Ordering::Acquire) == FREE)
    };
    let slot = free(table).or_else(|| {
        let used = (0..n)
            .map(|i| (i, table[i].last_used.load(Ordering::Relaxed)))
            .collect();
        let victims = core_stats::victims(used, EVICT_PERCENT);
        header()
            .evicted
            .fetch_add(victims.len() as u64, Ordering::Relaxed);
        for i in victims {
            remove(&table[i]);
        }
        free(table)
    });
    let Some(i) = slot else { return };
    let e = &table[i];
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    e.since.store(now, Ordering::Relaxed);
    e.last_used.store(now, Ordering::Relaxed);
    // Published last: a counter that finds the key finds a fresh entry.
    e.key.store(k, Ordering::SeqCst);
}

/// Takes an entry away: marks it BUSY, waits until nobody counts in it, clears it.
/// Lock held exclusively.
fn remove(e: &Entry) {
    let k = e.key.load(Ordering::SeqCst);
    if k == FREE || k == BUSY {
        return;
    }
    e.key.store(BUSY, Ordering::SeqCst);
    while e.pins.load(Ordering::SeqCst) != 0 {
        // A pin is held for a few atomic additions, never across anything that waits.
        std::hint::spin_loop();
    }
    for c in e.counters.iter().chain(&e.wait_buckets) {
        c.store(0, Ordering::Relaxed);
    }
    e.log_last.store(0, Ordering::Relaxed);
    e.log_suppressed.store(0, Ordering::Relaxed);
    e.key.store(FREE, Ordering::SeqCst);
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

/// Counts a wait of `us` microseconds that ended, in wait_time and its histogram
/// bucket. Only if the entry exists: this runs on an error's unwind too, where taking
/// a lock to create one is not wanted.
pub fn waited(role: pg_sys::Oid, us: u64) {
    with_entry(crate::shmem::my_db(), role, false, |e| {
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
    if seen != second
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

/// The entries `visible` lets through, as they are now (each counter is read
/// atomically; a row is not a snapshot of one instant, as in pg_stat views).
pub fn rows(visible: impl Fn(u32) -> bool) -> Vec<Row> {
    let mut out = Vec::new();
    for e in entries() {
        let k = e.key.load(Ordering::Acquire);
        if k == FREE || k == BUSY || !visible(k as u32) {
            continue;
        }
        let row = Row {
            db: (k >> 32) as u32,
            role: k as u32,
            since: e.since.load(Ordering::Relaxed),
            counters: std::array::from_fn(|i| e.counters[i].load(Ordering::Relaxed)),
            wait_buckets: std::array::from_fn(|i| e.wait_buckets[i].load(Ordering::Relaxed)),
        };
        // Skip an entry that was taken away while we read it.
        if e.key.load(Ordering::Acquire) == k {
            out.push(row);
        }
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

/// Removes the entries of `role` (in every database), or all of them and the
/// server-wide figures. Returns the time of the reset.
pub fn reset(role: Option<pg_sys::Oid>) -> i64 {
    let t = now();
    let _lock = Locked::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    for e in entries() {
        let k = e.key.load(Ordering::Acquire);
        if role.is_none_or(|r| k as u32 == u32::from(r)) {
            remove(e);
        }
    }
    if role.is_none() {
        let h = header();
        h.evicted.store(0, Ordering::Relaxed);
        h.log_suppressed.store(0, Ordering::Relaxed);
        h.reset_at.store(t, Ordering::Relaxed);
        for w in writers() {
            if w.pid.load(Ordering::Relaxed) == 0 {
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
    h.log_suppressed.store(saved.log_suppressed, Ordering::Relaxed);
    let table = entries();
    let n = table.len();
    // Most recently used first, so that a smaller quota.stats_max keeps those.
    let mut kept = saved.entries;
    kept.sort_by_key(|e| std::cmp::Reverse(e.last_used));
    for s in kept.into_iter().take(n) {
        let k = (u64::from(s.db) << 32) | u64::from(s.role);
        if k == FREE || k == BUSY {
            continue;
        }
        let start = home(k, n);
        let Some(i) = (0..n)
            .map(|i| (start + i) % n)
            .find(|&i| table[i].key.load(Ordering::Relaxed) == FREE)
        else {
            break;
        };
        let e = &table[i];
        e.since.store(s.since, Ordering::Relaxed);
        e.last_used.store(s.last_used, Ordering::Relaxed);
        for (c, v) in e.counters.iter().zip(s.counters) {
            c.store(v, Ordering::Relaxed);
        }
        for (c, v) in e.wait_buckets.iter().zip(s.wait_buckets) {
            c.store(v, Ordering::Relaxed);
        }
        e.key.store(k, Ordering::Relaxed);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn save_at_exit(code: i32, _arg: pg_sys::Datum) {
    // Not after a crash, nor when the postmaster resets shared memory after one: then
    // counting starts over.
    if code != 0 || HEADER.is_null() {
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
    let tmp = format!("{FILE}.tmp");
    let written = (|| -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&saved.encode())?;
        f.sync_all()?;
        std::fs::rename(&tmp, FILE)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        pgrx::log!("pg_quota: could not write the statistics file \"{FILE}\": {e}");
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
    // SAFETY: plain reads of process state.
    unsafe {
        w.pid.store(pg_sys::MyProcPid, Ordering::Relaxed);
        MY_WRITER = i;
    }
    w.started_at.store(now(), Ordering::Relaxed);
}

/// The writer exits: cleanly (it gave up its entry) or not.
pub fn writer_exits(clean: bool) {
    if let Some(w) = my_writer() {
        if clean {
            w.unclean.store(false, Ordering::Release);
        }
        w.pid.store(0, Ordering::Release);
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
                (e.len > 0)
                    .then(|| (String::from_utf8_lossy(&e.text[..e.len]).into_owned(), e.at))
            },
        })
        .collect()
}
