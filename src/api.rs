//! The SQL-facing functions. They check arguments and call in; nothing else.
//!
//! They return `Result<_, ErrorReport>` because that is how pgrx raises an error with
//! our SQLSTATE, DETAIL and HINT intact; the report is large, but it is built only on
//! the error path.
//!
//! Text arguments arrive as `&[u8]`: the bytes of a text datum in the server encoding.
//! pgrx's `&str` would insist on UTF-8 and fail in LATIN1 or SQL_ASCII databases. The
//! SQL declarations are written out by hand (`sql = …`) so that they say `text`, and
//! they are exactly those of 0.1.0, whose install script is frozen in tests/upgrade.
#![allow(clippy::result_large_err)]

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::core::QuotaError;
use crate::{admission, finish};

/// Admits one unit of work for `current_user`, or raises 53400 at the limit.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "start"(
	"label" TEXT DEFAULT NULL
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'start_wrapper';
"#
)]
fn start(label: Option<&[u8]>) -> Result<pgrx::Uuid, ErrorReport> {
    Ok(admission::start(label, c"quota.start()")?)
}

/// Like start(), but returns NULL where start() would raise 53400.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "try_start"(
	"label" TEXT DEFAULT NULL
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'try_start_wrapper';
"#
)]
fn try_start(label: Option<&[u8]>) -> Result<Option<pgrx::Uuid>, ErrorReport> {
    match admission::start(label, c"quota.try_start()") {
        Ok(id) => Ok(Some(id)),
        Err(QuotaError::Refused { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Ends a ticket. True if this call ended it, false if it had already ended.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "finish"(
	"ticket" uuid,
	"outcome" TEXT DEFAULT 'succeeded'
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'finish_wrapper';
"#
)]
fn finish(ticket: Option<pgrx::Uuid>, outcome: Option<&[u8]>) -> Result<bool, ErrorReport> {
    Ok(finish::finish(ticket, outcome)?)
}
