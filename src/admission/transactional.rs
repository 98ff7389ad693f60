//! Layer 5: a transactional start (0.5.0): the charge is a row of the caller's own
//! transaction, as `pg_logical_emit_message(true, …)` is. It counts against its scopes
//! at once, as an open charge (charges.rs), is kept if the transaction commits and
//! given back if it (or the savepoint under which it was taken) rolls back; it is on
//! disk exactly when the transaction's commit is. No ledger writer takes part.
//!
//! The row is inserted below SQL (ledger/write.rs, as the writer inserts), with the
//! transaction's full id in `txid`, so that the writer can later fold it into its
//! role's summary row (see sql/schema.sql) without anyone updating that row in the
//! caller's transaction, where every enqueue of the role would queue on it.

use pgrx::pg_sys;

use super::decide::{under_lock, Repeat};
use super::{Caller, Refused};
use crate::compat::{self, nap};
use crate::core::QuotaError;
use crate::ledger::heap::OpenRel;
use crate::ledger::rels::rels;
use crate::ledger::write::{new_ticket_id, record, Admitted, Tables};
use crate::queue::caller::{self as queue, Patience};

/// One try in the caller's transaction; see super::attempt. `began`: when the call
/// began (see Patience::since).
pub(crate) fn attempt(
    caller: &Caller,
    seq: u64,
    began: pg_sys::TimestampTz,
    lease_us: Option<i64>,
) -> Result<Result<(pgrx::Uuid, bool), Refused>, QuotaError> {
    // The ledger is opened for writing before the scope lock is taken: a wait for it
    // (behind maintenance, bounded) must not hold up the role's other starts.
    let (tables, _) = Tables::open_current();
    let ledger = &tables.ledger;
    // No writer is needed here, but one folds transactional tickets into their roles'
    // summary rows and purges them when it runs (writer/fold.rs).
    crate::workers::start_soon();
    let mut waited = Patience::since(began);
    loop {
        // SAFETY: plain clock read.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let taken = under_lock(
            caller,
            now,
            seq,
            &mut waited,
            || {},
            |reader| {
                let charged = crate::charges::take(
                    caller.role,
                    caller.tenant_key(),
                    caller.args.key,
                    reader.tags,
                    caller.args.weight,
                );
                // The charge is what every count reads (an open charge, in shared
                // memory); the row is only looked for by a repeat of its key. So a
                // start without a key inserts its row after the locks are released,
                // and the role's other starts do not queue behind its index inserts.
                // Charged, it leaves the line of waiting starts at once (if it was in
                // it): counted as an open charge, it must not count as a start ahead
                // of the others too while it inserts.
                Ok(charged.map(|()| {
                    crate::waiters::leave();
                    caller.args.key.map(|_| insert(caller, ledger, lease_us))
                }))
            },
        );
        match taken {
            Ok(Ok(Ok(id))) => {
                let id = id.unwrap_or_else(|| insert(caller, ledger, lease_us));
                return Ok(Ok((id, false)));
            }
            Ok(Ok(Err(e))) => return Err(e),
            Ok(Err(refused)) => return Ok(Err(refused)),
            Err(Repeat::Found(id, held)) => {
                return super::repeat_of(caller, id, held).map(|id| Ok((id, true)))
            }
            // A transactional start with our key is still open: wait for it without
            // the lock, as a unique index would, then look again.
            Err(Repeat::InProgress) => {
                if let Some(key) = caller.args.key {
                    super::wait_for_key(caller, key);
                }
            }
            // A writer-committed start with our key is in the writer's hands: it
            // resolves within one writer commit.
            Err(Repeat::InFlight) => {
                nap(1, compat::Wait::InFlight);
                waited.check_writer();
            }
            // Requests of the scope in flight waited for a writer that is gone.
            Err(Repeat::NoWriter) => queue::ensure_writer(),
        }
    }
}

/// Inserts the caller's ticket in its transaction, started now: after every wait of
/// the call, so that its lease runs whole from its started_at; and names it as the
/// ticket of the charge just taken.
fn insert(caller: &Caller, ledger: &OpenRel, lease_us: Option<i64>) -> pgrx::Uuid {
    // SAFETY: plain reads of the clock and of backend state; the transaction gets an id
    // if it has none (it is about to write).
    let (now, pid, txid) = unsafe {
        (
            pg_sys::GetCurrentTimestamp(),
            pg_sys::MyProcPid,
            pg_sys::GetTopFullTransactionId().value,
        )
    };
    let id = pgrx::Uuid::from_bytes(new_ticket_id(now));
    let lease_until = lease_us.map(|us| crate::core::lease::ends(now, us));
    record(
        ledger,
        rels().ncols,
        now,
        &[Admitted {
            id,
            role: caller.role,
            label: caller.args.label,
            key: caller.args.key,
            lease_until,
            pid,
            tenant: caller.args.tenant,
            txid: Some(txid),
            weight: caller.args.weight,
        }],
    );
    crate::charges::identify(*id.as_bytes(), lease_until);
    id
}
