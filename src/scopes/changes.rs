//! Layer 4: the changes a transaction makes to scope counters (see mod.rs): published
//! before it commits, with its transaction id, and applied after, unless a rebuild
//! that saw the transaction committed absorbed them meanwhile. Each backend has
//! PENDING_PER_SLOT places for them in the counters' segment.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;

use super::{find, layout, n_scopes, n_slots, Held, ScopeKey, BASE, LEASE_NONE, PENDING_PER_SLOT};
use crate::shmem;

/// What a transaction changes in one scope's counter: its active tickets, its rows (a
/// role's; a tenant has none), and the earliest lease end among the tickets it adds or
/// renews (LEASE_NONE if none; see Counter::earliest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    pub key: ScopeKey,
    pub active: i64,
    pub rows: i64,
    pub lease_floor: i64,
}

impl Change {
    pub fn new(key: ScopeKey, active: i64, rows: i64) -> Change {
        Change {
            key,
            active,
            rows,
            lease_floor: LEASE_NONE,
        }
    }
}

/// Adds to `changes` (one per scope, as `publish` takes them) what one ticket of scope
/// `key` changes: `active` active units and `rows` units of its role's rows (0.7.0:
/// units, as both counts are), and the same active units of its tenant if it has one
/// (a tenant has no rows of its own); a
/// ticket whose lease ends at `lease` (added, or renewed) lowers their `earliest`.
pub fn add_change(
    changes: &mut Vec<Change>,
    key: ScopeKey,
    active: i64,
    rows: i64,
    lease: Option<i64>,
) {
    let floor = lease.unwrap_or(LEASE_NONE);
    let mut add = |k: ScopeKey, rows: i64| match changes.iter_mut().find(|c| c.key == k) {
        Some(c) => {
            c.active += active;
            c.rows += rows;
            c.lease_floor = c.lease_floor.min(floor);
        }
        None => changes.push(Change {
            key: k,
            active,
            rows,
            lease_floor: floor,
        }),
    };
    add(ScopeKey::role(key.role), rows);
    if key.is_tenant() {
        add(key, 0);
    }
}

const PENDING_FREE: u32 = 0;
pub(super) const PENDING_SET: u32 = 1;
pub(super) const PENDING_ABSORBED: u32 = 2;

#[repr(C)]
pub struct Pending {
    pub(super) state: AtomicU32,
    db: AtomicU32,
    role: AtomicU32,
    pub(super) xid: AtomicU32,
    tenant: [AtomicU64; 2],
    d_active: AtomicI64,
    d_rows: AtomicI64,
    /// The earliest lease end among the tickets the change adds (or renews), LEASE_NONE
    /// if none: the counter's `earliest` goes down to it (0.6.0).
    pub(super) lease_floor: AtomicI64,
}

pub(super) fn pending_key(p: &Pending) -> (u32, u32, u128) {
    (
        p.db.load(Ordering::Relaxed),
        p.role.load(Ordering::Relaxed),
        u128::from(p.tenant[0].load(Ordering::Relaxed))
            | (u128::from(p.tenant[1].load(Ordering::Relaxed)) << 64),
    )
}

/// Publishes changes of this backend's transaction that is about to commit, as (scope,
/// Δactive, Δrows), after those it published already in this transaction (finish()
/// and transactional starts publish apart). Returns the scopes that did not fit; their
/// counters must be invalidated once the transaction has committed (`invalidate`).
pub fn publish(changes: &[Change]) -> Vec<ScopeKey> {
    let mine = pending(shmem::my_procno());
    // SAFETY: plain reads of backend state; the transaction wrote, so it has an id.
    let xid = unsafe { pg_sys::GetTopTransactionIdIfAny() };
    let mut free = mine
        .iter()
        .filter(|p| p.state.load(Ordering::Acquire) == PENDING_FREE);
    let mut overflow = Vec::new();
    for c in changes {
        let key = c.key;
        let Some(p) = free.next() else {
            overflow.push(key);
            continue;
        };
        let (db, role, tenant) = key.shared();
        p.db.store(db, Ordering::Relaxed);
        p.role.store(role, Ordering::Relaxed);
        p.tenant[0].store(tenant as u64, Ordering::Relaxed);
        p.tenant[1].store((tenant >> 64) as u64, Ordering::Relaxed);
        p.xid.store(xid.into_inner(), Ordering::Relaxed);
        p.d_active.store(c.active, Ordering::Relaxed);
        p.d_rows.store(c.rows, Ordering::Relaxed);
        p.lease_floor.store(c.lease_floor, Ordering::Relaxed);
        p.state.store(PENDING_SET, Ordering::Release);
    }
    overflow
}

/// After a transaction of this backend ended: applies each of its published changes
/// whose transaction committed (those a rebuild absorbed are not applied again), and
/// clears them all. Each change is judged by the transaction id it was published with,
/// not by what the caller believes ended: the writer's exit callback cannot know
/// whether its last change was a batch's or the expiry sweep's, and a transaction
/// still in progress (a FATAL in the middle of it) has not committed. Never raises an
/// error: it runs inside commit.
pub fn apply_mine() {
    if !shmem::available() {
        return;
    }
    let mine = pending(shmem::my_procno());
    if mine
        .iter()
        .all(|p| p.state.load(Ordering::Acquire) == PENDING_FREE)
    {
        return;
    }
    let held = Held::acquire(pg_sys::LWLockMode::LW_SHARED);
    // The earliest lease the committed changes add or renew, for the writer's sweep
    // (whether or not the scope has a counter).
    let mut floor = LEASE_NONE;
    for p in mine {
        // A change a rebuild absorbed is in the counter already, but its lease is news
        // to the writer's sweep all the same.
        let absorbed = p.state.load(Ordering::Acquire) == PENDING_ABSORBED;
        let set = p
            .state
            .compare_exchange(
                PENDING_SET,
                PENDING_FREE,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        // SAFETY: a commit log lookup of a transaction that has ended or is ours.
        let committed = (set || absorbed)
            && unsafe {
                pg_sys::TransactionIdDidCommit(pg_sys::TransactionId::from_inner(
                    p.xid.load(Ordering::Relaxed),
                ))
            };
        if committed {
            floor = floor.min(p.lease_floor.load(Ordering::Relaxed));
        }
        if set && committed {
            if let Some(e) = find(pending_key(p)) {
                // The lease floor first, for a look at the scope's tickets under way
                // (its snapshot may not see this change; see refresh_earliest), then
                // before the count: a reader that sees the new count sees the floor
                // with it.
                let lease = p.lease_floor.load(Ordering::Relaxed);
                e.floor_since.fetch_min(lease, Ordering::AcqRel);
                e.earliest.fetch_min(lease, Ordering::AcqRel);
                e.active
                    .fetch_add(p.d_active.load(Ordering::Relaxed), Ordering::AcqRel);
                e.rows
                    .fetch_add(p.d_rows.load(Ordering::Relaxed), Ordering::AcqRel);
            }
        }
        p.state.store(PENDING_FREE, Ordering::Release);
    }
    drop(held);
    if floor != LEASE_NONE {
        crate::workers::lower_lease_floor(shmem::my_db(), floor);
    }
}

/// Every backend's pending counter changes, PENDING_PER_SLOT per PGPROC number.
pub(super) fn all_pending() -> &'static [Pending] {
    // SAFETY: `layout` put them there; zeroed is PENDING_FREE.
    unsafe {
        BASE.slice::<Pending>(
            layout(n_slots(), n_scopes()).2,
            n_slots() * PENDING_PER_SLOT,
        )
    }
}

/// The pending counter changes published by backend `procno`.
fn pending(procno: usize) -> &'static [Pending] {
    &all_pending()[procno * PENDING_PER_SLOT..(procno + 1) * PENDING_PER_SLOT]
}
