//! Layer 1: maps the pure core's [`QuotaError`] onto PostgreSQL's error reports, keeping the
//! SQLSTATE, DETAIL and HINT that the core chose.
//!
//! 0.5.2: the text goes out in the server encoding, as PostgreSQL's own messages do
//! (encoding.rs). pgrx's reports carry Rust strings, whose bytes PostgreSQL then takes
//! for server-encoded text: a LATIN1 database's `café` reached a UTF-8 client as
//! `cafï¿½`. So the SQL functions run inside `boundary`, and an error raised there is
//! reported with the server's bytes by `report` once the Rust frames between have
//! unwound. Elsewhere (hooks, the ledger writer) pgrx reports it as before.

use std::cell::Cell;
use std::ffi::{c_char, c_int, CStr};

use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::PgSqlErrorCode;

use crate::core::{QuotaError, Sqlstate};
use crate::encoding::to_server;

fn errcode(s: Sqlstate) -> PgSqlErrorCode {
    match s {
        Sqlstate::ConfigurationLimitExceeded => {
            PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED
        }
        Sqlstate::StringDataRightTruncation => PgSqlErrorCode::ERRCODE_STRING_DATA_RIGHT_TRUNCATION,
        Sqlstate::NullValueNotAllowed => PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
        Sqlstate::InvalidParameterValue => PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
        Sqlstate::InsufficientPrivilege => PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
        Sqlstate::ObjectNotInPrerequisiteState => {
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE
        }
        Sqlstate::InsufficientResources => PgSqlErrorCode::ERRCODE_INSUFFICIENT_RESOURCES,
        Sqlstate::OperatorIntervention => PgSqlErrorCode::ERRCODE_OPERATOR_INTERVENTION,
        Sqlstate::LockNotAvailable => PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE,
        Sqlstate::FeatureNotSupported => PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
        Sqlstate::DependentObjectsStillExist => {
            PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST
        }
        Sqlstate::DuplicateSchema => PgSqlErrorCode::ERRCODE_DUPLICATE_SCHEMA,
        Sqlstate::StatementCompletionUnknown => {
            PgSqlErrorCode::ERRCODE_T_R_STATEMENT_COMPLETION_UNKNOWN
        }
        Sqlstate::Raised(code) => PgSqlErrorCode::from(code),
    }
}

impl From<QuotaError> for ErrorReport {
    fn from(e: QuotaError) -> Self {
        let mut report = ErrorReport::new(errcode(e.sqlstate()), e.to_string(), "pg_quota");
        if let Some(detail) = e.detail() {
            report = report.set_detail(detail);
        }
        if let Some(hint) = e.hint() {
            report = report.set_hint(hint);
        }
        report
    }
}

thread_local! {
    /// How many `boundary` calls are running in this backend (single-threaded).
    static INSIDE: Cell<u32> = const { Cell::new(0) };
}

/// The payload a `raise` inside a `boundary` unwinds with.
struct Raised(QuotaError);

/// Raises `e` as an ERROR. For code paths that cannot return a `Result`.
pub fn raise(e: QuotaError) -> ! {
    if INSIDE.get() > 0 {
        std::panic::panic_any(Raised(e));
    }
    ErrorReport::from(e).report(pgrx::PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}

/// Runs `f`, the body of an SQL function, and raises what it fails with (its Err, or a
/// `raise` anywhere below it) with the server's bytes. Every other panic, a PostgreSQL
/// error caught by pgrx among them, goes on to pgrx's guard unchanged.
pub fn boundary<T>(f: impl FnOnce() -> Result<T, QuotaError>) -> T {
    struct Inside;
    impl Drop for Inside {
        fn drop(&mut self) {
            INSIDE.set(INSIDE.get() - 1);
        }
    }
    let outcome = {
        INSIDE.set(INSIDE.get() + 1);
        let _inside = Inside;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
    };
    let e = match outcome {
        Ok(Ok(v)) => return v,
        Ok(Err(e)) => e,
        Err(payload) => match payload.downcast::<Raised>() {
            Ok(raised) => raised.0,
            Err(other) => std::panic::resume_unwind(other),
        },
    };
    let sqlstate = errcode(e.sqlstate()) as c_int;
    let message = palloc_server(&e.to_string());
    let detail = e.detail().map(|d| palloc_server(&d));
    let hint = e.hint().map(|h| palloc_server(&h));
    drop(e);
    // SAFETY: every Rust value of this call and of `f` is dropped by now (the texts are
    // palloc'd, and the aborting transaction frees them); the frames the ERROR's
    // longjmp leaves are this one's and pgrx's guard's, as pgrx's own ereport leaves.
    unsafe { report(pg_sys::PGERROR as c_int, sqlstate, message, detail, hint) };
    unreachable!("ERROR does not return")
}

/// Writes `line` to the server log only, in the server encoding. A LOG does not
/// return through a longjmp, so this may be called anywhere.
pub fn log_server_only(line: &str) {
    let line = palloc_server(line);
    // SAFETY: LOG_SERVER_ONLY returns normally; `report` frees the text.
    unsafe {
        report(
            pg_sys::LOG_SERVER_ONLY as c_int,
            PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED as c_int,
            line,
            None,
            None,
        )
    };
}

/// `text` in the server encoding, as a C string in the current memory context (a NUL
/// in it, which no text datum can hold, ends it).
fn palloc_server(text: &str) -> *mut c_char {
    let bytes = to_server(text);
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    // SAFETY: palloc0 gives len + 1 zeroed bytes; we copy len of them.
    unsafe {
        let p = pg_sys::palloc0(len + 1).cast::<u8>();
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, len);
        p.cast()
    }
}

// PostgreSQL's ereport() pieces, declared here as pgrx declares them for its own
// ereport (they are left out of its bindings). Called directly, not through pgrx's
// FFI guard, which would turn the ERROR into a Rust panic carrying the text as a Rust
// string again.
unsafe extern "C-unwind" {
    fn errstart(elevel: c_int, domain: *const c_char) -> bool;
    fn errfinish(filename: *const c_char, lineno: c_int, funcname: *const c_char);
    #[link_name = "errcode"]
    fn pg_errcode(sqlerrcode: c_int) -> c_int;
    fn errmsg_internal(fmt: *const c_char, ...) -> c_int;
    fn errdetail_internal(fmt: *const c_char, ...) -> c_int;
    fn errhint(fmt: *const c_char, ...) -> c_int;
}

/// ereport(`level`, errcode(`sqlstate`), errmsg("%s", `message`), …) with the bytes
/// as they are; the texts (from `palloc_server`) are freed once copied.
///
/// # Safety
/// The texts are palloc'd C strings. At ERROR and above it does not return: nothing
/// may be left on the Rust frames it jumps over that needs dropping.
unsafe fn report(
    level: c_int,
    sqlstate: c_int,
    message: *mut c_char,
    detail: Option<*mut c_char>,
    hint: Option<*mut c_char>,
) {
    const PERCENT_S: &CStr = c"%s";
    // SAFETY: the caller's promise; each err*() call copies its text into the error
    // being built, so it may be freed right after.
    unsafe {
        if !errstart(level, std::ptr::null()) {
            for p in [Some(message), detail, hint].into_iter().flatten() {
                pg_sys::pfree(p.cast());
            }
            return;
        }
        pg_errcode(sqlstate);
        errmsg_internal(PERCENT_S.as_ptr(), message);
        pg_sys::pfree(message.cast());
        if let Some(d) = detail {
            errdetail_internal(PERCENT_S.as_ptr(), d);
            pg_sys::pfree(d.cast());
        }
        if let Some(h) = hint {
            errhint(PERCENT_S.as_ptr(), h);
            pg_sys::pfree(h.cast());
        }
        errfinish(c"error.rs".as_ptr(), line!() as c_int, c"pg_quota".as_ptr());
    }
}
