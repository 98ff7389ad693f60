//! The finish path. Unlike start(), finish is transactional: it updates the ticket in
//! the caller's own transaction, so a rolled-back finish leaves the ticket active (I2).
//!
//! The update goes straight to the heap and the indexes (see heap.rs), so the role
//! check below is the access rule: the ledger's privileges are not consulted.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::admission::require_callable;
use crate::core::{parse_outcome, Outcome, QuotaError};
use crate::counts::{self, Key, Latest, Rels};
use crate::heap::OpenRel;

use crate::counts::{COL_ENDED_AT, COL_ID, COL_OUTCOME, COL_ROLE, NCOLS};

/// Ends `ticket` with `outcome` (text in the server encoding). Returns true if this
/// call ended it, false if it had already ended (so a retried finish never releases
/// twice).
pub fn finish(ticket: Option<pgrx::Uuid>, outcome: Option<&[u8]>) -> Result<bool, QuotaError> {
    require_callable(c"quota.finish()");
    let ticket = ticket.ok_or(QuotaError::NullArgument("ticket"))?;
    let outcome = parse_outcome(outcome.ok_or(QuotaError::NullArgument("outcome"))?)?;
    // SAFETY: both raise 25006 (on a standby, in a read-only transaction) or return.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(c"quota.finish()".as_ptr());
        pg_sys::PreventCommandIfReadOnly(c"quota.finish()".as_ptr());
    }
    // SAFETY: plain reads of backend state and the clock.
    let (me, now) = unsafe { (pg_sys::GetUserId(), pg_sys::GetCurrentTimestamp()) };
    let ledger = OpenRel::open(counts::rels().ledger, "ledger", COL_ID);
    let rels = counts::rels();

    loop {
        // The latest snapshot, not the transaction's: under REPEATABLE READ a ticket
        // committed by the writer after our snapshot must still be found (I3).
        let snap = Latest::take();
        let Some(found) = find(&ledger, &rels, &snap, ticket, outcome, now) else {
            return Err(QuotaError::UnknownTicket(ticket.to_string()));
        };
        // I5: only the holder, a member of it, or a superuser (is_member_of_role
        // says yes for them) may end a ticket. The refusal does not say whose it is.
        // SAFETY: a catalog lookup.
        if found.holder != me && !unsafe { pg_sys::is_member_of_role(me, found.holder) } {
            return Err(QuotaError::ForeignTicket {
                ticket: ticket.to_string(),
            });
        }
        if found.ended {
            return Ok(false);
        }
        match ledger.update(found.tid, found.new_tuple, &[COL_ENDED_AT, COL_OUTCOME]) {
            pg_sys::TM_Result::TM_Ok => {
                // The scope's active counter drops when this transaction commits.
                crate::scopes::note_finish(found.holder);
                return Ok(true);
            }
            // Ended by an earlier call in this same statement.
            pg_sys::TM_Result::TM_SelfModified => return Ok(false),
            // A concurrent finish committed first (or, long after, a purge): look
            // again with a fresh snapshot, which sees what it did. Under any isolation
            // level this returns false rather than a serialization failure.
            pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted => continue,
            other => pgrx::error!("pg_quota: unexpected result {other} updating ticket {ticket}"),
        }
    }
}

/// The ticket as found, and its replacement tuple.
struct Found {
    tid: pg_sys::ItemPointerData,
    holder: pg_sys::Oid,
    ended: bool,
    new_tuple: pg_sys::HeapTuple,
}

/// Finds the ticket through the primary key under `snap`, and forms the tuple that
/// would end it.
fn find(
    ledger: &OpenRel,
    rels: &Rels,
    snap: &Latest,
    ticket: pgrx::Uuid,
    outcome: Outcome,
    now: pg_sys::TimestampTz,
) -> Option<Found> {
    let key = ticket.into_datum().unwrap();
    let mut found = None;
    counts::scan_open(
        ledger.heap,
        ledger.index(rels.ledger_pkey),
        snap,
        &[Key::UuidEq(key)],
        |slot| {
            // SAFETY: the slot holds a ledger tuple, pinned while we read it; `form`
            // copies every value into the new tuple.
            unsafe {
                pg_sys::slot_getallattrs(slot);
                let mut values = std::slice::from_raw_parts((*slot).tts_values, NCOLS).to_vec();
                let mut nulls = std::slice::from_raw_parts((*slot).tts_isnull, NCOLS).to_vec();
                let holder = pg_sys::Oid::from(values[COL_ROLE - 1].value() as u32);
                let ended = !nulls[COL_ENDED_AT - 1];
                values[COL_ENDED_AT - 1] = now.into();
                nulls[COL_ENDED_AT - 1] = false;
                values[COL_OUTCOME - 1] = outcome.as_str().into_datum().unwrap();
                nulls[COL_OUTCOME - 1] = false;
                found = Some(Found {
                    tid: (*slot).tts_tid,
                    holder,
                    ended,
                    new_tuple: ledger.form(&mut values, &mut nulls),
                });
            }
            false
        },
    );
    found
}
