//! Layer 3, the ledger: counting a scope's tickets, and finding them, under a snapshot
//! the caller takes (see scan.rs).

use pgrx::pg_sys;

use crate::ledger::rels::Rels;
use crate::ledger::scan::{
    attr, distinct_oids, rescans, scan, scan_index, ts_attr, units, weight_attr, Key, Latest,
};
use crate::ledger::{
    COL_ENDED_AT, COL_LEASE_UNTIL, COL_ROLE, SUMMARY_COL_FOLDED, SUMMARY_COL_TICKETS,
};

/// The units (0.7.0: the sum of their weights) of the unfinished tickets `role` holds,
/// and the earliest end of their leases
/// (i64::MAX where none ends; 0.6.0, for a scope counter's `earliest`), as `snap` sees
/// them: a renew() not committed yet lowers the counter when it commits (finish.rs).
pub fn active_and_earliest(r: &Rels, snap: &Latest, role: pg_sys::Oid) -> (i64, i64) {
    active_and_earliest_on(r, r.ledger_idx, snap, &[Key::OidEq(role), Key::IsNull])
}

/// The same for tenant `tenant` (a text datum) of `role` (0.5.0's schema).
pub fn tenant_active_and_earliest(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    tenant: pg_sys::Datum,
) -> (i64, i64) {
    if !r.v5() {
        return (0, i64::MAX);
    }
    active_and_earliest_on(
        r,
        r.ledger_tenant_idx,
        snap,
        &[Key::OidEq(role), Key::TextEq(tenant), Key::IsNull],
    )
}

fn active_and_earliest_on(r: &Rels, index: pg_sys::Oid, snap: &Latest, keys: &[Key]) -> (i64, i64) {
    let (mut n, mut earliest) = (0i64, i64::MAX);
    let v2 = r.v2();
    scan(r.ledger, index, snap, keys, |slot| {
        n += weight_attr(slot);
        if v2 {
            if let Some(l) = ts_attr(slot, COL_LEASE_UNTIL) {
                earliest = earliest.min(l);
            }
        }
        true
    });
    (n, earliest)
}

/// The units of `role`'s ledger rows (0.7.0: a row counts its ticket's weight; the
/// summary row's `tickets` are units too): from its summary row (plus its transactional
/// tickets not folded into it yet, 0.5.0), or, where SQL-level writes to the ledger
/// made the summary forget it (see sql/schema.sql), by counting, if `count_if_missing`
/// (None otherwise); and whether that count was long enough that the writer should give
/// the role its summary row back (counting a long history on every call is what the
/// summary avoids).
pub fn rows(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    count_if_missing: bool,
) -> Option<(i64, bool)> {
    match summary_rows(r, snap, role, false) {
        Some((tickets, folded)) => Some((tickets + unfolded(r, snap, role, folded), false)),
        None if count_if_missing => {
            let n = ledger_rows(r, snap, role);
            Some((n, n > REBUILD_ABOVE))
        }
        None => None,
    }
}

/// The units of `role`'s transactional tickets (0.5.0) that have a txid of at least `from`:
/// those its summary row does not count yet (see sql/schema.sql, quota.summary).
pub fn unfolded(r: &Rels, snap: &Latest, role: pg_sys::Oid, from: u64) -> i64 {
    if !r.v5() {
        return 0;
    }
    in_both(r, |heap, idx| {
        units_index(
            heap,
            idx.txid,
            snap,
            &[Key::OidEq(role), Key::Xid8AtLeast(from)],
        )
    })
}

/// The indexes of one ledger table that `in_both` hands over.
pub struct Idx {
    pub role: pg_sys::Oid,
    pub key: pg_sys::Oid,
    pub txid: pg_sys::Oid,
}

/// The sum of `f` over the ledger's tables (0.6.0: quota.active, then quota.history;
/// before, the one table), each with its indexes.
pub fn in_both(r: &Rels, mut f: impl FnMut(pg_sys::Oid, &Idx) -> i64) -> i64 {
    let mut n = f(
        r.ledger,
        &Idx {
            role: r.ledger_idx,
            key: r.ledger_key_idx,
            txid: r.ledger_txid_idx,
        },
    );
    if r.split() {
        n += f(
            r.history,
            &Idx {
                role: r.history_idx,
                key: r.history_key_idx,
                txid: r.history_txid_idx,
            },
        );
    }
    n
}

/// `units`, holding a read lock on `index` for the scan (see scan::scan_index): a
/// Reader locks the first table's common indexes, not quota.history's. Every count of
/// a scope's retained tickets is a count of units (0.7.0): a ticket counts its weight
/// against retained limits as against active ones.
fn units_index(heap: pg_sys::Oid, index: pg_sys::Oid, snap: &Latest, keys: &[Key]) -> i64 {
    let mut locks = crate::ledger::locks::Locks::new();
    locks.take(index, pg_sys::AccessShareLock);
    units(heap, index, snap, keys)
}

/// The units of `role`'s transactional tickets that have a txid from `from` up to, not
/// including, `to` (0.5.2): what a fold moves into its summary row. 0.5.1 counted
/// everything from `from` on twice and took the difference, walking every ticket
/// committed since the horizon on each pass while the horizon crept, and every ticket
/// restored from an older cluster (see `foreign`) on every pass.
pub fn unfolded_below(r: &Rels, snap: &Latest, role: pg_sys::Oid, from: u64, to: u64) -> i64 {
    if !r.v5() || from >= to {
        return 0;
    }
    in_both(r, |heap, idx| {
        units_index(
            heap,
            idx.txid,
            snap,
            &[Key::OidEq(role), Key::Xid8AtLeast(from), Key::Xid8Below(to)],
        )
    })
}

/// At most `at_most` of `role`'s transactional tickets whose txid this cluster has not
/// issued yet, `next` being its next full transaction id read after `snap` was taken
/// (0.5.2): tickets restored from a dump of a cluster further on (or written so by a
/// superuser's SQL). Every transaction `snap` sees committed has an id below `next`, so
/// none of them is this cluster's own. Their tables, locations and weights (0.7.0),
/// lowest txid first in each table.
pub fn foreign(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    next: u64,
    at_most: usize,
) -> Vec<(pg_sys::Oid, pg_sys::ItemPointerData, i64)> {
    let mut out = Vec::new();
    if !r.v5() || at_most == 0 {
        return out;
    }
    in_both(r, |heap, idx| {
        if out.len() < at_most {
            scan_index(
                heap,
                idx.txid,
                snap,
                &[Key::OidEq(role), Key::Xid8AtLeast(next)],
                |slot| {
                    // SAFETY: the slot holds a visible ledger tuple.
                    out.push((heap, unsafe { (*slot).tts_tid }, weight_attr(slot)));
                    out.len() < at_most
                },
            );
        }
        0
    });
    out
}

/// A role without a summary row and more ledger rows than this makes the writer
/// rebuild the missing summary rows. 0.4.0 waited for 100: a role at its limit with
/// fewer rows (never admitted, so never given its row back by the writer) then went
/// without a counter until the writer restarted. A role with no rows at all (a new
/// one) asks for nothing: the writer's first admission gives it its row.
const REBUILD_ABOVE: i64 = 0;

/// A summary row's tickets, and (0.5.0) the txid below which its role's transactional
/// tickets are counted in it (0 where none are).
fn summary_entry(r: &Rels, slot: *mut pg_sys::TupleTableSlot) -> Option<(i64, u64)> {
    summary_entry_at(r, slot).map(|(_, tickets, folded)| (tickets, folded.unwrap_or(0)))
}

/// `role`'s summary row, if it has one: its tickets, and (0.5.0) the txid below which
/// its transactional tickets are counted in it (0 where none are).
/// `cached`: look where this backend last found or wrote it first (see `summary_row`),
/// for the ledger writer, which updates the row at every batch; a backend would find
/// the version it remembered replaced nearly every time.
pub fn summary_rows(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    cached: bool,
) -> Option<(i64, u64)> {
    // SAFETY: the caller holds locks on both relations (a Reader's, or the writer's).
    unsafe {
        let heap = pg_sys::table_open(r.summary, pg_sys::NoLock as i32);
        let index = pg_sys::index_open(r.summary_idx, pg_sys::NoLock as i32);
        let row = if cached {
            summary_row(r, heap, index, snap, role)
        } else {
            summary_scan(r, heap, index, snap, role)
        };
        pg_sys::index_close(index, pg_sys::NoLock as i32);
        pg_sys::table_close(heap, pg_sys::NoLock as i32);
        row.map(|(_, tickets, folded)| (tickets, folded.unwrap_or(0)))
    }
}

thread_local! {
    /// Where this backend last found or wrote each role's summary row: the summary's
    /// relfilenode the locations are in, and role -> location. See `summary_row`.
    static SUMMARY_AT: std::cell::RefCell<(u32, std::collections::HashMap<u32, pg_sys::ItemPointerData>)> =
        std::cell::RefCell::new((0, std::collections::HashMap::new()));
}

/// The most locations `SUMMARY_AT` keeps; past that it starts again.
const SUMMARY_AT_MAX: usize = 10_000;

/// A summary row: its location, tickets and `folded` (None where the column is NULL,
/// or before 0.5.0's schema, which has none).
type SummaryAt = (pg_sys::ItemPointerData, i64, Option<u64>);

/// `role`'s summary row as `snap` sees it (see `SummaryAt`).
///
/// The writer updates a role's row at every batch that admits it, so the row has a
/// version per batch; until pruning (or VACUUM, which an old snapshot holds off) removes
/// the dead ones, an index scan walks them all (with a REPEATABLE READ snapshot held
/// across 11,000 batches of a role, 11,000 versions a lookup). So the row is first
/// fetched where this backend last found or wrote it: a version `snap` sees there, of
/// this role, is the row (the primary key lets `snap` see one version of a role's row),
/// whatever happened in between. Only if that finds nothing (the row was updated by
/// someone else, a VACUUM moved on, the table was rewritten, an aborted write) is it
/// looked up through the index. The fetch prunes the page first where it is nearly full
/// (see scan::fetch_visible), as the index scan did.
pub fn summary_row(
    r: &Rels,
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    snap: &Latest,
    role: pg_sys::Oid,
) -> Option<SummaryAt> {
    // SAFETY: an open relation.
    let file = unsafe { crate::compat::relfilenode(heap) };
    let known = SUMMARY_AT.with_borrow(|(f, at)| {
        (*f == file)
            .then(|| at.get(&u32::from(role)).copied())
            .flatten()
    });
    if let Some(tid) = known {
        let fetched = crate::ledger::scan::fetch_visible(heap, tid, snap, |slot| {
            let of_role = attr(slot, 1).is_some_and(|d| u32::from(role) == d.value() as u32);
            of_role.then(|| summary_entry_at(r, slot)).flatten()
        });
        if let Some(Some(row)) = fetched {
            return Some(row);
        }
    }
    let row = summary_scan(r, heap, index, snap, role);
    // A location remembered stays unless the index found no row: one that `snap` does
    // not see may be newer than `snap` (the fold reads under a snapshot of its pass),
    // and the writer remembers every version it writes.
    match row {
        Some((tid, _, _)) if known.is_none() => remember_summary_at(file, role, tid),
        None if known.is_some() => forget_summary_at(role),
        _ => {}
    }
    row
}

/// `role`'s summary row found through the summary's index.
fn summary_scan(
    r: &Rels,
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    snap: &Latest,
    role: pg_sys::Oid,
) -> Option<SummaryAt> {
    let mut row = None;
    crate::ledger::scan::scan_open(heap, index, snap, &[Key::OidEq(role)], |slot| {
        row = summary_entry_at(r, slot);
        false
    });
    row
}

/// The summary row in `slot` (see `SummaryAt`).
fn summary_entry_at(r: &Rels, slot: *mut pg_sys::TupleTableSlot) -> Option<SummaryAt> {
    // SAFETY: the slot holds a visible summary tuple, pinned meanwhile.
    let tid = unsafe { (*slot).tts_tid };
    let folded = (r.summary_ncols >= SUMMARY_COL_FOLDED)
        .then(|| attr(slot, SUMMARY_COL_FOLDED as i32).map(|d| d.value() as u64))
        .flatten();
    attr(slot, SUMMARY_COL_TICKETS as i32).map(|d| (tid, d.value() as i64, folded))
}

/// Forgets where `role`'s summary row was.
fn forget_summary_at(role: pg_sys::Oid) {
    SUMMARY_AT.with_borrow_mut(|(_, at)| at.remove(&u32::from(role)));
}

/// Records that `role`'s summary row is at `tid` of the summary whose relfilenode is
/// `file` (a version this backend just wrote, or found).
pub fn remember_summary_at(file: u32, role: pg_sys::Oid, tid: pg_sys::ItemPointerData) {
    SUMMARY_AT.with_borrow_mut(|(f, at)| {
        if *f != file || at.len() >= SUMMARY_AT_MAX {
            *f = file;
            at.clear();
        }
        at.insert(u32::from(role), tid);
    });
}

/// The units of `role`'s ledger rows (in both tables), counted one by one.
pub fn ledger_rows(r: &Rels, snap: &Latest, role: pg_sys::Oid) -> i64 {
    in_both(r, |heap, idx| {
        units_index(heap, idx.role, snap, &[Key::OidEq(role)])
    })
}

/// The units of `role`'s ended tickets that are past `cutoff`.
pub fn expired(r: &Rels, snap: &Latest, role: pg_sys::Oid, cutoff: pg_sys::TimestampTz) -> i64 {
    units_index(
        r.history,
        r.history_idx,
        snap,
        &[Key::OidEq(role), Key::TsLess(cutoff)],
    )
}

/// `role`'s ended, still retained tickets (ended at or after `cutoff`), oldest first,
/// as (when it ended, its weight), up to the first whose units bring them to `enough`
/// (at least one), and never more than core::lease::AGE_OUT_READS of them; and whether
/// it stopped at that bound. What core::lease::capacity needs to say when enough have
/// aged out.
pub fn oldest_ended(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    cutoff: pg_sys::TimestampTz,
    enough: i64,
) -> (Vec<(i64, i64)>, bool) {
    oldest_until(
        r.history,
        r.history_idx,
        snap,
        &[Key::OidEq(role), Key::TsAtLeast(cutoff)],
        enough,
    )
}

/// The rows `keys` select on `index` (whose order after its keys is ended_at's), as
/// (ended_at, weight), until their weights reach `enough` (at least one row) or
/// AGE_OUT_READS rows were read (then true).
fn oldest_until(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    snap: &Latest,
    keys: &[Key],
    enough: i64,
) -> (Vec<(i64, i64)>, bool) {
    let mut out = Vec::new();
    let mut units = 0i64;
    let mut capped = false;
    scan_index(heap, index, snap, keys, |slot| {
        if let Some(ended) = ts_attr(slot, COL_ENDED_AT) {
            let w = weight_attr(slot);
            out.push((ended, w));
            units = units.saturating_add(w);
        }
        if units >= enough.max(1) {
            return false;
        }
        capped = out.len() >= crate::core::lease::AGE_OUT_READS;
        !capped
    });
    (out, capped)
}

/// Whether the version of a row in `slot` (visible to the scan's snapshot) is being
/// replaced or was replaced by a transaction that has not aborted: a finish() or
/// renew() still open, or the writer's expiry sweep. Such a ticket whose lease ran
/// out still counts as active: a renew() that began before the lease ran out and
/// commits later keeps it active (see finish::renew), so counting it as expired now
/// could admit past the limit. Over-counting for that moment is allowed (I2).
pub fn being_changed(slot: *mut pg_sys::TupleTableSlot) -> bool {
    // SAFETY: the slot holds a heap tuple in a buffer it pins (a heap index scan's
    // BufferHeapTupleTableSlot); its header is read under a share lock on the buffer,
    // as heap visibility checks read it.
    unsafe {
        let bslot = slot as *mut pg_sys::BufferHeapTupleTableSlot;
        let buffer = (*bslot).buffer;
        let hdr = (*(*bslot).base.tuple).t_data;
        pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
        let mask = u32::from((*hdr).t_infomask);
        let locked_only = mask & pg_sys::HEAP_XMAX_LOCK_ONLY != 0
            || mask & (pg_sys::HEAP_XMAX_IS_MULTI | pg_sys::HEAP_LOCK_MASK)
                == pg_sys::HEAP_XMAX_EXCL_LOCK;
        let xid = if mask & pg_sys::HEAP_XMAX_INVALID != 0 || locked_only {
            pg_sys::InvalidTransactionId
        } else if mask & pg_sys::HEAP_XMAX_IS_MULTI != 0 {
            pg_sys::HeapTupleGetUpdateXid(hdr)
        } else {
            (*hdr).t_choice.t_heap.t_xmax
        };
        pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_UNLOCK as i32);
        xid != pg_sys::InvalidTransactionId
            && (pg_sys::TransactionIdIsCurrentTransactionId(xid)
                || pg_sys::TransactionIdIsInProgress(xid)
                || pg_sys::TransactionIdDidCommit(xid))
    }
}

/// The units (0.7.0) of the unfinished tickets that tenant `tenant` (a text datum) of
/// `role` holds (0.5.0), lapsed leases included: what its retained count starts from.
pub fn tenant_unended(r: &Rels, snap: &Latest, role: pg_sys::Oid, tenant: pg_sys::Datum) -> i64 {
    if !r.v5() {
        return 0;
    }
    units(
        r.ledger,
        r.ledger_tenant_idx,
        snap,
        &[Key::OidEq(role), Key::TextEq(tenant), Key::IsNull],
    )
}

/// The units of tenant `tenant`'s tickets that ended at or after `cutoff`.
pub fn tenant_ended_since(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    tenant: pg_sys::Datum,
    cutoff: pg_sys::TimestampTz,
) -> i64 {
    if !r.v5() {
        return 0;
    }
    units_index(
        r.history,
        r.history_tenant_idx,
        snap,
        &[
            Key::OidEq(role),
            Key::TextEq(tenant),
            Key::TsAtLeast(cutoff),
        ],
    )
}

/// `oldest_ended` for tenant `tenant` (a text datum) of `role`.
pub fn tenant_oldest_ended(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    tenant: pg_sys::Datum,
    cutoff: pg_sys::TimestampTz,
    enough: i64,
) -> (Vec<(i64, i64)>, bool) {
    if !r.v5() {
        return (Vec::new(), false);
    }
    oldest_until(
        r.history,
        r.history_tenant_idx,
        snap,
        &[
            Key::OidEq(role),
            Key::TextEq(tenant),
            Key::TsAtLeast(cutoff),
        ],
        enough,
    )
}

/// The smallest role above `after` that has a transactional ticket (0.5.0) visible to
/// `snap`: one probe of ledger_txid_idx.
pub fn next_txn_role(r: &Rels, snap: &Latest, after: pg_sys::Oid) -> Option<pg_sys::Oid> {
    let mut found: Option<pg_sys::Oid> = None;
    if r.v5() {
        in_both(r, |heap, idx| {
            scan_index(heap, idx.txid, snap, &[Key::OidGreater(after)], |slot| {
                let role = attr(slot, COL_ROLE as i32).map(|d| d.value() as u32);
                if let Some(role) = role {
                    if found.is_none_or(|f| role < u32::from(f)) {
                        found = Some(pg_sys::Oid::from(role));
                    }
                }
                false
            });
            0
        });
    }
    found
}

/// The distinct roles with rows in `index` of each ledger table (`which` picks it)
/// visible to `snap`, smallest first (`distinct_oids` over each, merged).
fn roles_in(
    r: &Rels,
    snap: &Latest,
    which: impl Fn(&Idx) -> pg_sys::Oid,
) -> std::collections::BTreeSet<u32> {
    let mut roles = std::collections::BTreeSet::new();
    each_role_in(r, snap, which, |role, _| {
        roles.insert(u32::from(role));
    });
    roles
}

/// `distinct_oids` over `index` of each ledger table (`which` picks it): `visit` gets
/// each role with its first row of that table's index, once per table that has it.
fn each_role_in(
    r: &Rels,
    snap: &Latest,
    which: impl Fn(&Idx) -> pg_sys::Oid,
    mut visit: impl FnMut(pg_sys::Oid, *mut pg_sys::TupleTableSlot),
) {
    in_both(r, |heap, idx| {
        let mut locks = crate::ledger::locks::Locks::new();
        locks.take(which(idx), pg_sys::AccessShareLock);
        distinct_oids(heap, which(idx), COL_ROLE, snap, &mut visit);
        0
    });
}

/// The roles with ledger rows visible to `snap` that `keep` accepts, walking the
/// ledger with one loose index scan (`distinct_oids`).
pub fn roles_where(
    r: &Rels,
    snap: &Latest,
    mut keep: impl FnMut(pg_sys::Oid) -> bool,
) -> Vec<pg_sys::Oid> {
    roles_in(r, snap, |idx| idx.role)
        .into_iter()
        .map(pg_sys::Oid::from)
        .filter(|&role| keep(role))
        .collect()
}

/// How many ledger rows each role holds (0.5.1, for quota.usage_totals; only roles with
/// rows are in the map), without reading the ledger's history: each role's summary row
/// plus its transactional tickets not folded into it yet, or, for a role without a
/// summary row (SQL-level writes to the ledger made the summary forget it, until the
/// writer gives it back), its rows counted one by one; and whether any role had no
/// summary row (the caller asks the writer to rebuild them). Costs a read of the
/// summary, a step or a probe per role with ledger rows, and one per role with
/// transactional tickets.
pub fn db_rows(r: &Rels, snap: &Latest) -> (std::collections::HashMap<u32, RoleRows>, bool) {
    let mut summary = std::collections::HashMap::new();
    scan(r.summary, r.summary_idx, snap, &[], |slot| {
        if let (Some(role), Some(entry)) = (attr(slot, 1), summary_entry(r, slot)) {
            summary.insert(role.value() as u32, entry);
        }
        true
    });
    let txn_roles = if r.v5() {
        roles_in(r, snap, |idx| idx.txid)
    } else {
        Default::default()
    };
    // The roles, and each one's earliest ended_at: the first row of a role in its
    // (role, ended_at, …) index has it, where any of its tickets ended (NULLs sort
    // last; quota.active's are all NULL).
    let mut first_ended = std::collections::BTreeMap::<u32, Option<i64>>::new();
    each_role_in(
        r,
        snap,
        |idx| idx.role,
        |role, slot| {
            let ended = ts_attr(slot, COL_ENDED_AT);
            let e = first_ended.entry(u32::from(role)).or_insert(None);
            *e = match (*e, ended) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        },
    );
    let mut rows = std::collections::HashMap::new();
    let mut missing = false;
    for (&role, &first_ended) in &first_ended {
        let role = pg_sys::Oid::from(role);
        let n = match summary.get(&u32::from(role)) {
            Some(&(tickets, folded)) if txn_roles.contains(&u32::from(role)) => {
                tickets + unfolded(r, snap, role, folded)
            }
            Some(&(tickets, _)) => tickets,
            None => {
                missing = true;
                ledger_rows(r, snap, role)
            }
        };
        rows.insert(
            u32::from(role),
            RoleRows {
                rows: n,
                first_ended,
            },
        );
    }
    (rows, missing)
}

/// A role's ledger rows, as db_rows counts them.
#[derive(Clone, Copy)]
pub struct RoleRows {
    pub rows: i64,
    /// When its earliest ended ticket ended, if any has.
    pub first_ended: Option<pg_sys::TimestampTz>,
}

/// The first limit of each role's count in `db_ended_before`: a role's two sides are
/// counted up to it before either grows, so a role whose smaller side is empty reads
/// this many entries of the other.
const PER_ROLE_FIRST_LIMIT: i64 = 16;

/// How many of the database's finished tickets ended before `cutoff` (0.2.0's schema
/// on), role by role: `ended` gives each role's finished tickets and when the earliest
/// of them ended (db_rows), and a role with none, or none that ended before the
/// cutoff, costs nothing. For each other role, the entries of its (role, ended_at, …) index
/// on the smaller side of the cutoff (see core::stats::smaller_side): the history past
/// retention where the writer has not purged it (a role that stopped starting tickets,
/// or a caller with a shorter retention than the role's), otherwise the tickets that
/// ended since. 0.6.0 reads quota.history's index, which holds only ended tickets; with
/// one table the unended ones have a NULL ended_at, which neither side's key matches.
/// (0.5.1 to 0.5.2 read an index on (ended_at, lease_until) for all roles at once;
/// 0.6.0 has none on quota.history: a finish enters one index fewer.)
pub fn db_ended_before(
    r: &Rels,
    snap: &Latest,
    cutoff: pg_sys::TimestampTz,
    ended: impl Iterator<Item = (u32, i64, Option<pg_sys::TimestampTz>)>,
) -> i64 {
    if !r.v2() {
        return 0;
    }
    let mut locks = crate::ledger::locks::Locks::new();
    locks.take(r.history_idx, pg_sys::AccessShareLock);
    // SAFETY: the caller's Reader holds quota.history locked, and the index is locked
    // above; both are closed before we return.
    unsafe {
        let heap = pg_sys::table_open(r.history, pg_sys::NoLock as i32);
        let index = pg_sys::index_open(r.history_idx, pg_sys::NoLock as i32);
        let before = rescans(heap, index, snap, 2, |scan| {
            let mut before = 0i64;
            for (role, n, first_ended) in ended {
                pgrx::check_for_interrupts!();
                // No ticket of the role ended before the cutoff (its earliest did not).
                if n <= 0 || first_ended.is_none_or(|t| t >= cutoff) {
                    continue;
                }
                let role = pg_sys::Oid::from(role);
                // Both sides through the one scan, rescanned: a closure each cannot
                // borrow it mutably at once, so the sides take turns through a cell.
                let scan = std::cell::RefCell::new(&mut *scan);
                let side = |key: Key| {
                    let scan = &scan;
                    move |limit: i64| {
                        scan.borrow_mut()
                            .count_units(&[Key::OidEq(role), key], Some(limit))
                    }
                };
                before += crate::core::stats::smaller_side(
                    n,
                    PER_ROLE_FIRST_LIMIT,
                    side(Key::TsLess(cutoff)),
                    side(Key::TsAtLeast(cutoff)),
                );
            }
            before
        });
        pg_sys::index_close(index, pg_sys::NoLock as i32);
        pg_sys::table_close(heap, pg_sys::NoLock as i32);
        before
    }
}
