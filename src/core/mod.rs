//! Layer 1, the pure core of pg_quota: admission decisions, outcomes, labels, ticket ids and
//! every user-facing text. Nothing in here touches PostgreSQL, so all of it is tested
//! with plain `cargo test`; the pgrx layer only moves values in and out.

pub mod batch;
pub mod citus;
pub mod counters;
pub mod decision;
pub mod errors;
pub mod job_trigger;
pub mod lease;
pub mod policy;
pub mod refusals;
pub mod replication;
pub mod stats;
pub mod ticket;
pub mod turns;
pub mod weights;

pub use decision::{
    decide, decide_weighted, never_fits, refuse_on_active, Decision, Limits, Pending, Refusal,
    RefusalKind, Usage, MAX_WEIGHT,
};
pub use errors::{JobFn, QuotaError, Sqlstate};
pub use ticket::{
    check_key, check_label, check_tenant, parse_outcome, uuid_v7, Outcome, MAX_LABEL_CHARS,
};
