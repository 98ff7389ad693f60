//! Layer 1: maps the pure core's [`QuotaError`] onto PostgreSQL's error reports, keeping the
//! SQLSTATE, DETAIL and HINT that the core chose.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::PgSqlErrorCode;

use crate::core::{QuotaError, Sqlstate};

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

/// Raises `e` as an ERROR. For code paths that cannot return a `Result`.
pub fn raise(e: QuotaError) -> ! {
    ErrorReport::from(e).report(pgrx::PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}
