//! Layer 1: names from the catalogs, for messages and log lines, read from the server
//! encoding (encoding.rs).

use pgrx::pg_sys;

/// The name of database `db`, or its OID if it is gone.
pub fn database_name(db: pg_sys::Oid) -> String {
    // SAFETY: a syscache lookup; NULL if the database is gone.
    unsafe {
        let p = pg_sys::get_database_name(db);
        if p.is_null() {
            u32::from(db).to_string()
        } else {
            name_text(p)
        }
    }
}

/// The name of role `role`, or its OID if it was dropped.
pub fn role_name(role: pg_sys::Oid) -> String {
    // SAFETY: returns a palloc'd copy; noerr so a dropped role prints its oid.
    unsafe {
        let p = pg_sys::GetUserNameFromId(role, true);
        if p.is_null() {
            u32::from(role).to_string()
        } else {
            name_text(p)
        }
    }
}

/// The name of role `role` as an SQL identifier (quoted where it must be), or its OID
/// if it was dropped: for a hint's command to be copied as it is.
pub fn role_ident(role: pg_sys::Oid) -> String {
    // SAFETY: GetUserNameFromId returns a palloc'd copy (NULL for a dropped role, with
    // noerr); quote_identifier returns it or a palloc'd quoted copy.
    unsafe {
        let p = pg_sys::GetUserNameFromId(role, true);
        if p.is_null() {
            u32::from(role).to_string()
        } else {
            name_text(pg_sys::quote_identifier(p))
        }
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
