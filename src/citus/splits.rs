//! A shard split seen on the node that holds the shard (Citus deletes the old shard's
//! metadata there, in the split's transaction, then places the new shards): refused,
//! as the split's transaction is about to commit here, where a tenant of the shard
//! that holds active tickets or its own limits here would have its new shard on
//! another node. A split that keeps them here (isolate_tenant_to_new_shard, a split
//! whose children stay on this node) goes, and their tickets stay counted here.

use pgrx::pg_sys;

use super::metadata::{column_bool, query, read_placed};
use super::moves::{citus_call, held_here, Held};
use super::placement::shard_of;
use crate::core::citus::{shard_may_leave, ShardChange};
use crate::core::QuotaError;

/// The shard of Citus' own `SELECT citus_internal.delete_shard_metadata(shard)`,
/// which a split (citus_split_shard_by_split_points, isolate_tenant_to_new_shard)
/// sends to every node with metadata in its transaction, as it is about to run; None
/// for anything else (moves::citus_call).
///
/// # Safety
/// `stmt` is the PlannedStmt the executor is starting.
pub unsafe fn shard_deletion(stmt: *const pg_sys::PlannedStmt) -> Option<i64> {
    // SAFETY: the caller's.
    let args = unsafe {
        citus_call(
            stmt,
            &[
                (c"citus_internal", c"delete_shard_metadata"),
                (c"pg_catalog", c"citus_internal_delete_shard_metadata"),
            ],
            &[pg_sys::INT8OID],
        )
    }?;
    Some(args[0].value() as i64)
}

/// Whether shard $1 is of table $2 and placed on this node.
const OF_TABLE_HERE: &std::ffi::CStr = c"
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_shard s
                 JOIN pg_catalog.pg_dist_placement p ON p.shardid = s.shardid
                WHERE s.shardid = $1 AND s.logicalrelid = $2
                  AND p.groupid = (SELECT l.groupid FROM pg_catalog.pg_dist_local_group l))";

thread_local! {
    /// The splits of this transaction whose shard's tenants hold something here, each
    /// with the subtransaction level that saw it (xact::at_subxact_end): a split rolled
    /// back to a savepoint is not checked at the commit.
    static PENDING: std::cell::RefCell<Vec<((i64, Held), i32)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// As a split deletes `shard`'s metadata on this node: where the shard is of the table
/// pg_quota's start functions are colocated with and placed here, takes pg_quota's
/// lock on it (moves::held_here) and, where its tenants hold tickets or their own
/// limits here, keeps them for the check at the transaction's commit (`check`).
pub fn shard_splitting(shard: i64) -> Result<(), QuotaError> {
    // SAFETY: connected to SPI by held_here, inside the split's transaction.
    let concerned = |table: pg_sys::Oid| unsafe {
        query(
            pg_sys::GetUserId(),
            None,
            OF_TABLE_HERE,
            &[
                (pg_sys::INT8OID, pg_sys::Datum::from(shard)),
                (pg_sys::OIDOID, pg_sys::Datum::from(table)),
            ],
        );
        column_bool(1)
    };
    if let Some(held) = held_here(shard, ShardChange::Split, concerned)? {
        if !held.active.is_empty() || !held.own.is_empty() {
            register();
            // SAFETY: a plain read of transaction state.
            let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
            PENDING.with_borrow_mut(|p| p.push(((shard, held), level)));
        }
    }
    Ok(())
}

fn register() {
    // Backends are single-threaded: this one's flag.
    static mut REGISTERED: bool = false;
    // SAFETY: single-threaded backend state; the callback is registered once.
    unsafe {
        if !REGISTERED {
            pg_sys::RegisterXactCallback(Some(xact_event), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(subxact_event), std::ptr::null_mut());
            REGISTERED = true;
        }
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn xact_event(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    let pending = PENDING.with_borrow_mut(std::mem::take);
    if pending.is_empty() {
        return;
    }
    if matches!(
        event,
        pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT
            | pg_sys::XactEvent::XACT_EVENT_PARALLEL_PRE_COMMIT
            | pg_sys::XactEvent::XACT_EVENT_PRE_PREPARE
    ) {
        crate::error::boundary(|| check(pending.into_iter().map(|(p, _)| p).collect()));
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn subxact_event(
    event: pg_sys::SubXactEvent::Type,
    _my: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    PENDING.with_borrow_mut(|p| {
        crate::xact::at_subxact_end(p, event);
    });
}

/// The split's transaction is about to commit (or prepare) here, its new shards
/// placed: refuses it where a tenant that holds tickets or its own limits here now
/// has its shard on another node. A tenant's shard comes from Citus' own function, as
/// for a start (placement::shard_of), which reads the metadata this transaction wrote.
fn check(pending: Vec<(i64, Held)>) -> Result<(), QuotaError> {
    for (shard, held) in pending {
        let mut placed_here = std::collections::HashMap::new();
        let mut here = |tenant: &String| -> bool {
            *placed_here.entry(tenant.clone()).or_insert_with(|| {
                // SAFETY: inside the committing transaction; a call of Citus' function
                // with an argument of its types; then SPI (read_placed connects).
                unsafe {
                    let new = shard_of(held.shard_fn, held.table, held.owner, tenant.as_bytes());
                    read_placed(held.table, new).here
                }
            })
        };
        let active: Vec<String> = held.active.iter().filter(|t| !here(t)).cloned().collect();
        let own: Vec<String> = held.own.iter().filter(|t| !here(t)).cloned().collect();
        shard_may_leave(ShardChange::Split, shard, active, own)
            .map_err(QuotaError::ShardMoveRefused)?;
    }
    Ok(())
}
