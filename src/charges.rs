//! Layer 4, shared state: transactional charges (0.5.0), in a segment of their own.
//!
//! `start(…, transactional => true)` inserts its ticket in the caller's transaction,
//! where nobody else sees it until that transaction commits. Until then it must still
//! count against its scopes, for every other session: it is an open charge of each of
//! them (its role's, and its tenant's if it has one), held in their scope counters
//! (scopes.rs, `pin`), which keep their entries while they hold any.
//!
//! This file keeps a backend's open charges, each with the subtransaction nesting level
//! that took it, and ends them with the transaction:
//! - before it commits, they are published as changes of their scopes' counters (one
//!   more active ticket and one more row each), applied once it has committed, as
//!   finish() publishes what it ends; only then do they stop being open, so that for a
//!   moment they are counted twice (over-count), never not at all;
//! - when it (or the savepoint under which one was taken) rolls back, they stop being
//!   open, and the starts waiting in their scopes look again: the slot came back;
//! - PREPARE TRANSACTION is refused while it holds any (0A000): COMMIT PREPARED runs
//!   elsewhere, later, where nothing would take them over.
//!
//! The database cap counts every role's open charges of the database: each backend
//! keeps its own count in its entry of this segment.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::core::QuotaError;
use crate::ledger::rels::Tags;
use crate::scopes::{self, Pin, ScopeKey};
use crate::shmem::{self, Base, Layout, Segment};

/// One open charge of this backend's transaction.
struct Charge {
    role: pg_sys::Oid,
    /// The tenant's key, 0 for the role itself.
    tenant: u128,
    pins: [Option<Pin>; 2],
    /// Its idempotency key, and its ticket once inserted: a repeat of the key in this
    /// transaction gets that ticket (see `own_with_key`).
    key: Option<Vec<u8>>,
    id: Option<[u8; 16]>,
    /// When its ticket's lease ends (None: never): its scopes' counters' `earliest`
    /// goes down to it when it commits (see scopes::Counter).
    lease_until: Option<i64>,
    /// Its weight (0.7.0): the units it counts against its scopes' active limits.
    weight: i64,
}

// Single-threaded backend state: the open charges of the current transaction, with
// the subtransaction nesting level that took each, and the scopes whose changes did not
// fit when published (their counters are invalidated once the transaction commits).
static mut OPEN: Vec<(Charge, i32)> = Vec::new();
static mut OVERFLOW: Vec<ScopeKey> = Vec::new();
static mut CALLBACKS_REGISTERED: bool = false;

/// Takes an open charge of `weight` units of `role` (and of its tenant `tenant`, a key
/// of scopes::tenant_key, 0 for none) for the current (sub)transaction. The caller holds
/// the role's scope lock and has decided to admit. Fails with 53000 if a scope has no
/// counter it could keep (every entry of its window holds open charges itself); then
/// nothing is charged.
pub fn take(
    role: pg_sys::Oid,
    tenant: u128,
    key: Option<&[u8]>,
    tags: Option<Tags>,
    weight: i64,
) -> Result<(), QuotaError> {
    register_callbacks();
    let role_pin = scopes::pin(ScopeKey::role(role), tags, weight).ok_or(QuotaError::NoCounter)?;
    let tenant_pin = if tenant != 0 {
        match scopes::pin(ScopeKey { role, tenant }, tags, weight) {
            Some(p) => Some(p),
            None => {
                scopes::unpin(role_pin);
                return Err(QuotaError::NoCounter);
            }
        }
    } else {
        None
    };
    // SAFETY: single-threaded backend state; a plain read of transaction state.
    unsafe {
        let level = pg_sys::GetCurrentTransactionNestLevel();
        (*std::ptr::addr_of_mut!(OPEN)).push((
            Charge {
                role,
                tenant,
                pins: [Some(role_pin), tenant_pin],
                key: key.map(<[u8]>::to_vec),
                id: None,
                lease_until: None,
                weight,
            },
            level,
        ));
    }
    let mine = mine();
    mine.db.store(u32::from(shmem::my_db()), Ordering::Relaxed);
    mine.n.fetch_add(weight, Ordering::AcqRel);
    Ok(())
}

/// Names the ticket of the charge `take` took last, and when its lease ends.
pub fn identify(id: [u8; 16], lease_until: Option<i64>) {
    // SAFETY: single-threaded backend state.
    if let Some((c, _)) = unsafe { (*std::ptr::addr_of_mut!(OPEN)).last_mut() } {
        c.id = Some(id);
        c.lease_until = lease_until;
    }
}

/// The ticket of an open charge of this transaction in scope (`role`, `tenant`) with
/// idempotency key `key`, and its weight. Nobody else sees it before the commit, and this transaction
/// may not either: a repeat in the same statement runs under the same command id.
pub fn own_with_key(role: pg_sys::Oid, tenant: u128, key: &[u8]) -> Option<([u8; 16], i64)> {
    // SAFETY: single-threaded backend state.
    let open = unsafe { &*std::ptr::addr_of!(OPEN) };
    open.iter()
        .rev()
        .find(|(c, _)| c.role == role && c.tenant == tenant && c.key.as_deref() == Some(key))
        .and_then(|(c, _)| c.id.map(|id| (id, c.weight)))
}

/// The units of the open charges of any role this database has (0.7.0: their weights
/// summed): what the database cap counts
/// beside the committed tickets. A read that races with a charge being taken or ended
/// only misses or counts it once more for a moment; the cap is counted again by the
/// writer for its requests, and under each role's scope lock for transactional ones.
pub fn open_in_db() -> i64 {
    let db = u32::from(shmem::my_db());
    entries()
        .iter()
        .filter(|e| e.db.load(Ordering::Acquire) == db)
        .map(|e| e.n.load(Ordering::Acquire))
        .sum()
}

/// Ends `charges`: their scopes' counters no longer hold them. `committed`: they are
/// tickets now, which quota.stats counts as admitted; otherwise they were given back
/// (a rollback), and the starts waiting in their scopes look again.
fn end(charges: Vec<(Charge, i32)>, committed: bool) {
    let mine = mine();
    for (c, _) in charges {
        for p in c.pins.into_iter().flatten() {
            scopes::unpin(p);
        }
        mine.n.fetch_sub(c.weight, Ordering::AcqRel);
        if committed {
            crate::stats::add(c.role, crate::core::stats::Counter::Admitted, 1);
        } else {
            crate::waiters::wake(shmem::my_db(), c.role);
        }
    }
}

fn register_callbacks() {
    // SAFETY: single-threaded backend state; the callbacks are registered once.
    unsafe {
        if !CALLBACKS_REGISTERED {
            pg_sys::RegisterXactCallback(Some(xact_event), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(subxact_event), std::ptr::null_mut());
            CALLBACKS_REGISTERED = true;
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn xact_event(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    // SAFETY: single-threaded backend state.
    unsafe {
        let open = &mut *std::ptr::addr_of_mut!(OPEN);
        let overflow = &mut *std::ptr::addr_of_mut!(OVERFLOW);
        if open.is_empty() {
            return;
        }
        match event {
            pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT => {
                // One change per scope: each charge is its weight's active units and
                // as many more units of its role's rows (0.7.0), and the same active
                // units of its tenant.
                let mut changes = Vec::new();
                for (c, _) in open.iter() {
                    let key = ScopeKey {
                        role: c.role,
                        tenant: c.tenant,
                    };
                    scopes::add_change(&mut changes, key, c.weight, c.weight, c.lease_until);
                }
                *overflow = scopes::publish(&changes);
            }
            pg_sys::XactEvent::XACT_EVENT_PRE_PREPARE => {
                pgrx::pg_sys::panic::ErrorReport::new(
                    PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                    "cannot PREPARE a transaction that has taken transactional pg_quota charges",
                    "pg_quota",
                )
                .set_detail("COMMIT PREPARED would commit them elsewhere, where pg_quota could not count them.")
                .set_hint("Take transactional charges in transactions that commit directly, or use quota.start() without transactional.")
                .report(PgLogLevel::ERROR);
            }
            pg_sys::XactEvent::XACT_EVENT_COMMIT => {
                // Applied (or invalidated) first, then no longer open: never a moment
                // when a committed charge is counted nowhere.
                scopes::apply_mine();
                scopes::invalidate(overflow);
                overflow.clear();
                end(std::mem::take(open), true);
            }
            pg_sys::XactEvent::XACT_EVENT_ABORT => {
                scopes::apply_mine();
                overflow.clear();
                end(std::mem::take(open), false);
            }
            _ => {}
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn subxact_event(
    event: pg_sys::SubXactEvent::Type,
    _my_subid: pg_sys::SubTransactionId,
    _parent_subid: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    // SAFETY: single-threaded backend state; a plain read of transaction state.
    unsafe {
        let open = &mut *std::ptr::addr_of_mut!(OPEN);
        if open.is_empty() {
            return;
        }
        // The savepoint's inserts are rolled back with it: so are its charges.
        end(crate::xact::at_subxact_end(open, event), false);
    }
}

// ---------------------------------------------------------------------------------
// The segment: each backend's open charges, for the database cap
// ---------------------------------------------------------------------------------

#[repr(C)]
struct Entry {
    /// The database of the backend's open charges.
    db: AtomicU32,
    /// Their units (0.7.0; one per charge before).
    n: AtomicI64,
}

#[repr(C)]
struct Header {
    n: usize,
}

static BASE: Base = Base::new();

fn layout(n: usize) -> (Layout, usize) {
    let mut l = Layout::of::<Header>();
    let entries = l.array::<Entry>(n);
    (l, entries)
}

fn size() -> usize {
    layout(shmem::max_backends()).0.size()
}

/// # Safety
/// See shmem::Segment::attach.
unsafe fn attach(base: *mut u8, found: bool, _locks: *mut pg_sys::LWLockPadded) {
    // SAFETY: the segment is ours and zeroed when not `found`; zero is no charge.
    unsafe {
        if !found {
            (*(base as *mut Header)).n = shmem::max_backends();
        }
    }
    BASE.set(base);
}

/// The transactional charges' segment (see shmem.rs).
pub static SEGMENT: Segment = Segment {
    name: c"pg_quota charges",
    size,
    extra: shmem::nothing,
    locks: 0,
    attach,
};

fn entries() -> &'static [Entry] {
    // SAFETY: the segment starts with a Header; `layout` put `n` entries after it.
    unsafe {
        let n = BASE.header::<Header>().n;
        BASE.slice::<Entry>(layout(n).1, n)
    }
}

fn mine() -> &'static Entry {
    &entries()[shmem::my_procno()]
}
