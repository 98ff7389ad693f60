//! Layer 1: names from the catalogs, for messages and log lines, read from the server
//! encoding (encoding.rs).

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
