//! Layer 5: the ledger writer's rebuild of missing summary rows.

use crate::ledger::count::{roles_where, summary_rows};
use crate::ledger::heap::OpenRel;
use crate::ledger::rels::Reader;
use crate::ledger::scan::Latest;
use crate::ledger::write::add_to_summary;

/// Gives every role that has ledger rows but no summary row (after SQL-level writes to
/// the ledger, a restore, or ALTER EXTENSION UPDATE) its summary row back, so that
/// admission stops counting its history row by row.
pub fn rebuild_summary() {
    let reader = Reader::open();
    let rels = reader.rels;
    let snap = Latest::take();
    let missing = roles_where(&rels, &snap, |role| {
        summary_rows(&rels, &snap, role, true).is_none()
    });
    drop(snap);
    if missing.is_empty() {
        return;
    }
    let summary = OpenRel::open(rels.summary, "summary", 1);
    for role in missing {
        add_to_summary(&rels, &summary, role, 0);
    }
}
