//! Layer 5: quota.set_tenant_limits() (0.7.0), a tenant's own limits in place of its
//! role's quota.max_active_per_tenant and quota.max_retained_per_tenant.
//!
//! The change is a row of quota.tenant_overrides written in the caller's transaction:
//! it applies to starts once that transaction commits, and a rollback leaves the old
//! value. Nobody but superusers has privileges on the table, so the row is written as
//! the table's owner (the extension's installer, a superuser), after the checks here:
//! who may set the limits of which role's tenants, and that the values make sense.
//! Starts read the rows through ledger::overrides.

use pgrx::pg_sys;

use crate::catalog::{role_name, AsRole};
use crate::core::{check_tenant, QuotaError};
use crate::ledger::scan::text_datum;

/// The arguments of quota.set_tenant_limits(), NULL as None.
pub struct Request<'a> {
    pub tenant: Option<&'a [u8]>,
    pub max_active: Option<i32>,
    pub max_retained: Option<i32>,
    pub role: Option<pg_sys::Oid>,
}

/// The largest limit a tenant may have, as the settings' (quota.max_active_per_tenant
/// and quota.max_retained_per_tenant go up to 1,000,000).
pub const MAX_LIMIT: i32 = 1_000_000;

pub fn set(req: &Request) -> Result<(), QuotaError> {
    const NAME: &std::ffi::CStr = c"quota.set_tenant_limits()";
    crate::shmem::require_callable(NAME);
    let tenant = req.tenant.ok_or(QuotaError::NullArgument("tenant"))?;
    check_tenant(crate::admission::chars(tenant), tenant.len())?;
    // A tenant's own limits are read where it is admitted: on a Citus cluster whose
    // starts are distributed by tenant, on the node that holds it (core::citus).
    crate::core::citus::admit_here(
        &crate::encoding::server_text(tenant),
        crate::citus::placement(tenant)?,
        "quota.set_tenant_limits('…', …)",
    )
    .map_err(QuotaError::TenantElsewhere)?;
    for (what, v) in [
        ("max_active", req.max_active),
        ("max_retained", req.max_retained),
    ] {
        if let Some(v) = v.filter(|&v| !(0..=MAX_LIMIT).contains(&v)) {
            return Err(QuotaError::InvalidLimit {
                what,
                value: i64::from(v),
            });
        }
    }
    let role = req.role.ok_or(QuotaError::NullArgument("role"))?;
    // SAFETY: a lock on the role, as DROP ROLE takes one (AccessExclusiveLock) before
    // it drops it: once granted, a role that exists stays until this transaction
    // ends, so no row is written for a role whose drop (and the writer's purge of its
    // rows) committed meanwhile.
    unsafe {
        pg_sys::LockSharedObject(
            pg_sys::AuthIdRelationId,
            role,
            0,
            pg_sys::AccessShareLock as i32,
        )
    };
    if !crate::catalog::role_exists(role) {
        return Err(QuotaError::UnknownRole(u32::from(role)));
    }
    // SAFETY: plain reads of backend state and catalog lookups.
    let me = unsafe { pg_sys::GetUserId() };
    // As finish() decides whose tickets a role may end (I5).
    // SAFETY: catalog lookups.
    if !unsafe { pg_sys::superuser_arg(me) || pg_sys::is_member_of_role(me, role) } {
        return Err(QuotaError::ForeignTenantLimits {
            role: role_name(role),
        });
    }
    // SAFETY: both raise ERROR (25006) or return, as for any write.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(NAME.as_ptr());
        pg_sys::PreventCommandIfReadOnly(NAME.as_ptr());
    }
    let Some((table, _)) = crate::ledger::overrides::find() else {
        return Err(QuotaError::NeedsUpdate {
            feature: "a tenant's own limits",
            needs: "0.7.0",
        });
    };
    // One change at a time, to the transaction's end, on a lock of pg_quota's own (no
    // SQL function can take it, I4; no maintenance command conflicts with it): the
    // write below, under the latest snapshot, then sees every change that committed
    // before it, and none can commit between its look and its write, so it neither
    // misses a row nor raises 40001 under REPEATABLE READ or SERIALIZABLE (I3). A
    // superuser's own write to the table does not take it.
    // SAFETY: a plain read of backend state.
    let db = unsafe { pg_sys::MyDatabaseId };
    crate::ledger::locks::lock_tag_bounded(
        crate::scopes::overrides_lock_tag(db),
        pg_sys::ExclusiveLock,
        |seconds| QuotaError::TenantLimitsBusy { seconds },
    );
    // The write's own lock, with the same bound (a superuser's LOCK TABLE, a plain
    // CREATE INDEX): VACUUM, ANALYZE and concurrent index builds do not conflict.
    crate::ledger::locks::lock_bounded(table, pg_sys::RowExclusiveLock);
    // SAFETY: the table is locked; NULL if it was dropped before the lock was granted.
    let owner = unsafe {
        let rel = pg_sys::try_relation_open(table, pg_sys::NoLock as i32);
        if rel.is_null() {
            return Err(QuotaError::NotExtensionMember {
                relation: "quota.tenant_overrides".into(),
            });
        }
        let owner = (*(*rel).rd_rel).relowner;
        pg_sys::relation_close(rel, pg_sys::NoLock as i32);
        owner
    };
    // SAFETY: the caller's name in the server encoding (palloc'd), made a name datum by
    // PostgreSQL's own input function, as the column holds it.
    let by = unsafe {
        pg_sys::OidFunctionCall1Coll(
            pg_sys::Oid::from(pg_sys::F_NAMEIN),
            pg_sys::InvalidOid,
            pg_sys::Datum::from(pg_sys::GetUserNameFromId(me, false)),
        )
    };
    let as_owner = AsRole::enter(owner);
    let delete = req.max_active.is_none() && req.max_retained.is_none();
    let int4 = |v: Option<i32>| {
        (
            v.map_or(pg_sys::Datum::from(0), pg_sys::Datum::from),
            v.is_none(),
        )
    };
    let args: Vec<(pg_sys::Oid, pg_sys::Datum, bool)> = if delete {
        vec![
            (pg_sys::REGROLEOID, pg_sys::Datum::from(role), false),
            (pg_sys::TEXTOID, text_datum(tenant), false),
        ]
    } else {
        let (a, a_null) = int4(req.max_active);
        let (r, r_null) = int4(req.max_retained);
        vec![
            (pg_sys::REGROLEOID, pg_sys::Datum::from(role), false),
            (pg_sys::TEXTOID, text_datum(tenant), false),
            (pg_sys::INT4OID, a, a_null),
            (pg_sys::INT4OID, r, r_null),
            (pg_sys::NAMEOID, by, false),
        ]
    };
    let query: &std::ffi::CStr = if delete {
        c"DELETE FROM quota.tenant_overrides \
           WHERE role OPERATOR(pg_catalog.=) $1 AND tenant OPERATOR(pg_catalog.=) $2"
    } else {
        c"INSERT INTO quota.tenant_overrides AS o \
                 (role, tenant, max_active, max_retained, set_at, set_by) \
          VALUES ($1, $2, $3, $4, pg_catalog.now(), $5) \
          ON CONFLICT (role, tenant) DO UPDATE \
             SET max_active = EXCLUDED.max_active, max_retained = EXCLUDED.max_retained, \
                 set_at = EXCLUDED.set_at, set_by = EXCLUDED.set_by"
    };
    // SAFETY: SPI inside the caller's transaction; an ERROR unwinds through it and the
    // transaction's abort cleans SPI up.
    unsafe { execute_latest(query, &args) };
    drop(as_owner);
    // The table's trigger did this too; without it (a DBA disabled it, which the guard
    // warns of) the change must still reach this backend's cache and, at commit, every
    // other backend's.
    // SAFETY: the table exists and is locked.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(table) };
    crate::ledger::overrides::written();
    Ok(())
}

/// Runs `query` with `args` (type, value, is NULL) under the latest snapshot, not the
/// transaction's (see `set`), firing the table's triggers.
///
/// # Safety
/// Inside a transaction; the datums are valid for their types.
unsafe fn execute_latest(query: &std::ffi::CStr, args: &[(pg_sys::Oid, pg_sys::Datum, bool)]) {
    let mut types: Vec<pg_sys::Oid> = args.iter().map(|a| a.0).collect();
    let mut values: Vec<pg_sys::Datum> = args.iter().map(|a| a.1).collect();
    let nulls: Vec<std::ffi::c_char> = args
        .iter()
        .map(|a| if a.2 { b'n' } else { b' ' } as std::ffi::c_char)
        .collect();
    // SAFETY: the caller's promise; each call raises ERROR on failure, and the return
    // codes are checked besides.
    unsafe {
        if pg_sys::SPI_connect() != pg_sys::SPI_OK_CONNECT as i32 {
            pgrx::error!("pg_quota: SPI_connect failed");
        }
        let plan = pg_sys::SPI_prepare(query.as_ptr(), types.len() as i32, types.as_mut_ptr());
        if plan.is_null() {
            let code = std::ptr::addr_of!(pg_sys::SPI_result).read();
            pgrx::error!("pg_quota: SPI_prepare failed: {code}");
        }
        let rc = pg_sys::SPI_execute_snapshot(
            plan,
            values.as_mut_ptr(),
            nulls.as_ptr(),
            pg_sys::GetLatestSnapshot(),
            std::ptr::null_mut(),
            false,
            true,
            0,
        );
        if rc < 0 {
            pgrx::error!("pg_quota: SPI_execute_snapshot failed: {rc}");
        }
        pg_sys::SPI_finish();
    }
}
