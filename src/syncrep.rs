//! Layer 1: synchronous replication, read from the server for core::replication to
//! judge: whether the synchronous standbys confirmed a WAL position, and a wait for
//! them as a commit waits.

use pgrx::pg_sys;

use crate::core::replication::{self, SyncState};

/// The server's synchronous replication state now. The positions only grow, and an
/// aligned 8-byte read is atomic, so no lock is needed to read them; the flags are
/// read as SyncRepWaitForLSN reads them before it takes SyncRepLock.
fn state() -> SyncState {
    // SAFETY: WalSndCtl points into shared memory for the server's life once set; the
    // reads are volatile because walsenders and the checkpointer write the fields.
    unsafe {
        let ctl = pg_sys::WalSndCtl;
        let wal_senders = pg_sys::max_wal_senders > 0;
        if ctl.is_null() {
            return SyncState {
                wal_senders,
                standbys_defined: false,
                released: [0; 3],
            };
        }
        let status = u32::from(std::ptr::read_volatile(
            &raw const (*ctl).sync_standbys_status,
        ));
        // Until the checkpointer has read synchronous_standby_names once (INIT), the
        // setting itself says whether standbys are named, as SyncStandbysDefined does.
        let standbys_defined = if status & pg_sys::SYNC_STANDBY_INIT != 0 {
            status & pg_sys::SYNC_STANDBY_DEFINED != 0
        } else {
            let names = pg_sys::SyncRepStandbyNames;
            !names.is_null() && *names != 0
        };
        let released = [0, 1, 2].map(|m| std::ptr::read_volatile(&raw const (*ctl).lsn[m]));
        SyncState {
            wal_senders,
            standbys_defined,
            released,
        }
    }
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

/// The end of the last commit record this process wrote.
pub fn last_commit_end() -> pg_sys::XLogRecPtr {
    // SAFETY: a plain read of this process's own state, set at each commit.
    unsafe { pg_sys::XactLastCommitEnd }
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
