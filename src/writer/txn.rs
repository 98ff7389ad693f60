//! Layer 5: the transaction bracket of the ledger writer's work (batches, sweeps,
//! purges, rebuilds), as a background worker runs its transactions.

use std::time::Instant;

use pgrx::pg_sys;
use pgrx::prelude::*;

/// Runs `f` in a transaction of its own, as a background worker does.
pub fn in_transaction<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: the standard transaction bracket of a background worker; an ERROR in
    // `f` aborts the transaction through the worker's error handling.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        // I6: a charge is on disk before start() returns, even where the server runs
        // with synchronous_commit = off. Set for this transaction only, so that the
        // server's setting, reloaded or not, applies otherwise; stronger settings
        // (remote_apply, …) are kept.
        if pg_sys::synchronous_commit
            < pg_sys::SyncCommitLevel::SYNCHRONOUS_COMMIT_LOCAL_FLUSH as i32
        {
            pg_sys::set_config_option(
                c"synchronous_commit".as_ptr(),
                c"local".as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_LOCAL,
                true,
                pg_sys::PGERROR as i32,
                false,
            );
        }
    }
    // Before the snapshot, which must not predate a wait for a DROP EXTENSION.
    lock_extension();
    // SAFETY: the transaction is open.
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
    let r = f();
    let commit = Instant::now();
    // SAFETY: closes the bracket opened above.
    unsafe {
        pg_sys::PopActiveSnapshot();
        pg_sys::CommitTransactionCommand();
    }
    LAST_COMMIT_US.set(commit.elapsed().as_micros() as u64);
    r
}

/// Takes pg_quota's extension object in AccessShareLock for the transaction, before
/// any of its relations. DROP EXTENSION locks the extension in AccessExclusiveLock
/// first and then its member tables in pg_depend's order (quota.history, quota.summary,
/// then quota.active on a fresh 0.6.0 install), which is not the order the writer opens
/// them in (quota.active first): without this lock a writer holding quota.active and
/// waiting for quota.history deadlocks with a DROP EXTENSION holding quota.history and
/// waiting for quota.active, and the deadlock detector may cancel the DROP. With it,
/// the writer waits for the DROP to commit (and then finds the extension gone), or the
/// DROP waits for the writer's transaction. Only DROP EXTENSION (and DROP … CASCADE
/// reaching the extension) takes the lock in a mode that conflicts; the wait is bounded
/// by the writer's lock_timeout. Looked up each time: no cache to go stale when the
/// extension is dropped and created again.
fn lock_extension() {
    // SAFETY: a catalog lookup and an ordinary transaction-level lock, released when
    // the transaction ends; lock_timeout and the deadlock detector apply.
    unsafe {
        let ext = pg_sys::get_extension_oid(c"pg_quota".as_ptr(), true);
        if ext != pg_sys::InvalidOid {
            pg_sys::LockDatabaseObject(
                pg_sys::ExtensionRelationId,
                ext,
                0,
                pg_sys::AccessShareLock as i32,
            );
        }
    }
}

thread_local! {
    /// How long the last commit of `in_transaction` took, for quota.writer_stats.
    pub static LAST_COMMIT_US: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Runs `f` in a transaction of its own; returns whether it committed. A failure (a
/// lock held too long by maintenance, say) is logged as a warning and does not stop
/// the writer: admissions go on, and the caller says when the work is tried again.
pub fn try_in_transaction(what: &str, f: fn()) -> bool {
    let failed = PgTryBuilder::new(|| {
        in_transaction(f);
        None
    })
    .catch_others(|e| Some(caught_error(e).1))
    .execute();
    if let Some(msg) = failed {
        // SAFETY: pgrx flushed the error state; abort the failed transaction.
        unsafe { pg_sys::AbortCurrentTransaction() };
        crate::stats::writer_error(&format!("could not {what}: {msg}"));
        crate::error::log_line(
            pg_sys::WARNING,
            pgrx::PgSqlErrorCode::ERRCODE_WARNING,
            &format!("pg_quota ledger writer: could not {what}: {msg}"),
        );
        return false;
    }
    true
}

pub fn caught_error(e: pg_sys::panic::CaughtError) -> (i32, String) {
    use pg_sys::panic::CaughtError;
    match e {
        CaughtError::PostgresError(r)
        | CaughtError::ErrorReport(r)
        | CaughtError::RustPanic { ereport: r, .. } => {
            (r.sql_error_code() as i32, r.message().to_string())
        }
    }
}
