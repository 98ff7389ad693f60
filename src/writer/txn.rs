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
    // Before any of pg_quota's relations (see there), and before the snapshot, which
    // must not predate a wait for a DROP EXTENSION.
    crate::ledger::locks::lock_extension();
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
