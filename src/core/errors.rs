//! Every error pg_quota raises, with its SQLSTATE, message, detail and hint, written in
//! PostgreSQL's style: lowercase messages, numbers in DETAIL, the fix in HINT.

use super::decision::{Refusal, RefusalKind};
use super::refusals::{count_of, refusal_message};

/// The SQLSTATEs pg_quota uses, each from PostgreSQL's table of error codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sqlstate {
    /// 53400: a start refused at a limit (I8).
    ConfigurationLimitExceeded,
    /// 22001: a label over 200 characters.
    StringDataRightTruncation,
    /// 22004: a NULL where a value is required.
    NullValueNotAllowed,
    /// 22023: an unknown ticket or outcome.
    InvalidParameterValue,
    /// 42501: someone else's ticket.
    InsufficientPrivilege,
    /// 55000: the library was not preloaded, or the extension is missing.
    ObjectNotInPrerequisiteState,
    /// 53000: no background worker slot for the ledger writer.
    InsufficientResources,
    /// 57000: the ledger writer went away before it answered.
    OperatorIntervention,
    /// 55P03: a table pg_quota needs is locked by maintenance for too long.
    LockNotAvailable,
    /// 0A000: an index, constraint or trigger on pg_quota's tables that it cannot
    /// maintain or honour.
    FeatureNotSupported,
    /// 2BP01: dropping a trigger that pg_quota's tables rely on.
    DependentObjectsStillExist,
    /// 42P06: CREATE EXTENSION into a schema "quota" that pg_quota cannot trust.
    DuplicateSchema,
    /// 40003: the writer committed a charge but stopped before synchronous replication
    /// confirmed it.
    StatementCompletionUnknown,
    /// 39P01: quota.finish_job() fired other than AFTER UPDATE or DELETE FOR EACH ROW
    /// (0.6.0).
    TriggerProtocolViolated,
    /// 42703: the column a quota.finish_job() trigger names is not in its table.
    UndefinedColumn,
    /// 42804: the column a quota.finish_job() trigger names cannot hold a ticket.
    DatatypeMismatch,
    /// 22P02: a job's ticket that is not a uuid.
    InvalidTextRepresentation,
    /// 42704: a role (given by OID) that does not exist (0.7.0).
    UndefinedObject,
    /// The SQLSTATE of an error PostgreSQL raised in the ledger writer, relayed to the
    /// caller, as PostgreSQL packs it (MAKE_SQLSTATE: six bits a character).
    Raised(i32),
}

impl Sqlstate {
    pub fn code(self) -> String {
        let code = match self {
            Sqlstate::Raised(packed) => {
                return (0..5)
                    .map(|i| char::from(b'0' + ((packed >> (6 * i)) & 0x3F) as u8))
                    .collect()
            }
            Sqlstate::ConfigurationLimitExceeded => "53400",
            Sqlstate::StringDataRightTruncation => "22001",
            Sqlstate::NullValueNotAllowed => "22004",
            Sqlstate::InvalidParameterValue => "22023",
            Sqlstate::InsufficientPrivilege => "42501",
            Sqlstate::ObjectNotInPrerequisiteState => "55000",
            Sqlstate::InsufficientResources => "53000",
            Sqlstate::OperatorIntervention => "57000",
            Sqlstate::LockNotAvailable => "55P03",
            Sqlstate::FeatureNotSupported => "0A000",
            Sqlstate::DependentObjectsStillExist => "2BP01",
            Sqlstate::DuplicateSchema => "42P06",
            Sqlstate::StatementCompletionUnknown => "40003",
            Sqlstate::TriggerProtocolViolated => "39P01",
            Sqlstate::UndefinedColumn => "42703",
            Sqlstate::DatatypeMismatch => "42804",
            Sqlstate::InvalidTextRepresentation => "22P02",
            Sqlstate::UndefinedObject => "42704",
        };
        code.to_string()
    }
}

/// pg_quota's two trigger functions for a job queue's table (0.6.0): which one an
/// error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobFn {
    /// quota.finish_job(): finishes the job's ticket when the queue ends the job.
    Finish,
    /// quota.claim_job(): renews the job's ticket when the queue claims the job.
    Claim,
}

impl JobFn {
    /// The verb for what it does to a ticket, as in "permission denied to renew".
    pub fn action(self) -> &'static str {
        match self {
            JobFn::Finish => "finish",
            JobFn::Claim => "renew",
        }
    }

    /// How it is called, for the hints of its errors.
    fn usage(self) -> &'static str {
        match self {
            JobFn::Finish => "Its arguments are the ticket's column (uuid or text, or json or jsonb with the keys to follow, as in 'args->ticket', with no spaces around ->) and, optionally, the outcome (succeeded, failed or cancelled; succeeded by default).",
            JobFn::Claim => "Its arguments are the ticket's column (uuid or text, or jsonb with the keys to follow, as in 'args->ticket', with no spaces around ->; not a domain) and the lease a claimed job's ticket gets from the claim (an interval of a second or more, as in '5 minutes').",
        }
    }

    /// How a trigger of it must be created, for the hint of TriggerMisfired.
    fn timing(self) -> &'static str {
        match self {
            JobFn::Finish => "Create it as CREATE TRIGGER name AFTER UPDATE OR DELETE ON table FOR EACH ROW, with a WHEN clause for the rows whose job has ended.",
            JobFn::Claim => "Create it as CREATE TRIGGER name BEFORE UPDATE ON table FOR EACH ROW, with a WHEN clause for the rows the queue claims.",
        }
    }
}

impl std::fmt::Display for JobFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JobFn::Finish => "quota.finish_job()",
            JobFn::Claim => "quota.claim_job()",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    /// I8: a start refused at a limit.
    #[error("{}", refusal_message(.role, .tenant.as_deref(), .database, .refusal, *.tenant_limit_set))]
    Refused {
        role: String,
        /// The start's tenant, named in refusals at a tenant's limits (0.5.0), as the
        /// caller passed it (in the server encoding, shown lossily).
        tenant: Option<String>,
        /// The database, named in refusals at quota.max_active_per_database.
        database: String,
        refusal: Refusal,
        /// At a retained limit, when capacity returns (already formatted), if aging out
        /// alone brings it back: when the oldest retained ticket ages out, or (0.7.0)
        /// when enough units have.
        next_ageout: Option<String>,
        /// How capacity returns at a retained limit (0.7.0; see lease::capacity).
        age_out: super::lease::AgeOut,
        /// At quota.max_retained_per_role, where the limit is its default because
        /// nothing sets it for the role: the role as an SQL identifier, for the hint
        /// (0.6.0: a queue's jobs stopped after a week's 10,000 with no word of why).
        default_retained_for: Option<String>,
        /// At a tenant's limit, whether quota.set_tenant_limits() set it for the tenant
        /// (0.7.0), in place of the role's quota.max_*_per_tenant.
        tenant_limit_set: bool,
    },
    /// A label of `chars` characters, of at most `max` (core::ticket says how many).
    #[error("label is too long")]
    LabelTooLong { chars: usize, max: usize },
    #[error("idempotency key is too long")]
    KeyTooLong { chars: usize, max: usize },
    #[error("tenant is too long")]
    TenantTooLong { chars: usize, max: usize },
    /// `start(…, transactional => true)` where quota.allow_transactional is off for the
    /// charged role (0.5.0).
    #[error("transactional starts are not allowed for role \"{role}\"")]
    TransactionalNotAllowed { role: String },
    /// A writer-committed start repeating the idempotency key of a transactional start
    /// of its own transaction, not committed yet (0.5.0): its ticket could vanish with
    /// a rollback, which a writer-committed start promises it never does.
    #[error("idempotency key names a transactional ticket of this transaction, not committed yet")]
    KeyHeldUncommitted,
    /// A transactional charge found no scope counter it could hold (every counter of
    /// its window holds open charges already).
    #[error("no scope counter is free for a transactional charge")]
    NoCounter,
    /// A lease or wait that is not a positive (lease) or non-negative (wait) interval.
    #[error("invalid {what} \"{value}\"")]
    InvalidInterval { what: &'static str, value: String },
    /// renew() of a ticket that has ended: finished, or its lease ran out.
    #[error("ticket {ticket} has {}", if *.expired { "expired" } else { "already ended" })]
    TicketEnded { ticket: String, expired: bool },
    /// A 0.2.0 feature used while the database still has an older pg_quota schema.
    #[error("{feature} needs the schema of pg_quota {needs} or later")]
    NeedsUpdate {
        feature: &'static str,
        needs: &'static str,
    },
    #[error("{0} must not be null")]
    NullArgument(&'static str),
    /// 0.7.0: a weight below 1 or above 1,000,000 (core::weights).
    #[error("invalid weight {value}")]
    InvalidWeight { value: i64 },
    /// 0.7.0: a start of a weight above an active limit that applies to it.
    #[error("{}", .0.message())]
    WeightNeverFits(super::weights::NeverFits),
    /// 0.7.0: a weighted start() or try_start() by a role that may not execute the
    /// plain one (api::require_plain_execute).
    #[error("permission denied for function quota.{function}(text, interval, text, interval, text, boolean)")]
    PlainNotExecutable { function: String },
    /// 0.7.0: an idempotent repeat of a ticket with another weight.
    #[error("idempotency key names ticket {ticket}, of weight {held}, not {asked}")]
    WeightMismatch {
        ticket: String,
        held: i64,
        asked: i64,
    },
    /// quota.set_tenant_limits() with a limit below 0 or above 1,000,000 (0.7.0).
    #[error("invalid {what} {value}")]
    InvalidLimit { what: &'static str, value: i64 },
    /// quota.set_tenant_limits() for a role that does not exist (given by OID).
    #[error("role with OID {0} does not exist")]
    UnknownRole(u32),
    /// quota.set_tenant_limits() for the tenants of a role the caller is not a member
    /// of (0.7.0).
    #[error("permission denied to set the limits of tenants of role \"{role}\"")]
    ForeignTenantLimits { role: String },
    #[error("invalid outcome \"{0}\"")]
    InvalidOutcome(String),
    #[error("ticket {0} does not exist")]
    UnknownTicket(String),
    /// The message and its detail never name the ticket's owner: holding a uuid
    /// must not tell anyone which role it belongs to.
    #[error("permission denied to {action} ticket {ticket}")]
    ForeignTicket {
        ticket: String,
        /// "finish" or "renew".
        action: &'static str,
    },
    /// quota.finish_job() or quota.claim_job() with arguments it cannot use (0.6.0).
    #[error("invalid arguments for {func} in trigger \"{trigger}\"")]
    TriggerArguments {
        func: JobFn,
        trigger: String,
        why: String,
    },
    /// quota.finish_job() or quota.claim_job() called as a function, not as a trigger.
    #[error("{0} can only be called as a trigger")]
    NotCalledAsTrigger(JobFn),
    /// quota.finish_job() fired other than AFTER UPDATE or DELETE, FOR EACH ROW: a
    /// BEFORE trigger could finish the ticket of a change that a later trigger skips.
    /// quota.claim_job() fired other than BEFORE UPDATE, FOR EACH ROW: it changes the
    /// row it renews the ticket of.
    #[error("trigger \"{trigger}\": {func} must be fired {}", match .func {
        JobFn::Finish => "AFTER UPDATE or DELETE, FOR EACH ROW",
        JobFn::Claim => "BEFORE UPDATE, FOR EACH ROW",
    })]
    TriggerMisfired { func: JobFn, trigger: String },
    /// The column a job trigger reads the ticket from is not there.
    #[error("column \"{column}\" of relation \"{relation}\" does not exist")]
    TicketColumnMissing {
        func: JobFn,
        trigger: String,
        column: String,
        relation: String,
    },
    /// The column a job trigger reads the ticket from has a type that holds no ticket
    /// (with keys: not json or jsonb, and for quota.claim_job(), which writes it, not
    /// jsonb; without: not uuid or text).
    #[error("column \"{column}\" of type {type_name} cannot hold a ticket for {func}")]
    TicketColumnType {
        func: JobFn,
        trigger: String,
        column: String,
        type_name: String,
    },
    /// The column a quota.finish_job() trigger reads the ticket from is a virtual
    /// generated column (PostgreSQL 18), which triggers do not see.
    #[error("column \"{column}\" is a virtual generated column, which {func} cannot read")]
    TicketColumnVirtual {
        func: JobFn,
        trigger: String,
        column: String,
    },
    /// The column a quota.claim_job() trigger reads the ticket from is one the trigger
    /// could not clear a ticket in: a uuid or text column declared NOT NULL (`generated`
    /// false), or a generated column, which PostgreSQL computes again after BEFORE
    /// triggers (`generated` true).
    #[error("quota.claim_job() cannot clear a ticket in column \"{column}\": it is {}", if *.generated { "a generated column" } else { "NOT NULL" })]
    TicketColumnNotNull {
        trigger: String,
        column: String,
        generated: bool,
    },
    /// A job's ticket that the role firing a job trigger may not finish or renew (a
    /// WARNING). As for ForeignTicket, nothing names the ticket's owner.
    #[error("permission denied to {} ticket {ticket}", .func.action())]
    JobTicketForeign {
        func: JobFn,
        trigger: String,
        ticket: String,
        firing_role: String,
    },
    /// A job's ticket, read by a job trigger, that is not a uuid.
    #[error("invalid input syntax for type uuid: \"{value}\"")]
    TicketNotUuid {
        func: JobFn,
        trigger: String,
        path: String,
        value: String,
    },
    #[error("pg_quota must be loaded via shared_preload_libraries")]
    NotPreloaded,
    /// 0.7.1: a tenant's start on a Citus node that does not hold the tenant (core::citus).
    #[error("{0}")]
    TenantElsewhere(Box<super::citus::Elsewhere>),
    /// 0.7.1: a start waited for a Citus shard move or split on this node (core::citus).
    #[error("could not obtain pg_quota's lock on shard {shard}")]
    ShardBusy { shard: i64, seconds: i64 },
    /// 0.7.1: a Citus shard move (or split) refused while a start for a tenant of the
    /// shard is in progress on the node that holds it (core::citus).
    #[error("{}", .change.busy_message(*.shard))]
    ShardMoveBusy {
        shard: i64,
        change: super::citus::ShardChange,
    },
    /// 0.7.1: pg_quota's start functions distributed in more than one colocation
    /// group, or by another argument than the tenant (core::citus).
    #[error("{}", super::citus::misdeclared_message(*.groups))]
    CitusMisdeclared { groups: i64 },
    /// 0.7.1: a Citus shard move off this node, or a split that places tenants on
    /// another, refused (core::citus).
    #[error("{0}")]
    ShardMoveRefused(Box<super::citus::MoveRefused>),
    #[error("could not start the pg_quota ledger writer")]
    NoWorkerSlot { waited_ms: u64 },
    #[error("the pg_quota ledger writer exited before it answered")]
    WriterGone,
    /// The writer's transaction failed for this request: PostgreSQL's error, relayed.
    #[error("pg_quota ledger writer failed: {message}")]
    WriterFailed { code: i32, message: String },
    /// The writer committed the charge on this server, but was stopped (terminated, or
    /// its postmaster died) while its commit waited for the synchronous standby, so
    /// the standby may not have it. PostgreSQL does not acknowledge its own commits in
    /// that case either.
    #[error(
        "the pg_quota ledger writer stopped before synchronous replication confirmed the charge"
    )]
    CommitUnconfirmed,
    /// The writer for this database exited before it could serve requests, again
    /// after a retry: it cannot connect, or it fails while starting.
    #[error("the pg_quota ledger writer for database \"{db}\" could not start")]
    WriterDidNotStart { db: String },
    #[error("could not obtain lock on relation \"{relation}\"")]
    LockTimeout { relation: String, seconds: i64 },
    /// quota.set_tenant_limits() waited for another change of tenants' limits whose
    /// transaction is still open (0.7.0).
    #[error("could not obtain the lock on the tenants' limits")]
    TenantLimitsBusy { seconds: i64 },
    /// The ledger writer waited for extension pg_quota's own lock, which a command
    /// dropping the extension holds or awaits (0.6.0, ledger::locks::lock_extension).
    #[error("could not obtain lock on extension \"pg_quota\"")]
    ExtensionLockTimeout { seconds: i64 },
    /// A relation pg_quota opens is not the one its extension created (I5: lookups
    /// cannot be redirected), or no longer has the columns pg_quota writes.
    #[error("relation \"{relation}\" is not a table of extension pg_quota")]
    NotExtensionMember { relation: String },
    #[error("relation \"{relation}\" does not have the columns pg_quota expects")]
    BadShape { relation: String, why: String },
    #[error("pg_quota cannot maintain {what} \"{index}\" on {table}")]
    UnsupportedIndex {
        table: String,
        index: String,
        what: &'static str,
    },
    /// A trigger on one of pg_quota's tables, which pg_quota's writes would never fire
    /// (see guard.rs).
    #[error("cannot create trigger \"{trigger}\" on table \"{table}\"")]
    TriggerRefused { table: String, trigger: String },
    /// 0.6.0: COPY into the view quota.ledger under session_replication_role = replica,
    /// where its INSTEAD OF trigger does not fire and every row would be dropped
    /// without an error (a restore of an older dump with --disable-triggers).
    #[error("cannot copy into the view quota.ledger while session_replication_role is replica")]
    LedgerCopyUnderReplica,
    /// CREATE EXTENSION pg_quota while a schema "quota" exists that a role other than
    /// a superuser owns (`owner`, quoted as an identifier).
    #[error(
        "schema \"quota\" already exists and is owned by role {owner}, which is not a superuser"
    )]
    SchemaNotOurs { owner: String },
    /// … that roles other than superusers may create objects in (`creators`, quoted).
    #[error("schema \"quota\" already exists and lets {creators} create objects in it")]
    SchemaOpen { creators: String },
    /// … that already holds objects.
    #[error("schema \"quota\" already exists and is not empty")]
    SchemaNotEmpty,
    /// DROP TRIGGER or ALTER TRIGGER … RENAME of one of pg_quota's own triggers.
    #[error("cannot {action} trigger \"{trigger}\" on table \"{table}\" because extension pg_quota requires it")]
    TriggerRequired {
        table: String,
        trigger: String,
        /// "drop" or "rename".
        action: &'static str,
    },
}

/// The table of the tenants' own limits (0.7.0), as errors name it.
const OVERRIDES_TABLE: &str = "quota.tenant_overrides";

impl QuotaError {
    pub fn sqlstate(&self) -> Sqlstate {
        match self {
            QuotaError::Refused { .. } => Sqlstate::ConfigurationLimitExceeded,
            QuotaError::LabelTooLong { .. }
            | QuotaError::KeyTooLong { .. }
            | QuotaError::TenantTooLong { .. } => Sqlstate::StringDataRightTruncation,
            QuotaError::TransactionalNotAllowed { .. } | QuotaError::PlainNotExecutable { .. } => {
                Sqlstate::InsufficientPrivilege
            }
            QuotaError::NoCounter => Sqlstate::InsufficientResources,
            QuotaError::KeyHeldUncommitted => Sqlstate::ObjectNotInPrerequisiteState,
            QuotaError::InvalidInterval { .. } => Sqlstate::InvalidParameterValue,
            QuotaError::TicketEnded { .. } | QuotaError::NeedsUpdate { .. } => {
                Sqlstate::ObjectNotInPrerequisiteState
            }
            QuotaError::NullArgument(_) => Sqlstate::NullValueNotAllowed,
            QuotaError::InvalidLimit { .. }
            | QuotaError::InvalidWeight { .. }
            | QuotaError::WeightMismatch { .. } => Sqlstate::InvalidParameterValue,
            QuotaError::WeightNeverFits(_) => Sqlstate::ConfigurationLimitExceeded,
            QuotaError::UnknownRole(_) => Sqlstate::UndefinedObject,
            QuotaError::ForeignTenantLimits { .. } => Sqlstate::InsufficientPrivilege,
            QuotaError::InvalidOutcome(_) | QuotaError::UnknownTicket(_) => {
                Sqlstate::InvalidParameterValue
            }
            QuotaError::ForeignTicket { .. } | QuotaError::JobTicketForeign { .. } => {
                Sqlstate::InsufficientPrivilege
            }
            QuotaError::TriggerArguments { .. } => Sqlstate::InvalidParameterValue,
            QuotaError::NotCalledAsTrigger(_) => Sqlstate::FeatureNotSupported,
            QuotaError::TriggerMisfired { .. } => Sqlstate::TriggerProtocolViolated,
            QuotaError::TicketColumnMissing { .. } => Sqlstate::UndefinedColumn,
            QuotaError::TicketColumnType { .. } | QuotaError::TicketColumnVirtual { .. } => {
                Sqlstate::DatatypeMismatch
            }
            QuotaError::TicketColumnNotNull { .. } => Sqlstate::ObjectNotInPrerequisiteState,
            QuotaError::TicketNotUuid { .. } => Sqlstate::InvalidTextRepresentation,
            QuotaError::NotPreloaded => Sqlstate::ObjectNotInPrerequisiteState,
            QuotaError::TenantElsewhere(_) => Sqlstate::FeatureNotSupported,
            QuotaError::ShardMoveRefused(_) => Sqlstate::ObjectNotInPrerequisiteState,
            QuotaError::CitusMisdeclared { .. } => Sqlstate::ObjectNotInPrerequisiteState,
            QuotaError::ShardBusy { .. } | QuotaError::ShardMoveBusy { .. } => {
                Sqlstate::LockNotAvailable
            }
            QuotaError::NoWorkerSlot { .. } => Sqlstate::InsufficientResources,
            QuotaError::WriterGone => Sqlstate::OperatorIntervention,
            QuotaError::WriterFailed { code, .. } => Sqlstate::Raised(*code),
            QuotaError::CommitUnconfirmed => Sqlstate::StatementCompletionUnknown,
            QuotaError::WriterDidNotStart { .. }
            | QuotaError::NotExtensionMember { .. }
            | QuotaError::BadShape { .. } => Sqlstate::ObjectNotInPrerequisiteState,
            QuotaError::LockTimeout { .. }
            | QuotaError::ExtensionLockTimeout { .. }
            | QuotaError::TenantLimitsBusy { .. } => Sqlstate::LockNotAvailable,
            QuotaError::SchemaNotOurs { .. }
            | QuotaError::SchemaOpen { .. }
            | QuotaError::SchemaNotEmpty => Sqlstate::DuplicateSchema,
            QuotaError::UnsupportedIndex { .. } | QuotaError::TriggerRefused { .. } => {
                Sqlstate::FeatureNotSupported
            }
            QuotaError::LedgerCopyUnderReplica => Sqlstate::ObjectNotInPrerequisiteState,
            QuotaError::TriggerRequired { action, .. } => {
                if *action == "drop" {
                    Sqlstate::DependentObjectsStillExist
                } else {
                    Sqlstate::FeatureNotSupported
                }
            }
        }
    }

    pub fn detail(&self) -> Option<String> {
        match self {
            QuotaError::Refused { refusal: r, .. } => {
                let counts = if r.kind == RefusalKind::Database {
                    format!(
                        "Active tickets in the database, all roles together: {}. Active tickets of this role: {}.",
                        count_of(r.usage.db_active, r.limits.max_db),
                        r.usage.active,
                    )
                } else if r.kind.is_tenant() {
                    format!(
                        "Active tickets of the tenant: {}. Retained tickets of the tenant: {}. Active tickets of its role: {}.",
                        count_of(r.usage.tenant_active, r.limits.tenant_active),
                        count_of(r.usage.tenant_retained, r.limits.tenant_retained),
                        count_of(r.usage.active, r.limits.max_active),
                    )
                } else {
                    format!(
                        "Active tickets: {}. Retained tickets: {}.",
                        count_of(r.usage.active, r.limits.max_active),
                        count_of(r.usage.retained, r.limits.max_retained),
                    )
                };
                let counts = match super::weights::refusal_detail(r.weight) {
                    Some(w) => format!("{counts} {w}"),
                    None => counts,
                };
                Some(match r.usage.ahead {
                    0 => counts,
                    1 => format!(
                        "{counts} 1 earlier start() is still waiting for capacity and goes first."
                    ),
                    n => format!(
                        "{counts} {n} earlier starts are still waiting for capacity and go first."
                    ),
                })
            }
            QuotaError::LabelTooLong { chars, max } => Some(format!(
                "The label has {chars} characters; at most {max} are allowed."
            )),
            QuotaError::KeyTooLong { chars, max } => Some(format!(
                "The key has {chars} characters; at most {max} are allowed."
            )),
            QuotaError::TenantTooLong { chars, max } => Some(format!(
                "The tenant has {chars} characters; at most {max} are allowed."
            )),
            QuotaError::TransactionalNotAllowed { .. } => Some(
                "A transactional charge is given back when its transaction rolls back, so work launched outside the transaction (dblink, postgres_fdw, an untrusted language) could run past the limit."
                    .to_string(),
            ),
            QuotaError::KeyHeldUncommitted => Some(
                "A start without transactional commits its charge on its own, and would return a ticket that a rollback of this transaction removes."
                    .to_string(),
            ),
            QuotaError::NoCounter => Some(
                "Every scope counter its scope may use holds uncommitted transactional charges of other scopes."
                    .to_string(),
            ),
            QuotaError::InvalidInterval { what, .. } => Some(if *what == "lease" {
                "A lease must be longer than zero.".to_string()
            } else {
                "A wait must not be negative.".to_string()
            }),
            QuotaError::TicketEnded { expired: true, .. } => Some(
                "Its lease ran out before it was renewed; it no longer counts as active."
                    .to_string(),
            ),
            QuotaError::InvalidWeight { .. } => {
                Some("A ticket weighs 1 to 1000000 units.".to_string())
            }
            QuotaError::ForeignTicket { .. } => {
                Some("The ticket belongs to another role.".to_string())
            }
            QuotaError::WriterDidNotStart { .. } => Some(
                "It exited before it connected to the database; the server log says why. No charge was recorded for this call."
                    .to_string(),
            ),
            QuotaError::LockTimeout { seconds, .. } => Some(format!(
                "pg_quota waited {seconds} s. Maintenance such as VACUUM FULL, CLUSTER, REINDEX or ALTER TABLE holds or awaits a conflicting lock on it."
            )),
            QuotaError::TenantLimitsBusy { seconds } => Some(format!(
                "pg_quota waited {seconds} s for another transaction that changed tenants' limits with quota.set_tenant_limits() and is still open: changes queue one behind another."
            )),
            QuotaError::ExtensionLockTimeout { seconds } => Some(format!(
                "The ledger writer waited {seconds} s. A command that drops the extension (DROP EXTENSION pg_quota, DROP OWNED BY its owner) holds or awaits a conflicting lock on it."
            )),
            QuotaError::BadShape { why, .. } => Some(format!("{why}.")),
            QuotaError::TriggerArguments { why, .. } => Some(why.clone()),
            QuotaError::TicketColumnNotNull { trigger, .. } => Some(format!(
                "Trigger \"{trigger}\" reads the job's ticket from it with quota.claim_job()."
            )),
            QuotaError::TicketColumnMissing { func, trigger, .. }
            | QuotaError::TicketColumnType { func, trigger, .. }
            | QuotaError::TicketColumnVirtual { func, trigger, .. } => Some(format!(
                "Trigger \"{trigger}\" reads the job's ticket from it with {func}."
            )),
            QuotaError::JobTicketForeign { func: JobFn::Finish, trigger, firing_role, .. } => Some(format!(
                "Trigger \"{trigger}\" fired as role \"{firing_role}\", which may not finish it, and finished nothing for that row."
            )),
            QuotaError::JobTicketForeign { func: JobFn::Claim, trigger, firing_role, .. } => Some(format!(
                "Trigger \"{trigger}\" fired as role \"{firing_role}\", which may not renew it, and cleared the job's ticket: its run takes a slot of its own."
            )),
            QuotaError::TicketNotUuid { func: JobFn::Finish, trigger, path, .. } => Some(format!(
                "Trigger \"{trigger}\" read it from {path} of the job's row with quota.finish_job(), and finished nothing for that row."
            )),
            QuotaError::TicketNotUuid { func: JobFn::Claim, trigger, path, .. } => Some(format!(
                "Trigger \"{trigger}\" read it from {path} of the job's row with quota.claim_job(), and cleared it: the job's run takes a slot of its own."
            )),
            QuotaError::UnsupportedIndex { what, .. } => Some(format!(
                "pg_quota writes its tables below SQL: it keeps plain indexes on columns up to date, and unique ones only on the table's key; {what} could reject other roles' tickets or be left unchecked."
            )),
            QuotaError::UnknownTicket(_) => Some(
                "It was never issued in this database, or it ended longer ago than quota.retention and was purged."
                    .to_string(),
            ),
            QuotaError::SchemaNotOurs { .. } => Some(
                "pg_quota installs into a schema of its own, which only superusers may own or change."
                    .to_string(),
            ),
            QuotaError::TriggerRefused { table, .. } if table == OVERRIDES_TABLE => Some(
                "quota.set_tenant_limits() writes this table as its owner, so a trigger on it would run with the owner's privileges for whichever role calls the function."
                    .to_string(),
            ),
            QuotaError::TriggerRequired { table, .. } if table == OVERRIDES_TABLE => Some(
                "pg_quota tells every session of a change to the tenants' own limits with this trigger."
                    .to_string(),
            ),
            QuotaError::TriggerRefused { .. } => Some(
                "pg_quota writes its tables below SQL, where no trigger fires: a tool that copies a table through a trigger (pg_repack, an audit or replication trigger) would lose tickets, and a foreign key to it would go unchecked."
                    .to_string(),
            ),
            QuotaError::TriggerRequired { .. } => Some(
                "pg_quota keeps its counters and its summary exact with its triggers, and keeps pg_repack off its tables with repack_trigger."
                    .to_string(),
            ),
            QuotaError::NoWorkerSlot { waited_ms } => Some(format!(
                "No background worker slot (max_worker_processes) came free for this database's ledger writer in {waited_ms} ms (quota.writer_start_wait); the writers of other databases give theirs up when they have nothing to do."
            )),
            QuotaError::TenantElsewhere(e) => Some(e.detail()),
            QuotaError::ShardMoveRefused(e) => Some(e.detail()),
            QuotaError::ShardBusy { seconds, .. } => Some(super::citus::shard_busy_detail(*seconds)),
            _ => None,
        }
    }

    pub fn hint(&self) -> Option<String> {
        match self {
            QuotaError::Refused {
                refusal,
                next_ageout,
                age_out,
                default_retained_for,
                tenant_limit_set,
                ..
            } => Some(match (refusal.kind, next_ageout) {
                (RefusalKind::TenantActive, _) if *tenant_limit_set => "Finish one of the tenant's tickets with quota.finish(), or raise the tenant's own limit with quota.set_tenant_limits().".to_string(),
                (RefusalKind::TenantRetained, _) if *tenant_limit_set => format!(
                    "{}quota.set_tenant_limits() can raise the tenant's own limit.",
                    ageout(true, refusal.weight, *age_out, next_ageout.as_deref(), true)
                ),
                (RefusalKind::Database, _) => "Capacity returns when any role of the database finishes a ticket or a lease expires; a superuser can raise quota.max_active_per_database.".to_string(),
                (RefusalKind::Active, _) => "Finish a ticket with quota.finish(), or ask a superuser to raise quota.max_active_per_role.".to_string(),
                (RefusalKind::Retained, _) if default_retained_for.is_some() => format!(
                    "{}quota.max_retained_per_role is at its default of {}, which no setting for this role chose: a superuser can turn it off with ALTER ROLE {} SET quota.max_retained_per_role = 0, or set a limit it means.",
                    ageout(false, refusal.weight, *age_out, next_ageout.as_deref(), false),
                    refusal.limits.max_retained,
                    default_retained_for.as_deref().unwrap_or_default()
                ),
                (RefusalKind::Retained, Some(_)) => format!(
                    "{}a superuser can raise quota.max_retained_per_role or shorten quota.retention.",
                    ageout(false, refusal.weight, *age_out, next_ageout.as_deref(), true)
                ),
                (RefusalKind::Retained, None) => format!(
                    "{}A superuser can raise quota.max_retained_per_role.",
                    ageout(false, refusal.weight, *age_out, next_ageout.as_deref(), true)
                ),
                (RefusalKind::TenantActive, _) => "Finish one of the tenant's tickets with quota.finish(), or ask a superuser to raise quota.max_active_per_tenant for its role.".to_string(),
                (RefusalKind::TenantRetained, Some(_)) => format!(
                    "{}a superuser can raise quota.max_retained_per_tenant for its role or shorten quota.retention.",
                    ageout(true, refusal.weight, *age_out, next_ageout.as_deref(), true)
                ),
                (RefusalKind::TenantRetained, None) => format!(
                    "{}A superuser can raise quota.max_retained_per_tenant for its role.",
                    ageout(true, refusal.weight, *age_out, next_ageout.as_deref(), true)
                ),
            }),
            QuotaError::TriggerArguments { func, .. } => Some(func.usage().to_string()),
            QuotaError::TriggerMisfired { func, .. } => {
                Some(format!("{} {}", func.timing(), func.usage()))
            }
            QuotaError::TicketColumnMissing { func, .. }
            | QuotaError::TicketColumnType { func, .. } => Some(func.usage().to_string()),
            QuotaError::JobTicketForeign { func: JobFn::Finish, firing_role, .. } => Some(format!(
                "Complete the job as the role that started the ticket, or make \"{firing_role}\" a member of it (GRANT). A deferred trigger fires as the role current at COMMIT on PostgreSQL 15 to 17."
            )),
            QuotaError::JobTicketForeign { func: JobFn::Claim, firing_role, .. } => Some(format!(
                "Claim the job as the role that started the ticket, or make \"{firing_role}\" a member of it (GRANT)."
            )),
            QuotaError::TicketColumnNotNull { generated: false, .. } => Some(
                "Drop the NOT NULL constraint, or keep the ticket in a jsonb column, where the trigger writes JSON null.".to_string(),
            ),
            QuotaError::TicketColumnNotNull { generated: true, .. } => Some(
                "Name the column the ticket is computed from: PostgreSQL computes a generated column after BEFORE triggers, so what the trigger writes there is lost.".to_string(),
            ),
            QuotaError::TicketColumnVirtual { .. } => Some(
                "Make it a stored generated column (GENERATED ALWAYS AS (expression) STORED), or name the column it is computed from.".to_string(),
            ),
            QuotaError::InvalidOutcome(_) => {
                Some("Valid outcomes are succeeded, failed and cancelled.".to_string())
            }
            QuotaError::TransactionalNotAllowed { .. } => Some(
                "A superuser can allow them with quota.allow_transactional (for example ALTER ROLE … SET quota.allow_transactional = on), where the work is a row of the transaction, such as a queue's enqueue or claim. Without transactional, start() commits its charge on its own.".to_string(),
            ),
            QuotaError::NoCounter => Some(
                "Commit or roll back transactions that hold many transactional charges, or raise quota.scope_counters (a restart).".to_string(),
            ),
            QuotaError::KeyHeldUncommitted => Some(
                "Repeat it with transactional => true, or after this transaction commits.".to_string(),
            ),
            QuotaError::ForeignTicket { .. } => Some(
                "Only the role that started a ticket, a member of that role, or a superuser can finish or renew it."
                    .to_string(),
            ),
            QuotaError::InvalidLimit { .. } => Some(
                "A limit is 0 (no limit) or more; NULL leaves the role's setting in force."
                    .to_string(),
            ),
            QuotaError::WeightNeverFits(n) => Some(n.hint()),
            QuotaError::PlainNotExecutable { function } => Some(format!(
                "The weighted quota.{function}(weight, …) takes the privileges of the plain one as well: grant EXECUTE on both, or revoke it on both."
            )),
            QuotaError::WeightMismatch { .. } => Some(
                "Repeat a start with the weight it was first made with, or use another idempotency key."
                    .to_string(),
            ),
            QuotaError::ForeignTenantLimits { .. } => Some(
                "A role granted EXECUTE on quota.set_tenant_limits() sets the limits of tenants of the roles it is a member of; a superuser sets any."
                    .to_string(),
            ),
            QuotaError::TicketEnded { .. } => {
                Some("Start a new ticket with quota.start().".to_string())
            }
            QuotaError::NeedsUpdate { .. } => Some(
                "This database still has the schema of an older pg_quota. Run ALTER EXTENSION pg_quota UPDATE in it.".to_string(),
            ),
            QuotaError::TenantElsewhere(e) => Some(e.hint()),
            QuotaError::ShardMoveRefused(e) => Some(e.hint()),
            QuotaError::CitusMisdeclared { .. } => Some(super::citus::MISDECLARED_HINT.to_string()),
            QuotaError::ShardMoveBusy { change, .. } => Some(change.busy_hint()),
            QuotaError::NotPreloaded => Some(
                "Add pg_quota to shared_preload_libraries in postgresql.conf and restart the server."
                    .to_string(),
            ),
            QuotaError::NoWorkerSlot { .. } => Some(
                "Raise max_worker_processes, or wait for other background workers to exit.".to_string(),
            ),
            QuotaError::WriterFailed { .. } => {
                Some("No charge was recorded for this call.".to_string())
            }
            QuotaError::WriterGone => Some(
                "Try again: the next call starts a new writer. A charge the writer committed stays counted until it is finished.".to_string(),
            ),
            QuotaError::CommitUnconfirmed => Some(
                "The ticket may be recorded on this server: it then counts until it is finished or its lease runs out, and quota.tickets shows it. A standby that takes over may not have it.".to_string(),
            ),
            QuotaError::WriterDidNotStart { .. } => Some(
                "Fix what the server log reports, then try again.".to_string(),
            ),
            QuotaError::LockTimeout { .. } => {
                Some("Try again once the maintenance has finished.".to_string())
            }
            QuotaError::TenantLimitsBusy { .. } => Some(
                "Try again once that transaction has ended; pg_stat_activity shows it.".to_string(),
            ),
            QuotaError::ExtensionLockTimeout { .. } => Some(
                "Try again once that command has ended; if it dropped the extension, create it again first."
                    .to_string(),
            ),
            QuotaError::NotExtensionMember { .. } => Some(
                "Someone renamed or replaced pg_quota's schema or tables. Rename them back, or reinstall with DROP EXTENSION pg_quota and CREATE EXTENSION pg_quota.".to_string(),
            ),
            QuotaError::BadShape { .. } => Some(
                "Undo the ALTER TABLE, or reinstall with DROP EXTENSION pg_quota and CREATE EXTENSION pg_quota.".to_string(),
            ),
            QuotaError::UnsupportedIndex { .. } => {
                Some("Drop it; pg_quota creates the indexes it needs.".to_string())
            }
            QuotaError::SchemaNotOurs { .. } => Some(
                "Drop or rename the existing schema \"quota\", then run CREATE EXTENSION pg_quota again.".to_string(),
            ),
            QuotaError::SchemaOpen { .. } => Some(
                "Revoke CREATE on schema \"quota\" from every role that is not a superuser, or drop the schema, then run CREATE EXTENSION pg_quota again.".to_string(),
            ),
            QuotaError::SchemaNotEmpty => Some(
                "Move or drop the objects in schema \"quota\", then run CREATE EXTENSION pg_quota again.".to_string(),
            ),
            QuotaError::TriggerRefused { table, .. } if table == OVERRIDES_TABLE => Some(
                "Change the tenants' limits with quota.set_tenant_limits(), and read them in quota.tenant_limits.".to_string(),
            ),
            QuotaError::TriggerRequired { table, action, .. } if table == OVERRIDES_TABLE => Some(if *action == "drop" {
                "To remove it, drop extension pg_quota.".to_string()
            } else {
                "Leave pg_quota's triggers their names.".to_string()
            }),
            QuotaError::TriggerRefused { .. } => Some(
                "To compact pg_quota's tables, see \"Reclaiming space\" in pg_quota's user guide; pg_repack skips them by itself, and --exclude-extension=pg_quota leaves them out.".to_string(),
            ),
            QuotaError::LedgerCopyUnderReplica => Some(
                "The view sends each row to quota.active or quota.history through a trigger, which PostgreSQL does not fire under replica: copy with session_replication_role = origin (pg_restore without --disable-triggers), or copy unended tickets into quota.active and ended ones into quota.history.".to_string(),
            ),
            QuotaError::TriggerRequired { action, .. } => Some(if *action == "drop" {
                "To stop it firing, use ALTER TABLE … DISABLE TRIGGER; pg_quota then counts from the ledger. To remove it, drop extension pg_quota.".to_string()
            } else {
                "Leave pg_quota's triggers their names.".to_string()
            }),
            _ => None,
        }
    }
}

/// The NOTICE after pg_quota set enabled data triggers back to ENABLE ALWAYS (see
/// guard.rs); `triggers` name them as "name on table".
pub fn triggers_promoted(triggers: &[String]) -> String {
    format!(
        "pg_quota set {} {} back to ENABLE ALWAYS, so that {} whatever session_replication_role says",
        if triggers.len() == 1 { "trigger" } else { "triggers" },
        triggers.join(", "),
        if triggers.len() == 1 { "it fires" } else { "they fire" },
    )
}

/// The WARNING, DETAIL and HINT for data triggers a DBA disabled (see guard.rs);
/// The WARNING when quota.tenant_overrides' trigger is disabled (0.7.0): message,
/// DETAIL and HINT.
pub fn overrides_trigger_disabled() -> (String, String, String) {
    (
        "pg_quota's trigger tenant_overrides_written on quota.tenant_overrides is disabled".to_string(),
        "Until it is enabled again, a superuser's own writes to quota.tenant_overrides reach the sessions that cached the tenants' limits only with the next change made through quota.set_tenant_limits(), or the next DDL on the table.".to_string(),
        "Enable it again with ALTER TABLE … ENABLE ALWAYS TRIGGER, or change tenants' limits with quota.set_tenant_limits() only.".to_string(),
    )
}

/// `triggers` name them as "name on table".
pub fn triggers_disabled(triggers: &[String]) -> (String, String, String) {
    let one = triggers.len() == 1;
    (
        format!(
            "pg_quota's {} {} {} disabled",
            if one { "trigger" } else { "triggers" },
            triggers.join(", "),
            if one { "is" } else { "are" },
        ),
        format!(
            "Until {it} enabled again, admission counts from the ledger instead of its counters, which is slower while long transactions are open. What SQL writes to pg_quota's tables meanwhile is counted afresh once {it} enabled again.",
            it = if one { "it is" } else { "they are" },
        ),
        format!(
            "Enable {} again with ALTER TABLE … ENABLE ALWAYS TRIGGER.",
            if one { "it" } else { "them" }
        ),
    )
}

#[cfg(test)]
#[path = "errors_tests.rs"]
mod tests;

/// The first sentence of a retained refusal's HINT: how capacity returns (`how`,
/// `next_ageout`) for a start of `weight` (0.7.0), of the tenant's tickets or the
/// role's; then what the caller's next words follow: "; " after a time where
/// `joined`, else ". " (and always ". " without a time). A start of weight 1 that the
/// oldest ticket's aging out makes room for, or that finds every retained ticket
/// active, reads as before 0.7.0.
fn ageout(
    tenant: bool,
    weight: i64,
    how: super::lease::AgeOut,
    next_ageout: Option<&str>,
    joined: bool,
) -> String {
    use super::lease::{AgeOut, AGE_OUT_READS};
    let whose = if tenant { "the tenant's " } else { "the " };
    let of_tenant = if tenant { " of the tenant" } else { "" };
    let this = if weight > 1 {
        format!("a start of weight {weight}")
    } else {
        "this start".to_string()
    };
    let end = if joined { "; " } else { ". " };
    match (how, next_ageout) {
        (AgeOut::Oldest, Some(at)) if weight == 1 => {
            format!("Capacity returns at {at}, when {whose}oldest retained ticket ages out{end}")
        }
        (AgeOut::Oldest | AgeOut::Enough, Some(at)) => format!(
            "Capacity for {this} returns at {at}, when enough of {whose}retained units have aged out{end}"
        ),
        (AgeOut::TooFew, _) => format!(
            "Aging out frees too few of {whose}retained units for {this}: more tickets{of_tenant} must finish first, and tickets age out quota.retention after they finish. "
        ),
        (AgeOut::Beyond, _) => format!(
            "Capacity for {this} returns as more than {AGE_OUT_READS} of {whose}retained tickets age out, quota.retention after they end. "
        ),
        _ => format!(
            "Every retained ticket{of_tenant} is still active: tickets age out quota.retention after they finish. "
        ),
    }
}
