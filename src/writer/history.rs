//! Layer 5: the ledger writer's purge of old history (0.5.1). A batch purges what is
//! past retention in the roles it admits for, and the fold in the roles with
//! transactional tickets; a role that stopped starting tickets was purged by neither,
//! and kept its history past retention for good, growing the ledger (and what
//! quota.usage_totals may have to count, see ledger::count::db_ended_before).
//!
//! This pass reads the oldest finished tickets first, in ledger_open_idx (ended_at
//! order), up to the cutoff of the retentions set for every role, and deletes those
//! that are also past their role's own configured retention: what no configured
//! retention counts any longer, as a batch's purge does (a longer value that a
//! superuser SETs in one session only is not protected; USER_GUIDE, "Shortening
//! retention purges history"). It is bounded so that the starts waiting for the writer
//! meanwhile wait little: at most ENTRIES_PER_PASS entries read and PENDING_PER_SLOT
//! roles touched (so its changes to the scope counters all fit, see scopes/), in a
//! transaction of its own; a row someone holds a lock on is left for a later pass (the
//! writer never waits for a caller's open transaction). The next pass goes on from the
//! last ended_at it read, so that rows deleted before and still kept by an old snapshot
//! are not walked again; each writer starts from the oldest.

use std::collections::HashMap;

use pgrx::pg_sys;

use crate::ledger::count::summary_rows;
use crate::ledger::heap::OpenRel;
use crate::ledger::rels::Reader;
use crate::ledger::scan::{attr, scan_index, ts_attr, Key, Latest};
use crate::ledger::write::fold_into_summary;
use crate::ledger::{COL_ENDED_AT, COL_ID, COL_ROLE, COL_TXID};
use crate::scopes::{ScopeKey, PENDING_PER_SLOT};
use crate::timestamps::cutoff;

use super::txn::try_in_transaction;

/// The most index entries one pass reads.
const ENTRIES_PER_PASS: usize = 5000;

thread_local! {
    /// Where the next pass starts: the ended_at of the last entry the previous one
    /// read (entries before it were deleted or are kept for a longer retention).
    static FROM: std::cell::Cell<pg_sys::TimestampTz> = const { std::cell::Cell::new(i64::MIN) };
    /// The scopes whose changes did not fit when published (none are expected: a pass
    /// touches at most PENDING_PER_SLOT roles).
    static OVERFLOW: std::cell::RefCell<Vec<ScopeKey>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `purge` in a transaction of its own, then its changes applied to the scope counters.
pub fn purge_history() {
    let committed = try_in_transaction("purge history past retention", purge);
    crate::scopes::apply_mine();
    if committed {
        crate::scopes::invalidate(&OVERFLOW.with_borrow_mut(std::mem::take));
    }
}

/// What one pass deletes of one role: all its rows, and those its summary row counts.
#[derive(Default)]
struct Deleted {
    all: i64,
    summarized: i64,
}

fn purge() {
    let reader = Reader::open();
    let rels = reader.rels;
    if !rels.v2() {
        return;
    }
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let for_all =
        super::batch::configured_retention(pg_sys::InvalidOid).max(crate::gucs::retention_secs());
    let cut_all = cutoff(now, for_all);
    let ledger = OpenRel::open(rels.ledger, "ledger", COL_ID);
    let summary = OpenRel::open(rels.summary, "summary", 1);
    let snap = Latest::take();
    // Per role met: the cutoff of its own retention, and the txid below which its
    // summary row counts its transactional tickets.
    let mut roles: HashMap<u32, (pg_sys::TimestampTz, u64)> = HashMap::new();
    let mut doomed = Vec::new();
    let mut from = FROM.get();
    let mut read = 0;
    scan_index(
        rels.ledger,
        rels.ledger_open_idx,
        &snap,
        &[Key::TsAtLeast(from)],
        |slot| {
            let (Some(role), Some(ended_at)) =
                (attr(slot, COL_ROLE as i32), ts_attr(slot, COL_ENDED_AT))
            else {
                return true;
            };
            if ended_at >= cut_all {
                return false;
            }
            let role = role.value() as u32;
            if !roles.contains_key(&role) && roles.len() == PENDING_PER_SLOT {
                // Left for the next pass, which starts here.
                return false;
            }
            let (role_cut, folded) = *roles.entry(role).or_insert_with(|| {
                let oid = pg_sys::Oid::from(role);
                let keep = for_all.max(super::batch::configured_retention(oid));
                let folded = summary_rows(&rels, &snap, oid).map_or(0, |(_, f)| f);
                (cutoff(now, keep), folded)
            });
            from = ended_at;
            if ended_at < role_cut {
                let txid = if rels.v5() {
                    attr(slot, COL_TXID as i32).map(|d| d.value() as u64)
                } else {
                    None
                };
                // SAFETY: the slot holds a visible tuple of the ledger.
                doomed.push((
                    unsafe { (*slot).tts_tid },
                    role,
                    txid.is_none_or(|t| t < folded),
                ));
            }
            read += 1;
            read < ENTRIES_PER_PASS
        },
    );
    drop(snap);
    // The next pass starts at the last entry this one read (read again, so nothing is
    // skipped however many share its ended_at).
    FROM.set(from);
    let mut deleted: HashMap<u32, Deleted> = HashMap::new();
    for (tid, role, summarized) in doomed {
        // Never wait for a caller's lock on the row (a superuser's SELECT … FOR
        // UPDATE, say): a later pass deletes it.
        if !ledger.lock_nowait(tid) {
            continue;
        }
        if ledger.delete(tid) == pg_sys::TM_Result::TM_Ok {
            let d = deleted.entry(role).or_default();
            d.all += 1;
            d.summarized += i64::from(summarized);
        }
    }
    drop(ledger);
    let mut changes = Vec::new();
    for (role, d) in deleted {
        let oid = pg_sys::Oid::from(role);
        fold_into_summary(&rels, &summary, oid, -d.summarized, 0);
        changes.push((ScopeKey::role(oid), 0, -d.all));
    }
    drop(summary);
    drop(reader);
    // Published before the commit, applied after it (see scopes/).
    OVERFLOW.with_borrow_mut(|o| *o = crate::scopes::publish(&changes));
}
