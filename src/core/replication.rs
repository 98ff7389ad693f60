//! Synchronous replication as pg_quota judges it: which standby position a commit
//! waits for, and whether a position counts as confirmed. The rules are those of
//! PostgreSQL's SyncRepWaitForLSN (syncrep.c); the pgrx layer (syncrep.rs) reads the
//! server's state and passes it in.

/// `synchronous_commit` levels (PostgreSQL's SyncCommitLevel).
pub const LOCAL_FLUSH: i32 = 1;
pub const REMOTE_WRITE: i32 = 2;
pub const REMOTE_FLUSH: i32 = 3;
pub const REMOTE_APPLY: i32 = 4;

/// The standby position a commit at `level` waits for, as an index of
/// `WalSndCtlData.lsn` (SYNC_REP_WAIT_WRITE 0, FLUSH 1, APPLY 2); None when it waits
/// for no standby (`off`, `local`).
pub fn wait_mode(level: i32) -> Option<usize> {
    match level {
        REMOTE_WRITE => Some(0),
        REMOTE_FLUSH => Some(1),
        l if l >= REMOTE_APPLY => Some(2),
        _ => None,
    }
}

/// What the server says about synchronous replication at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncState {
    /// `max_wal_senders > 0` (SyncRepRequested's first half).
    pub wal_senders: bool,
    /// `synchronous_standby_names` names standbys (WalSndCtl's SYNC_STANDBY_DEFINED).
    pub standbys_defined: bool,
    /// How far the synchronous standbys have confirmed, per wait mode (WalSndCtl->lsn).
    pub released: [u64; 3],
}

/// Whether a commit at `level` that ended at WAL position `lsn` is confirmed: it
/// waits for no standby, or the standbys released every waiter up to `lsn`. The same
/// test SyncRepWaitForLSN makes before it waits, so a wait that ended early (cancel,
/// terminate, postmaster death) reads as unconfirmed, and one that never had to wait
/// reads as confirmed.
pub fn confirmed(level: i32, state: SyncState, lsn: u64) -> bool {
    let Some(mode) = wait_mode(level) else {
        return true;
    };
    !state.wal_senders || !state.standbys_defined || lsn <= state.released[mode]
}

/// Whether a server of `server_version_num` keeps WalSndCtl's synchronous-standby flag
/// as bits (SYNC_STANDBY_INIT, SYNC_STANDBY_DEFINED), as the May 2025 minor releases
/// made it, rather than as a bool.
pub fn flag_bits_in(server_version_num: u32) -> bool {
    match server_version_num / 10_000 {
        0..=14 => false,
        15 => server_version_num >= 150_013,
        16 => server_version_num >= 160_009,
        17 => server_version_num >= 170_005,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAITING: SyncState = SyncState {
        wal_senders: true,
        standbys_defined: true,
        released: [300, 200, 100],
    };

    #[test]
    fn local_and_off_wait_for_nobody() {
        assert_eq!(wait_mode(0), None);
        assert_eq!(wait_mode(LOCAL_FLUSH), None);
        assert!(confirmed(LOCAL_FLUSH, WAITING, u64::MAX));
        assert!(confirmed(0, WAITING, u64::MAX));
    }

    #[test]
    fn each_level_reads_its_own_position() {
        assert_eq!(wait_mode(REMOTE_WRITE), Some(0));
        assert_eq!(wait_mode(REMOTE_FLUSH), Some(1));
        assert_eq!(wait_mode(REMOTE_APPLY), Some(2));
        // written up to 300, flushed up to 200, applied up to 100
        assert!(confirmed(REMOTE_WRITE, WAITING, 250));
        assert!(!confirmed(REMOTE_FLUSH, WAITING, 250));
        assert!(confirmed(REMOTE_FLUSH, WAITING, 200));
        assert!(!confirmed(REMOTE_APPLY, WAITING, 150));
    }

    #[test]
    fn flag_bits_came_with_the_may_2025_minors() {
        assert!(!flag_bits_in(150_012));
        assert!(flag_bits_in(150_013));
        assert!(flag_bits_in(150_020));
        assert!(!flag_bits_in(160_008) && flag_bits_in(160_009));
        assert!(!flag_bits_in(170_004) && flag_bits_in(170_005));
        assert!(flag_bits_in(180_000));
    }

    #[test]
    fn nothing_to_confirm_without_standbys() {
        let none = SyncState {
            standbys_defined: false,
            ..WAITING
        };
        assert!(confirmed(REMOTE_FLUSH, none, u64::MAX));
        let no_senders = SyncState {
            wal_senders: false,
            ..WAITING
        };
        assert!(confirmed(REMOTE_APPLY, no_senders, u64::MAX));
    }
}
