//! Layer 4, beside scopes/ (whose lock tags it uses): what this node's Citus metadata
//! says of a tenant (0.7.1), for core::citus::admit_here; what a shard move would leave
//! behind on this node; and a start without a tenant kept from Citus' delegation.
//! Nothing is read where Citus is not loaded in this server; where it is not installed
//! in the database, a start for a tenant costs one catalog probe more. Otherwise what
//! was read is remembered per backend until Citus invalidates it: a start reads Citus'
//! metadata only the first time its backend meets the tenant (its shard, through fmgr)
//! or the shard (its nodes, a kept plan).
//!
//! - `metadata`: the reads of Citus' catalogs (SPI, kept plans), and whether Citus is
//!   loaded;
//! - `memory`: what a backend remembers of them, and the invalidations that make it
//!   forget;
//! - `placement`: where a start's tenant lives, and the shard lock a start holds;
//! - `moves`: a shard move seen on the node it would leave, refused while tenants of
//!   the shard hold tickets or their own limits there;
//! - `splits`: a shard split seen on the node that holds the shard, refused where it
//!   would place tenants that hold tickets or their own limits here on another node;
//! - `runs`: a move or split run on this node that takes shards from it (a
//!   coordinator that holds shards), refused likewise once its call has returned;
//! - `planner`: a start without a tenant kept from Citus' delegation.

mod memory;
mod metadata;
mod moves;
mod placement;
mod planner;
mod runs;
mod splits;

pub use moves::{placement_update, shard_leaving};
pub use placement::{placement, release, warn_per_node};
pub use planner::keep_tenantless_start_local;
pub use runs::{is_operation, operation_ended};
pub use splits::{shard_deletion, shard_splitting};
