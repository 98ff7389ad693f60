//! The finish path. Unlike start(), finish is transactional: it updates the ticket in
//! the caller's own transaction, so a rolled-back finish leaves the ticket active (I2).

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::admission::{require_preloaded, role_name};
use crate::core::{parse_outcome, QuotaError};
use crate::ledger::{self, Stmt};

static TICKET_STMT: Stmt = Stmt::new(ledger::TICKET, &[pg_sys::UUIDOID]);
static FINISH_STMT: Stmt = Stmt::new(
    ledger::FINISH,
    &[pg_sys::UUIDOID, pg_sys::TIMESTAMPTZOID, pg_sys::TEXTOID, pg_sys::OIDOID],
);

/// Ends `ticket` with `outcome`. Returns true if this call ended it, false if it had
/// already ended (so a retried finish never releases twice).
pub fn finish(ticket: Option<pgrx::Uuid>, outcome: Option<&str>) -> Result<bool, QuotaError> {
    require_preloaded();
    let ticket = ticket.ok_or(QuotaError::NullArgument("ticket"))?;
    let outcome = parse_outcome(outcome.ok_or(QuotaError::NullArgument("outcome"))?)?;
    // SAFETY: both raise 25006 (on a standby, in a read-only transaction) or return.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(c"quota.finish()".as_ptr());
        pg_sys::PreventCommandIfReadOnly(c"quota.finish()".as_ptr());
    }
    // SAFETY: plain reads of backend state and the clock.
    let (me, now) = unsafe { (pg_sys::GetUserId(), pg_sys::GetCurrentTimestamp()) };
    let owner = ledger::owner();

    // Statements run with the latest snapshot, not the transaction's: under
    // REPEATABLE READ a ticket committed by the writer after our snapshot must still
    // be found (I3). In READ COMMITTED a concurrent finish makes the update match no
    // row (false); under REPEATABLE READ PostgreSQL raises 40001 instead, as for any
    // update of a row changed after the snapshot.
    let end_as = |holder: pg_sys::Oid| {
        let mut args = [
            ticket.into_datum().unwrap(),
            now.into(),
            outcome.as_str().into_datum().unwrap(),
            holder.into(),
        ];
        FINISH_STMT.run_latest(&mut args, &[false; 4], false) == 1
    };
    ledger::as_owner(owner, || {
        ledger::connect(|| {
            // The common case in one statement: our own ticket, still active.
            if end_as(me) {
                return Ok(true);
            }
            let mut args = [ticket.into_datum().unwrap()];
            if TICKET_STMT.run_latest(&mut args, &[false], true) == 0 {
                return Err(QuotaError::UnknownTicket(ticket.to_string()));
            }
            let holder = pg_sys::Oid::from(ledger::value(0, 1).map_or(0, |d| d.value() as u32));
            let ended = ledger::value(0, 2).is_some_and(|d| d.value() != 0);
            // I5: only the holder, a member of it, or a superuser (is_member_of_role
            // says yes for them) may end a ticket.
            // SAFETY: a catalog lookup.
            if holder != me && !unsafe { pg_sys::is_member_of_role(me, holder) } {
                return Err(QuotaError::ForeignTicket {
                    ticket: ticket.to_string(),
                    owner: role_name(holder),
                });
            }
            Ok(!ended && holder != me && end_as(holder))
        })
    })
}
