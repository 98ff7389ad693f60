//! Layer 5, the paths: finish and renew. Unlike start(), finish is transactional: it
//! updates the ticket in the caller's own transaction, so a rolled-back finish leaves
//! the ticket active (I2). What the transaction finished reaches the scope counters,
//! quota.stats and the waiters when (and only if) it commits (the callbacks below).
//!
//! The update goes straight to the heap and the indexes (see heap.rs), so the role
//! check below is the access rule: the ledger's privileges are not consulted.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::core::stats::Counter;
use crate::core::{parse_outcome, Outcome, QuotaError};
use crate::ledger::heap::OpenRel;
use crate::ledger::rels::{self, Rels};
use crate::ledger::scan::{scan_open, Key, Latest};
use crate::ledger::write::Tables;
use crate::ledger::{COL_ENDED_AT, COL_LEASE_UNTIL, COL_OUTCOME, COL_ROLE, COL_TENANT};
use crate::scopes::ScopeKey;
use crate::{scopes, shmem};

/// The checks finish(), renew() and quota.finish_job() make first.
pub fn begin(name: &std::ffi::CStr) {
    shmem::require_callable(name);
    // SAFETY: both raise 25006 (on a standby, in a read-only transaction) or return.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(name.as_ptr());
        pg_sys::PreventCommandIfReadOnly(name.as_ptr());
    }
}

/// I5: only the holder, a member of it, or a superuser (is_member_of_role says yes
/// for them) may end or renew a ticket. The refusal does not say whose it is.
fn check_holder(found: &Found, ticket: pgrx::Uuid, action: &'static str) -> Result<(), QuotaError> {
    // SAFETY: plain read of backend state, and a catalog lookup.
    let me = unsafe { pg_sys::GetUserId() };
    if found.holder != me && !unsafe { pg_sys::is_member_of_role(me, found.holder) } {
        return Err(QuotaError::ForeignTicket {
            ticket: ticket.to_string(),
            action,
        });
    }
    Ok(())
}

/// Ends `ticket` with `outcome` (text in the server encoding). Returns true if this
/// call ended it, false if it had already ended, or its lease had run out (so a
/// retried finish never releases twice, and a late one never revives a slot that
/// admission already counted as free).
pub fn finish(ticket: Option<pgrx::Uuid>, outcome: Option<&[u8]>) -> Result<bool, QuotaError> {
    begin(c"quota.finish()");
    let ticket = ticket.ok_or(QuotaError::NullArgument("ticket"))?;
    let outcome = parse_outcome(outcome.ok_or(QuotaError::NullArgument("outcome"))?)?;
    finish_ticket(ticket, outcome)
}

/// finish() of a ticket and an outcome already read, after `begin`; also
/// quota.finish_job()'s (job_trigger.rs).
pub fn finish_ticket(ticket: pgrx::Uuid, outcome: Outcome) -> Result<bool, QuotaError> {
    // SAFETY: plain read of the clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let (tables, rels) = Tables::open_current_for_one();

    loop {
        // The latest snapshot, not the transaction's: under REPEATABLE READ a ticket
        // committed by the writer after our snapshot must still be found (I3). After a
        // CommandCounterIncrement, as SPI makes between a volatile function's queries:
        // a finish() or renew() earlier in this same statement is then seen, so
        // `renew(t, …), finish(t)` ends the renewed ticket, and two renews of one
        // ticket both apply, instead of hitting TM_SelfModified.
        // SAFETY: makes this transaction's earlier writes visible to new snapshots.
        unsafe { pg_sys::CommandCounterIncrement() };
        let snap = Latest::take();
        let Some(found) = find(&tables, &rels, &snap, ticket, None, |values, nulls| {
            values[COL_ENDED_AT - 1] = now.into();
            nulls[COL_ENDED_AT - 1] = false;
            values[COL_OUTCOME - 1] = outcome.as_str().into_datum().unwrap();
            nulls[COL_OUTCOME - 1] = false;
        }) else {
            return Err(QuotaError::UnknownTicket(ticket.to_string()));
        };
        check_holder(&found, ticket, "finish")?;
        if found.ended.is_some() || found.lease_until.is_some_and(|l| l <= now) {
            return Ok(false);
        }
        found.require_in_ledger(ticket);
        match tables.end(found.tid, found.new_tuple, &[COL_ENDED_AT, COL_OUTCOME]) {
            pg_sys::TM_Result::TM_Ok => {
                // The scope's active counter drops when this transaction commits.
                note_finish(found.holder, found.tenant, found.weight, outcome);
                return Ok(true);
            }
            // A concurrent finish committed first (or, long after, a purge), or this
            // command changed the row (not seen before the next CommandCounterIncrement):
            // look again with a fresh snapshot, which sees what it did. Under any isolation
            // level this returns false rather than a serialization failure.
            pg_sys::TM_Result::TM_Updated
            | pg_sys::TM_Result::TM_Deleted
            | pg_sys::TM_Result::TM_SelfModified => continue,
            other => pgrx::error!("pg_quota: unexpected result {other} updating ticket {ticket}"),
        }
    }
}

/// Extends `ticket`'s lease to `lease` (an interval datum) from now, in the caller's
/// transaction, and returns the new expiry. A ticket that has ended, or whose lease
/// has run out, cannot be renewed (55000): admission may already have given its slot
/// to someone else.
pub fn renew(
    ticket: Option<pgrx::Uuid>,
    lease: pg_sys::Datum,
) -> Result<pg_sys::TimestampTz, QuotaError> {
    begin(c"quota.renew()");
    let ticket = ticket.ok_or(QuotaError::NullArgument("ticket"))?;
    match renew_ticket(ticket, lease, "renew")? {
        Renewal::Renewed(until) => Ok(until),
        Renewal::Ended { expired } => Err(QuotaError::TicketEnded {
            ticket: ticket.to_string(),
            expired,
        }),
    }
}

/// What renew_ticket did.
pub enum Renewal {
    /// The lease now runs to this time (when this transaction commits).
    Renewed(pg_sys::TimestampTz),
    /// The ticket had ended (expired: by its lease), or its lease had run out: nothing
    /// changed.
    Ended { expired: bool },
}

/// renew() of a ticket, after `begin`; also quota.claim_job()'s (job_trigger.rs), which
/// goes on where the ticket has ended, so that an ended ticket is an answer here, not
/// an error. `action` names the caller's act in ForeignTicket.
///
/// The order matters. The row is updated first, and only then is the old lease
/// checked against the clock: from the update on, admission counts the ticket as
/// active even past its old lease (counts::being_changed), so a renew that passes the
/// check can never revive a slot that admission already handed out. One that fails it
/// puts the old lease back, in a second update, so that the transaction may go on and
/// commit without renewing. An update that had to wait for another transaction on the
/// row (1 ms or more) is written once more with the lease counted from then: the row
/// is this transaction's by then, so that write does not wait, and the old lease is
/// not checked again (the first check was the one that counted). A ticket whose lease
/// had run out when it was read, and whose row no transaction is changing, is answered
/// without any write: no renewal can revive it, and a write would keep it counted as
/// active until this transaction ends.
pub fn renew_ticket(
    ticket: pgrx::Uuid,
    lease: pg_sys::Datum,
    action: &'static str,
) -> Result<Renewal, QuotaError> {
    rels::rels().require_v2("quota.renew()");
    // SAFETY: plain read of the clock.
    crate::timestamps::lease_end(unsafe { pg_sys::GetCurrentTimestamp() }, lease)?;
    let (tables, rels) = Tables::open_current_for_one();
    // What the pass after this call's own update writes: None before that update.
    let mut again: Option<Again> = None;
    loop {
        // As in finish().
        // SAFETY: makes this transaction's earlier writes visible to new snapshots.
        unsafe { pg_sys::CommandCounterIncrement() };
        // The lease runs from this pass: one before it may have waited. The same clock
        // reading starts the timing of this pass, its lookup included.
        // SAFETY: plain read of the clock.
        let started = unsafe { pg_sys::GetCurrentTimestamp() };
        let until = crate::timestamps::lease_end(started, lease)?;
        let write = match again {
            Some(Again::PutBack(old)) => old,
            _ => until,
        };
        let snap = Latest::take();
        let Some(found) = find(
            &tables,
            &rels,
            &snap,
            ticket,
            Some(started),
            |values, nulls| {
                values[COL_LEASE_UNTIL - 1] = write.into();
                nulls[COL_LEASE_UNTIL - 1] = false;
            },
        ) else {
            if again.is_some() {
                pgrx::error!(
                    "pg_quota: ticket {ticket} is gone after this transaction's update of it"
                );
            }
            return Err(QuotaError::UnknownTicket(ticket.to_string()));
        };
        // A second pass finds this call's own version, checked on the first: no
        // answer but its write (an answer here would leave the first write standing).
        if again.is_none() {
            check_holder(&found, ticket, action)?;
            if found.ended.is_some() {
                return Ok(Renewal::Ended {
                    expired: found.outcome_expired,
                });
            }
            // Ran out before this call, and nobody is renewing it: nothing to write. A
            // write would keep it counted as active (counts::being_changed) for as
            // long as this transaction lasts: a queue's claim that goes on to run the
            // job would hold the slot twice, its ticket's and the next one's.
            if found.lapsed_untouched && !found.in_history {
                return Ok(Renewal::Ended { expired: true });
            }
        }
        found.require_in_ledger(ticket);
        // An unended ticket is in the table tickets start in (0.6.0: quota.active),
        // where it stays.
        match tables
            .ledger
            .update(found.tid, found.new_tuple, &[COL_LEASE_UNTIL])
        {
            pg_sys::TM_Result::TM_Ok => {}
            // Changed by another transaction that committed meanwhile, or by this
            // command (seen after the next CommandCounterIncrement): look again. Not
            // after this call's own update, which holds the row.
            pg_sys::TM_Result::TM_Updated
            | pg_sys::TM_Result::TM_Deleted
            | pg_sys::TM_Result::TM_SelfModified
                if again.is_none() =>
            {
                continue
            }
            other => pgrx::error!("pg_quota: unexpected result {other} updating ticket {ticket}"),
        }
        match again {
            Some(Again::PutBack(_)) => return Ok(Renewal::Ended { expired: true }),
            Some(Again::Fresh) => {}
            None => {
                // SAFETY: plain read of the clock, after the update.
                let checked = unsafe { pg_sys::GetCurrentTimestamp() };
                if let Some(old) = found.lease_until.filter(|&l| l <= checked) {
                    // Ran out: the row gets its old lease back (the sweep ends it as
                    // expired).
                    again = Some(Again::PutBack(old));
                    continue;
                }
                if checked - started >= WAITED_US {
                    again = Some(Again::Fresh);
                    continue;
                }
            }
        }
        // quota.stats counts the renewal when this transaction commits, and the
        // scope counters learn the lease it may shorten (see `note_renew`).
        note_renew(found.holder, found.tenant, until);
        return Ok(Renewal::Renewed(until));
    }
}

/// The second write of renew_ticket, on the row its first one updated.
#[derive(Clone, Copy)]
enum Again {
    /// The old lease had run out: this lease goes back.
    PutBack(pg_sys::TimestampTz),
    /// The update waited for another transaction: a lease from now.
    Fresh,
}

/// How long (microseconds) renew_ticket's update may take before it is taken to have
/// waited for another transaction, and the lease is written again from the clock. An
/// update that does not wait takes microseconds.
const WAITED_US: i64 = 1_000;

/// The ticket as found, and its replacement tuple.
struct Found {
    tid: pg_sys::ItemPointerData,
    holder: pg_sys::Oid,
    /// Its tenant's key (scopes::tenant_key), 0 for none.
    tenant: u128,
    /// Its weight (0.7.0): the active units its finish frees.
    weight: i64,
    ended: Option<pg_sys::TimestampTz>,
    /// Whether it ended by its lease (outcome `expired`, written by the sweep).
    outcome_expired: bool,
    lease_until: Option<pg_sys::TimestampTz>,
    /// Whether it had not ended, its lease had run out by the time `find` was given
    /// (false where none was), and no transaction was changing it
    /// (counts::being_changed): no renewal can revive it.
    lapsed_untouched: bool,
    new_tuple: pg_sys::HeapTuple,
    /// Whether it was found in quota.history (0.6.0), whose rows have all ended.
    in_history: bool,
}

impl Found {
    /// An unended ticket is changed where tickets start (quota.active from 0.6.0): its
    /// location is one there. One that quota.history holds unended was written there by
    /// SQL that bypassed the table's CHECK (a superuser's, with the CHECK dropped or
    /// not valid): an error that says where it is, rather than a change at that
    /// location of the other table.
    fn require_in_ledger(&self, ticket: pgrx::Uuid) {
        if self.in_history {
            pgrx::pg_sys::panic::ErrorReport::new(
                pgrx::PgSqlErrorCode::ERRCODE_DATA_CORRUPTED,
                format!("ticket {ticket} is in quota.history but has not ended"),
                "pg_quota",
            )
            .set_hint("Rows of quota.history must have ended. As a superuser, end it there (UPDATE quota.history SET ended_at = …, outcome = …), or move it: INSERT INTO quota.active SELECT * FROM quota.history WHERE id = …, then DELETE it from quota.history.")
            .report(pgrx::PgLogLevel::ERROR);
        }
    }
}

/// Finds the ticket through the primary key under `snap` (0.6.0: in quota.active,
/// else in quota.history, under the one snapshot, so a finish committed meanwhile is
/// seen in one or the other), and forms its replacement tuple: a copy that `change`
/// edits. With `lapsed_by`, it also tells whether the ticket's lease had run out by
/// then, untouched (`Found::lapsed_untouched`).
fn find(
    tables: &Tables,
    rels: &Rels,
    snap: &Latest,
    ticket: pgrx::Uuid,
    lapsed_by: Option<pg_sys::TimestampTz>,
    change: impl Fn(&mut [pg_sys::Datum], &mut [bool]),
) -> Option<Found> {
    let found = find_in(
        &tables.ledger,
        rels.ledger_pkey,
        rels,
        snap,
        ticket,
        lapsed_by,
        &change,
    );
    if found.is_some() || !rels.split() {
        return found;
    }
    let mut found = find_in(
        tables.history(),
        rels.history_pkey,
        rels,
        snap,
        ticket,
        lapsed_by,
        &change,
    );
    if let Some(f) = found.as_mut() {
        f.in_history = true;
    }
    found
}

fn find_in(
    ledger: &OpenRel,
    pkey: pg_sys::Oid,
    rels: &Rels,
    snap: &Latest,
    ticket: pgrx::Uuid,
    lapsed_by: Option<pg_sys::TimestampTz>,
    change: &impl Fn(&mut [pg_sys::Datum], &mut [bool]),
) -> Option<Found> {
    let ncols = rels.ncols;
    let key = ticket.into_datum().unwrap();
    let mut found = None;
    scan_open(
        ledger.heap,
        ledger.index(pkey),
        snap,
        &[Key::UuidEq(key)],
        |slot| {
            // SAFETY: the slot holds a ledger tuple, pinned while we read it; `form`
            // copies every value into the new tuple.
            unsafe {
                pg_sys::slot_getallattrs(slot);
                let mut values = std::slice::from_raw_parts((*slot).tts_values, ncols).to_vec();
                let mut nulls = std::slice::from_raw_parts((*slot).tts_isnull, ncols).to_vec();
                let holder = pg_sys::Oid::from(values[COL_ROLE - 1].value() as u32);
                let ts = |col: usize| (!nulls[col - 1]).then(|| values[col - 1].value() as i64);
                let ended = ts(COL_ENDED_AT);
                let lease_until = (ncols > COL_LEASE_UNTIL - 1)
                    .then(|| ts(COL_LEASE_UNTIL))
                    .flatten();
                let outcome_expired = !nulls[COL_OUTCOME - 1]
                    && String::from_datum(values[COL_OUTCOME - 1], false).as_deref()
                        == Some("expired");
                let tenant = if ncols >= COL_TENANT {
                    crate::ledger::scan::text_attr(slot, COL_TENANT)
                        .map_or(0, |t| crate::scopes::tenant_key(&t))
                } else {
                    0
                };
                let weight = crate::ledger::scan::weight_attr(slot);
                // The row's header only for a lease that ran out.
                let lapsed_untouched = ended.is_none()
                    && lease_until.zip(lapsed_by).is_some_and(|(l, by)| l <= by)
                    && !crate::ledger::count::being_changed(slot);
                change(&mut values, &mut nulls);
                found = Some(Found {
                    tid: (*slot).tts_tid,
                    holder,
                    tenant,
                    weight,
                    ended,
                    outcome_expired,
                    lease_until,
                    lapsed_untouched,
                    new_tuple: ledger.form(&mut values, &mut nulls),
                    in_history: false,
                });
            }
            false
        },
    );
    found
}

// ---------------------------------------------------------------------------------
// finish(): a backend's finished tickets, applied when its transaction commits
// ---------------------------------------------------------------------------------

// Single-threaded backend state: the tickets finished by the current transaction, as
// ((role, tenant key, weight), subtransaction nesting level), and the scopes that did
// not fit when published.
static mut FINISHED: Vec<((pg_sys::Oid, u128, i64), i32)> = Vec::new();
/// The tickets the current transaction renewed, as ((role, tenant key, new lease end),
/// subtransaction nesting level) (0.6.0).
static mut RENEWED: Vec<((pg_sys::Oid, u128, pg_sys::TimestampTz), i32)> = Vec::new();
static mut OVERFLOW: Vec<ScopeKey> = Vec::new();
/// The statistics the current transaction owes quota.stats when it commits: finishes
/// by outcome and renewals, as ((role, counter), subtransaction nesting level).
static mut STATS_OWED: Vec<((pg_sys::Oid, Counter), i32)> = Vec::new();
static mut CALLBACKS_REGISTERED: bool = false;

fn nest_level() -> i32 {
    // SAFETY: single-threaded backend state; the callbacks are registered once.
    unsafe {
        if !CALLBACKS_REGISTERED {
            pg_sys::RegisterXactCallback(Some(xact_event), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(subxact_event), std::ptr::null_mut());
            CALLBACKS_REGISTERED = true;
        }
        pg_sys::GetCurrentTransactionNestLevel()
    }
}

/// Records that this transaction ended a ticket of `role` (and tenant key `tenant`) of
/// `weight` units with `outcome`; its scopes' counters drop by its units, and
/// quota.stats counts the finish, when (and only if) the transaction commits.
pub fn note_finish(role: pg_sys::Oid, tenant: u128, weight: i64, outcome: crate::core::Outcome) {
    let level = nest_level();
    // SAFETY: single-threaded backend state.
    unsafe {
        (*std::ptr::addr_of_mut!(FINISHED)).push(((role, tenant, weight), level));
        (*std::ptr::addr_of_mut!(STATS_OWED)).push(((role, Counter::finished(outcome)), level));
    }
}

/// Records that this transaction renewed a ticket of `role` (and tenant key `tenant`)
/// to `until`: quota.stats counts it, and its scopes' counters lower their `earliest`
/// to `until` (a renew may shorten a lease; see scopes::Counter), when (and only if) the
/// transaction commits. Until then the ticket's committed lease is the old one.
pub fn note_renew(role: pg_sys::Oid, tenant: u128, until: pg_sys::TimestampTz) {
    let level = nest_level();
    // SAFETY: single-threaded backend state.
    unsafe {
        (*std::ptr::addr_of_mut!(STATS_OWED)).push(((role, Counter::Renewed), level));
        (*std::ptr::addr_of_mut!(RENEWED)).push(((role, tenant, until), level));
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn xact_event(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    // SAFETY: single-threaded backend state.
    unsafe {
        let finished = &mut *std::ptr::addr_of_mut!(FINISHED);
        let renewed = &mut *std::ptr::addr_of_mut!(RENEWED);
        let overflow = &mut *std::ptr::addr_of_mut!(OVERFLOW);
        let owed = &mut *std::ptr::addr_of_mut!(STATS_OWED);
        match event {
            pg_sys::XactEvent::XACT_EVENT_COMMIT => {
                for ((role, counter), _) in owed.drain(..) {
                    crate::stats::add(role, counter, 1);
                }
            }
            // A prepared renew commits elsewhere, later: not counted. Aborted work is
            // not counted either.
            pg_sys::XactEvent::XACT_EVENT_PREPARE | pg_sys::XactEvent::XACT_EVENT_ABORT => {
                owed.clear();
            }
            _ => {}
        }
        match event {
            pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT
                if !finished.is_empty() || !renewed.is_empty() =>
            {
                // One change per scope: its role's, and its tenant's if it has one.
                let mut per_scope = Vec::new();
                for &((role, tenant, weight), _) in finished.iter() {
                    scopes::add_change(&mut per_scope, ScopeKey { role, tenant }, -weight, 0, None);
                }
                for &((role, tenant, until), _) in renewed.iter() {
                    scopes::add_change(
                        &mut per_scope,
                        ScopeKey { role, tenant },
                        0,
                        0,
                        Some(until),
                    );
                }
                *overflow = scopes::publish(&per_scope);
            }
            pg_sys::XactEvent::XACT_EVENT_PRE_PREPARE
                if !finished.is_empty() || !renewed.is_empty() =>
            {
                // COMMIT PREPARED runs elsewhere, later: its finish (or the lease of its
                // renew, 0.6.0) could not be applied to the counters.
                pgrx::pg_sys::panic::ErrorReport::new(
                    PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                    "cannot PREPARE a transaction that has finished or renewed pg_quota tickets",
                    "pg_quota",
                )
                .set_hint("Finish and renew tickets in transactions that commit directly.")
                .report(PgLogLevel::ERROR);
            }
            pg_sys::XactEvent::XACT_EVENT_COMMIT => {
                scopes::apply_mine();
                scopes::invalidate(overflow);
                // Freed slots: starts waiting in this scope or for the database cap
                // look again (see waiters.rs).
                let mut woken: Vec<pg_sys::Oid> = Vec::new();
                for &((role, _, _), _) in finished.iter() {
                    if !woken.contains(&role) {
                        woken.push(role);
                        crate::waiters::wake(shmem::my_db(), role);
                    }
                }
                finished.clear();
                renewed.clear();
                overflow.clear();
            }
            pg_sys::XactEvent::XACT_EVENT_ABORT => {
                scopes::apply_mine();
                finished.clear();
                renewed.clear();
                overflow.clear();
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
    // SAFETY: single-threaded backend state.
    unsafe {
        let finished = &mut *std::ptr::addr_of_mut!(FINISHED);
        let renewed = &mut *std::ptr::addr_of_mut!(RENEWED);
        let owed = &mut *std::ptr::addr_of_mut!(STATS_OWED);
        // A rolled-back savepoint (or a caught error) undoes its finishes and renewals.
        crate::xact::at_subxact_end(finished, event);
        crate::xact::at_subxact_end(renewed, event);
        crate::xact::at_subxact_end(owed, event);
    }
}
