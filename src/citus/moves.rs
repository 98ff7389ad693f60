//! A shard move seen on the node it would leave (Citus' own metadata update, as it
//! starts to run there), refused while tenants of the shard hold active tickets or
//! their own limits on this node.

use pgrx::pg_sys;

use super::metadata::{
    citus_loaded, column, column_oid, column_text, connect, query, read_declared,
};
use super::planner::func_is;
use crate::core::QuotaError;

/// The shard, source group and target group of Citus' own
/// `SELECT citus_internal.update_placement_metadata(shard, source, target)`, which a
/// shard move (citus_move_shard_placement, the rebalancer) sends to every node with
/// metadata in its transaction, as it is about to run: a planned statement whose
/// plan is a Result of that one call, run by a superuser (Citus' own connections;
/// pg_quota names tenants in its refusal, and a role that may not run the function
/// must not take pg_quota's lock by preparing a call of it). None for anything else
/// (told apart by its shape alone, before any catalog lookup).
///
/// # Safety
/// `stmt` is the PlannedStmt the executor is starting.
pub unsafe fn placement_update(stmt: *const pg_sys::PlannedStmt) -> Option<(i64, i32, i32)> {
    if !citus_loaded() {
        return None;
    }
    // SAFETY: the caller's; every node is checked for its tag before it is cast.
    unsafe {
        let plan = (*stmt).planTree;
        if (*stmt).commandType != pg_sys::CmdType::CMD_SELECT
            || plan.is_null()
            || (*plan).type_ != pg_sys::NodeTag::T_Result
            || !(*plan).lefttree.is_null()
            || !pg_sys::superuser_arg(pg_sys::GetUserId())
        {
            return None;
        }
        let targets = pgrx::PgList::<pg_sys::TargetEntry>::from_pg((*plan).targetlist);
        if targets.len() != 1 {
            return None;
        }
        let expr = (*targets.get_ptr(0)?).expr;
        if expr.is_null() || (*expr).type_ != pg_sys::NodeTag::T_FuncExpr {
            return None;
        }
        let func = expr.cast::<pg_sys::FuncExpr>();
        let args = pgrx::PgList::<pg_sys::Node>::from_pg((*func).args);
        if args.len() != 3 {
            return None;
        }
        // Before Citus 12 (and from an older node during a rolling upgrade):
        // pg_catalog.citus_internal_update_placement_metadata.
        if !func_is(
            (*func).funcid,
            &[
                (c"citus_internal", c"update_placement_metadata"),
                (c"pg_catalog", c"citus_internal_update_placement_metadata"),
            ],
        ) {
            return None;
        }
        // Citus writes the shard as a plain number, an int4 constant under an implicit
        // cast to int8, which the planner has folded.
        let mut consts = [(pg_sys::InvalidOid, pg_sys::Datum::from(0)); 3];
        for (i, c) in consts.iter_mut().enumerate() {
            let arg = args.get_ptr(i)?;
            if (*arg).type_ != pg_sys::NodeTag::T_Const {
                return None;
            }
            let arg = arg.cast::<pg_sys::Const>();
            if (*arg).constisnull {
                return None;
            }
            *c = ((*arg).consttype, (*arg).constvalue);
        }
        if consts[0].0 != pg_sys::INT8OID
            || consts[1].0 != pg_sys::INT4OID
            || consts[2].0 != pg_sys::INT4OID
        {
            return None;
        }
        Some((
            consts[0].1.value() as i64,
            consts[1].1.value() as i32,
            consts[2].1.value() as i32,
        ))
    }
}

/// This node's group.
const LOCAL_GROUP: &std::ffi::CStr = c"SELECT l.groupid FROM pg_catalog.pg_dist_local_group l";

/// The tenants with active tickets and with their own limits here. Read as the
/// bootstrap superuser (pg_quota's tables are not the move's user's to read), with
/// search_path pinned, by a query that calls no code but PostgreSQL's own.
const HELD_HERE: &str = "SELECT {active}, {own}";
const ACTIVE_HERE: &str = "(SELECT pg_catalog.array_agg(DISTINCT a.tenant) FROM quota.active a
   WHERE a.tenant IS NOT NULL
     AND (a.lease_until IS NULL OR a.lease_until OPERATOR(pg_catalog.>) pg_catalog.now()))";
const OWN_HERE: &str = "(SELECT pg_catalog.array_agg(o.tenant) FROM quota.tenant_overrides o)";

/// Of the tenants in $2 and in $3, those whose shard of table $1 is $4, as the table's
/// owner (see PLACED), each list joined with a unit separator, sorted.
const OF_SHARD: &std::ffi::CStr = c"
SELECT (SELECT pg_catalog.string_agg(t, E'\\x1f' ORDER BY t) FROM pg_catalog.unnest($2) t
         WHERE pg_catalog.get_shard_id_for_distribution_column($1, t) OPERATOR(pg_catalog.=) $4),
       (SELECT pg_catalog.string_agg(t, E'\\x1f' ORDER BY t) FROM pg_catalog.unnest($3) t
         WHERE pg_catalog.get_shard_id_for_distribution_column($1, t) OPERATOR(pg_catalog.=) $4)";

/// Refuses (core::citus::shard_may_leave) Citus' move of `shard` off this node, the
/// source group `source`, where a tenant of the shard holds active tickets or its own
/// limits here. Nothing is read unless pg_quota's starts are distributed by tenant.
pub fn shard_leaving(shard: i64, source: i32) -> Result<(), QuotaError> {
    // SAFETY: schema quota's OID, InvalidOid if it is gone; then catalog probes.
    let (ns, has_active, has_own) = unsafe {
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        if ns == pg_sys::InvalidOid {
            return Ok(());
        }
        (
            ns,
            pg_sys::get_relname_relid(c"active".as_ptr(), ns) != pg_sys::InvalidOid,
            pg_sys::get_relname_relid(c"tenant_overrides".as_ptr(), ns) != pg_sys::InvalidOid,
        )
    };
    let held = std::ffi::CString::new(
        HELD_HERE
            .replace(
                "{active}",
                if has_active {
                    ACTIVE_HERE
                } else {
                    "NULL::pg_catalog.text[]"
                },
            )
            .replace(
                "{own}",
                if has_own {
                    OWN_HERE
                } else {
                    "NULL::pg_catalog.text[]"
                },
            ),
    )
    .expect("no NUL in the query");
    // SAFETY: SPI inside the move's transaction; an ERROR unwinds through it and the
    // abort cleans SPI up. The arrays read by the first query stay in SPI's memory
    // until SPI_finish, after the second.
    unsafe {
        connect();
        let found = read_declared(ns).is_some();
        let (true, Some(table), Some(owner)) = (found, column_oid(1), column_oid(2)) else {
            pg_sys::SPI_finish();
            return Ok(());
        };
        query(pg_sys::GetUserId(), None, LOCAL_GROUP, &[]);
        if column(1).map(|d| d.value() as i32) != Some(source) {
            pg_sys::SPI_finish();
            return Ok(()); // not the node the shard leaves
        }
        // Hold off new starts for the shard's tenants here to the move's end; where a
        // start holds the lock (a transactional charge not committed yet, a start that
        // waits for capacity), refuse now rather than wait: its transaction may next
        // write to the shard, which the move blocks, and the two would deadlock.
        let mut tag = crate::scopes::shard_lock_tag(pg_sys::MyDatabaseId, shard);
        if pg_sys::LockAcquire(&mut tag, pg_sys::ExclusiveLock as i32, false, true)
            == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
        {
            pg_sys::SPI_finish();
            return Err(QuotaError::ShardMoveBusy { shard });
        }
        query(pg_sys::BOOTSTRAP_SUPERUSERID.into(), None, &held, &[]);
        let (active, own) = (column(1), column(2));
        if active.is_none() && own.is_none() {
            pg_sys::SPI_finish();
            return Ok(());
        }
        // SAFETY: an empty text[] in the current (SPI's) memory context.
        let empty = || pg_sys::Datum::from(pg_sys::construct_empty_array(pg_sys::TEXTOID));
        query(
            owner,
            None,
            OF_SHARD,
            &[
                (pg_sys::OIDOID, pg_sys::Datum::from(table)),
                (pg_sys::TEXTARRAYOID, active.unwrap_or_else(empty)),
                (pg_sys::TEXTARRAYOID, own.unwrap_or_else(empty)),
                (pg_sys::INT8OID, pg_sys::Datum::from(shard)),
            ],
        );
        let split = |s: Option<String>| -> Vec<String> {
            s.map(|s| s.split('\u{1f}').map(str::to_string).collect())
                .unwrap_or_default()
        };
        let (active, own) = (split(column_text(1)), split(column_text(2)));
        pg_sys::SPI_finish();
        crate::core::citus::shard_may_leave(shard, active, own)
            .map_err(QuotaError::ShardMoveRefused)
    }
}
