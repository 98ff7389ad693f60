//! Layer 1: maps the pure core's [`QuotaError`] onto PostgreSQL's error reports, keeping the
//! SQLSTATE, DETAIL and HINT that the core chose.
//!
//! 0.5.2: the text goes out in the server encoding, as PostgreSQL's own messages do
//! (encoding.rs). pgrx's reports carry Rust strings, whose bytes PostgreSQL then takes
//! for server-encoded text: a LATIN1 database's `café` reached a UTF-8 client as
//! `cafï¿½`. So the SQL functions run inside `boundary`, and an error raised there is
//! reported with the server's bytes by `report` once the Rust frames between have
//! unwound. Elsewhere (hooks, the ledger writer) pgrx reports it as before.

use std::any::Any;
use std::cell::Cell;
use std::ffi::{c_char, c_int, CStr};

use pgrx::pg_sys;
use pgrx::pg_sys::panic::{CaughtError, ErrorReport};
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
        Sqlstate::TriggerProtocolViolated => {
            PgSqlErrorCode::ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED
        }
        Sqlstate::UndefinedColumn => PgSqlErrorCode::ERRCODE_UNDEFINED_COLUMN,
        Sqlstate::DatatypeMismatch => PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH,
        Sqlstate::InvalidTextRepresentation => PgSqlErrorCode::ERRCODE_INVALID_TEXT_REPRESENTATION,
        Sqlstate::UndefinedObject => PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
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

/// Runs `f`, the body of an SQL function, and raises what it fails with (its Err, a
/// `raise` anywhere below it, or an ERROR of PostgreSQL's that pgrx caught there) with
/// the server's bytes. Every other panic goes on to pgrx's guard unchanged.
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
    let out = match outcome {
        Ok(Ok(v)) => return v,
        Ok(Err(e)) => Outgoing::from(e),
        Err(payload) => match outgoing(payload) {
            Ok(out) => out,
            Err(other) => std::panic::resume_unwind(other),
        },
    };
    let texts = out.palloc();
    drop(out);
    // SAFETY: every Rust value of this call and of `f` is dropped by now (the texts are
    // palloc'd, and the aborting transaction frees them); the frames the ERROR's
    // longjmp leaves are this one's and pgrx's guard's, as pgrx's own ereport leaves.
    unsafe { report(pg_sys::PGERROR as c_int, texts) };
    unreachable!("ERROR does not return")
}

/// An ERROR as `boundary` raises it.
struct Outgoing {
    sqlstate: c_int,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
}

impl From<QuotaError> for Outgoing {
    fn from(e: QuotaError) -> Self {
        Outgoing {
            sqlstate: errcode(e.sqlstate()) as c_int,
            message: e.to_string(),
            detail: e.detail(),
            hint: e.hint(),
        }
    }
}

impl Outgoing {
    /// Its texts in the server encoding, palloc'd (see `report`).
    fn palloc(&self) -> Texts {
        Texts {
            sqlstate: self.sqlstate,
            message: palloc_server(&self.message),
            detail: self.detail.as_deref().map(palloc_server),
            hint: self.hint.as_deref().map(palloc_server),
        }
    }
}

/// What `boundary` raises for a panic: the QuotaError a `raise` unwound with, as it
/// was raised or as pgrx's PgTryBuilder passes on a panic it did not handle (or one its
/// handler raised), wrapped in CaughtError::RustPanic; or an ERROR that pgrx caught
/// (PostgreSQL's, whose text pgrx keeps only where it is valid UTF-8, or its own) whose
/// text is not the same in the server encoding: pgrx would send its UTF-8 bytes for the
/// server's. Anything else (a Rust panic, an ERROR pgrx reports as it is, with its
/// source location) is given back to unwind on.
fn outgoing(payload: Box<dyn Any + Send>) -> Result<Outgoing, Box<dyn Any + Send>> {
    let payload = match payload.downcast::<Raised>() {
        Ok(r) => return Ok(Outgoing::from(r.0)),
        Err(p) => p,
    };
    let caught = *payload.downcast::<CaughtError>()?;
    match caught {
        CaughtError::RustPanic { ereport, payload } => match payload.downcast::<Raised>() {
            Ok(r) => Ok(Outgoing::from(r.0)),
            Err(payload) => Err(Box::new(CaughtError::RustPanic { ereport, payload })),
        },
        CaughtError::PostgresError(ref r) | CaughtError::ErrorReport(ref r)
            if r.level() == pgrx::PgLogLevel::ERROR
                && [Some(r.message()), r.detail(), r.hint()]
                    .into_iter()
                    .flatten()
                    .any(|t| to_server(t) != t.as_bytes()) =>
        {
            Ok(Outgoing {
                sqlstate: r.sql_error_code() as c_int,
                message: r.message().to_string(),
                detail: r.detail().map(str::to_string),
                hint: r.hint().map(str::to_string),
            })
        }
        other => Err(Box::new(other)),
    }
}

/// Writes `line` to the server log only, in the server encoding: a refusal's line.
pub fn log_server_only(line: &str) {
    log_line(
        pg_sys::LOG_SERVER_ONLY,
        PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
        line,
    );
}

/// Writes `line` at `level` (below ERROR: LOG, WARNING, …) with `sqlstate`, in the
/// server encoding. May be called anywhere: a message below ERROR does not longjmp,
/// and interrupts are held while it is written (errfinish checks for them at the end,
/// and a cancel or terminate there would raise straight over the Rust frames below
/// us; it is served at the next CHECK_FOR_INTERRUPTS instead).
pub fn log_line(level: u32, sqlstate: PgSqlErrorCode, line: &str) {
    debug_assert!(level < pg_sys::PGERROR);
    let texts = Texts {
        sqlstate: sqlstate as c_int,
        message: palloc_server(line),
        detail: None,
        hint: None,
    };
    report_below_error(level as c_int, texts);
}

/// `report` at a level below ERROR, which returns, with interrupts held while it is
/// written (see `log_line`).
fn report_below_error(level: c_int, texts: Texts) {
    debug_assert!(level < pg_sys::PGERROR as c_int);
    // SAFETY: HOLD_INTERRUPTS/RESUME_INTERRUPTS, as PostgreSQL's macros do it; below
    // ERROR, report returns.
    unsafe {
        pg_sys::InterruptHoldoffCount += 1;
        report(level, texts);
        pg_sys::InterruptHoldoffCount -= 1;
    }
}

/// Reports `e` as a WARNING, with its SQLSTATE, DETAIL and HINT, and returns: for what
/// a statement should go on past (quota.finish_job()'s rows whose ticket it cannot
/// finish). Interrupts are held while it is written, as in `log_line`. Its texts are
/// made ASCII (core::ticket::ascii_escaped): a WARNING is converted to the client's
/// encoding as it is sent, and a character that encoding lacks would raise an ERROR
/// from inside errfinish, over the Rust frames of the caller.
pub fn warn(e: &QuotaError) {
    let ascii = |t: &str| crate::core::ticket::ascii_escaped(t, usize::MAX);
    let mut out = Outgoing::from(e.clone());
    out.message = ascii(&out.message);
    out.detail = out.detail.as_deref().map(ascii);
    out.hint = out.hint.as_deref().map(ascii);
    let texts = out.palloc();
    drop(out);
    report_below_error(pg_sys::WARNING as c_int, texts);
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

/// An error's texts in the server encoding, palloc'd C strings.
struct Texts {
    sqlstate: c_int,
    message: *mut c_char,
    detail: Option<*mut c_char>,
    hint: Option<*mut c_char>,
}

/// ereport(`level`, errcode(…), errmsg_internal("%s", …), …) with the bytes as they are;
/// the texts are freed once copied.
///
/// # Safety
/// At ERROR and above it does not return: nothing may be left on the Rust frames it
/// jumps over that needs dropping.
unsafe fn report(level: c_int, t: Texts) {
    const PERCENT_S: &CStr = c"%s";
    // SAFETY: the caller's promise; each err*() call copies its text into the error
    // being built, so it may be freed right after.
    unsafe {
        if !errstart(level, std::ptr::null()) {
            for p in [Some(t.message), t.detail, t.hint].into_iter().flatten() {
                pg_sys::pfree(p.cast());
            }
            return;
        }
        pg_errcode(t.sqlstate);
        errmsg_internal(PERCENT_S.as_ptr(), t.message);
        pg_sys::pfree(t.message.cast());
        if let Some(d) = t.detail {
            errdetail_internal(PERCENT_S.as_ptr(), d);
            pg_sys::pfree(d.cast());
        }
        if let Some(h) = t.hint {
            errhint(PERCENT_S.as_ptr(), h);
            pg_sys::pfree(h.cast());
        }
        // No source location (PG_FUNCNAME_MACRO may be NULL too): it would name this
        // function every time, and VERBOSE clients would see a line number that moves
        // with each edit.
        errfinish(std::ptr::null(), 0, std::ptr::null());
    }
}
