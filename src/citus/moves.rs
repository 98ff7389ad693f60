//! A shard move seen on the node it would leave (Citus' own metadata update, once it
//! has run there), refused while tenants of the shard hold active tickets or their own
//! limits on this node; and what the split guard (splits.rs) shares with it.

use pgrx::pg_sys;

use super::metadata::{
    citus_loaded, column, column_text, connect, declared_table, query, quota_ns,
};
use super::planner::func_is;
use crate::core::citus::ShardChange;
use crate::core::QuotaError;

/// The shard, source group and target group of Citus' own
/// `SELECT citus_internal.update_placement_metadata(shard, source, target)`, which a
/// shard move (citus_move_shard_placement, the rebalancer) sends to every node with
/// metadata in its transaction (citus_call). The hook acts once the call has returned
/// its row: Citus' own checks then let its user change Citus' metadata (a superuser,
/// the table's owner, Citus' own connections), so a refusal may name the tenants, and
/// a call that was only planned or prepared takes no lock.
///
/// # Safety
/// `stmt` is the PlannedStmt the executor has run.
pub unsafe fn placement_update(stmt: *const pg_sys::PlannedStmt) -> Option<(i64, i32, i32)> {
    // Before Citus 12 (and from an older node during a rolling upgrade):
    // pg_catalog.citus_internal_update_placement_metadata.
    // SAFETY: the caller's.
    let args = unsafe {
        citus_call(
            stmt,
            &[
                (c"citus_internal", c"update_placement_metadata"),
                (c"pg_catalog", c"citus_internal_update_placement_metadata"),
            ],
            &[pg_sys::INT8OID, pg_sys::INT4OID, pg_sys::INT4OID],
        )
    }?;
    Some((
        args[0].value() as i64,
        args[1].value() as i32,
        args[2].value() as i32,
    ))
}

/// The constant arguments of a planned statement that is one call of one of Citus'
/// internal functions `names` (schema, name), with arguments of `types`:
/// `SELECT f(c1, c2, …)`, whose plan is a Result of that one call. None for anything
/// else (told apart by its shape alone, before any catalog lookup).
///
/// # Safety
/// `stmt` is the PlannedStmt the executor has run.
pub(super) unsafe fn citus_call(
    stmt: *const pg_sys::PlannedStmt,
    names: &[(&std::ffi::CStr, &std::ffi::CStr)],
    types: &[pg_sys::Oid],
) -> Option<Vec<pg_sys::Datum>> {
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
        if args.len() != types.len() || !func_is((*func).funcid, names) {
            return None;
        }
        // Citus writes a shard as a plain number, an int4 constant under an implicit
        // cast to int8, which the planner has folded.
        let mut values = Vec::with_capacity(types.len());
        for (i, ty) in types.iter().enumerate() {
            let arg = args.get_ptr(i)?;
            if (*arg).type_ != pg_sys::NodeTag::T_Const {
                return None;
            }
            let arg = arg.cast::<pg_sys::Const>();
            if (*arg).constisnull || (*arg).consttype != *ty {
                return None;
            }
            values.push((*arg).constvalue);
        }
        Some(values)
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
/// limits here. Run once Citus' metadata update has run here (so Citus' own checks
/// let its user change its metadata: a superuser, the table's owner, Citus' own
/// connections). Nothing is read unless pg_quota's starts are distributed by tenant.
pub fn shard_leaving(shard: i64, source: i32) -> Result<(), QuotaError> {
    let Some((ns, held)) = held_query(HeldAs::Arrays) else {
        return Ok(());
    };
    // SAFETY: SPI inside the move's transaction; an ERROR unwinds through it and the
    // abort cleans SPI up. The arrays read by one query stay in SPI's memory until
    // SPI_finish, after the next.
    unsafe {
        connect();
        let Some((table, owner, _)) = declared_table(ns) else {
            pg_sys::SPI_finish();
            return Ok(());
        };
        query(pg_sys::GetUserId(), None, LOCAL_GROUP, &[]);
        if column(1).map(|d| d.value() as i32) != Some(source) {
            pg_sys::SPI_finish();
            return Ok(()); // not the node the shard leaves
        }
        if let Err(e) = lock_exclusively(shard, ShardChange::Move) {
            pg_sys::SPI_finish();
            return Err(e);
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
        let (active, own) = (names(column_text(1)), names(column_text(2)));
        pg_sys::SPI_finish();
        crate::core::citus::shard_may_leave(ShardChange::Move, shard, active, own)
            .map_err(QuotaError::ShardMoveRefused)
    }
}

/// Takes pg_quota's lock on `shard` exclusively, to the end of the transaction: it
/// holds off new starts for the shard's tenants here. Where a start holds it (a
/// transactional charge not committed yet, a start that waits for capacity), `change`
/// is refused now (55P03) rather than left to wait: the start's transaction may next
/// write to the shard, which the change blocks, and the two would deadlock.
pub(super) fn lock_exclusively(shard: i64, change: ShardChange) -> Result<(), QuotaError> {
    // SAFETY: a plain read of backend state, and a conditional lock acquisition.
    unsafe {
        let mut tag = crate::scopes::shard_lock_tag(pg_sys::MyDatabaseId, shard);
        if pg_sys::LockAcquire(&mut tag, pg_sys::ExclusiveLock as i32, false, true)
            == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
        {
            return Err(QuotaError::ShardMoveBusy { shard, change });
        }
    }
    Ok(())
}

/// How held_query gives the tenants: as two text[] (for OF_SHARD), or as two texts of
/// names joined with a unit separator (`names`).
#[derive(Clone, Copy)]
pub(super) enum HeldAs {
    Arrays,
    Texts,
}

/// Schema quota's OID, and the query of the tenants with active tickets and with their
/// own limits here (HELD_HERE, as far as this version's tables have them); None where
/// pg_quota's schema is gone.
pub(super) fn held_query(shape: HeldAs) -> Option<(pg_sys::Oid, std::ffi::CString)> {
    let ns = quota_ns()?;
    // SAFETY: catalog probes.
    let (has_active, has_own) = unsafe {
        (
            pg_sys::get_relname_relid(c"active".as_ptr(), ns) != pg_sys::InvalidOid,
            pg_sys::get_relname_relid(c"tenant_overrides".as_ptr(), ns) != pg_sys::InvalidOid,
        )
    };
    let part = |has: bool, sql: &str| {
        let array = if has { sql } else { "NULL::pg_catalog.text[]" };
        match shape {
            HeldAs::Arrays => array.to_string(),
            HeldAs::Texts => format!("pg_catalog.array_to_string({array}, E'\\x1f')"),
        }
    };
    let sql = HELD_HERE
        .replace("{active}", &part(has_active, ACTIVE_HERE))
        .replace("{own}", &part(has_own, OWN_HERE));
    Some((
        ns,
        std::ffi::CString::new(sql).expect("no NUL in the query"),
    ))
}

/// Names joined with a unit separator, as OF_SHARD and held_query's texts give them.
pub(super) fn names(joined: Option<String>) -> Vec<String> {
    joined
        .filter(|s| !s.is_empty())
        .map(|s| s.split('\u{1f}').map(str::to_string).collect())
        .unwrap_or_default()
}
