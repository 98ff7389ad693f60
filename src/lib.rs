//! pg_quota: race-safe, rollback-proof admission quotas per role.
//!
//! `core` holds every decision and message as plain Rust; the other modules adapt it
//! to PostgreSQL, in layers that each import only from the layers below them (see the
//! module list, and README.md, "Layout"). See ../shared/design.md for the contract and
//! invariants I1–I9.

use pgrx::prelude::*;

pub mod core;

// Layer 1: pure rules (core), version differences, settings, errors, and small helpers
// over the server's catalogs, clock and transactions.
mod catalog;
mod compat;
mod encoding;
mod error;
mod gucs;
mod inval;
mod policy;
mod syncrep;
mod timestamps;
mod xact;
// Layer 2: shared memory, reserved and attached.
mod shmem;
// Layer 3: pg_quota's tables below SQL.
mod ledger;
// Layer 4: shared state, each owning its segment.
mod queue;
mod scopes;
mod stats;
mod waiters;
mod workers;
// Layer 4, after the rooms it uses (scopes, waiters, stats).
mod charges;
// Layer 4, after scopes (its shard lock's tag): Citus' metadata of a tenant's node,
// read below the paths (0.7.1).
mod citus;
// Layer 5: the paths.
mod admission;
mod finish;
mod tenant_limits;
// Layer 5, after finish (whose body it calls): quota.finish_job().
mod job_trigger;
// Layer 5, after job_trigger (the DDL hooks check its triggers when created).
mod hooks;
mod writer;
// Layer 6: the SQL surface.
mod api;

::pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
// 0.3.0's views read functions defined in Rust, so they come last.
extension_sql_file!("../sql/stats.sql", name = "stats", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // Shared memory, the writer table and the request slots exist only when the
    // library is preloaded. Refusing to load otherwise makes CREATE EXTENSION, and
    // any call after the preload was removed, fail with a hint that says how to fix it.
    // SAFETY: a plain read of a postmaster flag.
    if !unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress } {
        error::raise(crate::core::QuotaError::NotPreloaded);
    }
    gucs::init();
    // Each subsystem's shared memory; the order is that of their LWLocks in the
    // "pg_quota" tranche.
    shmem::reserve(&workers::SEGMENT);
    shmem::reserve(&queue::SEGMENT);
    shmem::reserve(&scopes::SEGMENT);
    shmem::reserve(&waiters::SEGMENT);
    shmem::reserve(&stats::SEGMENT);
    shmem::reserve(&charges::SEGMENT);
    hooks::init();
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    include!("tests.rs");
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec!["shared_preload_libraries = 'pg_quota'"]
    }
}
