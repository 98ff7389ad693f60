//! A shard move or split run on this node that takes shards from this node itself: a
//! coordinator that holds shards (`shouldhaveshards`). Citus changes the metadata of
//! the node that runs the operation in C, without the commands it sends the other
//! nodes (moves.rs, splits.rs), so pg_quota sees the operation by its call instead
//! (PostgreSQL's function-manager hook: hooks/mod.rs). Once the call has returned, in
//! its transaction, pg_quota finds the shards it gave up on this node in the cleanup
//! records Citus wrote for them in that transaction, and refuses the operation where
//! a tenant that holds active tickets or its own limits here now has its shard on
//! another node, one the operation took away or made.

use pgrx::pg_sys;

use super::memory::{proc_changes, OPERATION_SEEN};
use super::metadata::{column_text, connect, declared_table, query};
use super::moves::{held_query, lock_exclusively, names, HeldAs};
use super::placement::shard_of;
use super::planner::func_is;
use super::splits::written_here;
use crate::core::citus::{shard_may_leave, ShardChange};
use crate::core::QuotaError;

/// Citus' operations that take a shard off a node, as their calls are named (all in
/// pg_catalog): moves (the rebalancer's too: each of its moves is such a call, in a
/// session of its own or in a background task's worker) and splits.
const OPERATIONS: [(&std::ffi::CStr, &std::ffi::CStr); 4] = [
    (c"pg_catalog", c"citus_move_shard_placement"),
    (c"pg_catalog", c"master_move_shard_placement"),
    (c"pg_catalog", c"citus_split_shard_by_split_points"),
    (c"pg_catalog", c"isolate_tenant_to_new_shard"),
];

/// Whether function `funcid` is one of Citus' shard operations. Where Citus is not
/// loaded, at once false; otherwise remembered per backend until pg_proc changes
/// (memory::OPERATION_SEEN).
pub fn is_operation(funcid: pg_sys::Oid) -> bool {
    if !super::metadata::citus_loaded() {
        return false;
    }
    let key = u32::from(funcid);
    let seen = proc_changes();
    if let Some(known) = OPERATION_SEEN.with_borrow_mut(|m| m.get(seen, &key)) {
        return known;
    }
    // A change of pg_proc taken in during the lookup leaves the answer unkept.
    let is = func_is(funcid, &OPERATIONS);
    OPERATION_SEEN.with_borrow_mut(|m| m.keep(seen, proc_changes(), key, is));
    is
}

/// The declared table's shards this node holds, sorted.
const PLACED_HERE: &std::ffi::CStr = c"
SELECT pg_catalog.string_agg(s.shardid::pg_catalog.text, ',' ORDER BY s.shardid)
  FROM pg_catalog.pg_dist_shard s
  JOIN pg_catalog.pg_dist_placement p ON p.shardid OPERATOR(pg_catalog.=) s.shardid
 WHERE s.logicalrelid OPERATOR(pg_catalog.=) $1
   AND p.groupid OPERATOR(pg_catalog.=) (SELECT l.groupid FROM pg_catalog.pg_dist_local_group l)";

/// The shards of table $1 that an operation marked for dropping from this node once
/// it commits: Citus writes such a record (a shard placement, to drop on success) in
/// the operation's own transaction for each placement a move takes off its source
/// node or a split replaces, named as ConstructQualifiedShardName names it: as
/// Citus' shard_name($1, shard) names it, with `public.` before it in schema public,
/// which shard_name() leaves off (its two-argument form, from every Citus version).
/// Each as `xmin:shard:exists` (whether the shard is still in the metadata: a moved
/// one is, a split one is not), joined with commas.
const GIVEN_UP: &std::ffi::CStr = c"
SELECT pg_catalog.string_agg(c.xmin::pg_catalog.text OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||)
         x.shard::pg_catalog.text OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||)
         (EXISTS (SELECT FROM pg_catalog.pg_dist_shard s WHERE s.shardid OPERATOR(pg_catalog.=) x.shard))::pg_catalog.text,
         ',')
  FROM pg_catalog.pg_dist_cleanup c,
       LATERAL (SELECT pg_catalog.substring(c.object_name, '_([0-9]+)\"?$')::pg_catalog.int8 AS shard) x,
       LATERAL (SELECT n.nspname OPERATOR(pg_catalog.=) 'public' AS public
                  FROM pg_catalog.pg_class r JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) r.relnamespace
                 WHERE r.oid OPERATOR(pg_catalog.=) $1) t
 WHERE c.object_type OPERATOR(pg_catalog.=) 1 AND c.policy_type OPERATOR(pg_catalog.=) 2
   AND c.node_group_id OPERATOR(pg_catalog.=) (SELECT l.groupid FROM pg_catalog.pg_dist_local_group l)
   AND x.shard OPERATOR(pg_catalog.>) 0
   AND CASE WHEN t.public THEN 'public.' OPERATOR(pg_catalog.||) pg_catalog.shard_name($1, x.shard)
            ELSE pg_catalog.shard_name($1, x.shard) END OPERATOR(pg_catalog.=) c.object_name";

/// PLACED_HERE as it reads now (this transaction's own changes included).
///
/// # Safety
/// Connected to SPI; `table` is a distributed table's OID.
unsafe fn placed_here(table: pg_sys::Oid) -> Vec<i64> {
    // SAFETY: the caller's.
    unsafe {
        query(
            pg_sys::GetUserId(),
            None,
            PLACED_HERE,
            &[(pg_sys::OIDOID, pg_sys::Datum::from(table))],
        );
        column_text(1)
            .map(|s| s.split(',').filter_map(|n| n.parse().ok()).collect())
            .unwrap_or_default()
    }
}

/// The shards of `table` that this transaction gave up on this node (GIVEN_UP, its
/// own records only), sorted, each with whether it is still in the metadata. Read as
/// the bootstrap superuser: Citus' cleanup records are not every user's to read.
///
/// # Safety
/// Connected to SPI; `table` is a distributed table's OID.
unsafe fn given_up(table: pg_sys::Oid) -> Vec<(i64, bool)> {
    // SAFETY: the caller's; a plain check of an xid.
    unsafe {
        query(
            pg_sys::BOOTSTRAP_SUPERUSERID.into(),
            None,
            GIVEN_UP,
            &[(pg_sys::OIDOID, pg_sys::Datum::from(table))],
        );
        let mut shards: Vec<(i64, bool)> = column_text(1)
            .unwrap_or_default()
            .split(',')
            .filter_map(|r| {
                let mut f = r.split(':');
                let xmin: u32 = f.next()?.parse().ok()?;
                let shard: i64 = f.next()?.parse().ok()?;
                let exists = f.next()? == "true";
                pg_sys::TransactionIdIsCurrentTransactionId(xmin.into()).then_some((shard, exists))
            })
            .collect();
        shards.sort_unstable();
        shards.dedup();
        shards
    }
}

/// What took a tenant's shard away from this node: a move of that shard, or a split
/// of the shard named.
type Away = Option<(ShardChange, i64)>;

/// One of Citus' shard operations has returned here, in its transaction, where
/// pg_quota's starts are distributed by tenant and Citus keeps cleanup records: the
/// declared table's shards this transaction gave up on this node are locked to its
/// end (moves::lock_exclusively: a start in progress for one of their tenants
/// refuses the operation, 55P03), and the operation is refused where a tenant that
/// holds active tickets or its own limits here now has its shard on another node: a
/// shard given up here (a move), or one this transaction made where it gave up a
/// shard here that is gone (a split's). Raised in the call's own statement, so that
/// whoever called it sees the refusal (the rebalancer's loopback sessions commit
/// with errors turned into warnings). Nothing more is read where this node gave up
/// no shard.
pub fn operation_ended() -> Result<(), QuotaError> {
    let Some((ns, held)) = held_query(HeldAs::Texts) else {
        return Ok(());
    };
    // SAFETY: a catalog probe.
    let cleanup = unsafe {
        pg_sys::get_relname_relid(
            c"pg_dist_cleanup".as_ptr(),
            pg_sys::PG_CATALOG_NAMESPACE.into(),
        )
    };
    if cleanup == pg_sys::InvalidOid {
        return Ok(());
    }
    let kind = |exists: bool| {
        if exists {
            ShardChange::Move
        } else {
            ShardChange::Split
        }
    };
    // SAFETY: SPI inside the operation's transaction; an ERROR unwinds through it and
    // the abort cleans SPI up.
    let found = unsafe {
        connect();
        let found = match declared_table(ns) {
            None => Ok(None),
            Some(d) => {
                let left = given_up(d.0);
                match left
                    .iter()
                    .try_for_each(|&(s, exists)| lock_exclusively(s, kind(exists)))
                {
                    Err(e) => Err(e),
                    Ok(()) if left.is_empty() => Ok(None),
                    Ok(()) => {
                        let now = placed_here(d.0);
                        query(pg_sys::BOOTSTRAP_SUPERUSERID.into(), None, &held, &[]);
                        Ok(Some((
                            d,
                            now,
                            left,
                            names(column_text(1)),
                            names(column_text(2)),
                        )))
                    }
                }
            }
        };
        pg_sys::SPI_finish();
        found?
    };
    let Some(((table, owner, shard_fn), now, left, active, own)) = found else {
        return Ok(());
    };
    // A tenant whose shard this operation neither gave up nor made is not its to judge
    // (a superuser's start, never refused, of a tenant of another node); nor is one
    // whose new shard another split in the transaction made, where no shard split
    // here is gone.
    let split_of = left.iter().find(|(_, exists)| !exists).map(|&(s, _)| s);
    let mut away_of: std::collections::HashMap<i64, Away> = Default::default();
    let mut away = |tenant: String| -> (String, Away) {
        // SAFETY: inside the operation's transaction; a call of Citus' function with an
        // argument of its types; then SPI (written_here connects).
        let shard = unsafe { shard_of(shard_fn, table, owner, tenant.as_bytes()) };
        let a = *away_of.entry(shard).or_insert_with(|| {
            if now.contains(&shard) {
                None
            } else if left.iter().any(|&(s, _)| s == shard) {
                Some((ShardChange::Move, shard))
            } else {
                // SAFETY: as above.
                split_of
                    .filter(|_| unsafe { written_here(shard) })
                    .map(|parent| (ShardChange::Split, parent))
            }
        });
        (tenant, a)
    };
    let active: Vec<(String, Away)> = active.into_iter().map(&mut away).collect();
    let own: Vec<(String, Away)> = own.into_iter().map(&mut away).collect();
    // The refusal names the first shard found, and the tenants it took away.
    let Some(first) = active.iter().chain(own.iter()).find_map(|(_, a)| *a) else {
        return Ok(());
    };
    let of_first = |list: Vec<(String, Away)>| -> Vec<String> {
        list.into_iter()
            .filter(|(_, a)| *a == Some(first))
            .map(|(t, _)| t)
            .collect()
    };
    shard_may_leave(first.0, first.1, of_first(active), of_first(own))
        .map_err(QuotaError::ShardMoveRefused)
}
