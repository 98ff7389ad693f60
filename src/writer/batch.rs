//! Layer 5: one batch of the ledger writer. It decides every request it claimed with
//! the exact counts (core::batch), inserts the admitted tickets, purges what is past
//! retention in the roles that grow, keeps their summary rows, and answers every caller;
//! a group that fails is retried or split so that one request's failure fails no other.

use std::collections::HashMap;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::core::batch::{self, BatchRequest, Counted};
use crate::core::{Decision, Limits, RefusalKind};
use crate::ledger::heap::OpenRel;
use crate::ledger::keys::retained_with_key;
use crate::ledger::leases::db_active;
use crate::ledger::rels::Reader;
use crate::ledger::scan::{text_datum, Latest};
use crate::ledger::write::{add_to_summary, new_ticket_id, purge_before, record, Admitted, Tables};
use crate::queue::{self, serve, Request, REPLY_ADMITTED, REPLY_REFUSED};
use crate::scopes::counts::{self, Tenant};
use crate::scopes::{Change, ScopeKey};
use crate::shmem;
use crate::timestamps::cutoff;

use super::txn::{caught_error, in_transaction, LAST_COMMIT_US};

/// How often a batch is retried after the writer's statement was cancelled
/// (pg_cancel_backend on the writer): the requests did nothing wrong.
const MAX_CANCEL_RETRIES: u32 = 3;

// The slots of the batch in progress and the transaction that records them: the exit
// callback needs both to answer callers truthfully if the writer is terminated. A
// background worker is single-threaded, so plain statics suffice.
thread_local! {
    /// The group of slots whose transaction is in progress.
    static BATCH: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Slots claimed by this writer and waiting for their turn in the same batch (after
    /// a failed group was split into single requests).
    static QUEUED: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}
static mut BATCH_XID: pg_sys::TransactionId = pg_sys::InvalidTransactionId;

/// Whether the transaction of the batch in progress committed, for the exit callback:
/// false while it is still in progress, or when there is none.
pub fn committed() -> bool {
    // SAFETY: single-threaded worker state; a commit log lookup.
    unsafe {
        BATCH_XID != pg_sys::InvalidTransactionId && pg_sys::TransactionIdDidCommit(BATCH_XID)
    }
}

/// At exit: the batch in progress is answered if it `committed` (and its admissions
/// counted), handed back as PENDING for the next writer otherwise, as are the requests
/// claimed for later groups of the same batch.
pub fn hand_back_at_exit(committed: bool) {
    if committed {
        BATCH.with_borrow(|b| count_admitted(b));
        // As `settle` judges it: a commit the synchronous standbys did not confirm
        // hands out no ticket.
        if !crate::syncrep::last_commit_confirmed() {
            BATCH.with_borrow(|b| b.iter().for_each(|&i| serve::set_unconfirmed(i)));
        }
    }
    BATCH.with_borrow(|b| b.iter().for_each(|&i| serve::hand_back(i, committed)));
    QUEUED.with_borrow(|q| q.iter().for_each(|&i| serve::hand_back(i, false)));
}

/// A scope's counts as the batch decides on them: its active tickets, and its
/// retained ones for each of `retentions` (the cutoffs `exact` was counted at).
fn counted_of(exact: counts::Exact, retentions: &[i64]) -> Counted {
    Counted {
        active: exact.active,
        retained: retentions.iter().copied().zip(exact.retained).collect(),
    }
}

/// Handles one batch, then answers every caller in it. A group whose transaction
/// fails is retried when the failure was not the requests' doing (a cancel), or split
/// into single requests when one of them may be the cause, so that one request's
/// failure never fails another's.
pub fn process(batch: Vec<usize>) {
    QUEUED.with_borrow_mut(|q| q.clone_from(&batch));
    let mut groups = vec![(batch, 0u32)];
    while let Some((group, retries)) = groups.pop() {
        QUEUED.with_borrow_mut(|q| q.retain(|i| !group.contains(i)));
        BATCH.with_borrow_mut(|b| b.clone_from(&group));
        // SAFETY: single-threaded worker state, read by the exit callback.
        unsafe { BATCH_XID = pg_sys::InvalidTransactionId };
        let outcome = PgTryBuilder::new(|| {
            let overflow = in_transaction(|| {
                let changes = handle_batch(&group);
                // SAFETY: the transaction id our writes got, if any; the exit callback
                // asks the commit log about it.
                unsafe { BATCH_XID = pg_sys::GetTopTransactionIdIfAny() };
                // Published before the commit, applied after it (see scopes.rs).
                crate::scopes::publish(&changes)
            });
            // Before anyone is answered: a caller that no longer counts its request as
            // in flight must find it in the counter.
            crate::scopes::apply_mine();
            crate::scopes::invalidate(&overflow);
            Ok(())
        })
        .catch_others(|e| Err(caught_error(e)))
        .execute();
        match outcome {
            Ok(()) => {
                crate::stats::writer_batch(group.len(), Some(LAST_COMMIT_US.get()));
                count_admitted(&group);
                // SAFETY: single-threaded worker state, set in the transaction above.
                let wrote = unsafe { BATCH_XID } != pg_sys::InvalidTransactionId;
                let going = settle(&group, wrote);
                serve::answer(&group);
                if going {
                    // Terminated, or the postmaster is gone: go now, rather than commit
                    // more batches that could not be confirmed either. The batch is
                    // answered and counted, so the exit callback must not see it; the
                    // requests queued behind it are handed back to the next writer.
                    BATCH.with_borrow_mut(Vec::clear);
                    // SAFETY: single-threaded worker state; ProcDiePending is still
                    // set, and raising InterruptPending makes the check below end the
                    // worker with FATAL, as `die` would have.
                    unsafe {
                        BATCH_XID = pg_sys::InvalidTransactionId;
                        pg_sys::InterruptPending = 1;
                    }
                    pgrx::check_for_interrupts!();
                }
            }
            Err((code, msg)) => {
                // SAFETY: pgrx flushed the error state when it caught the error; abort
                // the failed transaction as a worker's error recovery does.
                unsafe {
                    pg_sys::AbortCurrentTransaction();
                    BATCH_XID = pg_sys::InvalidTransactionId;
                }
                crate::stats::writer_error(&msg);
                crate::scopes::apply_mine();
                let cancelled = code == PgSqlErrorCode::ERRCODE_QUERY_CANCELED as i32;
                if cancelled && retries < MAX_CANCEL_RETRIES {
                    QUEUED.with_borrow_mut(|q| q.extend(&group));
                    groups.push((group, retries + 1));
                } else if group.len() > 1 && may_be_one_requests_fault(code) {
                    QUEUED.with_borrow_mut(|q| q.extend(&group));
                    groups.extend(group.iter().map(|&i| (vec![i], retries)));
                } else {
                    crate::error::log_line(
                        pg_sys::LOG,
                        PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
                        &format!(
                            "pg_quota ledger writer: {} request(s) failed: {msg}",
                            group.len()
                        ),
                    );
                    for &i in &group {
                        serve::set_error(i, code, &msg);
                    }
                    crate::stats::writer_batch(group.len(), None);
                    serve::answer(&group);
                }
            }
        }
    }
    BATCH.with_borrow_mut(Vec::clear);
    QUEUED.with_borrow_mut(Vec::clear);
    // SAFETY: reports the worker as idle in pg_stat_activity.
    unsafe { pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_IDLE, std::ptr::null()) };
}

/// Holds back the tickets of a batch that synchronous replication has not confirmed.
/// A commit that waits for the synchronous standbys (synchronous_standby_names)
/// returns early, without their confirmation, when the writer is cancelled or
/// terminated or the postmaster dies meanwhile (SyncRepWaitForLSN warns that the
/// transaction "has already committed locally, but might not have been replicated").
/// PostgreSQL then tells its own client nothing; a ticket handed out here could be
/// lost with this server. So the batch's admissions are answered as unconfirmed: the
/// callers raise 40003, and the charges stay counted here (over-count, never
/// under-count). A batch that committed nothing (every request a repeat of a key, or
/// refused) answers tickets earlier commits made, perhaps one a terminated writer
/// could not confirm: it waits for the standbys now, as its commit would have.
/// Judged by the standbys' confirmed positions (syncrep.rs), so a terminate that comes
/// after a confirmed commit, or where no standby is waited for, costs nobody a ticket.
/// Returns whether the writer is going down (terminated, or the postmaster is gone);
/// read before anything can process the interrupt, which clears the flag.
fn settle(group: &[usize], wrote: bool) -> bool {
    let reused = group.iter().any(|&i| {
        // SAFETY: the slot is CLAIMED by us, and its reply written by us.
        let r = unsafe { &*serve::reply(i) };
        r.kind == REPLY_ADMITTED && r.reused
    });
    let confirmed = if wrote {
        crate::syncrep::last_commit_confirmed()
    } else if reused {
        crate::syncrep::wait_for_flushed()
    } else {
        true
    };
    if !confirmed {
        for &i in group {
            serve::set_unconfirmed(i);
        }
    }
    // SAFETY: a volatile read of a flag that signal handlers and SyncRepWaitForLSN set.
    unsafe { std::ptr::read_volatile(&raw const pg_sys::ProcDiePending) != 0 }
}

/// Errors that a single request's data could cause (a constraint a DBA added, a
/// value a type rejects). Anything else, such as a lock timeout, would fail every
/// request alike, so retrying them one by one would only multiply the wait.
fn may_be_one_requests_fault(code: i32) -> bool {
    let class = |c: PgSqlErrorCode| (c as i32) & 0xfff; // the two-character class
    let ours = code & 0xfff;
    ours == class(PgSqlErrorCode::ERRCODE_INTEGRITY_CONSTRAINT_VIOLATION)
        || ours == class(PgSqlErrorCode::ERRCODE_DATA_EXCEPTION)
}

/// quota.stats: the tickets a committed batch handed out, and the idempotent repeats
/// it answered, counted here rather than by the callers, since a caller cancelled
/// after we claimed its request never hears of its ticket, which still counts.
fn count_admitted(group: &[usize]) {
    for &i in group {
        let s = queue::slot(i);
        // SAFETY: the slot is CLAIMED by us, and its reply written by us.
        let r = unsafe { &*serve::reply(i) };
        // A repeat of another weight is refused by its caller (22023): no hit.
        if r.kind == REPLY_ADMITTED && !(r.reused && r.weight != s.weight()) {
            let counter = if r.reused {
                crate::core::stats::Counter::IdempotentHits
            } else {
                crate::core::stats::Counter::Admitted
            };
            crate::stats::add_in(s.dboid(), s.role(), counter, 1);
        }
    }
}

/// Decides every request of the batch and records the admitted ones. Runs inside the
/// batch transaction; the writer is the only process that inserts writer-committed
/// tickets, so counts taken here, plus the transactional charges still open (which
/// their scopes' counters hold), plus this batch's own admissions, are exact (I1).
/// Returns the changes of the scope counters to publish.
fn handle_batch(batch: &[usize]) -> Vec<Change> {
    let reader = Reader::open();
    let rels = reader.rels;
    // The locks the writes need, before the clock is read: `now` is every admitted
    // ticket's started_at and the start of its lease, so no lock wait (the writer waits
    // up to its lock_timeout for maintenance) may come between it and the insert.
    let tables = Tables::open(&rels);
    let ledger = &tables.ledger;
    // Its purges write quota.history (0.6.0): opened here too, before the clock.
    tables.history();
    let summary = OpenRel::open(rels.summary, "summary", 1);
    // SAFETY: the slots are CLAIMED by us; their callers do not touch them until DONE.
    let requests: Vec<&Request> = batch
        .iter()
        .map(|&i| unsafe { serve::request(i) })
        .collect();
    // The database cap spans roles, which the callers' scope locks do not: a batch
    // with a capped request reads the database's open charges and takes its snapshot
    // under the cap's lock, which transactional starts hold from their count to their
    // charge (see scopes::cap_lock_tag): a charge taken before is in the read, and a
    // start that counts after counts this batch's requests as in flight until they are
    // answered, after the commit. The open charges are read before the snapshot: one
    // that commits in between is counted twice, never missed.
    let capped = rels.v2() && requests.iter().any(|r| r.max_db > 0 && !r.exempt);
    let cap = crate::scopes::cap_lock_tag(crate::shmem::my_db());
    let open_db = if capped {
        // SAFETY: an ordinary transaction-level lock, released below (or when the
        // batch's transaction ends, on an error); lock_timeout and the deadlock
        // detector apply. Its holders hold no lock the writer waits for meanwhile.
        unsafe { pg_sys::LockAcquire(&cap, pg_sys::ExclusiveLock as i32, false, false) };
        crate::charges::open_in_db()
    } else {
        0
    };
    let snap = Latest::take();
    if capped {
        // SAFETY: taken above, under the same owner.
        unsafe { pg_sys::LockRelease(&cap, pg_sys::ExclusiveLock as i32, false) };
    }
    // SAFETY: plain clock read, after every lock the writes wait for and after the
    // counts' snapshot: a ticket is admitted no earlier than its started_at.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let roles: Vec<pg_sys::Oid> = batch.iter().map(|&i| queue::slot(i).role()).collect();
    let tenants: Vec<u128> = batch.iter().map(|&i| queue::slot(i).tenant()).collect();
    let weights: Vec<i64> = batch.iter().map(|&i| queue::slot(i).weight()).collect();
    let breqs: Vec<BatchRequest> = requests
        .iter()
        .zip(roles.iter().zip(&tenants))
        .zip(&weights)
        .map(|((r, (role, &tenant)), &weight)| BatchRequest {
            role: u32::from(*role),
            tenant: (tenant != 0).then_some(tenant),
            limits: Limits {
                max_active: r.max_active,
                max_retained: r.max_retained,
                max_db: if rels.v2() { r.max_db } else { 0 },
                tenant_active: r.tenant_active,
                tenant_retained: r.tenant_retained,
            },
            retention_secs: r.retention_secs,
            exempt: r.exempt,
            weight,
        })
        .collect();
    // Each tenant's text, for the ledger.
    let tenant_text = |role: u32, t: u128| -> Option<&[u8]> {
        (0..batch.len())
            .find(|&k| breqs[k].role == role && tenants[k] == t)
            .and_then(|k| requests[k].tenant())
    };

    // Idempotent starts: a request whose key names a ticket its scope still retains
    // gets that ticket and is charged nothing; so does a request repeating a key
    // admitted earlier in this batch. Only the writer inserts, and it handles one
    // batch at a time, so eight sessions sending one key at once get one ticket.
    let mut reused: Vec<Option<([u8; 16], i64)>> = vec![None; batch.len()];
    if rels.v2() {
        for (k, req) in requests.iter().enumerate() {
            let Some(key) = req.key() else { continue };
            let cutoff = cutoff(now, req.retention_secs);
            reused[k] = retained_with_key(&rels, &snap, roles[k], req.tenant(), key, now, cutoff);
        }
    }
    let fresh: Vec<usize> = (0..batch.len()).filter(|&k| reused[k].is_none()).collect();
    let fresh_reqs: Vec<BatchRequest> = fresh.iter().map(|&k| breqs[k]).collect();

    // Count each role once, from its scope counter (see scopes/), and only what its
    // requests are limited by. The counter is exact for us: we are the only process
    // that adds writer-committed admissions to it, right after each commit, and the
    // transactional charges not committed yet are its open ones. Leases that ran out
    // are subtracted, under a snapshot taken after the counter was read.
    let counted: HashMap<u32, Counted> = batch::needs(&fresh_reqs)
        .into_iter()
        .map(|(role, needs)| {
            let cutoffs: Vec<_> = needs
                .retentions
                .iter()
                .map(|&ret| cutoff(now, ret))
                .collect();
            let exact = counts::role_exact(&reader, pg_sys::Oid::from(role), now, &cutoffs);
            (role, counted_of(exact, &needs.retentions))
        })
        .collect();
    // The same for each tenant of the batch, from the ledger where it has no counter.
    let tenant_counted: HashMap<batch::TenantOf, Counted> = batch::tenant_needs(&fresh_reqs)
        .into_iter()
        .map(|((role, t), needs)| {
            let tenant = Tenant {
                key: t,
                text: text_datum(tenant_text(role, t).unwrap_or_default()),
            };
            let cutoffs: Vec<_> = needs
                .retentions
                .iter()
                .map(|&ret| cutoff(now, ret))
                .collect();
            let exact =
                counts::tenant_exact(&reader, pg_sys::Oid::from(role), tenant, now, &cutoffs);
            ((role, t), counted_of(exact, &needs.retentions))
        })
        .collect();
    // The database cap: every role's active tickets together, counted once, and the
    // transactional charges still open.
    let db_active =
        batch::db_cap(&fresh_reqs).map_or(0, |cap| db_active(&rels, &snap, now, cap) + open_db);
    let fresh_decisions = batch::decide_batch(&fresh_reqs, &counted, &tenant_counted, db_active);
    let mut decisions: Vec<Option<Decision>> = vec![None; batch.len()];
    for (&k, d) in fresh.iter().zip(fresh_decisions) {
        decisions[k] = Some(d);
    }

    let mut admitted: Vec<Admitted> = Vec::new();
    // Each scope's admissions in this batch, in units (0.7.0: active and retained
    // counts both take a ticket's weight).
    let mut pending: HashMap<ScopeKey, i64> = HashMap::new();
    // The earliest lease end each scope's admissions bring (see scopes::Counter).
    let mut floors: HashMap<ScopeKey, i64> = HashMap::new();
    for (k, ((&i, req), breq)) in batch.iter().zip(&requests).zip(&breqs).enumerate() {
        // SAFETY: as above; the reply belongs to the writer while the slot is CLAIMED.
        let reply = unsafe { serve::reply(i) };
        let role = pg_sys::Oid::from(breq.role);
        // A key admitted earlier in this batch, in this scope.
        let repeated = req.key().and_then(|key| {
            admitted
                .iter()
                .find(|a| a.role == role && a.tenant == req.tenant() && a.key == Some(key))
                .map(|a| (*a.id.as_bytes(), a.weight))
        });
        if let Some((id, weight)) = reused[k].or(repeated) {
            // The caller compares the weight with its own (admission::repeat_of).
            reply.kind = REPLY_ADMITTED;
            reply.ticket = id;
            reply.weight = weight;
            reply.reused = true;
            continue;
        }
        match decisions[k].expect("decided") {
            Decision::Admit => {
                let id = new_ticket_id(now);
                let lease_until = req.lease_us.map(|us| crate::core::lease::ends(now, us));
                admitted.push(Admitted {
                    id: pgrx::Uuid::from_bytes(id),
                    role,
                    label: req.has_label.then(|| &req.label[..req.label_len]),
                    key: req.key(),
                    // From the instant the ticket starts (its started_at), not from
                    // when its caller asked: the caller may have waited since.
                    lease_until,
                    pid: req.pid,
                    tenant: req.tenant(),
                    txid: None,
                    weight: breq.weight,
                });
                let floor = lease_until.unwrap_or(crate::scopes::LEASE_NONE);
                let mut count = |key: ScopeKey| {
                    *pending.entry(key).or_default() += breq.weight;
                    let f = floors.entry(key).or_insert(floor);
                    *f = (*f).min(floor);
                };
                count(ScopeKey::role(role));
                if let Some(t) = breq.tenant {
                    count(ScopeKey { role, tenant: t });
                }
                reply.kind = REPLY_ADMITTED;
                reply.ticket = id;
                reply.weight = breq.weight;
                reply.reused = false;
            }
            Decision::Refuse(r) => {
                // Only a caller cancelled after handing over its request, sessions
                // with different settings, or roles racing for the database cap get
                // here: callers count their own scope's in-flight requests.
                let cutoff = cutoff(now, req.retention_secs);
                let tenant = breq.tenant.map(|t| Tenant {
                    key: t,
                    text: text_datum(req.tenant().unwrap_or_default()),
                });
                let p = pending
                    .get(&ScopeKey::role(role))
                    .copied()
                    .unwrap_or_default();
                let pt = breq
                    .tenant
                    .and_then(|t| pending.get(&ScopeKey { role, tenant: t }).copied())
                    .unwrap_or_default();
                // This batch's admissions of the scope are not in the ledger's counts
                // yet: they take their units before this start's.
                let ahead = if r.kind.is_tenant() { pt } else { p };
                let (full, next) = counts::refusal_numbers(
                    &reader,
                    role,
                    tenant,
                    now,
                    cutoff,
                    req.retention_secs,
                    r.kind,
                    breq.weight + ahead,
                    r.limits.of(r.kind),
                );
                reply.kind = REPLY_REFUSED;
                reply.refusal_kind = match r.kind {
                    RefusalKind::Active => 1,
                    RefusalKind::Retained => 2,
                    RefusalKind::Database => 3,
                    RefusalKind::TenantActive => 4,
                    RefusalKind::TenantRetained => 5,
                };
                reply.active = full.active + p;
                reply.retained = full.retained + p;
                reply.tenant_active = full.tenant_active + pt;
                reply.tenant_retained = full.tenant_retained + pt;
                reply.db_active = r.usage.db_active;
                reply.capacity = next;
            }
        }
    }
    drop(snap);
    if admitted.is_empty() {
        return Vec::new();
    }
    // `reader` stays until the end: its locks keep the indexes chosen above from being
    // dropped (REINDEX or DROP INDEX CONCURRENTLY waits for the tables' lockers).

    // Purge what is past retention in the roles that grow, so that the expired count
    // each admission reads stays small. A ticket is kept as long as any session of its
    // role could count it: the longest retention among the batch's requests, the
    // writer's own setting, and every value configured for the role or the database.
    let mut longest: HashMap<u32, i64> = HashMap::new();
    for b in &breqs {
        let e = longest.entry(b.role).or_insert(b.retention_secs);
        *e = (*e).max(b.retention_secs);
    }
    // Values set for every role (the database's and the cluster's) once, then the own
    // values of each role that purges: a few index probes, however many roles have
    // settings, and none for a role of the batch that admitted nothing.
    let for_all = retention_floor();
    let mut delta: Vec<(pg_sys::Oid, i64)> = Vec::new();
    let mut changes = Vec::new();
    for (&key, &units) in &pending {
        if key.is_tenant() {
            // A tenant's counter keeps its active units only.
            changes.push(Change {
                key,
                active: units,
                rows: 0,
                lease_floor: floors[&key],
            });
            continue;
        }
        let oid = key.role;
        let keep = longest[&u32::from(oid)]
            .max(for_all)
            .max(configured_retention(oid));
        let purged = purge_before(&rels, &tables, oid, cutoff(now, keep));
        delta.push((oid, units - purged.summarized));
        changes.push(Change {
            key,
            active: units,
            rows: units - purged.all,
            lease_floor: floors[&key],
        });
    }
    record(ledger, rels.ncols, now, &admitted);
    drop(tables);

    for (role, n) in delta {
        add_to_summary(&rels, &summary, role, n);
    }
    drop(summary);
    drop(reader);
    changes
}

/// The longest quota.retention that every role's sessions may run with, whatever their
/// own settings: the server's value (postgresql.conf, ALTER SYSTEM, the command line),
/// the values set for every role in this database, and the writer's own. The writer's
/// own alone is not enough (0.5.1): it runs as the bootstrap superuser, so an `ALTER
/// ROLE postgres SET quota.retention` shorter than the server's made it purge tickets
/// that every other role's sessions still counted.
pub(super) fn retention_floor() -> i64 {
    let server = i64::from(crate::gucs::server_value(crate::gucs::Setting::Retention));
    configured_retention(pg_sys::InvalidOid)
        .max(crate::gucs::retention_secs())
        .max(server)
}

/// The longest quota.retention configured in pg_db_role_setting for `role` (InvalidOid:
/// for every role) that applies in this database: ALTER ROLE … SET, ALTER ROLE … IN
/// DATABASE … SET, and for every role ALTER DATABASE … SET and ALTER ROLE ALL … SET; 0 if
/// none. Two probes of the catalog's (setdatabase, setrole) index (policy::row): 0.3.x
/// scanned the whole catalog for each batch, and with 100,000 roles that have a setting
/// the writer served 27 times fewer starts.
pub(super) fn configured_retention(role: pg_sys::Oid) -> i64 {
    let i = crate::gucs::Setting::Retention as usize;
    [shmem::my_db(), pg_sys::InvalidOid]
        .into_iter()
        .filter_map(|db| crate::policy::row(db, role)[i])
        .map(i64::from)
        .max()
        .unwrap_or(0)
}
