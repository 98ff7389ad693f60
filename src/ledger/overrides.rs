//! Layer 3, the ledger: each tenant's own limits (0.7.0), which
//! quota.set_tenant_limits() keeps in quota.tenant_overrides, one row per (role,
//! tenant). Read below SQL with one probe of the table's primary key under the latest
//! snapshot, and cached in the backend until the table's relcache entry is
//! invalidated: the table's statement trigger (`tenant_overrides_written`) and
//! quota.set_tenant_limits() send that invalidation when a change to it commits,
//! whoever made it (the function, a superuser's own write, a restore), and so does the
//! writer's purge of dropped roles. Invalidations are processed before each look, so a
//! change that committed before a start began applies to it, in a transaction already
//! open too (I3). A change applies from its commit, to the transaction that made it
//! too: the look does not see this transaction's own writes, and nothing is cached
//! while it is open.
//!
//! A start of a tenant that is found in the cache reads no relation and takes no lock,
//! as a refusal from the scope counters must not (BENCHMARKS, "refusals").

use std::collections::HashMap;

use pgrx::pg_sys;

use crate::core::QuotaError;
use crate::error::raise;
use crate::ledger::indexes::{find_index, missing};
use crate::ledger::locks::Locks;
use crate::ledger::scan::{attr, scan, text_datum, Key, Latest};

/// quota.tenant_overrides' columns, 1-based, as sql/schema.sql creates them.
pub const COL_ROLE: usize = 1;
pub const COL_TENANT: usize = 2;
pub const COL_MAX_ACTIVE: usize = 3;
pub const COL_MAX_RETAINED: usize = 4;
const NCOLS: usize = 6;

/// A tenant's own limits; None where the role's setting applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Override {
    pub max_active: Option<i32>,
    pub max_retained: Option<i32>,
}

/// How many tenants' limits a backend keeps, found or not (a pooled back end serves
/// many tenants); past it the cache starts over.
const CACHED_TENANTS: usize = 65_536;

struct Cache {
    /// SharedInvalidMessageCounter when the table was looked up: any invalidation
    /// looks it up again (an ALTER EXTENSION UPDATE may have created it).
    invalidations: u64,
    /// GENERATION when the entries were read (before the read).
    generation: u64,
    /// The table and its primary key, once looked up since the last invalidation;
    /// Some(None): the database's schema is older than 0.7.0 and has no overrides.
    table: Option<Option<(pg_sys::Oid, pg_sys::Oid)>>,
    entries: HashMap<pg_sys::Oid, HashMap<Vec<u8>, Override>>,
    len: usize,
}

// Single-threaded backend state.
static mut CACHE: Option<Cache> = None;
/// Bumped by every relcache invalidation of quota.tenant_overrides (TABLE_OID) or of
/// every relation (a sinval queue overflow).
static mut GENERATION: u64 = 0;
static mut TABLE_OID: pg_sys::Oid = pg_sys::InvalidOid;
static mut CALLBACK_REGISTERED: bool = false;

/// This module's crate::inval::Handler.
unsafe fn relcache_changed(relid: pg_sys::Oid) {
    // SAFETY: single-threaded backend state.
    unsafe {
        if relid == pg_sys::InvalidOid || relid == TABLE_OID {
            GENERATION += 1;
        }
    }
}
/// The top-level transaction that last wrote quota.tenant_overrides in this backend
/// (see `written`): while it is the current one, nothing read is cached.
static mut WRITTEN_BY: pg_sys::TransactionId = pg_sys::InvalidTransactionId;

/// The table's name in schema quota, for lookups and messages.
pub const TABLE: &std::ffi::CStr = c"tenant_overrides";

/// Called by the table's trigger after a write to it: this backend's cache is dropped,
/// and nothing is cached until the writing transaction ends, since it may roll back
/// (the invalidation that other backends act on is sent only if it commits).
pub fn written() {
    // SAFETY: single-threaded backend state; the transaction wrote, so it has an xid.
    unsafe {
        *std::ptr::addr_of_mut!(CACHE) = None;
        WRITTEN_BY = pg_sys::GetTopTransactionIdIfAny();
    }
}

/// The own limits of `tenant` of `role`, if quota.set_tenant_limits() set any.
pub fn of(role: pg_sys::Oid, tenant: &[u8]) -> Override {
    // SAFETY: single-threaded backend state; AcceptInvalidationMessages processes the
    // shared invalidation queue, as any lock acquisition does (nothing to do in the
    // common case), so a change committed before this call is seen.
    let (cache, dirty) = unsafe {
        if !CALLBACK_REGISTERED {
            crate::inval::on_relcache(relcache_changed);
            CALLBACK_REGISTERED = true;
        }
        pg_sys::AcceptInvalidationMessages();
        let now = pg_sys::SharedInvalidMessageCounter;
        let generation = GENERATION;
        let slot = &mut *std::ptr::addr_of_mut!(CACHE);
        if slot.as_ref().is_none_or(|c| c.generation != generation) {
            *slot = Some(Cache {
                invalidations: now,
                generation,
                table: None,
                entries: HashMap::new(),
                len: 0,
            });
        }
        let c = slot.as_mut().expect("made above");
        if c.invalidations != now {
            c.invalidations = now;
            c.table = None;
        }
        let written = WRITTEN_BY;
        let dirty = written != pg_sys::InvalidTransactionId
            && pg_sys::GetTopTransactionIdIfAny() == written;
        (slot.as_mut().expect("made above"), dirty)
    };
    if !dirty {
        if let Some(o) = cache.entries.get(&role).and_then(|m| m.get(tenant)) {
            return *o;
        }
    }
    let table = *cache.table.get_or_insert_with(find);
    let Some((heap, pkey)) = table else {
        return Override::default();
    };
    // SAFETY: single-threaded backend state. A table found anew (another OID) makes
    // what was read from the old one void.
    unsafe {
        if TABLE_OID != heap {
            TABLE_OID = heap;
            cache.entries.clear();
            cache.len = 0;
        }
    }
    let found = read(heap, pkey, role, tenant);
    if !dirty {
        if cache.len >= CACHED_TENANTS {
            cache.entries.clear();
            cache.len = 0;
        }
        cache
            .entries
            .entry(role)
            .or_default()
            .insert(tenant.to_vec(), found);
        cache.len += 1;
    }
    found
}

/// quota.tenant_overrides and its index on (role, tenant), or None where the schema
/// has no such table (older than 0.7.0). A table of that name that is not the
/// extension's own, or not of its shape, is an error (I5).
pub fn find() -> Option<(pg_sys::Oid, pg_sys::Oid)> {
    // SAFETY: catalog lookups; the table is locked before it is opened.
    unsafe {
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        if ns == pg_sys::InvalidOid {
            return None;
        }
        let oid = pg_sys::get_relname_relid(TABLE.as_ptr(), ns);
        if oid == pg_sys::InvalidOid {
            return None;
        }
        let shown = "quota.tenant_overrides".to_string();
        let ext = pg_sys::get_extension_oid(c"pg_quota".as_ptr(), true);
        if ext == pg_sys::InvalidOid
            || pg_sys::getExtensionOfObject(pg_sys::RelationRelationId, oid) != ext
            || pg_sys::get_rel_relkind(oid) != pg_sys::RELKIND_RELATION as std::ffi::c_char
        {
            raise(QuotaError::NotExtensionMember { relation: shown });
        }
        let mut locks = Locks::new();
        locks.take(oid, pg_sys::AccessShareLock);
        let rel = pg_sys::table_open(oid, pg_sys::NoLock as i32);
        crate::ledger::rels::check_shape(
            rel,
            "tenant_overrides",
            &[
                ("role", &[pg_sys::REGROLEOID]),
                ("tenant", &[pg_sys::TEXTOID]),
                ("max_active", &[pg_sys::INT4OID]),
                ("max_retained", &[pg_sys::INT4OID]),
                ("set_at", &[pg_sys::TIMESTAMPTZOID]),
                ("set_by", &[pg_sys::NAMEOID]),
            ],
            &[NCOLS],
        );
        let pkey = find_index(rel, &[COL_ROLE, COL_TENANT], &[]);
        pg_sys::table_close(rel, pg_sys::NoLock as i32);
        Some((
            oid,
            pkey.unwrap_or_else(|| missing("tenant_overrides", "role, tenant")),
        ))
    }
}

/// One probe of the primary key, under the latest snapshot.
fn read(heap: pg_sys::Oid, pkey: pg_sys::Oid, role: pg_sys::Oid, tenant: &[u8]) -> Override {
    let mut locks = Locks::new();
    locks.take(heap, pg_sys::AccessShareLock);
    locks.take(pkey, pg_sys::AccessShareLock);
    let snap = Latest::take();
    // Not this transaction's own uncommitted writes: a change applies from its commit
    // (a writer-committed ticket admitted under it would outlive its rollback).
    // SAFETY: a registered copy of the latest snapshot, ours to change.
    unsafe { (*snap.0).curcid = pg_sys::FirstCommandId };
    let mut found = Override::default();
    scan(
        heap,
        pkey,
        &snap,
        &[Key::OidEq(role), Key::TextEq(text_datum(tenant))],
        |slot| {
            let limit = |col: usize| attr(slot, col as i32).map(|d| d.value() as i32);
            found = Override {
                max_active: limit(COL_MAX_ACTIVE),
                max_retained: limit(COL_MAX_RETAINED),
            };
            false
        },
    );
    found
}
