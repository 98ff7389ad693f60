//! Layer 4: the ledger writer's half of the request queue (see mod.rs): claiming the
//! PENDING requests of its database, answering them, and handing back what it cannot
//! answer when it exits.

use std::sync::atomic::Ordering;

use pgrx::pg_sys;

use super::*;
use crate::workers::{self, TableLock};

/// Claims up to `max` PENDING requests of database `db`, of at most `max_scopes`
/// scopes (a role, and each tenant of it, is one). The claim is checked after the
/// compare-and-swap: a slot withdrawn and reused by a backend of another database
/// between our read of its database and the swap is handed back.
pub fn claim(db: pg_sys::Oid, max: usize, max_scopes: usize) -> Vec<usize> {
    let mut batch = Vec::new();
    // A batch publishes one counter change per scope (see scopes/): at most as many
    // scopes as fit; the others wait for the next batch.
    let mut scopes: Vec<(pg_sys::Oid, u128)> = Vec::new();
    let new_scopes = |scopes: &Vec<(pg_sys::Oid, u128)>, role: pg_sys::Oid, tenant: u128| {
        usize::from(!scopes.contains(&(role, 0)))
            + usize::from(tenant != 0 && !scopes.contains(&(role, tenant)))
    };
    for (i, s) in slots().iter().enumerate() {
        if load_state(s) != SLOT_PENDING || s.dboid() != db {
            continue;
        }
        if scopes.len() + new_scopes(&scopes, s.role(), s.tenant()) > max_scopes {
            continue;
        }
        if s.state
            .compare_exchange(
                SLOT_PENDING,
                SLOT_CLAIMED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            continue;
        }
        let claimed_db = s.dboid();
        if claimed_db != db {
            s.state.store(SLOT_PENDING, Ordering::Release);
            let _lock = TableLock::acquire_shared();
            if let Some(w) = workers::writer_of(claimed_db) {
                if let Ok(p) = usize::try_from(workers::writer(w).procno) {
                    shmem::wake(p);
                }
            }
            continue;
        }
        let (role, tenant) = (s.role(), s.tenant());
        if !scopes.contains(&(role, 0)) {
            scopes.push((role, 0));
        }
        if tenant != 0 && !scopes.contains(&(role, tenant)) {
            scopes.push((role, tenant));
        }
        batch.push(i);
        if batch.len() == max {
            break;
        }
    }
    batch
}

/// Marks the claimed slots of `group` DONE and wakes their callers.
pub fn answer(group: &[usize]) {
    for &i in group {
        // CLAIMED by us until now; nobody else moves a claimed slot.
        let _ = slot(i).state.compare_exchange(
            SLOT_CLAIMED,
            SLOT_DONE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        shmem::wake(i);
    }
}

/// Marks claimed slot `i`'s admission as not confirmed by synchronous replication: its
/// caller raises QuotaError::CommitUnconfirmed instead of returning the ticket.
/// Refusals and errors are left as they are: they charged nothing.
pub fn set_unconfirmed(i: usize) {
    // SAFETY: the slot is CLAIMED by us.
    let r = unsafe { &mut *slot(i).reply.get() };
    if r.kind == REPLY_ADMITTED {
        r.kind = REPLY_UNCONFIRMED;
    }
}

/// Answers claimed slot `i` with an error: the writer's SQLSTATE and message.
pub fn set_error(i: usize, code: i32, msg: &str) {
    // SAFETY: the slot is CLAIMED by us.
    let r = unsafe { &mut *slot(i).reply.get() };
    r.kind = REPLY_ERROR;
    r.sqlerrcode = code;
    let mut n = msg.len().min(ERROR_TEXT_BYTES);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    r.error[..n].copy_from_slice(&msg.as_bytes()[..n]);
    r.error_len = n;
}

/// The request in claimed slot `i`.
///
/// # Safety
/// The slot is CLAIMED by this writer: its caller does not touch it until DONE.
pub unsafe fn request(i: usize) -> &'static Request {
    // SAFETY: per the contract above.
    unsafe { &*slot(i).request.get() }
}

/// The reply of claimed slot `i`, which this writer writes.
///
/// # Safety
/// The slot is CLAIMED by this writer, and no other reference to its reply is alive.
#[allow(clippy::mut_from_ref)]
pub unsafe fn reply(i: usize) -> &'static mut Reply {
    // SAFETY: per the contract above.
    unsafe { &mut *slot(i).reply.get() }
}

/// Hands claimed slot `i` back: DONE if its batch committed (its reply is written),
/// PENDING otherwise, for the next writer; wakes its caller.
pub fn hand_back(i: usize, done: bool) {
    let s = slot(i);
    let to = if done { SLOT_DONE } else { SLOT_PENDING };
    if s.state
        .compare_exchange(SLOT_CLAIMED, to, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        shmem::wake(i);
    }
}

/// Whether a request of database `db` waits to be claimed. Callers hold the writer
/// table's lock, which callers hold to enqueue.
pub fn pending_in(db: pg_sys::Oid) -> bool {
    slots()
        .iter()
        .any(|s| load_state(s) == SLOT_PENDING && s.dboid() == db)
}

/// Wakes the callers with requests of database `db` waiting to be claimed: their writer
/// is gone, and they start a new one.
pub fn wake_pending(db: pg_sys::Oid) {
    for (i, s) in slots().iter().enumerate() {
        if load_state(s) == SLOT_PENDING && s.dboid() == db {
            shmem::wake(i);
        }
    }
}
