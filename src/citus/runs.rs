//! A shard move or split run on this node that takes shards from this node itself: a
//! coordinator that holds shards (`shouldhaveshards`). Citus changes the metadata of
//! the node that runs the operation in C, without the commands it sends the other
//! nodes (moves.rs, splits.rs), so pg_quota sees the operation by its call instead
//! (PostgreSQL's function-manager hook: hooks/mod.rs), and, as its transaction
//! commits here (splits.rs), finds the shards it took from this node in the cleanup
//! records Citus wrote for them in that transaction, and refuses it where a tenant
//! that holds active tickets or its own limits here now has its shard on another
//! node, one this operation took away or made.

use pgrx::pg_sys;

use super::metadata::{column_text, connect, declared_table, query};
use super::moves::{held_query, lock_exclusively, names, HeldAs};
use super::placement::shard_of;
use super::planner::func_is;
use super::splits::{pend, written_here, Pending};
use crate::core::citus::{shard_may_leave, ShardChange};
use crate::core::QuotaError;

/// Citus' operations that take a shard off a node, as their calls are named (all in
/// pg_catalog): moves (the rebalancer and the background rebalancer call
/// citus_move_shard_placement too, each in a session of its own), then splits.
const MOVES: [&std::ffi::CStr; 2] = [
    c"citus_move_shard_placement",
    c"master_move_shard_placement",
];
const SPLITS: [&std::ffi::CStr; 2] = [
    c"citus_split_shard_by_split_points",
    c"isolate_tenant_to_new_shard",
];

thread_local! {
    /// Per function OID: which operation it is (None: none of them), for the
    /// function manager's question, asked at every lookup of a function that is not
    /// built in. Forgotten at any change of pg_proc.
    static KNOWN: std::cell::RefCell<std::collections::HashMap<u32, Option<ShardChange>>> =
        std::cell::RefCell::new(Default::default());
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn proc_changed(_arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    KNOWN.with_borrow_mut(|k| k.clear());
}

/// Which of Citus' shard operations function `funcid` is, if any. Where Citus is not
/// loaded, at once none.
pub fn operation(funcid: pg_sys::Oid) -> Option<ShardChange> {
    if !super::metadata::citus_loaded() {
        return None;
    }
    if let Some(known) = KNOWN.with_borrow(|k| k.get(&u32::from(funcid)).copied()) {
        return known;
    }
    // Backends are single-threaded: this one's flag.
    static mut REGISTERED: bool = false;
    // SAFETY: single-threaded backend state; the callback is registered once.
    unsafe {
        if !REGISTERED {
            pg_sys::CacheRegisterSyscacheCallback(
                pg_sys::SysCacheIdentifier::PROCOID as i32,
                Some(proc_changed),
                pg_sys::Datum::from(0),
            );
            REGISTERED = true;
        }
    }
    let named = |list: &[&std::ffi::CStr]| {
        let names: Vec<_> = list.iter().map(|n| (c"pg_catalog", *n)).collect();
        func_is(funcid, &names)
    };
    let op = if named(&MOVES) {
        Some(ShardChange::Move)
    } else if named(&SPLITS) {
        Some(ShardChange::Split)
    } else {
        None
    };
    KNOWN.with_borrow_mut(|k| k.insert(u32::from(funcid), op));
    op
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
/// node or a split replaces, named as shard_name() names it. Each as
/// `xmin:shard:exists` (whether the shard is still in the metadata: a moved one is,
/// a split one is not), joined with commas.
const GIVEN_UP: &std::ffi::CStr = c"
SELECT pg_catalog.string_agg(c.xmin::pg_catalog.text OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||)
         x.shard::pg_catalog.text OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||)
         (EXISTS (SELECT FROM pg_catalog.pg_dist_shard s WHERE s.shardid OPERATOR(pg_catalog.=) x.shard))::pg_catalog.text,
         ',')
  FROM pg_catalog.pg_dist_cleanup c,
       LATERAL (SELECT pg_catalog.substring(c.object_name, '_([0-9]+)\"?$')::pg_catalog.int8 AS shard) x
 WHERE c.object_type OPERATOR(pg_catalog.=) 1 AND c.policy_type OPERATOR(pg_catalog.=) 2
   AND c.node_group_id OPERATOR(pg_catalog.=) (SELECT l.groupid FROM pg_catalog.pg_dist_local_group l)
   AND x.shard OPERATOR(pg_catalog.>) 0
   AND pg_catalog.shard_name($1, x.shard, false) OPERATOR(pg_catalog.=) c.object_name";

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

/// As `change`, one of Citus' shard operations, begins here: has this transaction's
/// commit here check what it took from this node (`check`). Nothing is read now.
pub fn operation_begins(change: ShardChange) {
    if !super::splits::pending_run() {
        pend(Pending::Run { change });
    }
}

/// The transaction that ran one of Citus' shard operations here is about to commit
/// (or prepare), where pg_quota's starts are distributed by tenant and the cleanup
/// records are in Citus' catalog: the declared table's shards it gave up on this node
/// are locked (moves::lock_exclusively: a start in progress for one of their tenants
/// refuses the operation, 55P03, `change` naming it), and the operation is refused
/// where a tenant that holds active tickets or its own limits here now has its shard
/// on another node, a shard given up here (a move) or made by this transaction (a
/// split's). Nothing more is read where this node gave up no shard.
pub(super) fn check(change: ShardChange) -> Result<(), QuotaError> {
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
    // SAFETY: SPI inside the committing transaction; an ERROR unwinds through it and
    // the abort cleans SPI up.
    let found = unsafe {
        connect();
        let found = match declared_table(ns) {
            None => Ok(None),
            Some(d) => {
                let left = given_up(d.0);
                match left
                    .iter()
                    .try_for_each(|&(s, _)| lock_exclusively(s, change))
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
    // Per tenant's shard: what took it away from this node, if this operation did: a
    // move (the shard given up here is the tenant's, placed elsewhere now), or a split
    // (the tenant's shard is a new one, made by this transaction, placed elsewhere;
    // named by the shard it replaced here). A tenant whose shard this operation
    // neither gave up nor made is not its to judge (a superuser's start, never
    // refused, of a tenant of another node).
    let split_of = left
        .iter()
        .find(|(_, exists)| !exists)
        .unwrap_or(&left[0])
        .0;
    let mut away_of: std::collections::HashMap<i64, Option<(ShardChange, i64)>> =
        Default::default();
    let mut away = |tenant: &String| -> Option<(ShardChange, i64)> {
        // SAFETY: inside the committing transaction; a call of Citus' function with an
        // argument of its types; then SPI (written_here connects).
        let shard = unsafe { shard_of(shard_fn, table, owner, tenant.as_bytes()) };
        *away_of.entry(shard).or_insert_with(|| {
            if now.contains(&shard) {
                None
            } else if left.iter().any(|&(s, _)| s == shard) {
                Some((ShardChange::Move, shard))
            // SAFETY: as above.
            } else if unsafe { written_here(shard) } {
                Some((ShardChange::Split, split_of))
            } else {
                None
            }
        })
    };
    let active: Vec<(String, Option<(ShardChange, i64)>)> = active
        .into_iter()
        .map(|t| {
            let a = away(&t);
            (t, a)
        })
        .collect();
    let own: Vec<(String, Option<(ShardChange, i64)>)> = own
        .into_iter()
        .map(|t| {
            let a = away(&t);
            (t, a)
        })
        .collect();
    // The refusal names the first shard found, and the tenants it took away.
    let Some(first) = active.iter().chain(own.iter()).find_map(|(_, a)| *a) else {
        return Ok(());
    };
    let of_first = |list: Vec<(String, Option<(ShardChange, i64)>)>| -> Vec<String> {
        list.into_iter()
            .filter(|(_, a)| *a == Some(first))
            .map(|(t, _)| t)
            .collect()
    };
    shard_may_leave(first.0, first.1, of_first(active), of_first(own))
        .map_err(QuotaError::ShardMoveRefused)
}
