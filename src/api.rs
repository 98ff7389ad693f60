//! The SQL-facing functions. They check arguments and call in; nothing else.
//!
//! They return `Result<_, ErrorReport>` because that is how pgrx raises an error with
//! our SQLSTATE, DETAIL and HINT intact; the report is large, but it is built only on
//! the error path.
//!
//! Text arguments arrive as `&[u8]`: the bytes of a text datum in the server encoding.
//! pgrx's `&str` would insist on UTF-8 and fail in LATIN1 or SQL_ASCII databases. The
//! SQL declarations are written out by hand (`sql = …`) so that they say `text`.
//!
//! Two generations of entry points live side by side, because a newer library runs
//! an older schema until the operator runs ALTER EXTENSION pg_quota UPDATE:
//! - 0.1.x's schema declares `start(label)` and `try_start(label)` on the C symbols
//!   `start_wrapper` and `try_start_wrapper`, with one argument. Those symbols stay,
//!   with no SQL of their own (`sql = false`): they exist for old schemas only.
//! - 0.2.0's schema declares `start(label, lease, idempotency_key, wait)` and the
//!   same `try_start` on `start_v2_wrapper` and `try_start_v2_wrapper`, and adds
//!   `renew`. Every 0.1.x call (`start()`, `start('x')`) resolves to them unchanged,
//!   since the old one-argument functions are dropped by the update.
#![allow(clippy::result_large_err)]

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::admission::{self, StartArgs};
use crate::core::QuotaError;
use crate::finish;

fn refused_as_null(r: Result<pgrx::Uuid, QuotaError>) -> Result<Option<pgrx::Uuid>, ErrorReport> {
    match r {
        Ok(id) => Ok(Some(id)),
        Err(QuotaError::Refused { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// 0.1.x's start(label), for databases not yet updated.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn start(label: Option<&[u8]>) -> Result<pgrx::Uuid, ErrorReport> {
    Ok(admission::start(
        &StartArgs::label_only(label),
        c"quota.start()",
    )?)
}

/// 0.1.x's try_start(label), for databases not yet updated.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn try_start(label: Option<&[u8]>) -> Result<Option<pgrx::Uuid>, ErrorReport> {
    refused_as_null(admission::start(
        &StartArgs::label_only(label),
        c"quota.try_start()",
    ))
}

fn args<'a>(
    label: Option<&'a [u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&'a [u8]>,
    wait: Option<Interval>,
) -> Result<StartArgs<'a>, QuotaError> {
    Ok(StartArgs {
        label,
        key: idempotency_key,
        lease: lease.and_then(|l| l.into_datum()),
        wait: Some(
            wait.ok_or(QuotaError::NullArgument("wait"))?
                .into_datum()
                .expect("an interval datum"),
        ),
    })
}

/// Admits one unit of work for `current_user`, or raises 53400 at the limit (after
/// waiting up to `wait` for capacity).
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "start"(
	"label" TEXT DEFAULT NULL,
	"lease" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0'
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'start_v2_wrapper';
"#
)]
fn start_v2(
    label: Option<&[u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&[u8]>,
    wait: Option<Interval>,
) -> Result<pgrx::Uuid, ErrorReport> {
    let a = args(label, lease, idempotency_key, wait)?;
    Ok(admission::start(&a, c"quota.start()")?)
}

/// Like start(), but returns NULL where start() would raise 53400.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "try_start"(
	"label" TEXT DEFAULT NULL,
	"lease" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0'
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'try_start_v2_wrapper';
"#
)]
fn try_start_v2(
    label: Option<&[u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&[u8]>,
    wait: Option<Interval>,
) -> Result<Option<pgrx::Uuid>, ErrorReport> {
    let a = args(label, lease, idempotency_key, wait)?;
    refused_as_null(admission::start(&a, c"quota.try_start()"))
}

/// Ends a ticket. True if this call ended it, false if it had already ended (or its
/// lease had run out).
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

/// Extends a ticket's lease to `lease` from now; returns the new expiry.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "renew"(
	"ticket" uuid,
	"lease" interval
) RETURNS timestamptz
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'renew_wrapper';
"#
)]
fn renew(
    ticket: Option<pgrx::Uuid>,
    lease: Option<Interval>,
) -> Result<pgrx::datum::TimestampWithTimeZone, ErrorReport> {
    let lease = lease.ok_or(QuotaError::NullArgument("lease"))?;
    let until = finish::renew(ticket, lease.into_datum().expect("an interval datum"))?;
    // SAFETY: a timestamptz value is a valid datum of its type.
    Ok(unsafe {
        pgrx::datum::TimestampWithTimeZone::from_datum(pg_sys::Datum::from(until), false)
            .expect("not null")
    })
}
