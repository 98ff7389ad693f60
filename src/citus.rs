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
