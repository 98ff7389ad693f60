//! The DROP hook: a ledger writer must never hold up DROP DATABASE (which waits only
//! five seconds for other sessions to leave) nor outlive DROP EXTENSION.
//!
//! dropdb() runs the object-access DROP hook before it counts the sessions still
//! connected to the database, so asking the writer to leave here is in time.

use pgrx::pg_sys;
use pgrx::prelude::*;

static mut PREV_OBJECT_ACCESS_HOOK: pg_sys::object_access_hook_type = None;

pub fn init() {
    // SAFETY: _PG_init runs once in the postmaster before any hook can fire.
    unsafe {
        PREV_OBJECT_ACCESS_HOOK = pg_sys::object_access_hook;
        pg_sys::object_access_hook = Some(object_access);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn object_access(
    access: pg_sys::ObjectAccessType::Type,
    class_id: pg_sys::Oid,
    object_id: pg_sys::Oid,
    sub_id: i32,
    arg: *mut std::ffi::c_void,
) {
    // SAFETY: we pass the call on unchanged, then only read catalogs.
    unsafe {
        if let Some(prev) = PREV_OBJECT_ACCESS_HOOK {
            prev(access, class_id, object_id, sub_id, arg);
        }
        if access != pg_sys::ObjectAccessType::OAT_DROP {
            return;
        }
        if class_id == pg_sys::DatabaseRelationId {
            crate::writer::request_exit(object_id);
        } else if class_id == pg_sys::ExtensionRelationId {
            let name = pg_sys::get_extension_name(object_id);
            if !name.is_null() && std::ffi::CStr::from_ptr(name) == c"pg_quota" {
                crate::writer::request_exit(crate::shmem::my_db());
            }
        }
    }
}
