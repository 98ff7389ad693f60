//! Layer 6, the SQL surface: the functions SQL calls. They check arguments and call
//! into the paths (layer 5) and the statistics (layer 4); nothing else.
//!
//! The ones that start, finish and renew tickets run inside `error::boundary`, which
//! raises their errors with our SQLSTATE, DETAIL and HINT intact and their names in the
//! server encoding (0.5.2, see error.rs).
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
//!   since the old one-argument functions are dropped by the update. Those symbols
//!   stay too, with no SQL of their own from 0.5.0 on.
//! - 0.5.0's schema declares `start(…, tenant, transactional)` and the same
//!   `try_start` on `start_v5_wrapper` and `try_start_v5_wrapper`; every older call
//!   resolves to them unchanged.
#![allow(clippy::result_large_err)]

use pgrx::prelude::*;

use crate::admission::{self, OnRefusal, StartArgs};
use crate::core::QuotaError;
use crate::error::boundary;
use crate::finish;

/// start(): a refusal raises 53400.
fn raising(args: &StartArgs) -> Result<pgrx::Uuid, QuotaError> {
    let id = admission::start(args, c"quota.start()", OnRefusal::Raise)?;
    Ok(id.expect("a refusal raises"))
}

/// try_start(): a refusal is NULL.
fn refused_as_null(args: &StartArgs) -> Result<Option<pgrx::Uuid>, QuotaError> {
    admission::start(args, c"quota.try_start()", OnRefusal::Null)
}

/// 0.1.x's start(label), for databases not yet updated.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn start(label: Option<&[u8]>) -> pgrx::Uuid {
    boundary(|| raising(&StartArgs::label_only(label)))
}

/// 0.1.x's try_start(label), for databases not yet updated.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn try_start(label: Option<&[u8]>) -> Option<pgrx::Uuid> {
    boundary(|| refused_as_null(&StartArgs::label_only(label)))
}

fn args<'a>(
    label: Option<&'a [u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&'a [u8]>,
    wait: Option<Interval>,
    tenant: Option<&'a [u8]>,
    transactional: Option<bool>,
) -> Result<StartArgs<'a>, QuotaError> {
    weighed(
        label,
        lease,
        idempotency_key,
        wait,
        tenant,
        transactional,
        Some(1),
    )
}

/// The plain function a weighted overload takes its privileges from (0.7.0): EXECUTE
/// on `quota.<name>(text, interval, text, interval, text, boolean)` is required too,
/// so that a DBA's REVOKE of the plain start() or try_start() (made before the update
/// to 0.7.0, or in a dump of an older version restored here, where it names only the
/// plain function) also holds for the weighted one, which the update creates with
/// PUBLIC's EXECUTE. Looked up on every call through the syscache, by schema OID
/// (get_namespace_oid checks no USAGE, as the rest of the library finds schema quota:
/// a role that reaches start() through a view or a column default may lack it); a
/// missing function (none to narrow anything) lets the call through.
fn require_plain_execute(name: &'static std::ffi::CStr) -> Result<(), QuotaError> {
    let args = [
        pg_sys::TEXTOID,
        pg_sys::INTERVALOID,
        pg_sys::TEXTOID,
        pg_sys::INTERVALOID,
        pg_sys::TEXTOID,
        pg_sys::BOOLOID,
    ];
    // SAFETY: catalog lookups that return InvalidOid for a missing schema or function;
    // the oidvector is palloc'd in the current memory context.
    let func = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return Ok(());
        }
        let types = pg_sys::buildoidvector(args.as_ptr(), args.len() as i32);
        pg_sys::GetSysCacheOid(
            pg_sys::SysCacheIdentifier::PROCNAMEARGSNSP as i32,
            pg_sys::Anum_pg_proc_oid as pg_sys::AttrNumber,
            pg_sys::Datum::from(name.as_ptr()),
            pg_sys::Datum::from(types),
            pg_sys::Datum::from(nsp),
            pg_sys::Datum::from(0),
        )
    };
    // SAFETY: a plain read of backend state.
    let role = unsafe { pg_sys::GetUserId() };
    if func == pg_sys::InvalidOid || crate::compat::may_execute(func, role) {
        Ok(())
    } else {
        Err(QuotaError::PlainNotExecutable {
            function: name.to_string_lossy().into_owned(),
        })
    }
}

/// `args` with a weight (0.7.0), checked first: core::ticket::check_weight.
fn weighed<'a>(
    label: Option<&'a [u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&'a [u8]>,
    wait: Option<Interval>,
    tenant: Option<&'a [u8]>,
    transactional: Option<bool>,
    weight: Option<i32>,
) -> Result<StartArgs<'a>, QuotaError> {
    let weight = crate::core::ticket::check_weight(weight)?;
    Ok(StartArgs {
        label,
        key: idempotency_key,
        lease: lease.and_then(|l| l.into_datum()),
        wait: Some(
            wait.ok_or(QuotaError::NullArgument("wait"))?
                .into_datum()
                .expect("an interval datum"),
        ),
        tenant,
        transactional: transactional.ok_or(QuotaError::NullArgument("transactional"))?,
        weight,
    })
}

/// 0.2.0's start(label, lease, idempotency_key, wait), for databases not yet updated.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn start_v2(
    label: Option<&[u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&[u8]>,
    wait: Option<Interval>,
) -> pgrx::Uuid {
    boundary(|| {
        raising(&args(
            label,
            lease,
            idempotency_key,
            wait,
            None,
            Some(false),
        )?)
    })
}

/// 0.2.0's try_start(label, lease, idempotency_key, wait), for databases not yet
/// updated.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn try_start_v2(
    label: Option<&[u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&[u8]>,
    wait: Option<Interval>,
) -> Option<pgrx::Uuid> {
    boundary(|| {
        refused_as_null(&args(
            label,
            lease,
            idempotency_key,
            wait,
            None,
            Some(false),
        )?)
    })
}

/// Admits one unit of work for `current_user` (and its `tenant`, if given), or raises
/// 53400 at a limit (after waiting up to `wait` for capacity). With `transactional`,
/// the charge commits or rolls back with the calling transaction.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "start"(
	"label" TEXT DEFAULT NULL,
	"lease" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'start_v5_wrapper';
"#
)]
fn start_v5(
    label: Option<&[u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&[u8]>,
    wait: Option<Interval>,
    tenant: Option<&[u8]>,
    transactional: Option<bool>,
) -> pgrx::Uuid {
    boundary(|| {
        raising(&args(
            label,
            lease,
            idempotency_key,
            wait,
            tenant,
            transactional,
        )?)
    })
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
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'try_start_v5_wrapper';
"#
)]
fn try_start_v5(
    label: Option<&[u8]>,
    lease: Option<Interval>,
    idempotency_key: Option<&[u8]>,
    wait: Option<Interval>,
    tenant: Option<&[u8]>,
    transactional: Option<bool>,
) -> Option<pgrx::Uuid> {
    boundary(|| {
        refused_as_null(&args(
            label,
            lease,
            idempotency_key,
            wait,
            tenant,
            transactional,
        )?)
    })
}

/// 0.7.0: start() of a ticket that counts `weight` units against its limits.
/// An overload rather than a new argument of start(): the existing function stays, so
/// that what depends on it (a view, a column default, a function) keeps working. Its
/// weight comes first and has no default, so that a call without one resolves to the
/// existing function as before; and where the existing function's arguments are not
/// text (lease and wait, intervals, and transactional), this one's are of the same
/// type, so that a call of the existing one with literals of unknown type, such as
/// start('a job', '1 hour'), is never ambiguous: PostgreSQL resolves each literal to
/// text where any candidate takes text there, and the existing function alone takes
/// text first. Hence the order: weight, lease, label, wait, tenant, transactional,
/// idempotency_key (USER_GUIDE, "Weighted tickets": call it with named arguments).
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "start"(
	"weight" INT,
	"lease" interval DEFAULT NULL,
	"label" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false,
	"idempotency_key" TEXT DEFAULT NULL
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'start_v7_wrapper';
"#
)]
fn start_v7(
    weight: Option<i32>,
    lease: Option<Interval>,
    label: Option<&[u8]>,
    wait: Option<Interval>,
    tenant: Option<&[u8]>,
    transactional: Option<bool>,
    idempotency_key: Option<&[u8]>,
) -> pgrx::Uuid {
    boundary(|| {
        require_plain_execute(c"start")?;
        raising(&weighed(
            label,
            lease,
            idempotency_key,
            wait,
            tenant,
            transactional,
            weight,
        )?)
    })
}

/// 0.7.0: try_start() of a weighted ticket, as start_v7.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "try_start"(
	"weight" INT,
	"lease" interval DEFAULT NULL,
	"label" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false,
	"idempotency_key" TEXT DEFAULT NULL
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'try_start_v7_wrapper';
"#
)]
fn try_start_v7(
    weight: Option<i32>,
    lease: Option<Interval>,
    label: Option<&[u8]>,
    wait: Option<Interval>,
    tenant: Option<&[u8]>,
    transactional: Option<bool>,
    idempotency_key: Option<&[u8]>,
) -> Option<pgrx::Uuid> {
    boundary(|| {
        require_plain_execute(c"try_start")?;
        refused_as_null(&weighed(
            label,
            lease,
            idempotency_key,
            wait,
            tenant,
            transactional,
            weight,
        )?)
    })
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
fn finish(ticket: Option<pgrx::Uuid>, outcome: Option<&[u8]>) -> bool {
    boundary(|| finish::finish(ticket, outcome))
}

/// 0.6.0: a trigger that finishes a job's ticket when the queue ends the job, in the
/// queue's own transaction (job_trigger.rs; USER_GUIDE, "quota.finish_job() RETURNS
/// trigger"). Written out by hand rather than with pgrx's `#[pg_trigger]`, whose
/// wrapper answers a call that is not a trigger's with a Rust panic (XX000).
#[pg_guard]
#[no_mangle]
#[doc(hidden)]
pub unsafe extern "C-unwind" fn finish_job_wrapper(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    // SAFETY: PostgreSQL's fcinfo for this call.
    unsafe { job_trigger_call(crate::core::JobFn::Finish, fcinfo) }
}

/// 0.6.0: a trigger that renews a job's ticket when the queue claims the job, in the
/// claim's own transaction, and clears a ticket it cannot renew from the row
/// (job_trigger.rs; USER_GUIDE, "quota.claim_job() RETURNS trigger").
#[pg_guard]
#[no_mangle]
#[doc(hidden)]
pub unsafe extern "C-unwind" fn claim_job_wrapper(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    // SAFETY: PostgreSQL's fcinfo for this call.
    unsafe { job_trigger_call(crate::core::JobFn::Claim, fcinfo) }
}

/// The body of both trigger functions: the row a BEFORE trigger returns (claim_job),
/// or a null pointer, which an AFTER trigger's result must be (finish_job).
///
/// # Safety
/// `fcinfo` is PostgreSQL's for a call of one of them.
unsafe fn job_trigger_call(
    func: crate::core::JobFn,
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let row = boundary(|| {
        // SAFETY: the caller's fcinfo; its context is a TriggerData exactly when the
        // trigger manager calls (CALLED_AS_TRIGGER).
        let data = unsafe {
            let context = (*fcinfo).context;
            (!context.is_null() && (*context).type_ == pg_sys::NodeTag::T_TriggerData)
                .then(|| &*(context as *const pg_sys::TriggerData))
        };
        let data = data.ok_or(QuotaError::NotCalledAsTrigger(func))?;
        // SAFETY: the TriggerData of this trigger call.
        unsafe { crate::job_trigger::fire(func, data) }
    });
    pg_sys::Datum::from(row)
}

/// PG_FUNCTION_INFO_V1(finish_job_wrapper).
#[no_mangle]
#[doc(hidden)]
pub extern "C" fn pg_finfo_finish_job_wrapper() -> &'static pg_sys::Pg_finfo_record {
    const V1_API: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1_API
}

/// PG_FUNCTION_INFO_V1(claim_job_wrapper).
#[no_mangle]
#[doc(hidden)]
pub extern "C" fn pg_finfo_claim_job_wrapper() -> &'static pg_sys::Pg_finfo_record {
    const V1_API: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1_API
}

extension_sql!(
    r#"
CREATE FUNCTION "finish_job"() RETURNS trigger
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'finish_job_wrapper';
"#,
    name = "finish_job"
);

extension_sql!(
    r#"
CREATE FUNCTION "claim_job"() RETURNS trigger
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'claim_job_wrapper';
"#,
    name = "claim_job"
);

/// The session's quota.retention as an interval, for quota.usage (declared by hand in
/// sql/schema.sql, which creates the view before pgrx's functions exist).
#[pg_extern(stable, parallel_safe, sql = false)]
fn current_retention() -> Interval {
    crate::shmem::require_preloaded();
    Interval::new(
        0,
        0,
        crate::gucs::retention_secs().saturating_mul(1_000_000),
    )
    .expect("a retention in seconds is a valid interval")
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
) -> pgrx::datum::TimestampWithTimeZone {
    boundary(|| {
        let lease = lease.ok_or(QuotaError::NullArgument("lease"))?;
        let until = finish::renew(ticket, lease.into_datum().expect("an interval datum"))?;
        Ok(tstz(until))
    })
}

// ---------------------------------------------------------------------------------
// 0.3.0: statistics (see stats.rs). The views in sql/stats.sql name the databases and
// roles; these functions return oids.
// ---------------------------------------------------------------------------------

/// A timestamptz value as pgrx's type, for the functions that return one.
fn tstz(t: i64) -> pgrx::datum::TimestampWithTimeZone {
    // SAFETY: a timestamptz value is a valid datum of its type.
    unsafe {
        pgrx::datum::TimestampWithTimeZone::from_datum(pg_sys::Datum::from(t), false)
            .expect("not null")
    }
}

/// Whether the caller sees every role's statistics: superusers and members of
/// pg_read_all_stats, as in pg_stat_activity and pg_stat_statements.
fn sees_all_stats() -> bool {
    // SAFETY: plain catalog lookups for the current user.
    unsafe {
        let me = pg_sys::GetUserId();
        pg_sys::superuser_arg(me)
            || pg_sys::has_privs_of_role(me, pg_sys::Oid::from(pg_sys::ROLE_PG_READ_ALL_STATS))
    }
}

/// The statistics rows the caller may see: every row for superusers and members of
/// pg_read_all_stats, otherwise those of the roles whose tickets it may finish (its
/// current_user and the roles it is a member of), as in quota.tickets and quota.usage.
fn visible_stats() -> Vec<crate::stats::Row> {
    crate::shmem::require_preloaded();
    let all = sees_all_stats();
    // SAFETY: a plain read of backend state.
    let me = unsafe { pg_sys::GetUserId() };
    crate::stats::rows(|role| {
        all || role == u32::from(me)
            // SAFETY: a membership lookup in the backend's role cache; role 0 (the
            // rows of roles no longer listed) is nobody's.
            || (role != 0 && unsafe { pg_sys::is_member_of_role(me, pg_sys::Oid::from(role)) })
    })
}

/// The rows of quota.stats the caller may see.
#[pg_extern(
    volatile,
    parallel_safe,
    sql = r#"
CREATE FUNCTION "stats_rows"(
	OUT "dbid" oid, OUT "roleid" oid,
	OUT "admitted" bigint,
	OUT "refused_active" bigint, OUT "refused_retained" bigint, OUT "refused_database" bigint,
	OUT "finished_succeeded" bigint, OUT "finished_failed" bigint, OUT "finished_cancelled" bigint,
	OUT "expired" bigint, OUT "renewed" bigint, OUT "idempotent_hits" bigint,
	OUT "waits" bigint, OUT "wait_time" double precision, OUT "wait_timeouts" bigint,
	OUT "stats_reset" timestamptz
) RETURNS SETOF record
VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stats_rows_wrapper';
"#
)]
fn stats_rows() -> TableIterator<
    'static,
    (
        name!(dbid, pg_sys::Oid),
        name!(roleid, pg_sys::Oid),
        name!(admitted, i64),
        name!(refused_active, i64),
        name!(refused_retained, i64),
        name!(refused_database, i64),
        name!(finished_succeeded, i64),
        name!(finished_failed, i64),
        name!(finished_cancelled, i64),
        name!(expired, i64),
        name!(renewed, i64),
        name!(idempotent_hits, i64),
        name!(waits, i64),
        name!(wait_time, f64),
        name!(wait_timeouts, i64),
        name!(stats_reset, pgrx::datum::TimestampWithTimeZone),
    ),
> {
    use crate::core::stats::Counter as C;
    let rows = visible_stats();
    TableIterator::new(rows.into_iter().map(|r| {
        let c = |k: C| r.counters[k as usize] as i64;
        (
            pg_sys::Oid::from(r.db),
            pg_sys::Oid::from(r.role),
            c(C::Admitted),
            c(C::RefusedActive),
            c(C::RefusedRetained),
            c(C::RefusedDatabase),
            c(C::FinishedSucceeded),
            c(C::FinishedFailed),
            c(C::FinishedCancelled),
            c(C::Expired),
            c(C::Renewed),
            c(C::IdempotentHits),
            c(C::Waits),
            r.counters[C::WaitTime as usize] as f64 / 1000.0,
            c(C::WaitTimeouts),
            tstz(r.since),
        )
    }))
}

/// quota.stats_info's one row.
#[pg_extern(
    volatile,
    parallel_safe,
    sql = r#"
CREATE FUNCTION "stats_info_row"(
	OUT "max" integer, OUT "entries" bigint, OUT "evicted" bigint,
	OUT "log_suppressed" bigint, OUT "stats_reset" timestamptz
) RETURNS SETOF record
VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stats_info_row_wrapper';
"#
)]
fn stats_info_row() -> TableIterator<
    'static,
    (
        name!(max, i32),
        name!(entries, i64),
        name!(evicted, i64),
        name!(log_suppressed, i64),
        name!(stats_reset, pgrx::datum::TimestampWithTimeZone),
    ),
> {
    crate::shmem::require_preloaded();
    let (max, entries, evicted, suppressed, reset) = crate::stats::info();
    TableIterator::once((max, entries, evicted, suppressed, tstz(reset)))
}

/// quota.writer_stats: every database's ledger writer, for those who see all stats.
#[pg_extern(
    volatile,
    parallel_safe,
    sql = r#"
CREATE FUNCTION "writer_stats_rows"(
	OUT "dbid" oid, OUT "pid" integer, OUT "started_at" timestamptz,
	OUT "batches" bigint, OUT "requests" bigint, OUT "mean_batch_size" double precision,
	OUT "commit_time" double precision, OUT "restarts" bigint,
	OUT "last_error" text, OUT "last_error_at" timestamptz
) RETURNS SETOF record
VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'writer_stats_rows_wrapper';
"#
)]
fn writer_stats_rows() -> TableIterator<
    'static,
    (
        name!(dbid, pg_sys::Oid),
        name!(pid, Option<i32>),
        name!(started_at, pgrx::datum::TimestampWithTimeZone),
        name!(batches, i64),
        name!(requests, i64),
        name!(mean_batch_size, Option<f64>),
        name!(commit_time, f64),
        name!(restarts, i64),
        // Text in this database's encoding (0.5.2): the writers' messages are kept as
        // UTF-8, and a writer of another database may have written it. The varlena
        // of bytes is the declared text column's.
        name!(last_error, Option<Vec<u8>>),
        name!(last_error_at, Option<pgrx::datum::TimestampWithTimeZone>),
    ),
> {
    crate::shmem::require_preloaded();
    let rows = if sees_all_stats() {
        crate::stats::writer_rows()
    } else {
        Vec::new()
    };
    TableIterator::new(rows.into_iter().map(|w| {
        let (last_error, last_error_at) = match w.last_error {
            Some((msg, at)) => (Some(crate::encoding::to_server(&msg)), Some(tstz(at))),
            None => (None, None),
        };
        (
            pg_sys::Oid::from(w.db),
            (w.pid != 0).then_some(w.pid),
            tstz(w.started_at),
            w.batches as i64,
            w.requests as i64,
            (w.batches > 0).then(|| w.requests as f64 / w.batches as f64),
            w.commit_us as f64 / 1000.0,
            w.restarts as i64,
            last_error,
            last_error_at,
        )
    }))
}

/// quota.usage_totals() (0.5.1): the database's active and retained tickets and its
/// ledger rows, all roles together, without reading the ledger's history (see
/// stats/usage.rs). EXECUTE is revoked from PUBLIC and granted to pg_read_all_stats
/// (sql/stats.sql): the totals cover every role. PARALLEL UNSAFE: see below.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "usage_totals"(
	OUT "active" bigint, OUT "retained" bigint, OUT "ledger_rows" bigint
) RETURNS SETOF record
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'usage_totals_wrapper';
"#
)]
fn usage_totals() -> TableIterator<
    'static,
    (
        name!(active, i64),
        name!(retained, i64),
        name!(ledger_rows, i64),
    ),
> {
    // It reads the latest committed state, which a parallel worker (or a leader in
    // parallel mode) cannot take: 25000, as start() refuses there, rather than XX000.
    crate::shmem::require_callable(c"quota.usage_totals()");
    let t = crate::stats::usage_totals();
    TableIterator::once((t.active, t.retained, t.ledger_rows))
}

/// Empties quota.stats: the rows of `role` in every database, or, with NULL, every
/// row and quota.stats_info's figures. EXECUTE is revoked from PUBLIC.
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "stats_reset"(
	"role" regrole DEFAULT NULL
) RETURNS timestamptz
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stats_reset_wrapper';
"#
)]
fn stats_reset(role: Option<pg_sys::Oid>) -> pgrx::datum::TimestampWithTimeZone {
    crate::shmem::require_preloaded();
    tstz(crate::stats::reset(role))
}

/// quota.wait_histogram: per (database, role) the caller may see, the waits that ended
/// within each bound, cumulative (the last bound is infinity), as Prometheus buckets.
#[pg_extern(
    volatile,
    parallel_safe,
    sql = r#"
CREATE FUNCTION "wait_histogram_rows"(
	OUT "dbid" oid, OUT "roleid" oid, OUT "le" double precision, OUT "waits" bigint
) RETURNS SETOF record
VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'wait_histogram_rows_wrapper';
"#
)]
fn wait_histogram_rows() -> TableIterator<
    'static,
    (
        name!(dbid, pg_sys::Oid),
        name!(roleid, pg_sys::Oid),
        name!(le, f64),
        name!(waits, i64),
    ),
> {
    use crate::core::stats::WAIT_BUCKETS_MS;
    let rows = visible_stats();
    TableIterator::new(rows.into_iter().flat_map(|r| {
        let bounds = WAIT_BUCKETS_MS.into_iter().chain([f64::INFINITY]);
        let mut sum = 0i64;
        bounds
            .zip(r.wait_buckets)
            .map(move |(le, n)| {
                sum += n as i64;
                (pg_sys::Oid::from(r.db), pg_sys::Oid::from(r.role), le, sum)
            })
            .collect::<Vec<_>>()
    }))
}

/// 0.7.0: a tenant's own limits, in place of its role's quota.max_active_per_tenant
/// and quota.max_retained_per_tenant (NULL: the role's setting; 0: no limit; both NULL
/// removes them), from the calling transaction's commit on (tenant_limits.rs).
#[pg_extern(
    volatile,
    parallel_unsafe,
    sql = r#"
CREATE FUNCTION "set_tenant_limits"(
	"tenant" TEXT,
	"max_active" INT DEFAULT NULL,
	"max_retained" INT DEFAULT NULL,
	"role" regrole DEFAULT CURRENT_USER::pg_catalog.regrole
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'set_tenant_limits_wrapper';
"#
)]
fn set_tenant_limits(
    tenant: Option<&[u8]>,
    max_active: Option<i32>,
    max_retained: Option<i32>,
    role: Option<pg_sys::Oid>,
) {
    boundary(|| {
        crate::tenant_limits::set(&crate::tenant_limits::Request {
            tenant,
            max_active,
            max_retained,
            role,
        })
    })
}

/// 0.7.0: the statement trigger of quota.tenant_overrides. Whoever wrote it (the
/// function above, a superuser, a restore), every backend's cache of tenants' limits
/// is invalidated when the write commits (ledger/overrides.rs).
#[pg_guard]
#[no_mangle]
#[doc(hidden)]
pub unsafe extern "C-unwind" fn tenant_overrides_written_wrapper(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    // SAFETY: PostgreSQL's fcinfo for this call; its context is a TriggerData exactly
    // when the trigger manager calls, whose relation is open.
    unsafe {
        let context = (*fcinfo).context;
        if context.is_null() || (*context).type_ != pg_sys::NodeTag::T_TriggerData {
            // PostgreSQL refuses to call a trigger function otherwise.
            pgrx::error!("quota.tenant_overrides_written() can only be called as a trigger");
        }
        let data = &*(context as *const pg_sys::TriggerData);
        pg_sys::CacheInvalidateRelcacheByRelid((*data.tg_relation).rd_id);
    }
    crate::ledger::overrides::written();
    pg_sys::Datum::from(0)
}

/// PG_FUNCTION_INFO_V1(tenant_overrides_written_wrapper).
#[no_mangle]
#[doc(hidden)]
pub extern "C" fn pg_finfo_tenant_overrides_written_wrapper() -> &'static pg_sys::Pg_finfo_record {
    const V1_API: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1_API
}

extension_sql!(
    r#"
CREATE FUNCTION quota.tenant_overrides_written() RETURNS trigger
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'tenant_overrides_written_wrapper';
REVOKE ALL ON FUNCTION quota.tenant_overrides_written() FROM PUBLIC;
CREATE TRIGGER tenant_overrides_written
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON quota.tenant_overrides
    FOR EACH STATEMENT EXECUTE FUNCTION quota.tenant_overrides_written();
-- Also under session_replication_role = replica (a restore with --disable-triggers
-- aside, which a superuser chooses).
ALTER TABLE quota.tenant_overrides ENABLE ALWAYS TRIGGER tenant_overrides_written;
REVOKE ALL ON FUNCTION quota.set_tenant_limits(text, integer, integer, regrole) FROM PUBLIC;
"#,
    name = "tenant_overrides",
    requires = ["schema", set_tenant_limits]
);
