//! Layer 3, the ledger: finding a scope's tickets by their idempotency key (0.2.0's
//! schema on), for a repeat of the key: the one still retained, and a transactional
//! start with the key still in progress, which the repeat waits for as an insert into
//! a unique index waits for a conflicting one.

use pgrx::pg_sys;

use crate::ledger::count::in_both;
use crate::ledger::rels::Rels;
use crate::ledger::scan::{
    attr, scan_any, scan_index, text_attr, text_datum, ts_attr, weight_attr, Key, Latest,
};
use crate::ledger::{COL_ENDED_AT, COL_ID, COL_LEASE_UNTIL, COL_STARTED_AT, COL_TENANT, COL_TXID};

/// A ticket found by its idempotency key.
pub struct Keyed {
    pub id: [u8; 16],
    pub started_at: pg_sys::TimestampTz,
    pub ended_at: Option<pg_sys::TimestampTz>,
    pub lease_until: Option<pg_sys::TimestampTz>,
    /// Its tenant's text (0.5.0), None for the role itself.
    pub tenant: Option<Vec<u8>>,
    /// Its weight (0.7.0; 1 before).
    pub weight: i64,
}

/// The tickets of `role` with idempotency key `key` (a text datum) (0.2.0's schema
/// only).
pub fn with_key(r: &Rels, snap: &Latest, role: pg_sys::Oid, key: pg_sys::Datum) -> Vec<Keyed> {
    let mut out = Vec::new();
    in_both(r, |heap, idx| {
        keyed(r, heap, idx.key, snap, role, key, &mut out);
        0
    });
    out
}

fn keyed(
    r: &Rels,
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    snap: &Latest,
    role: pg_sys::Oid,
    key: pg_sys::Datum,
    out: &mut Vec<Keyed>,
) {
    scan_index(
        heap,
        index,
        snap,
        &[Key::OidEq(role), Key::TextEq(key)],
        |slot| {
            if let (Some(d), Some(started_at)) =
                (attr(slot, COL_ID as i32), ts_attr(slot, COL_STARTED_AT))
            {
                out.push(Keyed {
                    // SAFETY: a uuid datum points at its 16 bytes.
                    id: unsafe { *(d.cast_mut_ptr::<[u8; 16]>()) },
                    started_at,
                    ended_at: ts_attr(slot, COL_ENDED_AT),
                    lease_until: ts_attr(slot, COL_LEASE_UNTIL),
                    tenant: if r.v5() {
                        text_attr(slot, COL_TENANT)
                    } else {
                        None
                    },
                    weight: weight_attr(slot),
                });
            }
            true
        },
    );
}

/// The ticket of `role` (of its tenant `tenant`, 0.5.0) with idempotency key `key`
/// (bytes in the server encoding) that is still retained for a caller whose retention
/// starts at `cutoff`, if any, with its weight. A key is a scope's: the same key under
/// another tenant (or under the role itself) is another ticket's.
pub fn retained_with_key(
    rels: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    tenant: Option<&[u8]>,
    key: &[u8],
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
) -> Option<([u8; 16], i64)> {
    let datum = text_datum(key);
    // Sessions of one role may run with different retentions, so more than one ticket
    // with the key may be retained here: the newest is the one a retry should get.
    with_key(rels, snap, role, datum)
        .into_iter()
        .filter(|k| k.tenant.as_deref() == tenant)
        .filter(|k| crate::core::lease::is_retained(k.ended_at, k.lease_until, now, cutoff))
        .max_by_key(|k| k.started_at)
        .map(|k| (k.id, k.weight))
}

/// A transaction still in progress, other than this one, that inserted a ticket of
/// `role` (of its tenant `tenant`) with idempotency key `key`: a transactional start
/// (0.5.0) that has not committed or rolled back yet. A repeat of its key waits for it,
/// as an insert into a unique index would.
pub fn key_in_progress(
    rels: &Rels,
    role: pg_sys::Oid,
    tenant: Option<&[u8]>,
    key: &[u8],
) -> Option<pg_sys::TransactionId> {
    if !rels.v5() {
        return None;
    }
    let datum = text_datum(key);
    let mut found = None;
    scan_any(
        rels.ledger,
        rels.ledger_key_idx,
        &[Key::OidEq(role), Key::TextEq(datum)],
        |slot, xmin| {
            // SAFETY: transaction status lookups; xmin is a normal id or invalid.
            let running = xmin != pg_sys::InvalidTransactionId
                && unsafe {
                    !pg_sys::TransactionIdIsCurrentTransactionId(xmin)
                        && pg_sys::TransactionIdIsInProgress(xmin)
                };
            // Only a transactional start's row (the writer's have no txid; the writer
            // answers repeats of its own requests, see queue::in_flight_with_key).
            let transactional = attr(slot, COL_TXID as i32).is_some();
            if running && transactional && text_attr(slot, COL_TENANT).as_deref() == tenant {
                found = Some(xmin);
                return false;
            }
            true
        },
    );
    found
}
