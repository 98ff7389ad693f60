//! A shard move or split run on this node that takes shards from this node itself: a
//! coordinator that holds shards (`shouldhaveshards`). Citus changes the metadata of
//! the node that runs the operation in C, without the commands it sends the other
//! nodes (moves.rs, splits.rs), so pg_quota sees the operation by its call instead
//! (PostgreSQL's function-manager hook: hooks/mod.rs), notes which of the declared
//! table's shards this node holds as it begins, and, as its transaction commits here
//! (splits.rs), refuses it where a tenant that holds active tickets or its own limits
//! here now has its shard on another node, one this operation took away or made.

use pgrx::pg_sys;

use super::metadata::{column_text, connect, declared_table, query, quota_ns};
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

/// As `change`, one of Citus' shard operations, begins here, where pg_quota's starts
/// are distributed by tenant: notes the declared table's shards this node holds, for
/// `check` as the transaction commits. The first operation of a transaction is the
/// one noted (what it saw is what the transaction began from).
pub fn operation_begins(change: ShardChange) -> Result<(), QuotaError> {
    if super::splits::pending_run() {
        return Ok(());
    }
    let Some(ns) = quota_ns() else {
        return Ok(());
    };
    // SAFETY: SPI inside the operation's transaction; an ERROR unwinds through it and
    // the abort cleans SPI up.
    let before = unsafe {
        connect();
        let before = declared_table(ns).map(|(table, ..)| placed_here(table));
        pg_sys::SPI_finish();
        before
    };
    if let Some(before) = before {
        pend(Pending::Run { change, before });
    }
    Ok(())
}

/// The transaction that ran `change` here is about to commit (or prepare): the
/// declared table's shards this node held as it began and holds no longer are locked
/// (moves::lock_exclusively: a start in progress for one of their tenants refuses the
/// operation, 55P03), and the operation is refused where a tenant that holds active
/// tickets or its own limits here now has its shard on another node, a shard this
/// operation took from this node (a move) or made (a split). Nothing is read where
/// this node gave up no shard.
pub(super) fn check(change: ShardChange, before: &[i64]) -> Result<(), QuotaError> {
    let Some((ns, held)) = held_query(HeldAs::Texts) else {
        return Ok(());
    };
    // SAFETY: SPI inside the committing transaction, as in operation_begins.
    let found = unsafe {
        connect();
        let found = match declared_table(ns) {
            None => Ok(None),
            Some(d) => {
                let now = placed_here(d.0);
                let left: Vec<i64> = before
                    .iter()
                    .copied()
                    .filter(|s| !now.contains(s))
                    .collect();
                match left.iter().try_for_each(|&s| lock_exclusively(s, change)) {
                    Err(e) => Err(e),
                    Ok(()) if left.is_empty() => Ok(None),
                    Ok(()) => {
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
    // Per shard: whether a tenant of it is away because of this operation. A tenant
    // whose shard neither left this node nor was made by this transaction is not this
    // operation's to judge (a superuser's start, never refused, of a tenant of
    // another node).
    let mut away_of: std::collections::HashMap<i64, bool> = Default::default();
    let mut away = |tenant: &String| -> bool {
        // SAFETY: inside the committing transaction; a call of Citus' function with an
        // argument of its types; then SPI (written_here connects).
        let shard = unsafe { shard_of(shard_fn, table, owner, tenant.as_bytes()) };
        *away_of.entry(shard).or_insert_with(|| {
            // SAFETY: as above.
            !now.contains(&shard) && (left.contains(&shard) || unsafe { written_here(shard) })
        })
    };
    let active: Vec<String> = active.into_iter().filter(|t| away(t)).collect();
    let own: Vec<String> = own.into_iter().filter(|t| away(t)).collect();
    shard_may_leave(change, left[0], active, own).map_err(QuotaError::ShardMoveRefused)
}
