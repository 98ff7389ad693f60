//! Layer 4: the statistics file, `pg_stat/pg_quota.stat`: written by the postmaster
//! when it shuts down cleanly, read and removed when it starts.

use std::sync::atomic::Ordering;

use pgrx::pg_sys;

use crate::core::stats::{self as core_stats, Saved, SavedStats};

use super::table::*;

// ---------------------------------------------------------------------------------
// The stats file
// ---------------------------------------------------------------------------------

pub(super) fn load() {
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
pub(super) unsafe extern "C-unwind" fn save_at_exit(code: i32, _arg: pg_sys::Datum) {
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
