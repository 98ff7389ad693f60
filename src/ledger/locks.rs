//! Layer 3, the ledger: locks on pg_quota's relations and on the extension, each taken
//! with a bounded wait, so that a caller never queues without bound behind maintenance
//! (VACUUM FULL, REINDEX, CLUSTER), and read locks released as soon as the reads are
//! done (see rels.rs).

use std::time::Duration;

use pgrx::pg_sys;

use crate::compat;
use crate::core::QuotaError;
use crate::error::raise;

/// How long a caller waits for a lock on one of pg_quota's relations before it gives
/// up with 55P03 (or the session's lock_timeout, if shorter).
pub const LOCK_WAIT: Duration = Duration::from_secs(5);

/// Locks `relid` in `mode`, waiting at most LOCK_WAIT (or lock_timeout, if shorter).
/// The wait is an ordinary lock wait, so it shows in pg_locks and pg_stat_activity and
/// the deadlock detector sees it; only its length is bounded, by lowering
/// lock_timeout for the duration of the wait. A caller that queues behind a VACUUM
/// FULL waiting for someone else thus gets 55P03 after a few seconds, naming the table.
pub fn lock_bounded(relid: pg_sys::Oid, mode: u32) {
    // SAFETY: a plain lock request; it processes invalidations once granted.
    if unsafe { pg_sys::ConditionalLockRelationOid(relid, mode as i32) } {
        return;
    }
    // SAFETY: a syscache lookup, made before we wait so that the error path needs none.
    let name = unsafe {
        let p = pg_sys::get_rel_name(relid);
        if p.is_null() {
            u32::from(relid).to_string()
        } else {
            crate::catalog::name_text(p)
        }
    };
    wait_bounded(
        // SAFETY: an ordinary lock wait; cancel and statement_timeout still apply.
        || unsafe { pg_sys::LockRelationOid(relid, mode as i32) },
        |seconds| QuotaError::LockTimeout {
            relation: format!("quota.{name}"),
            seconds,
        },
    );
}

/// Takes the lock `tag` in `mode` to the end of the transaction, waiting at most
/// LOCK_WAIT (then raising `timed_out(seconds)`, 55P03), as `lock_bounded` does for a
/// table.
pub fn lock_tag_bounded(
    tag: pg_sys::LOCKTAG,
    mode: u32,
    timed_out: impl FnOnce(i64) -> QuotaError,
) {
    let mut tag = tag;
    // SAFETY: a transaction-level lock request on a tag of our own.
    let got = unsafe { pg_sys::LockAcquire(&mut tag, mode as i32, false, true) };
    if got != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL {
        return;
    }
    wait_bounded(
        // SAFETY: as above, waiting; cancel and statement_timeout still apply.
        || unsafe {
            pg_sys::LockAcquire(&mut tag, mode as i32, false, false);
        },
        timed_out,
    );
}

/// Runs `wait`, a lock wait, with lock_timeout lowered to LOCK_WAIT for its duration
/// (where the session's is longer or off), and raises `timed_out(seconds)` (55P03)
/// instead of PostgreSQL's lock timeout error.
fn wait_bounded(wait: impl FnOnce(), timed_out: impl FnOnce(i64) -> QuotaError) {
    struct Restore(i32);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts back the session's own setting.
            unsafe { pg_sys::LockTimeout = self.0 };
        }
    }
    // SAFETY: the GUC variable behind lock_timeout (milliseconds, 0 = off), read by
    // the lock manager when it starts to wait; restored right after the wait.
    let session = unsafe { pg_sys::LockTimeout };
    let bound = LOCK_WAIT.as_millis() as i32;
    let limit = if session > 0 {
        session.min(bound)
    } else {
        bound
    };
    let mut error = std::panic::AssertUnwindSafe(Some(timed_out(i64::from((limit / 1000).max(1)))));
    let _restore = Restore(session);
    // SAFETY: as above.
    unsafe { pg_sys::LockTimeout = limit };
    pgrx::PgTryBuilder::new(std::panic::AssertUnwindSafe(wait))
        .catch_when(
            pgrx::PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE,
            move |_| {
                // The transaction is aborted by this ERROR, which also takes us out of the
                // lock's wait queue.
                raise(error.0.take().expect("a lock wait times out once"))
            },
        )
        .execute();
}

thread_local! {
    /// The OID of extension pg_quota as `lock_extension` last found it.
    static EXTENSION: std::cell::Cell<pg_sys::Oid> = const { std::cell::Cell::new(pg_sys::InvalidOid) };
}

/// Takes extension pg_quota's own lock (its pg_extension object) in AccessShareLock
/// for the transaction, before any of its relations; the ledger writer does so first
/// in each of its transactions (writer/txn.rs). DROP EXTENSION locks the extension in
/// AccessExclusiveLock first and then its member tables in pg_depend's order
/// (quota.history and quota.summary before quota.active on a fresh 0.6.0 install),
/// which is not the order they are opened in (quota.active first, see Reader::open).
/// Without this lock a writer holding quota.active and waiting for quota.history
/// deadlocked with a DROP EXTENSION holding quota.history and waiting for quota.active,
/// and the deadlock detector could cancel the DROP. With it, the writer waits for the
/// DROP to end (and then finds the extension gone), or the DROP for the writer's
/// transaction. Only commands that drop the extension conflict (DROP EXTENSION, DROP
/// OWNED BY its owner, a DROP … CASCADE that reaches it), and those queued behind
/// another holder of the extension's lock (COMMENT ON EXTENSION, ALTER EXTENSION …
/// ADD) make the writer wait too, as any queued lock does. The wait is bounded as
/// `lock_bounded`'s, and times out with 55P03 naming the extension. The OID is checked
/// again once locked, as RangeVarGetRelidExtended checks a name, since a DROP and
/// CREATE EXTENSION committed during the wait leave the lock on a dead OID. Without
/// the extension, nothing is locked: opening the tables then fails.
pub fn lock_extension() {
    let lookup = || {
        // SAFETY: a catalog lookup (an index scan of pg_extension before 18).
        unsafe { pg_sys::get_extension_oid(c"pg_quota".as_ptr(), true) }
    };
    let mut ext = EXTENSION.get();
    if ext == pg_sys::InvalidOid {
        ext = lookup();
    }
    loop {
        if ext == pg_sys::InvalidOid {
            EXTENSION.set(ext);
            return;
        }
        let (class, mode) = (pg_sys::ExtensionRelationId, pg_sys::AccessShareLock as i32);
        // SAFETY: an ordinary transaction-level lock request on an object; granted, it
        // processes invalidations, so the lookup below sees every committed change.
        if !unsafe { pg_sys::ConditionalLockDatabaseObject(class, ext, 0, mode) } {
            wait_bounded(
                // SAFETY: as above, waiting; cancel and statement_timeout still apply.
                || unsafe { pg_sys::LockDatabaseObject(class, ext, 0, mode) },
                |seconds| QuotaError::ExtensionLockTimeout { seconds },
            );
        }
        let now = lookup();
        if now == ext {
            EXTENSION.set(ext);
            return;
        }
        // SAFETY: releases the lock just taken, on an extension that is gone.
        unsafe { pg_sys::UnlockDatabaseObject(class, ext, 0, mode) };
        ext = now;
    }
}

/// Relation locks taken with `lock_bounded` and released when dropped (or kept to the
/// end of the transaction, for write locks, as the executor keeps them).
pub struct Locks {
    held: Vec<(pg_sys::Oid, u32)>,
}

impl Locks {
    pub fn new() -> Locks {
        Locks { held: Vec::new() }
    }

    pub fn take(&mut self, relid: pg_sys::Oid, mode: u32) {
        // Not under a write lock held to the transaction's end (a transactional start's
        // tables): it keeps out all a read lock would, concurrent index commands wait
        // for it to make an index ready, dead or gone, and it processed invalidations.
        let write_held = || compat::relation_lock_held(relid, pg_sys::RowExclusiveLock);
        if mode == pg_sys::AccessShareLock && write_held() {
            return;
        }
        lock_bounded(relid, mode);
        if mode == pg_sys::AccessShareLock {
            self.held.push((relid, mode));
        }
    }
}

impl Drop for Locks {
    /// Read locks end with the reads: a transaction that called start() and stays
    /// open holds nothing that maintenance would queue behind.
    fn drop(&mut self) {
        for &(relid, mode) in self.held.iter().rev() {
            // SAFETY: we took exactly this lock in `take`; the lock manager counts
            // repeated acquisitions, so a lock the transaction held before stays.
            unsafe { pg_sys::UnlockRelationOid(relid, mode as i32) };
        }
    }
}
