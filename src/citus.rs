//! Layer 3, beside ledger/: what this node's Citus metadata says of a tenant (0.7.1), for
//! core::citus::admit_here. Nothing is read where Citus is not loaded in this server
//! or not installed in this database, or where pg_quota's start functions are not
//! distributed: a start then costs one GUC lookup and one catalog probe more.

use pgrx::pg_sys;

use crate::catalog::{name_text, AsRole};
use crate::core::citus::Placement;
use crate::ledger::scan::text_datum;

/// The colocation of pg_quota's start functions: the table Citus places them with
/// (the first of their colocation group), and its owner. The first distributed start
/// function decides; USER_GUIDE "Citus" has them all distributed alike.
const DECLARED: &std::ffi::CStr = c"
SELECT r.logicalrelid::pg_catalog.oid, k.relowner
  FROM (SELECT o.colocationid FROM pg_catalog.pg_dist_object o
          JOIN pg_catalog.pg_proc f ON f.oid = o.objid
         WHERE o.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
           AND o.colocationid IS NOT NULL AND o.colocationid <> 0
           AND f.pronamespace = $1 AND f.proname IN ('start', 'try_start')
         ORDER BY o.objid LIMIT 1) c
  LEFT JOIN LATERAL (SELECT d.logicalrelid FROM pg_catalog.pg_dist_partition d
                      WHERE d.colocationid = c.colocationid
                      ORDER BY d.logicalrelid LIMIT 1) r ON true
  LEFT JOIN pg_catalog.pg_class k ON k.oid = r.logicalrelid";

/// The nodes that hold the tenant's shard of the table, and whether this one does.
/// Run as the table's owner: get_shard_id_for_distribution_column() wants SELECT on
/// it, which a role that only starts tickets need not have.
const PLACED: &std::ffi::CStr = c"
SELECT $1::pg_catalog.regclass::pg_catalog.text,
       coalesce(pg_catalog.bool_or(p.groupid = (SELECT l.groupid FROM pg_catalog.pg_dist_local_group l)), false),
       coalesce(pg_catalog.string_agg(n.nodename || ':' || n.nodeport, ', ' ORDER BY n.nodeid), '')
  FROM pg_catalog.pg_dist_placement p
  LEFT JOIN pg_catalog.pg_dist_node n ON n.groupid = p.groupid AND n.noderole = 'primary'
 WHERE p.shardid = pg_catalog.get_shard_id_for_distribution_column($1, $2)";

/// Where `tenant` lives, if pg_quota's start functions are distributed by tenant in
/// this database; None where they are not (or Citus is not here).
pub fn placement(tenant: &[u8]) -> Option<Placement> {
    // SAFETY: a GUC lookup (NULL where Citus never defined it: not preloaded) and a
    // catalog probe of pg_extension, both inside the caller's transaction.
    unsafe {
        if pg_sys::GetConfigOption(c"citus.shard_count".as_ptr(), true, false).is_null()
            || pg_sys::get_extension_oid(c"citus".as_ptr(), true) == pg_sys::InvalidOid
        {
            return None;
        }
    }
    // SAFETY: schema quota's OID, InvalidOid if it is gone (then nothing matches).
    let ns = unsafe { pg_sys::get_namespace_oid(c"quota".as_ptr(), true) };
    // SAFETY: SPI inside the caller's transaction; an ERROR unwinds through it and the
    // transaction's abort cleans SPI up. Columns are read by the query's own types.
    unsafe {
        connect();
        // The caller's own privileges (Citus' metadata is readable by all), with
        // search_path pinned: an operator of the caller's schemas must not stand in
        // for pg_catalog's.
        let as_caller = AsRole::enter(pg_sys::GetUserId());
        let found = query(DECLARED, &[(pg_sys::OIDOID, pg_sys::Datum::from(ns))]);
        drop(as_caller);
        if found == 0 {
            pg_sys::SPI_finish();
            return None;
        }
        // A table dropped since its colocation was read has no owner: as no table.
        let (Some(table), Some(owner)) = (column_oid(1), column_oid(2)) else {
            pg_sys::SPI_finish();
            return Some(Placement {
                table: None,
                nodes: String::new(),
                here: false,
            });
        };
        let as_owner = AsRole::enter(owner);
        query(
            PLACED,
            &[
                (pg_sys::OIDOID, pg_sys::Datum::from(table)),
                (pg_sys::TEXTOID, text_datum(tenant)),
            ],
        );
        drop(as_owner);
        let placement = Placement {
            table: Some(column_text(1).unwrap_or_else(|| u32::from(table).to_string())),
            here: column_bool(2),
            nodes: column_text(3).unwrap_or_default(),
        };
        pg_sys::SPI_finish();
        Some(placement)
    }
}

/// Says once per session, as a WARNING, that the role's own active limit and the
/// database cap count per node (core::citus::per_node_warning), where any is set.
pub fn warn_per_node(limits: &crate::core::Limits) {
    // Backends are single-threaded: a plain flag of this one's.
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if WARNED.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    if let Some(w) = crate::core::citus::per_node_warning(limits.max_active, limits.max_db) {
        WARNED.store(true, std::sync::atomic::Ordering::Relaxed);
        pgrx::warning!("{w}");
    }
}

/// # Safety
/// Inside a transaction.
unsafe fn connect() {
    // SAFETY: the caller's.
    if unsafe { pg_sys::SPI_connect() } != pg_sys::SPI_OK_CONNECT as i32 {
        pgrx::error!("pg_quota: SPI_connect failed");
    }
}

/// Runs `sql` read-only with `args`; the number of rows (at most one is kept).
///
/// # Safety
/// Connected to SPI; the datums are valid for their types.
unsafe fn query(sql: &std::ffi::CStr, args: &[(pg_sys::Oid, pg_sys::Datum)]) -> u64 {
    let mut types: Vec<pg_sys::Oid> = args.iter().map(|a| a.0).collect();
    let mut values: Vec<pg_sys::Datum> = args.iter().map(|a| a.1).collect();
    // SAFETY: the caller's; an error raises ERROR, and the return code is checked.
    unsafe {
        let rc = pg_sys::SPI_execute_with_args(
            sql.as_ptr(),
            args.len() as i32,
            types.as_mut_ptr(),
            values.as_mut_ptr(),
            std::ptr::null(),
            true,
            1,
        );
        if rc != pg_sys::SPI_OK_SELECT as i32 {
            pgrx::error!("pg_quota: reading Citus' metadata failed: {rc}");
        }
        pg_sys::SPI_processed
    }
}

/// # Safety
/// After `query` returned a row; `n` is a column of it.
unsafe fn column(n: i32) -> Option<pg_sys::Datum> {
    let mut null = false;
    // SAFETY: the caller's.
    let d = unsafe {
        let t = pg_sys::SPI_tuptable;
        if t.is_null() || (*t).numvals == 0 {
            return None;
        }
        pg_sys::SPI_getbinval(*(*t).vals, (*t).tupdesc, n, &mut null)
    };
    (!null).then_some(d)
}

/// # Safety
/// As `column`; the column is an oid.
unsafe fn column_oid(n: i32) -> Option<pg_sys::Oid> {
    // SAFETY: the caller's.
    unsafe { column(n) }.map(|d| pg_sys::Oid::from(d.value() as u32))
}

/// # Safety
/// As `column`; the column is a bool.
unsafe fn column_bool(n: i32) -> bool {
    // SAFETY: the caller's.
    unsafe { column(n) }.is_some_and(|d| d.value() != 0)
}

/// # Safety
/// As `column`.
unsafe fn column_text(n: i32) -> Option<String> {
    // SAFETY: the caller's; SPI_getvalue is the column's output text, palloc'd in
    // the server encoding, NULL for a NULL.
    unsafe {
        let t = pg_sys::SPI_tuptable;
        if t.is_null() || (*t).numvals == 0 {
            return None;
        }
        let p = pg_sys::SPI_getvalue(*(*t).vals, (*t).tupdesc, n);
        (!p.is_null()).then(|| name_text(p))
    }
}

/// The shard, source group and target group of Citus' own
/// `SELECT citus_internal.update_placement_metadata(shard, source, target)`, which a
/// shard move (citus_move_shard_placement, the rebalancer) sends to every node with
/// metadata in its transaction; None for any other query (most are told apart by
/// their shape alone, before any catalog lookup).
///
/// # Safety
/// `query` is a Query that parse analysis just produced.
pub unsafe fn placement_update(query: *const pg_sys::Query) -> Option<(i64, i32, i32)> {
    // SAFETY: the caller's; every node is checked for its tag before it is cast.
    unsafe {
        if (*query).commandType != pg_sys::CmdType::CMD_SELECT
            || (!(*query).jointree.is_null() && !(*(*query).jointree).quals.is_null())
        {
            return None;
        }
        let targets = pgrx::PgList::<pg_sys::TargetEntry>::from_pg((*query).targetList);
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
        let name = pg_sys::get_func_name((*func).funcid);
        if name.is_null() || std::ffi::CStr::from_ptr(name) != c"update_placement_metadata" {
            return None;
        }
        let schema = pg_sys::get_namespace_name(pg_sys::get_func_namespace((*func).funcid));
        if schema.is_null() || std::ffi::CStr::from_ptr(schema) != c"citus_internal" {
            return None;
        }
        // Citus writes the shard as a plain number, which parse analysis leaves as an
        // int4 constant under an implicit cast to int8: folded here, as the planner
        // would.
        let mut consts = [(pg_sys::InvalidOid, pg_sys::Datum::from(0)); 3];
        for (i, c) in consts.iter_mut().enumerate() {
            let arg = pg_sys::eval_const_expressions(std::ptr::null_mut(), args.get_ptr(i)?);
            if arg.is_null() || (*arg).type_ != pg_sys::NodeTag::T_Const {
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

/// This node's group, and the tenants with active tickets and with their own limits
/// here. Read as the bootstrap superuser (pg_quota's tables are not the move's
/// user's to read), with search_path pinned, by a query that calls no code but
/// PostgreSQL's own.
const HELD_HERE: &str = "
SELECT (SELECT l.groupid FROM pg_catalog.pg_dist_local_group l), {active}, {own}";
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
pub fn shard_leaving(shard: i64, source: i32) -> Result<(), crate::core::QuotaError> {
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
        let as_caller = AsRole::enter(pg_sys::GetUserId());
        let found = query(DECLARED, &[(pg_sys::OIDOID, pg_sys::Datum::from(ns))]);
        drop(as_caller);
        let (true, Some(table), Some(owner)) = (found == 1, column_oid(1), column_oid(2)) else {
            pg_sys::SPI_finish();
            return Ok(());
        };
        let as_superuser = AsRole::enter(pg_sys::BOOTSTRAP_SUPERUSERID.into());
        query(&held, &[]);
        drop(as_superuser);
        let here = column(1).map(|d| d.value() as i32);
        let (active, own) = (column(2), column(3));
        if here != Some(source) || (active.is_none() && own.is_none()) {
            pg_sys::SPI_finish();
            return Ok(());
        }
        // SAFETY: an empty text[] in the current (SPI's) memory context.
        let empty = || pg_sys::Datum::from(pg_sys::construct_empty_array(pg_sys::TEXTOID));
        let as_owner = AsRole::enter(owner);
        query(
            OF_SHARD,
            &[
                (pg_sys::OIDOID, pg_sys::Datum::from(table)),
                (pg_sys::TEXTARRAYOID, active.unwrap_or_else(empty)),
                (pg_sys::TEXTARRAYOID, own.unwrap_or_else(empty)),
                (pg_sys::INT8OID, pg_sys::Datum::from(shard)),
            ],
        );
        drop(as_owner);
        let split = |s: Option<String>| -> Vec<String> {
            s.map(|s| s.split('\u{1f}').map(str::to_string).collect())
                .unwrap_or_default()
        };
        let (active, own) = (split(column_text(1)), split(column_text(2)));
        pg_sys::SPI_finish();
        crate::core::citus::shard_may_leave(shard, active, own)
            .map_err(crate::core::QuotaError::ShardMoveRefused)
    }
}
