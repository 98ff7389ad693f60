//! What a backend remembers of Citus' metadata (core::citus::Remembered), and the
//! invalidations that make it forget: each memory is valid for one generation.

use pgrx::pg_sys;

use crate::core::citus::{Declared, Placed, Remembered};

/// Bumped by each relcache invalidation of a relation in WATCHED (Citus sends one
/// for the table whose shards, placements or distribution change, and for
/// pg_dist_object, pg_dist_node, pg_dist_local_group and pg_dist_colocation on any
/// change of theirs), of every relation (a reset of the invalidation queue), or of any
/// relation while Citus' metadata is being read (READING: the table read may not be
/// watched yet), and by any change of pg_proc (DECLARED picks the start functions by
/// name: a distributed function renamed to quota.start changes no catalog of Citus'):
/// what placement() remembers (core::citus::Remembered) is then read again. Dropping
/// Citus drops its catalogs, which invalidates them too. READING is a flag: a read
/// nested in a read (a domain check of the distribution column that starts a ticket)
/// ends it early, and an ERROR in a read leaves it set to the next read; either only
/// makes the memory forget more.
static mut GENERATION: u64 = 1;
/// The table the start functions are colocated with, then Citus' catalogs.
static mut WATCHED: [pg_sys::Oid; 1 + CATALOGS.len()] = [pg_sys::InvalidOid; 1 + CATALOGS.len()];
static mut READING: bool = false;
static mut REGISTERED: bool = false;
const CATALOGS: [&std::ffi::CStr; 7] = [
    c"pg_dist_object",
    c"pg_dist_partition",
    c"pg_dist_shard",
    c"pg_dist_placement",
    c"pg_dist_node",
    c"pg_dist_local_group",
    c"pg_dist_colocation",
];

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn proc_changed(_arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    // SAFETY: single-threaded backend state.
    unsafe {
        GENERATION += 1;
        PROC_CHANGES += 1;
    }
}

/// Bumped by any change of pg_proc alone (proc_changed): what OPERATION_SEEN remembers
/// is valid for one count.
static mut PROC_CHANGES: u64 = 1;

/// Registers this module's invalidation handlers, once per backend.
fn register() {
    // SAFETY: single-threaded backend state; the handlers are registered once.
    unsafe {
        if !REGISTERED {
            crate::inval::on_relcache(relcache_changed);
            pg_sys::CacheRegisterSyscacheCallback(
                pg_sys::SysCacheIdentifier::PROCOID as i32,
                Some(proc_changed),
                pg_sys::Datum::from(0),
            );
            REGISTERED = true;
        }
    }
}

/// This module's crate::inval::Handler.
unsafe fn relcache_changed(relid: pg_sys::Oid) {
    // SAFETY: single-threaded backend state, read by value.
    unsafe {
        let watched = std::ptr::addr_of!(WATCHED).read();
        if READING || relid == pg_sys::InvalidOid || watched.contains(&relid) {
            GENERATION += 1;
        }
    }
}

/// The generation now, with every invalidation committed so far taken in (as a lock
/// acquisition takes them in): what is remembered from this generation is what
/// Citus' metadata says as committed now.
pub(super) fn generation() -> u64 {
    register();
    // SAFETY: single-threaded backend state; AcceptInvalidationMessages has nothing to
    // do in the common case.
    unsafe {
        pg_sys::AcceptInvalidationMessages();
        GENERATION
    }
}

/// The changes of pg_proc this backend has taken in so far (without taking in more:
/// the function manager asks runs::is_operation at every lookup of a function).
pub(super) fn proc_changes() -> u64 {
    register();
    // SAFETY: single-threaded backend state, read by value.
    unsafe { PROC_CHANGES }
}

/// Runs `read` (a read of Citus' metadata) with every relcache invalidation that
/// comes in meanwhile counted; its value, and the generation as it is then (without
/// taking invalidations in): where that moved during the read, what it read is used
/// but not kept.
pub(super) fn reading<T>(read: impl FnOnce() -> T) -> (T, u64) {
    // SAFETY: single-threaded backend state. An ERROR inside leaves READING set,
    // which only makes the memo forget more, until the next read resets it.
    unsafe { READING = true };
    let value = read();
    // SAFETY: as above.
    unsafe {
        READING = false;
        (value, GENERATION)
    }
}

thread_local! {
    /// DECLARED by schema quota's OID; a tenant's shard; a shard's placement.
    pub(super) static DECLARED_SEEN: std::cell::RefCell<Remembered<u32, Declared>> =
        std::cell::RefCell::new(Remembered::new(4));
    pub(super) static SHARD_SEEN: std::cell::RefCell<Remembered<Vec<u8>, i64>> =
        std::cell::RefCell::new(Remembered::new(4_096));
    pub(super) static PLACED_SEEN: std::cell::RefCell<Remembered<i64, Placed>> =
        std::cell::RefCell::new(Remembered::new(16_384));
    /// Per function OID, whether it is one of Citus' shard operations
    /// (runs::is_operation), valid for one count of proc_changes.
    pub(super) static OPERATION_SEEN: std::cell::RefCell<Remembered<u32, bool>> =
        std::cell::RefCell::new(Remembered::new(4_096));
}

/// Watches `table` (the table the start functions are colocated with, InvalidOid for
/// none) and Citus' catalogs from now on. Called inside `reading`, with the read of
/// DECLARED: an invalidation between the two counts as one during the read.
pub(super) fn watch(table: pg_sys::Oid) {
    let mut watched = [pg_sys::InvalidOid; 1 + CATALOGS.len()];
    watched[0] = table;
    // SAFETY: syscache lookups of Citus' catalogs (InvalidOid where one is missing),
    // inside the caller's transaction; then single-threaded backend state, written at
    // once.
    unsafe {
        for (w, name) in watched[1..].iter_mut().zip(CATALOGS) {
            *w = pg_sys::get_relname_relid(name.as_ptr(), pg_sys::PG_CATALOG_NAMESPACE.into());
        }
        std::ptr::addr_of_mut!(WATCHED).write(watched);
    }
}
