//! Layer 1: what a transaction did, kept in step with its subtransactions.

use pgrx::pg_sys;

/// Keeps a list of what a transaction did, each item with the subtransaction nesting
/// level that did it, in step with the subtransaction that ends: what a rolled-back
/// one did is forgotten, what a committed one did becomes its parent's. Returns what
/// was forgotten (nothing but at a rollback), for a caller that must undo it.
pub fn at_subxact_end<T>(
    items: &mut Vec<(T, i32)>,
    event: pg_sys::SubXactEvent::Type,
) -> Vec<(T, i32)> {
    // SAFETY: a plain read of transaction state.
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    match event {
        pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => {
            let (gone, kept) = std::mem::take(items)
                .into_iter()
                .partition(|(_, l)| *l >= level);
            *items = kept;
            gone
        }
        pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => {
            for item in items.iter_mut().filter(|i| i.1 >= level) {
                item.1 = level - 1;
            }
            Vec::new()
        }
        _ => Vec::new(),
    }
}
