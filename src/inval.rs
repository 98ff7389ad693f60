//! Layer 1: one relcache invalidation callback for all of pg_quota's backend caches
//! (ledger::rels, ledger::overrides, citus). PostgreSQL keeps room for few such
//! callbacks in a backend (MAX_RELCACHE_CALLBACKS, 10, of which Citus takes several),
//! and a registration past them is a FATAL: pg_quota takes one.

use pgrx::pg_sys;

/// What a cache does on an invalidation of relation `relid` (InvalidOid: of every
/// relation). Called inside AcceptInvalidationMessages: it may only mark its cache
/// stale, never read a catalog, raise an error or panic (the callback's guard would
/// turn a panic into an ERROR in the middle of the queue's processing, and the
/// messages already taken off it would be lost).
pub type Handler = unsafe fn(relid: pg_sys::Oid);

/// pg_quota's caches that take invalidations; each registers once.
static mut HANDLERS: [Option<Handler>; 4] = [None; 4];
static mut REGISTERED: bool = false;

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn relcache_changed(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // SAFETY: single-threaded backend state; each handler's contract (above).
    unsafe {
        for h in (*std::ptr::addr_of!(HANDLERS)).iter().flatten() {
            h(relid);
        }
    }
}

/// Calls `handler` on each relcache invalidation this backend takes in from now on.
/// The caller registers a handler once per backend.
pub fn on_relcache(handler: Handler) {
    // SAFETY: single-threaded backend state; the callback is registered once.
    unsafe {
        if !REGISTERED {
            pg_sys::CacheRegisterRelcacheCallback(Some(relcache_changed), pg_sys::Datum::from(0));
            REGISTERED = true;
        }
        let handlers = &mut *std::ptr::addr_of_mut!(HANDLERS);
        match handlers.iter_mut().find(|h| h.is_none()) {
            Some(slot) => *slot = Some(handler),
            None => pgrx::error!("pg_quota: no room for another relcache handler"),
        }
    }
}
