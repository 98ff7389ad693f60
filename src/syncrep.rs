//! Layer 1: synchronous replication, read from the server for core::replication to
//! judge: whether the synchronous standbys confirmed a WAL position, and a wait for
//! them as a commit waits.

use pgrx::pg_sys;

use crate::core::replication::{self, SyncState};

/// SyncRepLock, a C macro for slot 32 of the main LWLock array in every release
/// pg_quota builds for (lwlocknames.h through 16, lwlocklist.h from 17).
fn sync_rep_lock() -> *mut pg_sys::LWLock {
    // SAFETY: MainLWLockArray is set up before any backend or worker runs.
    unsafe { &raw mut (*pg_sys::MainLWLockArray.add(32)).lock }
}

/// The server's synchronous replication state now, read under SyncRepLock as
/// SyncRepWaitForLSN reads it: the checkpointer releases the waiters and changes the
/// flags under that lock, so a writer released because the standbys' names were reset
/// does not read the old flag with the old positions.
///
/// Whether standbys are named is read from the shared flag, as SyncRepWaitForLSN reads
/// it, and from this process's own setting until the checkpointer has set the flag.
/// The flag's bits (SYNC_STANDBY_INIT 1, SYNC_STANDBY_DEFINED 2) came with the May
/// 2025 minor releases (15.13, 16.9, 17.5; 18 has them); an older server keeps a plain
/// bool there, whose `true` reads as INIT alone, so there 1 means "named".
fn state() -> SyncState {
    // SAFETY: WalSndCtl points into shared memory for the server's life once set; the
    // fields are read under the lock their writers hold.
    unsafe {
        let wal_senders = pg_sys::max_wal_senders > 0;
        let names = pg_sys::SyncRepStandbyNames;
        let named_here = !names.is_null() && *names != 0;
        let ctl = pg_sys::WalSndCtl;
        if ctl.is_null() {
            return SyncState {
                wal_senders,
                standbys_defined: named_here,
                released: [0; 3],
            };
        }
        pg_sys::LWLockAcquire(sync_rep_lock(), pg_sys::LWLockMode::LW_SHARED);
        let status = u32::from((*ctl).sync_standbys_status);
        let released = (*ctl).lsn;
        pg_sys::LWLockRelease(sync_rep_lock());
        let standbys_defined = if status & pg_sys::SYNC_STANDBY_DEFINED != 0 {
            true
        } else if status & pg_sys::SYNC_STANDBY_INIT == 0 {
            named_here
        } else {
            !flag_bits_in_use()
        };
        SyncState {
            wal_senders,
            standbys_defined,
            released,
        }
    }
}

/// Whether the running server keeps WalSndCtl's flag as bits (see `state`).
fn flag_bits_in_use() -> bool {
    thread_local! {
        static BITS: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    }
    if let Some(b) = BITS.get() {
        return b;
    }
    // SAFETY: reads a built-in, always present, read-only setting.
    let v: u32 = unsafe {
        let p = pg_sys::GetConfigOption(c"server_version_num".as_ptr(), false, false);
        if p.is_null() {
            0
        } else {
            std::ffi::CStr::from_ptr(p)
                .to_str()
                .unwrap_or("0")
                .parse()
                .unwrap_or(0)
        }
    };
    let b = replication::flag_bits_in(v);
    BITS.set(Some(b));
    b
}

/// Whether a commit that ended at `lsn` is confirmed by the synchronous standbys that
/// this process's `synchronous_commit` waits for (true when it waits for none).
pub fn confirmed(lsn: pg_sys::XLogRecPtr) -> bool {
    // SAFETY: a plain read of this process's setting.
    let level = unsafe { pg_sys::synchronous_commit };
    replication::confirmed(level, state(), lsn)
}

/// Whether synchronous standbys are named, so that a commit may wait for them.
pub fn standbys_defined() -> bool {
    let s = state();
    s.wal_senders && s.standbys_defined
}

/// Whether the last commit this process made is confirmed (see `confirmed`).
pub fn last_commit_confirmed() -> bool {
    // SAFETY: a plain read of this process's own state, set at each commit.
    confirmed(unsafe { pg_sys::XactLastCommitEnd })
}

/// Waits, as a commit at this process's `synchronous_commit` waits, until the
/// synchronous standbys confirmed all WAL this server has flushed; returns whether
/// they did. A wait ended early (a cancel, a terminate, the postmaster's death:
/// PostgreSQL warns and returns) reads false; a terminate stays pending, as it does
/// after a commit. Outside a transaction.
pub fn wait_for_flushed() -> bool {
    // SAFETY: reads the flush position; SyncRepWaitForLSN is what a commit calls after
    // its commit record, here with the position every earlier commit ended before.
    // Interrupts are held around it, as CommitTransaction holds them: its WARNING on an
    // early end would otherwise process a pending terminate (errfinish checks for
    // interrupts) and end the process before the caller hears of it.
    unsafe {
        let lsn = pg_sys::GetFlushRecPtr(std::ptr::null_mut());
        pg_sys::InterruptHoldoffCount += 1;
        pg_sys::SyncRepWaitForLSN(lsn, true);
        pg_sys::InterruptHoldoffCount -= 1;
        confirmed(lsn)
    }
}
