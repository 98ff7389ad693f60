//! Layer 1: names from the catalogs, for messages and log lines, read from the server
//! encoding (encoding.rs); and `AsRole`, for the few queries pg_quota runs with a
//! table owner's privileges (tenant_limits.rs, citus/).

use pgrx::pg_sys;

/// The name of database `db`, or its OID if it is gone.
pub fn database_name(db: pg_sys::Oid) -> String {
    // SAFETY: a syscache lookup; NULL if the database is gone.
    named(
        u32::from(db),
        unsafe { pg_sys::get_database_name(db) },
        |p| p,
    )
}

/// Whether role `role` exists.
pub fn role_exists(role: pg_sys::Oid) -> bool {
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

/// The name of role `role`, or its OID if it was dropped.
pub fn role_name(role: pg_sys::Oid) -> String {
    // SAFETY: returns a palloc'd copy; noerr so a dropped role gives NULL.
    named(
        u32::from(role),
        unsafe { pg_sys::GetUserNameFromId(role, true) },
        |p| p,
    )
}

/// The name of role `role` as an SQL identifier (quoted where it must be), or its OID
/// if it was dropped: for a hint's command to be copied as it is.
pub fn role_ident(role: pg_sys::Oid) -> String {
    // SAFETY: as in role_name; quote_identifier returns its argument or a palloc'd
    // quoted copy.
    named(
        u32::from(role),
        unsafe { pg_sys::GetUserNameFromId(role, true) },
        |p| unsafe { pg_sys::quote_identifier(p) },
    )
}

/// The name at `p` (passed through `shown`) as `name_text` reads it, or `oid` where
/// the object is gone (`p` NULL).
fn named(
    oid: u32,
    p: *mut std::ffi::c_char,
    shown: impl FnOnce(*const std::ffi::c_char) -> *const std::ffi::c_char,
) -> String {
    if p.is_null() {
        oid.to_string()
    } else {
        // SAFETY: `p` is a NUL-terminated name, and so is what `shown` makes of it.
        unsafe { name_text(shown(p)) }
    }
}

/// A name PostgreSQL hands over as a C string (a relation's, a trigger's, a type's), in
/// the server encoding, for a message.
///
/// # Safety
/// `p` points at a NUL-terminated string.
pub unsafe fn name_text(p: *const std::ffi::c_char) -> String {
    // SAFETY: the caller's promise.
    crate::encoding::server_text(unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes())
}

/// Runs as `role` until dropped, with search_path pinned to pg_catalog, pg_temp, as
/// PostgreSQL's own code runs a query with another role's privileges (a security
/// definer function, REFRESH MATERIALIZED VIEW): SECURITY_LOCAL_USERID_CHANGE refuses
/// SET ROLE and the like meanwhile, SECURITY_RESTRICTED_OPERATION keeps what runs from
/// leaving state behind in the session, and nothing the query runs (a check, a default)
/// resolves a name through the caller's search_path. After an ERROR, the
/// (sub)transaction's abort restores both, as for a security definer function.
pub(crate) struct AsRole {
    user: pg_sys::Oid,
    context: i32,
    nest: i32,
}

impl AsRole {
    pub(crate) fn enter(role: pg_sys::Oid) -> AsRole {
        let mut user = pg_sys::InvalidOid;
        let mut context = 0;
        // SAFETY: reads and sets the backend's current user and a GUC at a nesting
        // level of its own, both restored in drop (or by the abort).
        unsafe {
            let nest = pg_sys::NewGUCNestLevel();
            pg_sys::set_config_option(
                c"search_path".as_ptr(),
                c"pg_catalog, pg_temp".as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
            pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
            pg_sys::SetUserIdAndSecContext(
                role,
                context
                    | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32
                    | pg_sys::SECURITY_RESTRICTED_OPERATION as i32,
            );
            AsRole {
                user,
                context,
                nest,
            }
        }
    }
}

impl Drop for AsRole {
    fn drop(&mut self) {
        // SAFETY: restores what `enter` read and set. During an ERROR's unwind the
        // GUC level is left to the abort, which pops it (AtEOXact_GUC there).
        unsafe {
            pg_sys::SetUserIdAndSecContext(self.user, self.context);
            if !std::thread::panicking() {
                pg_sys::AtEOXact_GUC(true, self.nest);
            }
        }
    }
}
