//! pg_quota: race-safe, rollback-proof admission quotas per role.
//!
//! `core` holds every decision and message as plain Rust; the other modules adapt it
//! to PostgreSQL. See ../shared/design.md for the contract and invariants I1–I8.

use pgrx::prelude::*;

pub mod core;

mod admission;
mod api;
mod compat;
mod counts;
mod error;
mod finish;
mod guard;
mod gucs;
mod heap;
mod hooks;
mod scopes;
mod shmem;
mod stats;
mod waiters;
mod writer;

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
    shmem::init();
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
