//! Layer 4, shared state: admission statistics in shared memory (0.3.0): quota.stats,
//! quota.stats_info and quota.writer_stats.
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
//!
//! table.rs holds the table, file.rs the stats file, writers.rs quota.writer_stats,
//! usage.rs quota.usage_totals (0.5.1, read from the ledger's summary and indexes).

mod file;
mod table;
mod usage;
mod writers;

pub use usage::totals as usage_totals;

use std::sync::atomic::Ordering;

use pgrx::pg_sys;

use crate::core::stats::{self as core_stats, Counter, N_COUNTERS, N_WAIT_BUCKETS};
use table::*;

pub use writers::{writer_batch, writer_error, writer_exits, writer_rows, writer_started};

/// The statistics' segment (see shmem.rs).
pub static SEGMENT: crate::shmem::Segment = crate::shmem::Segment {
    name: SHMEM_NAME,
    size,
    extra,
    locks: 1,
    attach,
};

/// Attaches the segment and its hash table; in the postmaster, which creates them,
/// loads the stats file and arranges for it to be written at shutdown.
///
/// # Safety
/// See shmem::Segment::attach.
unsafe fn attach(base: *mut u8, found: bool, locks: *mut pg_sys::LWLockPadded) {
    // SAFETY: per the contract above.
    unsafe {
        if table::init(base, found, locks) && !pg_sys::IsUnderPostmaster {
            file::load();
            pg_sys::on_shmem_exit(Some(file::save_at_exit), pg_sys::Datum::from(0));
        }
    }
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
        // Forward only, as in `refused`: a backend that read the clock earlier may
        // store after one that read it later.
        e.last_used.fetch_max(t, Ordering::Relaxed);
    });
}

/// Makes sure (this database, role) has an entry.
pub fn ensure(role: pg_sys::Oid) {
    let t = now();
    with_entry(crate::shmem::my_db(), role, true, |e| {
        e.last_used.fetch_max(t, Ordering::Relaxed);
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

/// Counts a refusal of `role` in this database at `t` (the refusal's clock reading), and
/// returns the line to log if `quota.log_refusals` is on and the rate limit lets it
/// through.
pub fn refused(role: pg_sys::Oid, counter: Counter, log: bool, t: i64) -> Option<u64> {
    let mut line = None;
    with_entry(crate::shmem::my_db(), role, true, |e| {
        e.counters[counter as usize].fetch_add(1, Ordering::Relaxed);
        // Forward only: `t` is the refusal's own clock reading, which a later call may
        // already have passed.
        e.last_used.fetch_max(t, Ordering::Relaxed);
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
