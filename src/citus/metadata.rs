//! The reads of Citus' catalogs, through SPI with kept plans and search_path pinned,
//! as committed now (the latest snapshot); and whether Citus is loaded at all.

use pgrx::pg_sys;

use crate::catalog::{name_text, AsRole};
use crate::core::citus::{Declared, Placed};

/// The colocation of pg_quota's start functions: the table Citus places them with
/// (the first of their colocation group) and its owner, how many colocation groups
/// they are in, and whether each is distributed by its tenant argument. Only
/// start() and try_start() count: set_tenant_limits() follows (USER_GUIDE "Citus").
const DECLARED: &std::ffi::CStr = c"
SELECT r.logicalrelid::pg_catalog.oid, k.relowner, c.groups, c.by_tenant,
       pg_catalog.to_regprocedure('pg_catalog.get_shard_id_for_distribution_column(pg_catalog.regclass,pg_catalog.\"any\")')::pg_catalog.oid
  FROM (SELECT pg_catalog.min(o.colocationid) AS colocationid,
               pg_catalog.count(DISTINCT o.colocationid) AS groups,
               pg_catalog.bool_and(o.distribution_argument_index = 4) AS by_tenant
          FROM pg_catalog.pg_dist_object o
          JOIN pg_catalog.pg_proc f ON f.oid = o.objid
         WHERE o.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
           AND o.colocationid IS NOT NULL AND o.colocationid <> 0
           AND f.pronamespace = $1 AND f.proname IN ('start', 'try_start')
        HAVING pg_catalog.count(*) > 0) c
  LEFT JOIN LATERAL (SELECT d.logicalrelid FROM pg_catalog.pg_dist_partition d
                      WHERE d.colocationid = c.colocationid
                      ORDER BY d.logicalrelid LIMIT 1) r ON true
  LEFT JOIN pg_catalog.pg_class k ON k.oid = r.logicalrelid";

/// The nodes that hold shard $2 of table $1, and whether this one does.
const PLACED: &std::ffi::CStr = c"
SELECT $1::pg_catalog.regclass::pg_catalog.text,
       coalesce(pg_catalog.bool_or(p.groupid = (SELECT l.groupid FROM pg_catalog.pg_dist_local_group l)), false),
       coalesce(pg_catalog.string_agg(n.nodename || ':' || n.nodeport, ', ' ORDER BY n.nodeid), '')
  FROM pg_catalog.pg_dist_placement p
  LEFT JOIN pg_catalog.pg_dist_node n ON n.groupid = p.groupid AND n.noderole = 'primary'
 WHERE p.shardid = $2";

/// The slots of the plans kept for the backend's life (SPI_keepplan): the plan cache
/// replans them when a catalog they read changes.
const DECLARED_PLAN: usize = 0;
const PLACED_PLAN: usize = 1;

/// DECLARED as it reads now.
///
/// # Safety
/// Inside a transaction; `ns` is schema quota's OID (or InvalidOid).
pub(super) unsafe fn read_declared_now(ns: pg_sys::Oid) -> Declared {
    // SAFETY: the caller's.
    unsafe {
        connect();
        let d = match read_declared(ns) {
            None => Declared::No,
            Some(groups) if groups != 1 || !column_bool(4) => Declared::Misdeclared { groups },
            Some(_) => match (column_oid(1), column_oid(2)) {
                (Some(table), Some(owner)) => Declared::With {
                    table: table.into(),
                    owner: owner.into(),
                    shard_fn: column_oid(5).map_or(0, u32::from),
                },
                _ => Declared::NoTable,
            },
        };
        pg_sys::SPI_finish();
        d
    }
}

/// PLACED as it reads now: the nodes that hold `shard` of `table`.
///
/// # Safety
/// Inside a transaction; `table` is a distributed table's OID.
pub(super) unsafe fn read_placed(table: pg_sys::Oid, shard: i64) -> Placed {
    // SAFETY: the caller's.
    unsafe {
        connect();
        query(
            pg_sys::GetUserId(),
            Some(PLACED_PLAN),
            PLACED,
            &[
                (pg_sys::OIDOID, pg_sys::Datum::from(table)),
                (pg_sys::INT8OID, pg_sys::Datum::from(shard)),
            ],
        );
        let placed = Placed {
            table: column_text(1).unwrap_or_else(|| u32::from(table).to_string()),
            here: column_bool(2),
            nodes: column_text(3).unwrap_or_default(),
        };
        pg_sys::SPI_finish();
        placed
    }
}

/// Reads DECLARED (its row left in SPI_tuptable): the number of colocation groups of
/// pg_quota's distributed start functions, None where none is distributed. With the
/// caller's own privileges: Citus' metadata is readable by all.
///
/// # Safety
/// Connected to SPI; `ns` is schema quota's OID (or InvalidOid).
pub(super) unsafe fn read_declared(ns: pg_sys::Oid) -> Option<i64> {
    // SAFETY: the caller's.
    unsafe {
        let found = query(
            pg_sys::GetUserId(),
            Some(DECLARED_PLAN),
            DECLARED,
            &[(pg_sys::OIDOID, pg_sys::Datum::from(ns))],
        );
        (found == 1).then(|| column(3).map_or(0, |d| d.value() as i64))
    }
}

/// The table DECLARED names (the first of the start functions' colocation group), its
/// owner, and the OID of Citus' get_shard_id_for_distribution_column (InvalidOid if it
/// is missing), however the start functions are distributed; None where none is, or
/// where their group has no table. For the guards of moves and splits, which judge
/// what this node holds rather than what a start would make of the declaration.
///
/// # Safety
/// Connected to SPI; `ns` is schema quota's OID (or InvalidOid).
pub(super) unsafe fn declared_table(
    ns: pg_sys::Oid,
) -> Option<(pg_sys::Oid, pg_sys::Oid, pg_sys::Oid)> {
    // SAFETY: the caller's.
    unsafe {
        read_declared(ns)?;
        Some((
            column_oid(1)?,
            column_oid(2)?,
            column_oid(5).unwrap_or(pg_sys::InvalidOid),
        ))
    }
}

/// Schema quota's OID; None where it is gone.
pub(super) fn quota_ns() -> Option<pg_sys::Oid> {
    // SAFETY: a syscache lookup; InvalidOid where the schema is missing.
    let ns = unsafe { pg_sys::get_namespace_oid(c"quota".as_ptr(), true) };
    (ns != pg_sys::InvalidOid).then_some(ns)
}

/// # Safety
/// Inside a transaction.
pub(super) unsafe fn connect() {
    // SAFETY: the caller's.
    if unsafe { pg_sys::SPI_connect() } != pg_sys::SPI_OK_CONNECT as i32 {
        pgrx::error!("pg_quota: SPI_connect failed");
    }
}

/// Runs `sql` read-only as `role`, with search_path pinned (catalog::AsRole: an
/// operator of the caller's schemas must not stand in for pg_catalog's), with `args`
/// under the latest snapshot; the number of rows (at most one is kept). With a slot,
/// its plan is prepared once and kept.
///
/// # Safety
/// Connected to SPI; the datums are valid for their types; a slot always names the
/// same `sql` and argument types.
pub(super) unsafe fn query(
    role: pg_sys::Oid,
    slot: Option<usize>,
    sql: &std::ffi::CStr,
    args: &[(pg_sys::Oid, pg_sys::Datum)],
) -> u64 {
    // Backends are single-threaded: this one's kept plans.
    static mut KEPT: [pg_sys::SPIPlanPtr; 2] = [std::ptr::null_mut(); 2];
    let mut types: Vec<pg_sys::Oid> = args.iter().map(|a| a.0).collect();
    let mut values: Vec<pg_sys::Datum> = args.iter().map(|a| a.1).collect();
    let _as_role = AsRole::enter(role);
    // SAFETY: the caller's; an error raises ERROR, and the return codes are checked.
    // KEPT is this backend's alone.
    unsafe {
        let kept = slot.map(|i| &mut *std::ptr::addr_of_mut!(KEPT[i]));
        let plan = match kept {
            Some(p) if !p.is_null() => *p,
            _ => {
                let plan = pg_sys::SPI_prepare(sql.as_ptr(), args.len() as i32, types.as_mut_ptr());
                if plan.is_null() {
                    let code = std::ptr::addr_of!(pg_sys::SPI_result).read();
                    pgrx::error!("pg_quota: reading Citus' metadata failed: {code}");
                }
                if let Some(p) = kept {
                    if pg_sys::SPI_keepplan(plan) == 0 {
                        *p = plan;
                    }
                }
                plan
            }
        };
        let rc = pg_sys::SPI_execute_snapshot(
            plan,
            values.as_mut_ptr(),
            std::ptr::null(),
            pg_sys::GetLatestSnapshot(),
            std::ptr::null_mut(),
            true,
            false,
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
pub(super) unsafe fn column(n: i32) -> Option<pg_sys::Datum> {
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
pub(super) unsafe fn column_oid(n: i32) -> Option<pg_sys::Oid> {
    // SAFETY: the caller's.
    unsafe { column(n) }.map(|d| pg_sys::Oid::from(d.value() as u32))
}

/// # Safety
/// As `column`; the column is a bool.
pub(super) unsafe fn column_bool(n: i32) -> bool {
    // SAFETY: the caller's.
    unsafe { column(n) }.is_some_and(|d| d.value() != 0)
}

/// # Safety
/// As `column`.
pub(super) unsafe fn column_text(n: i32) -> Option<String> {
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

/// Whether Citus is loaded in this server (its GUCs are defined only then). Fixed
/// for the server's life: shared_preload_libraries.
pub(super) fn citus_loaded() -> bool {
    // Backends are single-threaded; 0 unknown, 1 no, 2 yes.
    static LOADED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
    match LOADED.load(std::sync::atomic::Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            // SAFETY: a GUC lookup; NULL where Citus never defined it.
            let loaded = unsafe {
                !pg_sys::GetConfigOption(c"citus.shard_count".as_ptr(), true, false).is_null()
            };
            LOADED.store(
                if loaded { 2 } else { 1 },
                std::sync::atomic::Ordering::Relaxed,
            );
            loaded
        }
    }
}
