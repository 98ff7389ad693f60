//! A shard move seen on the node it would leave (Citus' own metadata update, as it
//! starts to run there), refused while tenants of the shard hold active tickets or
//! their own limits on this node.

use pgrx::pg_sys;

use super::metadata::{
    citus_loaded, column, column_oid, column_text, connect, query, read_declared,
};
use super::planner::func_is;
use crate::core::citus::ShardChange;
use crate::core::QuotaError;

/// The shard, source group and target group of Citus' own
/// `SELECT citus_internal.update_placement_metadata(shard, source, target)`, which a
/// shard move (citus_move_shard_placement, the rebalancer) sends to every node with
/// metadata in its transaction, as it is about to run (citus_call); as the user who
/// runs the move, a superuser or the table's owner (held_here judges: pg_quota names
/// tenants in its refusal, and a role that may not run the function must not take
/// pg_quota's lock by preparing a call of it).
///
/// # Safety
/// `stmt` is the PlannedStmt the executor is starting.
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
/// else (told apart by its shape alone, before any catalog lookup). Who runs it is
/// held_here's to judge.
///
/// # Safety
/// `stmt` is the PlannedStmt the executor is starting.
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

/// The owner of shard $1's table.
const SHARD_OWNER: &std::ffi::CStr = c"
SELECT c.relowner FROM pg_catalog.pg_dist_shard s
  JOIN pg_catalog.pg_class c ON c.oid = s.logicalrelid
 WHERE s.shardid = $1";

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
    // SAFETY: connected to SPI by held_here, inside the move's transaction.
    let concerned = |_: pg_sys::Oid| unsafe {
        query(pg_sys::GetUserId(), None, LOCAL_GROUP, &[]);
        column(1).map(|d| d.value() as i32) == Some(source) // the node the shard leaves
    };
    match held_here(shard, ShardChange::Move, concerned)? {
        Some(held) => {
            crate::core::citus::shard_may_leave(ShardChange::Move, shard, held.active, held.own)
                .map_err(QuotaError::ShardMoveRefused)
        }
        None => Ok(()),
    }
}

/// Of a shard that Citus moves or splits on this node: the table pg_quota's start
/// functions are colocated with, its owner, and Citus' function that gives a tenant's
/// shard; the shard's tenants with active tickets here, and with their own limits here.
pub(super) struct Held {
    pub table: pg_sys::Oid,
    pub owner: pg_sys::Oid,
    pub shard_fn: pg_sys::Oid,
    pub active: Vec<String>,
    pub own: Vec<String>,
}

/// Where pg_quota's starts are distributed by tenant and `concerned` (run connected
/// to SPI, with the table the start functions are colocated with) says that `change`
/// of `shard` concerns this node: takes pg_quota's lock on the shard exclusively, to
/// the end of the transaction, and reads what its tenants hold here (Held). None
/// where this node is not concerned. The lock holds off new starts for the shard's
/// tenants here; where a start holds it (a transactional charge not committed yet, a
/// start that waits for capacity), the change is refused now (55P03) rather than left
/// to wait: the start's transaction may next write to the shard, which the change
/// blocks, and the two would deadlock.
pub(super) fn held_here(
    shard: i64,
    change: ShardChange,
    concerned: impl FnOnce(pg_sys::Oid) -> bool,
) -> Result<Option<Held>, QuotaError> {
    // SAFETY: schema quota's OID, InvalidOid if it is gone; then catalog probes.
    let (ns, has_active, has_own) = unsafe {
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        if ns == pg_sys::InvalidOid {
            return Ok(None);
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
    // SAFETY: SPI inside the change's transaction; an ERROR unwinds through it and the
    // abort cleans SPI up. The arrays read by one query stay in SPI's memory until
    // SPI_finish, after the next.
    unsafe {
        connect();
        let found = read_declared(ns).is_some();
        let (true, Some(table), Some(owner)) = (found, column_oid(1), column_oid(2)) else {
            pg_sys::SPI_finish();
            return Ok(None);
        };
        let shard_fn = column_oid(5).unwrap_or(pg_sys::InvalidOid);
        // Citus sends its metadata commands as the user who runs the operation, which
        // it lets the owner of the shard's table run: a superuser or that owner (or a
        // member of its role). Anyone else's call fails in Citus' own checks; until
        // then it must not take pg_quota's lock, nor learn the names of the tenants
        // that the refusal would give.
        query(
            pg_sys::GetUserId(),
            None,
            SHARD_OWNER,
            &[(pg_sys::INT8OID, pg_sys::Datum::from(shard))],
        );
        let user = pg_sys::GetUserId();
        let may = column_oid(1).is_some_and(|o| pg_sys::has_privs_of_role(user, o));
        if !(pg_sys::superuser_arg(user) || may) || !concerned(table) {
            pg_sys::SPI_finish();
            return Ok(None);
        }
        let mut tag = crate::scopes::shard_lock_tag(pg_sys::MyDatabaseId, shard);
        if pg_sys::LockAcquire(&mut tag, pg_sys::ExclusiveLock as i32, false, true)
            == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
        {
            pg_sys::SPI_finish();
            return Err(QuotaError::ShardMoveBusy { shard, change });
        }
        let mut out = Held {
            table,
            owner,
            shard_fn,
            active: Vec::new(),
            own: Vec::new(),
        };
        query(pg_sys::BOOTSTRAP_SUPERUSERID.into(), None, &held, &[]);
        let (active, own) = (column(1), column(2));
        if active.is_none() && own.is_none() {
            pg_sys::SPI_finish();
            return Ok(Some(out));
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
        out.active = split(column_text(1));
        out.own = split(column_text(2));
        pg_sys::SPI_finish();
        Ok(Some(out))
    }
}
