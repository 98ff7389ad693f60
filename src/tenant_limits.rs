//! Layer 5: quota.set_tenant_limits() (0.7.0), a tenant's own limits in place of its
//! role's quota.max_active_per_tenant and quota.max_retained_per_tenant.
//!
//! The change is a row of quota.tenant_overrides written in the caller's transaction:
//! it applies to starts once that transaction commits, and a rollback leaves the old
//! value. Nobody but superusers has privileges on the table, so the row is written as
//! the table's owner (the extension's installer, a superuser), after the checks here:
//! who may set the limits of which role's tenants, and that the values make sense.
//! Starts read the rows through ledger::overrides.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::spi::Spi;

use crate::catalog::role_name;
use crate::core::{check_tenant, QuotaError};
use crate::ledger::scan::text_datum;

/// The arguments of quota.set_tenant_limits(), NULL as None.
pub struct Request<'a> {
    pub tenant: Option<&'a [u8]>,
    pub max_active: Option<i32>,
    pub max_retained: Option<i32>,
    pub role: Option<pg_sys::Oid>,
}

pub fn set(req: &Request) -> Result<(), QuotaError> {
    const NAME: &std::ffi::CStr = c"quota.set_tenant_limits()";
    crate::shmem::require_callable(NAME);
    let tenant = req.tenant.ok_or(QuotaError::NullArgument("tenant"))?;
    check_tenant(crate::admission::chars(tenant), tenant.len())?;
    for (what, v) in [
        ("max_active", req.max_active),
        ("max_retained", req.max_retained),
    ] {
        if let Some(v) = v.filter(|&v| v < 0) {
            return Err(QuotaError::InvalidLimit {
                what,
                value: i64::from(v),
            });
        }
    }
    let role = req.role.ok_or(QuotaError::NullArgument("role"))?;
    if !role_exists(role) {
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
    let by = role_name(me);
    // SAFETY: a syscache lookup of a table that exists (found above).
    let owner = unsafe { table_owner(table) };
    let as_owner = AsRole::enter(owner);
    let tenant_arg = || {
        // SAFETY: a text datum in the server encoding, as the column holds.
        unsafe { DatumWithOid::new(text_datum(tenant), pg_sys::TEXTOID) }
    };
    // SAFETY: an OID datum typed as regrole, which is an OID.
    let role_arg = || unsafe { DatumWithOid::new(role, pg_sys::REGROLEOID) };
    let written = if req.max_active.is_none() && req.max_retained.is_none() {
        Spi::run_with_args(
            "DELETE FROM quota.tenant_overrides \
              WHERE role OPERATOR(pg_catalog.=) $1 AND tenant OPERATOR(pg_catalog.=) $2",
            &[role_arg(), tenant_arg()],
        )
    } else {
        Spi::run_with_args(
            "INSERT INTO quota.tenant_overrides AS o \
                    (role, tenant, max_active, max_retained, set_at, set_by) \
             VALUES ($1, $2, $3, $4, pg_catalog.now(), $5) \
             ON CONFLICT (role, tenant) DO UPDATE \
                SET max_active = EXCLUDED.max_active, max_retained = EXCLUDED.max_retained, \
                    set_at = EXCLUDED.set_at, set_by = EXCLUDED.set_by",
            &[
                role_arg(),
                tenant_arg(),
                req.max_active.into(),
                req.max_retained.into(),
                // SAFETY: a name datum (palloc'd, NAMEDATALEN bytes) of the caller's name.
                unsafe { DatumWithOid::new(name_datum(&by), pg_sys::NAMEOID) },
            ],
        )
    };
    drop(as_owner);
    written.unwrap_or_else(|e| pgrx::error!("pg_quota: {e}"));
    Ok(())
}

fn role_exists(role: pg_sys::Oid) -> bool {
    // SAFETY: a syscache probe of pg_authid.
    unsafe {
        pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::AUTHOID as i32,
            role.into(),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
}

/// # Safety
/// `table` exists.
unsafe fn table_owner(table: pg_sys::Oid) -> pg_sys::Oid {
    // SAFETY: the caller's promise; the relation is opened without a lock only to read
    // its owner, which ALTER TABLE OWNER would change under AccessExclusiveLock.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation(table);
        let owner = (*(*rel).rd_rel).relowner;
        pg_sys::RelationClose(rel);
        owner
    }
}

/// A name datum holding `s` (truncated to NAMEDATALEN - 1 bytes, as PostgreSQL does).
fn name_datum(s: &str) -> pg_sys::Datum {
    // SAFETY: palloc0 of NAMEDATALEN bytes, into which at most NAMEDATALEN - 1 are
    // copied: the name stays NUL-terminated.
    unsafe {
        let p = pg_sys::palloc0(pg_sys::NAMEDATALEN as usize).cast::<u8>();
        let n = s.len().min(pg_sys::NAMEDATALEN as usize - 1);
        std::ptr::copy_nonoverlapping(s.as_ptr(), p, n);
        pg_sys::Datum::from(p)
    }
}

/// Runs as `role` until dropped, as PostgreSQL's own code does to run a query with
/// another role's privileges (SECURITY_LOCAL_USERID_CHANGE: SET ROLE and the like are
/// refused meanwhile; SECURITY_RESTRICTED_OPERATION: nothing the query runs can leave
/// state behind in the session). An ERROR's abort restores the role too.
struct AsRole {
    user: pg_sys::Oid,
    context: i32,
}

impl AsRole {
    fn enter(role: pg_sys::Oid) -> AsRole {
        let mut user = pg_sys::InvalidOid;
        let mut context = 0;
        // SAFETY: reads and sets the backend's current user, restored in drop.
        unsafe {
            pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
            pg_sys::SetUserIdAndSecContext(
                role,
                context
                    | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32
                    | pg_sys::SECURITY_RESTRICTED_OPERATION as i32,
            );
        }
        AsRole { user, context }
    }
}

impl Drop for AsRole {
    fn drop(&mut self) {
        // SAFETY: restores what `enter` read.
        unsafe { pg_sys::SetUserIdAndSecContext(self.user, self.context) };
    }
}
