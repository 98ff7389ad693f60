//! Layer 5: the ledger writer's fold of transactional tickets (0.5.0). A
//! transactional start inserts its ticket in its caller's transaction and must not
//! update its role's summary row there (every enqueue of the role would queue on that
//! row until its commit). The row counts the role's transactional tickets below its
//! `folded` txid; the others are counted from ledger_txid_idx when a counter is built.
//! This pass moves `folded` up to the horizon below which every transaction has ended,
//! adding the tickets those committed, so that what is counted from the index stays
//! short; and it purges what is past retention in those roles, as a batch does for the
//! roles it admits, since their starts may never reach the writer.
//!
//! From 0.5.2 it reads only the range it folds, and it adopts the tickets restored
//! from a cluster further on, whose txids this cluster has not issued yet (see
//! ledger::write::adopted_version): they get a txid below every fold, in bounded steps,
//! and their summary row counts them from the same commit.
//!
//! None of this changes what a scope counts: a fold or an adoption moves tickets from
//! the index's count to the row's, in one commit; a purge removes rows past every
//! retention that could count them, and publishes that to the counters as a batch does.

use pgrx::pg_sys;

use crate::ledger::count::{foreign, next_txn_role, summary_rows, unfolded_below};
use crate::ledger::heap::OpenRel;
use crate::ledger::rels::{Reader, Rels};
use crate::ledger::scan::Latest;
use crate::ledger::write::Tables;
use crate::ledger::write::{adopted_version, fold_into_summary, horizon, purge_before};
use crate::ledger::COL_TXID;
use crate::scopes::{Change, ScopeKey};
use crate::timestamps::cutoff;

use super::txn::try_in_transaction;

/// The most roles one pass folds; the next pass goes on after the last one.
const ROLES_PER_PASS: usize = 256;
/// The most restored tickets one pass adopts (see the module's comment); the next
/// pass, which then comes at once, takes the rest.
const ADOPT_PER_PASS: usize = 5_000;

thread_local! {
    /// The role the last pass stopped after, and the scopes whose purges did not fit
    /// when published.
    static AFTER: std::cell::Cell<pg_sys::Oid> = const { std::cell::Cell::new(pg_sys::InvalidOid) };
    /// Whether the last pass left restored tickets to adopt.
    static MORE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static OVERFLOW: std::cell::RefCell<Vec<ScopeKey>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `fold` in a transaction of its own, then its purges applied to the scope counters.
/// Returns whether restored tickets are left to adopt: the writer then folds again at
/// once, rather than a second later.
pub fn fold_and_purge() -> bool {
    MORE.set(false);
    let committed = try_in_transaction("fold transactional tickets", fold);
    crate::scopes::apply_mine();
    if committed {
        crate::scopes::invalidate(&OVERFLOW.with_borrow_mut(std::mem::take));
    }
    committed && MORE.get()
}

fn fold() {
    let reader = Reader::open();
    let rels = reader.rels;
    if !rels.v5() {
        return;
    }
    let tables = Tables::open(&rels);
    let summary = OpenRel::open(rels.summary, "summary", 1);
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let snap = Latest::take();
    let h = horizon(&snap);
    // After the snapshot: every transaction it sees committed has an id below this.
    // SAFETY: a plain read of shared state.
    let next = unsafe { pg_sys::ReadNextFullTransactionId().value };
    let for_all = super::batch::retention_floor();
    let mut adopt_left = ADOPT_PER_PASS;
    let mut changes = Vec::new();
    let mut after = AFTER.get();
    for _ in 0..ROLES_PER_PASS {
        let Some(role) = next_txn_role(&rels, &snap, after) else {
            after = pg_sys::InvalidOid;
            break;
        };
        after = role;
        let adopted = adopt(&rels, &tables, &snap, role, next, &mut adopt_left);
        if adopt_left == 0 && adopted > 0 {
            // The role may have more: the next pass, at once, starts with it again.
            // (Without progress, its tickets are all being changed by open
            // transactions: the next pass goes on with the roles after it, a second
            // later, rather than spin.)
            MORE.set(true);
            after = pg_sys::Oid::from(u32::from(role) - 1);
        }
        // A role without a summary row is counted from the ledger meanwhile, and gets
        // its row from the summary rebuild asked for here (a role limited only per
        // tenant never counts its own rows, which is what asks for it elsewhere); its
        // history is purged all the same. Adopted tickets are among the rows that
        // rebuild counts, below its `folded`.
        match summary_rows(&rels, &snap, role, true) {
            None => crate::workers::request_summary_rebuild(),
            Some((_, folded)) => {
                let added = adopted + unfolded_below(&rels, &snap, role, folded, h);
                // Nothing to fold, nothing to write: the row is not rewritten on every
                // pass just because transaction ids moved on.
                if added != 0 {
                    fold_into_summary(&rels, &summary, role, added, h);
                }
            }
        }
        let keep = for_all.max(super::batch::configured_retention(role));
        let purged = purge_before(&rels, &tables, role, cutoff(now, keep));
        if purged.all > 0 {
            fold_into_summary(&rels, &summary, role, -purged.summarized, 0);
            changes.push(Change::new(ScopeKey::role(role), 0, -purged.all));
        }
        if adopt_left == 0 {
            break;
        }
    }
    AFTER.set(after);
    drop(snap);
    drop(summary);
    drop(tables);
    drop(reader);
    // Published before the commit, applied after it (see scopes/).
    OVERFLOW.with_borrow_mut(|o| *o = crate::scopes::publish(&changes));
}

/// Gives `role`'s tickets whose txid this cluster has not issued yet (`next` read after
/// `snap`; see ledger::count::foreign) a txid below every fold, at most `left` of them,
/// and takes those from `left`. A ticket a finish() or renew() is changing right now
/// is left for a later pass: the writer never waits for a caller's transaction.
/// Returns the units (0.7.0) of those it adopted.
fn adopt(
    rels: &Rels,
    tables: &Tables,
    snap: &Latest,
    role: pg_sys::Oid,
    next: u64,
    left: &mut usize,
) -> i64 {
    let mut adopted = 0;
    for (relid, tid, weight) in foreign(rels, snap, role, next, *left) {
        *left -= 1;
        // Changed in place, in whichever table it is.
        let ledger = tables.by_oid(relid);
        if !ledger.lock_nowait(tid) {
            continue;
        }
        let Some(tuple) = adopted_version(ledger, rels.ncols, tid, next) else {
            continue;
        };
        if ledger.update(tid, tuple, &[COL_TXID]) == pg_sys::TM_Result::TM_Ok {
            adopted += weight;
        }
    }
    adopted
}
