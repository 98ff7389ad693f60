//! Layer 4: quota.writer_stats, a small array of per-database entries in the
//! statistics' segment, written by each database's ledger writer; not kept across
//! restarts.

use std::sync::atomic::Ordering;

use pgrx::pg_sys;

use super::table::*;

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
