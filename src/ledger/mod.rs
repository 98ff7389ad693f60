//! Layer 3, the ledger: pg_quota's tables below SQL. Finding and checking the relations
//! and their locks (rels.rs), reading them with index scans under the latest snapshot
//! (scan.rs), counting a scope (count.rs), finding a ticket by its idempotency key
//! (keys.rs), and writing heap and index tuples (heap.rs,
//! write.rs). It knows nothing of shared memory or of who calls it: a caller that wants
//! something done in response (a summary rebuilt) is told, and acts itself.

pub mod count;
pub mod heap;
pub mod indexes;
pub mod keys;
pub mod leases;
pub mod locks;
pub mod overrides;
pub mod rels;
pub mod scan;
pub mod write;

/// Ledger columns, 1-based, as created by sql/schema.sql.
pub const COL_ID: usize = 1;
pub const COL_ROLE: usize = 2;
pub const COL_LABEL: usize = 3;
pub const COL_STARTED_AT: usize = 4;
pub const COL_ENDED_AT: usize = 5;
pub const COL_OUTCOME: usize = 6;
/// Columns added by 0.2.0 (sql/pg_quota--0.1.1--0.2.0.sql appends them).
pub const COL_LEASE_UNTIL: usize = 7;
pub const COL_KEY: usize = 8;
pub const COL_PID: usize = 9;
/// Columns added by 0.5.0 (sql/pg_quota--0.4.1--0.5.0.sql appends them).
pub const COL_TENANT: usize = 10;
pub const COL_TXID: usize = 11;
/// Added by 0.7.0 (sql/pg_quota--0.6.1--0.7.0.sql appends it to both tables): the
/// ticket's weight, NULL for 1, so that a ticket of weight 1 costs no byte more.
pub const COL_WEIGHT: usize = 12;
/// The ledger's columns in the schemas of 0.1.x, of 0.2.0 to 0.4.x, of 0.5.0, and of
/// 0.7.0.
pub const NCOLS_V1: usize = 6;
pub const NCOLS_V2: usize = 9;
pub const NCOLS_V5: usize = 11;
pub const NCOLS_V7: usize = 12;
/// quota.summary's columns: role, tickets, and from 0.5.0 folded.
pub const SUMMARY_COL_TICKETS: usize = 2;
pub const SUMMARY_COL_FOLDED: usize = 3;
