//! Where a start's tenant lives (what Citus' metadata says, remembered per backend),
//! and the shard lock a start holds against a move of the tenant's shard.

use pgrx::pg_sys;

use super::memory::{generation, reading, watch, DECLARED_SEEN, PLACED_SEEN, SHARD_SEEN};
use super::metadata::{citus_loaded, read_declared_now, read_placed};
use crate::catalog::AsRole;
use crate::core::citus::{Declared, Placement};
use crate::core::QuotaError;
use crate::ledger::scan::text_datum;

/// Where `tenant` lives, if pg_quota's start functions are distributed by tenant in
/// this database; None where they are not (or Citus is not here). Citus' metadata is
/// read as committed now, as Citus itself reads it to route a call, not as of the
/// transaction's snapshot: a REPEATABLE READ transaction sees a move or a new
/// distribution as soon as Citus does. What was read is remembered for the backend
/// until Citus' metadata changes (GENERATION), so a start reads it once per tenant.
pub fn placement(tenant: &[u8]) -> Result<Option<Placement>, QuotaError> {
    if !citus_loaded() {
        return Ok(None);
    }
    // SAFETY: schema quota's OID, InvalidOid if it is gone (then nothing matches).
    let ns = u32::from(unsafe { pg_sys::get_namespace_oid(c"quota".as_ptr(), true) });
    let mut seen = generation();
    let declared = match DECLARED_SEEN.with_borrow_mut(|m| m.get(seen, &ns)) {
        Some(d) => d,
        None => {
            // SAFETY: a catalog probe of pg_extension, inside the caller's transaction.
            // Not remembered where Citus is not installed: nothing would say when it is.
            if unsafe { pg_sys::get_extension_oid(c"citus".as_ptr(), true) } == pg_sys::InvalidOid {
                return Ok(None);
            }
            let (d, now) = reading(|| {
                // SAFETY: SPI inside the caller's transaction (an ERROR unwinds through
                // it, and the transaction's abort cleans SPI up).
                let d = unsafe { read_declared_now(ns.into()) };
                watch(match d {
                    Declared::With { table, .. } => table.into(),
                    _ => pg_sys::InvalidOid,
                });
                d
            });
            DECLARED_SEEN.with_borrow_mut(|m| m.keep(seen, now, ns, d));
            d
        }
    };
    let (table, owner, shard_fn) = match declared {
        Declared::No => return Ok(None),
        Declared::Misdeclared { groups } => return Err(QuotaError::CitusMisdeclared { groups }),
        // A table dropped since its colocation was read has no owner: as no table.
        Declared::NoTable => {
            return Ok(Some(Placement {
                table: None,
                nodes: String::new(),
                here: false,
                shard: None,
            }))
        }
        Declared::With {
            table,
            owner,
            shard_fn,
        } => (
            pg_sys::Oid::from(table),
            pg_sys::Oid::from(owner),
            pg_sys::Oid::from(shard_fn),
        ),
    };
    // The tenant's shard, as remembered for generation `at` or read now.
    let shard_at = |at: u64| match SHARD_SEEN.with_borrow_mut(|m| m.get(at, tenant)) {
        Some(shard) => shard,
        None => {
            // SAFETY: a call of Citus' function with an argument of its types.
            let (shard, now) = reading(|| unsafe { shard_of(shard_fn, table, owner, tenant) });
            SHARD_SEEN.with_borrow_mut(|m| m.keep(at, now, tenant.to_vec(), shard));
            shard
        }
    };
    let mut shard = shard_at(seen);
    // Held until `release` (a writer-committed start's charge has committed) or the
    // transaction's end: a move of the shard off this node, or a split of it, refuses
    // to go meanwhile (citus/moves.rs, citus/splits.rs), so that no charge is left
    // behind; and a start that comes during one waits for it (LOCK_WAIT at most), then
    // reads where its tenant is after it: the change's invalidations are sent before
    // its locks are given back. A split replaces the shard: where the tenant's shard
    // is another one after the wait, that one is locked in its place (twice at most,
    // then the start is refused as busy, 55P03).
    // SAFETY: a plain read of backend state.
    let db = unsafe { pg_sys::MyDatabaseId };
    let mut moved = 0;
    let locked = loop {
        crate::ledger::locks::lock_tag_bounded(
            crate::scopes::shard_lock_tag(db, shard),
            pg_sys::ShareLock,
            |seconds| QuotaError::ShardBusy { shard, seconds },
        );
        let locked = generation();
        if locked == seen {
            break locked;
        }
        let now = shard_at(locked);
        if now == shard {
            break locked;
        }
        moved += 1;
        if moved == 3 {
            // Split again and again meanwhile: busy (55P03), which a caller retries.
            return Err(QuotaError::ShardBusy {
                shard: now,
                seconds: 0,
            });
        }
        release_shard(shard);
        (shard, seen) = (now, locked);
    };
    let placed = match PLACED_SEEN.with_borrow_mut(|m| m.get(locked, &shard)) {
        Some(p) => p,
        None => {
            // SAFETY: SPI inside the caller's transaction, as above.
            let (placed, now) = reading(|| unsafe { read_placed(table, shard) });
            PLACED_SEEN.with_borrow_mut(|m| m.keep(locked, now, shard, placed.clone()));
            placed
        }
    };
    Ok(Some(Placement {
        table: Some(placed.table),
        here: placed.here,
        nodes: placed.nodes,
        shard: Some(shard),
    }))
}

/// The tenant's shard of `table`: Citus' get_shard_id_for_distribution_column()
/// (`func`), called through fmgr rather than SPI (it answers from Citus' own
/// metadata cache), as the table's owner: it wants SELECT on the table, which a role
/// that only starts tickets need not have; with search_path pinned (AsRole), since
/// it converts the tenant with the distribution column's input function, which a
/// domain's check may run.
///
/// # Safety
/// Inside a transaction; `func` is that function's OID, `table` a distributed table,
/// `owner` its owner. An ERROR unwinds through it; the abort restores the user.
pub(super) unsafe fn shard_of(
    func: pg_sys::Oid,
    table: pg_sys::Oid,
    owner: pg_sys::Oid,
    tenant: &[u8],
) -> i64 {
    if func == pg_sys::InvalidOid {
        pgrx::error!(
            "pg_quota: Citus' get_shard_id_for_distribution_column(regclass, \"any\") is missing"
        );
    }
    let value = text_datum(tenant);
    // SAFETY: the caller's. The function reads its second argument's type from the
    // call's expression (get_fn_expr_argtype), so the FmgrInfo carries one: a FuncExpr
    // of a regclass and a text constant, in the current memory context.
    unsafe {
        let mut flinfo: pg_sys::FmgrInfo = std::mem::zeroed();
        pg_sys::fmgr_info(func, &mut flinfo);
        let mut args = pg_sys::lappend(
            std::ptr::null_mut(),
            pg_sys::makeConst(
                pg_sys::REGCLASSOID,
                -1,
                pg_sys::InvalidOid,
                4,
                pg_sys::Datum::from(table),
                false,
                true,
            )
            .cast(),
        );
        args = pg_sys::lappend(
            args,
            pg_sys::makeConst(
                pg_sys::TEXTOID,
                -1,
                pg_sys::DEFAULT_COLLATION_OID.into(),
                -1,
                value,
                false,
                false,
            )
            .cast(),
        );
        flinfo.fn_expr = pg_sys::makeFuncExpr(
            func,
            pg_sys::INT8OID,
            args,
            pg_sys::InvalidOid,
            pg_sys::DEFAULT_COLLATION_OID.into(),
            pg_sys::CoercionForm::COERCE_EXPLICIT_CALL,
        )
        .cast();
        let _owner = AsRole::enter(owner);
        let shard = pg_sys::FunctionCall2Coll(
            &mut flinfo,
            pg_sys::InvalidOid,
            pg_sys::Datum::from(table),
            value,
        );
        shard.value() as i64
    }
}

/// Says once per session, as a WARNING, that the role's own active limit and the
/// database cap count per node (core::citus::per_node_warning), where either is
/// chosen: the role limit's default (100, which no setting chose) is not named.
pub fn warn_per_node(policy: &crate::policy::Policy) {
    // Backends are single-threaded: a plain flag of this one's.
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if WARNED.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    if let Some(w) = crate::core::citus::per_node_warning(
        if policy.active_is_default {
            0
        } else {
            policy.limits.max_active
        },
        policy.limits.max_db,
    ) {
        WARNED.store(true, std::sync::atomic::Ordering::Relaxed);
        pgrx::warning!("{w}");
    }
}

/// Gives back the shard lock `placement` took for a start, once the start's charge
/// is committed (a writer-committed start): a move that comes later sees the charge.
/// A transactional start keeps it to its transaction's end, when its charge commits.
pub fn release(placement: &Option<Placement>) {
    if let Some(shard) = placement.as_ref().and_then(|p| p.shard) {
        release_shard(shard);
    }
}

/// Gives back one hold of the shard lock on `shard` that this start took (one taken
/// before, by an earlier start of the transaction, stays).
fn release_shard(shard: i64) {
    // SAFETY: a plain read of backend state, and the release of a lock this
    // transaction holds (LockRelease warns, harmlessly, where it does not).
    unsafe {
        let mut tag = crate::scopes::shard_lock_tag(pg_sys::MyDatabaseId, shard);
        pg_sys::LockRelease(&mut tag, pg_sys::ShareLock as i32, false);
    }
}
