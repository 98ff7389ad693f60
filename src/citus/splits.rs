//! A shard split seen on a node that holds Citus' metadata (Citus deletes the old
//! shard's metadata there, in the split's transaction, then places the new shards):
//! refused, as the split's transaction is about to commit here, where a tenant that
//! holds active tickets or its own limits on this node would then have its shard on
//! another node. A split that keeps them here (isolate_tenant_to_new_shard, a split
//! whose children stay on this node) goes, and their tickets stay counted here.

use pgrx::pg_sys;

use super::metadata::{column, column_text, connect, declared_table, query, quota_ns, read_placed};
use super::moves::{citus_call, held_query, lock_exclusively, names, HeldAs};
use super::placement::shard_of;
use crate::core::citus::{shard_may_leave, ShardChange};
use crate::core::QuotaError;

/// The shard of Citus' own `SELECT citus_internal.delete_shard_metadata(shard)`,
/// which a split (citus_split_shard_by_split_points, isolate_tenant_to_new_shard)
/// sends to every node with metadata in its transaction; None for anything else
/// (moves::citus_call).
///
/// # Safety
/// `stmt` is the PlannedStmt the executor has run.
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

thread_local! {
    /// The shards this transaction's splits deleted here, each with the subtransaction
    /// level that deleted it (xact::at_subxact_end): a split rolled back to a savepoint
    /// is not checked at the commit.
    static PENDING: std::cell::RefCell<Vec<(i64, i32)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Once a split's deletion of `shard`'s metadata has run here (so Citus' own checks
/// let its user change its metadata: a superuser, the table's owner, Citus' own
/// connections), where pg_quota's starts are distributed by tenant: takes pg_quota's
/// lock on the shard (moves::lock_exclusively) and has the transaction's commit here
/// check where every tenant that holds something here then lives (`check`).
pub fn shard_splitting(shard: i64) -> Result<(), QuotaError> {
    let Some(ns) = quota_ns() else {
        return Ok(());
    };
    // SAFETY: SPI inside the split's transaction; an ERROR unwinds through it and the
    // abort cleans SPI up.
    let declared = unsafe {
        connect();
        let declared = declared_table(ns).is_some();
        pg_sys::SPI_finish();
        declared
    };
    if !declared {
        return Ok(());
    }
    lock_exclusively(shard, ShardChange::Split)?;
    register();
    // SAFETY: a plain read of transaction state.
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    PENDING.with_borrow_mut(|p| p.push((shard, level)));
    Ok(())
}

fn register() {
    // Backends are single-threaded: this one's flag.
    static mut REGISTERED: bool = false;
    // SAFETY: single-threaded backend state; the callbacks are registered once.
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
    let Some(&(shard, _)) = pending.first() else {
        return;
    };
    if matches!(
        event,
        pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT
            | pg_sys::XactEvent::XACT_EVENT_PARALLEL_PRE_COMMIT
            | pg_sys::XactEvent::XACT_EVENT_PRE_PREPARE
    ) {
        crate::error::boundary(|| check(shard));
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
/// placed: refuses it where a tenant that holds active tickets or its own limits here
/// now has its shard on another node, a shard that this transaction made. A tenant's
/// shard comes from Citus' own function, as for a start (placement::shard_of), which
/// reads the metadata this transaction wrote; each shard's placement is read once.
/// `shard` names the split in the refusal.
fn check(shard: i64) -> Result<(), QuotaError> {
    let Some((ns, held)) = held_query(HeldAs::Texts) else {
        return Ok(());
    };
    // SAFETY: SPI inside the committing transaction, as in shard_splitting.
    let found = unsafe {
        connect();
        let found = declared_table(ns).map(|d| {
            query(pg_sys::BOOTSTRAP_SUPERUSERID.into(), None, &held, &[]);
            (d, names(column_text(1)), names(column_text(2)))
        });
        pg_sys::SPI_finish();
        found
    };
    let Some(((table, owner, shard_fn), active, own)) = found else {
        return Ok(());
    };
    // Per shard: whether this transaction placed it on another node (a new shard of
    // the split, its row written here, not placed here). A tenant whose shard was
    // not made by this transaction is not this split's to judge: its tickets here
    // were not placed by it (a superuser's start, which is never refused, or tickets
    // from before the start functions were distributed).
    let mut away_of: std::collections::HashMap<i64, bool> = Default::default();
    let mut away = |tenant: &String| -> bool {
        // SAFETY: inside the committing transaction; a call of Citus' function with an
        // argument of its types; then SPI (read_placed and written_here connect).
        let now = unsafe { shard_of(shard_fn, table, owner, tenant.as_bytes()) };
        *away_of
            .entry(now)
            // SAFETY: as above.
            .or_insert_with(|| unsafe { !read_placed(table, now).here && written_here(now) })
    };
    let active: Vec<String> = active.into_iter().filter(|t| away(t)).collect();
    let own: Vec<String> = own.into_iter().filter(|t| away(t)).collect();
    shard_may_leave(ShardChange::Split, shard, active, own).map_err(QuotaError::ShardMoveRefused)
}

/// The transaction that wrote shard $1's row.
const SHARD_XMIN: &std::ffi::CStr =
    c"SELECT s.xmin FROM pg_catalog.pg_dist_shard s WHERE s.shardid = $1";

/// Whether this transaction wrote `shard`'s row of pg_dist_shard (a split's new shard).
///
/// # Safety
/// Inside a transaction.
pub(super) unsafe fn written_here(shard: i64) -> bool {
    // SAFETY: the caller's; SPI as elsewhere here; a plain check of an xid.
    unsafe {
        connect();
        query(
            pg_sys::GetUserId(),
            None,
            SHARD_XMIN,
            &[(pg_sys::INT8OID, pg_sys::Datum::from(shard))],
        );
        let xmin = column(1).map(|d| d.value() as u32);
        pg_sys::SPI_finish();
        xmin.is_some_and(|x| pg_sys::TransactionIdIsCurrentTransactionId(x.into()))
    }
}
