//! The SQL-facing functions. They check arguments and call in; nothing else.
//!
//! They return `Result<_, ErrorReport>` because that is how pgrx raises an error with
//! our SQLSTATE, DETAIL and HINT intact; the report is large, but it is built only on
//! the error path.
#![allow(clippy::result_large_err)]

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::core::QuotaError;
use crate::{admission, finish};

/// Admits one unit of work for `current_user`, or raises 53400 at the limit.
#[pg_extern(volatile, parallel_unsafe)]
fn start(label: default!(Option<&str>, "NULL")) -> Result<pgrx::Uuid, ErrorReport> {
    Ok(admission::start(label)?)
}

/// Like start(), but returns NULL where start() would raise 53400.
#[pg_extern(volatile, parallel_unsafe)]
fn try_start(label: default!(Option<&str>, "NULL")) -> Result<Option<pgrx::Uuid>, ErrorReport> {
    match admission::start(label) {
        Ok(id) => Ok(Some(id)),
        Err(QuotaError::Refused { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Ends a ticket. True if this call ended it, false if it had already ended.
#[pg_extern(volatile, parallel_unsafe)]
fn finish(
    ticket: Option<pgrx::Uuid>,
    outcome: default!(Option<&str>, "'succeeded'"),
) -> Result<bool, ErrorReport> {
    Ok(finish::finish(ticket, outcome)?)
}
