//! Layer 5: a writer-committed start (the default): the request goes to the ledger
//! writer (queue/caller.rs), which commits the charge in its own transaction before
//! start() returns, so that it survives the caller's rollback (I2) and is on disk (I6).

use pgrx::pg_sys;

use super::decide::{under_lock, Repeat};
use super::{Caller, Numbers, Refused};
use crate::queue::caller::{self as queue, Answer, Patience};
use crate::queue::Request;

/// One try through the writer at `now`; see super::attempt. `began`: when the call
/// began (see Patience::since). `repeat`: the caller's key names a ticket already,
/// which the writer must answer (synchronous standbys are named).
pub(crate) fn attempt(
    caller: &Caller,
    seq: u64,
    mut now: pg_sys::TimestampTz,
    began: pg_sys::TimestampTz,
    lease_us: Option<i64>,
    repeat: bool,
) -> Result<Result<(pgrx::Uuid, bool), Refused>, crate::core::QuotaError> {
    let args = caller.args;
    let limits = caller.limits;
    let retention = caller.policy.retention_secs;
    // SAFETY: a plain read of backend state.
    let pid = unsafe { pg_sys::MyProcPid };
    let fill = |r: &mut Request| {
        r.exempt = caller.exempt;
        r.max_active = limits.max_active;
        r.max_retained = limits.max_retained;
        r.max_db = limits.max_db;
        r.tenant_active = limits.tenant_active;
        r.tenant_retained = limits.tenant_retained;
        r.retention_secs = retention;
        r.has_label = args.label.is_some();
        let bytes = args.label.unwrap_or(b"");
        r.label[..bytes.len()].copy_from_slice(bytes);
        r.label_len = bytes.len();
        r.has_key = args.key.is_some();
        let key = args.key.unwrap_or(b"");
        r.key[..key.len()].copy_from_slice(key);
        r.key_len = key.len();
        r.has_tenant = args.tenant.is_some();
        let tenant = args.tenant.unwrap_or(b"");
        r.tenant[..tenant.len()].copy_from_slice(tenant);
        r.tenant_len = tenant.len();
        r.lease_us = lease_us;
        r.pid = pid;
    };
    let tenant = caller.tenant_key();

    // A repeat goes to the writer, which answers it without a limit check, when the
    // ticket may not be confirmed yet: synchronous standbys are named, and the ticket
    // may be one whose commit a terminated writer could not confirm (40003); the writer
    // waits for the standbys before it answers (writer/batch.rs, `settle`). So does a
    // repeat of a key whose first start is still in the writer's hands: refused here,
    // its caller would think nothing was charged, and then the first start commits.
    let through_writer = || {
        queue::enqueue(tenant, args.weight, fill);
        queue::wait(crate::waiters::leave)
    };
    let answer = if repeat || ((caller.exempt || !limits.any()) && args.key.is_none()) {
        // I7: superusers are never refused; the writer still records their ticket.
        // With every limit off there is nothing to count either. A start with a key
        // still takes the scope lock (0.5.2): its key is looked for, and its request
        // published, under the lock that a transactional start with the same key
        // holds from its own look to its insert. Without it, such a start could insert
        // its row (uncommitted, so invisible to the writer) after our look and before
        // our request reached the writer, and the key got two tickets.
        through_writer()
    } else {
        // Kept across the tries below, so that writers that keep failing to start
        // end the call (see Patience).
        let mut waited = Patience::since(began);
        loop {
            let handed = under_lock(caller, now, seq, &mut waited, queue::reclaim_mine, |_| {
                // Handed over only to a running writer: a wait in line for a writer
                // slot under the scope lock would hold up every other start of the
                // scope.
                if queue::enqueue_to_running(tenant, args.weight, fill) {
                    Ok(())
                } else {
                    Err(Repeat::NoWriter)
                }
            });
            match handed {
                Ok(Ok(())) => break queue::wait(crate::waiters::leave),
                Ok(Err(refused)) => return Ok(Err(refused)),
                Err(Repeat::Found(id, held)) if !crate::syncrep::standbys_defined() => {
                    return super::repeat_of(caller, id, held).map(|id| Ok((id, true)))
                }
                // The database had no writer, or the one that the requests in flight
                // waited for is gone: wait in line for one without the scope lock, then
                // decide again (the counts may have moved meanwhile).
                Err(Repeat::NoWriter) => queue::ensure_writer(),
                // A transactional start with our key is still open: wait for it
                // without the lock, then decide again.
                Err(Repeat::InProgress) => {
                    if let Some(key) = args.key {
                        super::wait_for_key(caller, key);
                    }
                }
                Err(_) => break through_writer(),
            }
            // Either wait may have been long: the next decision judges leases and ages
            // by the clock after it.
            // SAFETY: plain clock read.
            now = unsafe { pg_sys::GetCurrentTimestamp() };
        }
    };
    Ok(match answer {
        Answer::Admitted(id, held) => Ok((super::repeat_of(caller, id, held)?, false)),
        Answer::Refused(kind, usage, next) => Err(Refused {
            kind,
            numbers: Numbers::Full(usage, next),
            // The writer counted its batch's admissions ahead itself.
            ahead_units: 0,
        }),
    })
}
