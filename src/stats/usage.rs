//! quota.usage_totals (0.5.1): the database's active and retained tickets, all roles
//! together, for monitoring. quota.usage reads every retained ticket of the ledger,
//! which with millions of them is a scan of millions of rows on every scrape; this
//! reads the summary (one row per role), one index probe per role, the unfinished
//! tickets, and of each role's finished ones only the smaller side of the caller's
//! retention cutoff (see ledger::count::db_rows and db_ended_before, and ledger::leases::db_open). It reads the
//! latest committed state, as admission does.

use pgrx::pg_sys;

use crate::core::stats::UsageTotals;
use crate::ledger::count::{db_ended_before, db_rows};
use crate::ledger::leases::db_open;
use crate::ledger::rels::Reader;
use crate::ledger::scan::Latest;
use crate::timestamps::cutoff;

/// The totals, with the caller's quota.retention.
pub fn totals() -> UsageTotals {
    let reader = Reader::open();
    let rels = reader.rels;
    rels.require_v2("quota.usage_totals()");
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let snap = Latest::take();
    let cutoff = cutoff(now, crate::gucs::retention_secs());
    let (by_role, missing) = db_rows(&rels, &snap);
    if missing {
        // Counting those roles row by row is what the summary spares the next call.
        crate::workers::request_summary_rebuild();
    }
    let rows = by_role.values().map(|r| r.rows).sum();
    let open = db_open(&rels, &snap, now, cutoff);
    let ended = by_role.iter().map(|(&role, r)| {
        let open = open.by_role.get(&role).copied().unwrap_or(0);
        (role, r.rows - open, r.first_ended)
    });
    let ended_gone = db_ended_before(&rels, &snap, cutoff, ended);
    UsageTotals::new(open.active, rows, open.gone + ended_gone)
}
