//! Layer 3, the ledger: the indexes pg_quota reads on its tables, found by what they
//! index (their leading columns, order, operators, collation and predicate), not by
//! name, so that REINDEX CONCURRENTLY (which swaps names) and renames do not matter;
//! and the predicates of partial indexes, as far as pg_quota evaluates them.

use pgrx::pg_sys;

use crate::compat;
use crate::core::QuotaError;
use crate::error::raise;
use crate::ledger::locks::lock_bounded;
use crate::ledger::{
    COL_ENDED_AT, COL_ID, COL_KEY, COL_LEASE_UNTIL, COL_ROLE, COL_TENANT, COL_TXID, NCOLS_V2,
    NCOLS_V5,
};

/// An index predicate as pg_quota can evaluate it: the columns (1-based) it requires to
/// be NULL (true) or NOT NULL (false), all of them. None for any other predicate, and
/// an empty list for an index without one.
///
/// # Safety
/// `idx` is an open index.
pub unsafe fn null_tests(idx: pg_sys::Relation) -> Option<Vec<(usize, bool)>> {
    // SAFETY: the relcache's predicate, an implicitly ANDed list of expression nodes,
    // read only; node tags are checked before each cast.
    unsafe {
        let pred = pg_sys::RelationGetIndexPredicate(idx);
        let mut out = Vec::new();
        if pred.is_null() {
            return Some(out);
        }
        for k in 0..(*pred).length as usize {
            let node = (*(*pred).elements.add(k)).ptr_value as *mut pg_sys::Node;
            if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_NullTest {
                return None;
            }
            let test = node as *mut pg_sys::NullTest;
            let arg = (*test).arg as *mut pg_sys::Node;
            if arg.is_null() || (*arg).type_ != pg_sys::NodeTag::T_Var || (*test).argisrow {
                return None;
            }
            let attno = (*(arg as *mut pg_sys::Var)).varattno;
            if attno <= 0 {
                return None;
            }
            out.push((
                attno as usize,
                (*test).nulltesttype == pg_sys::NullTestType::IS_NULL,
            ));
        }
        Some(out)
    }
}

/// The first valid, plain btree index of `heap` whose leading key columns are `keys`
/// and whose predicate is exactly `predicate` (see `null_tests`; empty: none).
pub(super) fn find_index(
    heap: pg_sys::Relation,
    keys: &[usize],
    predicate: &[(usize, bool)],
) -> Option<pg_sys::Oid> {
    // SAFETY: `heap` is open and locked; each index is locked before it is opened and
    // unlocked after, as the planner does when it inspects indexes.
    unsafe {
        let list = pg_sys::RelationGetIndexList(heap);
        let n = if list.is_null() {
            0
        } else {
            (*list).length as usize
        };
        for i in 0..n {
            let oid = (*(*list).elements.add(i)).oid_value;
            lock_bounded(oid, pg_sys::AccessShareLock);
            let idx = pg_sys::index_open(oid, pg_sys::NoLock as i32);
            let ix = &*(*idx).rd_index;
            let nkeys = ix.indnkeyatts as usize;
            let key = |k: usize| *ix.indkey.values.as_ptr().add(k) as usize;
            // The scans assume ascending order with the type's default operators: a
            // DBA's index on (role DESC, …) or with another operator class would
            // return rows in another order, or compare them differently.
            // And with the column's own collation, or a deterministic one (equality is
            // all the scans ask of text): a tenant's text compared under a DBA's
            // case-insensitive collation would match other tenants' tickets.
            let plain_order = |k: usize| {
                let typ = (*compat::tuple_desc_attr((*idx).rd_att, k)).atttypid;
                let default = pg_sys::GetDefaultOpClass(typ, pg_sys::BTREE_AM_OID);
                let column = (*compat::tuple_desc_attr((*heap).rd_att, keys[k] - 1)).attcollation;
                *(*idx).rd_indoption.add(k) == 0
                    && default != pg_sys::InvalidOid
                    && *(*idx).rd_opfamily.add(k) == pg_sys::get_opclass_family(default)
                    && {
                        let coll = *(*idx).rd_indcollation.add(k);
                        coll == column
                            || (coll != pg_sys::InvalidOid
                                && pg_sys::get_collation_isdeterministic(coll))
                    }
            };
            let usable = (*(*idx).rd_rel).relam == pg_sys::BTREE_AM_OID
                && ix.indisvalid
                && ix.indisready
                && ix.indislive
                && nkeys >= keys.len()
                && keys
                    .iter()
                    .enumerate()
                    .all(|(k, &col)| key(k) == col && plain_order(k))
                && pg_sys::RelationGetIndexExpressions(idx).is_null()
                && null_tests(idx).as_deref() == Some(predicate);
            pg_sys::index_close(idx, pg_sys::NoLock as i32);
            pg_sys::UnlockRelationOid(oid, pg_sys::AccessShareLock as i32);
            if usable {
                return Some(oid);
            }
        }
        None
    }
}

/// The indexes of a ledger table (quota.ledger before 0.6.0, quota.active or
/// quota.history from 0.6.0), as `Rels` names them; a missing one is an error naming
/// `name`. `key_partial`: its key index is on keyed tickets only (quota.active's, so
/// the schema is 0.6.0's or later). `starts`: the table tickets start in; before 0.6.0
/// it holds the history too, and needs an index on (ended_at, lease_until) for its
/// unended tickets (`open`); quota.active has one in 0.6.0 only, quota.history none.
/// Every index is found by the prefix pg_quota needs, and with lease_until next where
/// it has it (`Rels::ledger_idx_leased`), so that this library serves 0.6.0's
/// quota.active as 0.6.0's did, and 0.6.1's, without lease_until.
#[derive(Clone, Copy)]
pub(super) struct TableIndexes {
    pub(super) pkey: pg_sys::Oid,
    pub(super) idx: pg_sys::Oid,
    pub(super) idx_leased: bool,
    pub(super) open: pg_sys::Oid,
    pub(super) key: pg_sys::Oid,
    pub(super) tenant: pg_sys::Oid,
    pub(super) tenant_leased: bool,
    pub(super) txid: pg_sys::Oid,
}

/// The index pg_quota needs on `table` or a clear error (XX000-free: BadShape).
pub(super) fn missing(table: &str, cols: &str) -> ! {
    raise(QuotaError::BadShape {
        relation: format!("quota.{table}"),
        why: format!("It has no valid btree index on ({cols}), which pg_quota created and needs"),
    })
}

/// # Safety
/// `l` is an open, locked ledger table with `ncols` columns.
pub(super) unsafe fn table_indexes(
    l: pg_sys::Relation,
    name: &str,
    ncols: usize,
    key_partial: bool,
    starts: bool,
) -> TableIndexes {
    let v2 = ncols >= NCOLS_V2;
    let v5 = ncols >= NCOLS_V5;
    let need =
        |found: Option<pg_sys::Oid>, cols: &str| found.unwrap_or_else(|| missing(name, cols));
    let key_predicate: &[(usize, bool)] = if key_partial {
        &[(COL_KEY, false)]
    } else {
        &[]
    };
    // The index on `cols` with lease_until next, if there is one and `v2`; else one on
    // `cols`.
    let leased = |cols: &[usize], predicate: &[(usize, bool)]| {
        let with: Vec<usize> = cols.iter().copied().chain([COL_LEASE_UNTIL]).collect();
        match find_index(l, &with, predicate).filter(|_| v2) {
            Some(oid) => (Some(oid), true),
            None => (find_index(l, cols, predicate), false),
        }
    };
    let (idx, idx_leased) = leased(&[COL_ROLE, COL_ENDED_AT], &[]);
    let (tenant, tenant_leased) = if v5 {
        leased(
            &[COL_ROLE, COL_TENANT, COL_ENDED_AT],
            &[(COL_TENANT, false)],
        )
    } else {
        (None, false)
    };
    let open_cols = [COL_ENDED_AT, COL_LEASE_UNTIL];
    TableIndexes {
        pkey: need(find_index(l, &[COL_ID], &[]), "id"),
        idx: need(idx, "role, ended_at"),
        idx_leased,
        open: if v2 && starts && !key_partial {
            need(find_index(l, &open_cols, &[]), "ended_at, lease_until")
        } else if v2 && starts {
            find_index(l, &open_cols, &[]).unwrap_or(pg_sys::InvalidOid)
        } else {
            pg_sys::InvalidOid
        },
        key: if v2 {
            need(
                find_index(l, &[COL_ROLE, COL_KEY], key_predicate),
                if key_partial {
                    "role, idempotency_key) WHERE (idempotency_key IS NOT NULL"
                } else {
                    "role, idempotency_key"
                },
            )
        } else {
            pg_sys::InvalidOid
        },
        tenant: if v5 {
            need(tenant, "role, tenant, ended_at) WHERE (tenant IS NOT NULL")
        } else {
            pg_sys::InvalidOid
        },
        tenant_leased,
        txid: if v5 {
            need(
                find_index(l, &[COL_ROLE, COL_TXID], &[(COL_TXID, false)]),
                "role, txid) WHERE (txid IS NOT NULL",
            )
        } else {
            pg_sys::InvalidOid
        },
    }
}
