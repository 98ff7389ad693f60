//! Counting a scope's tickets with direct index scans under the latest snapshot.
//!
//! Admission runs on every start(), including every refusal, so it must be cheap: an
//! SPI query would build and tear down an executor tree each time. Instead we probe
//! the two indexes directly, as PostgreSQL's own catalog code does with systable
//! scans. Relations are found by OID from a syscache lookup of their names in the
//! schema `quota`, so the search_path plays no part (I5), and no permission check
//! applies: only pg_quota's own code reaches these scans.

use pgrx::pg_sys;

use crate::core::Usage;

/// Ledger columns, 1-based, as created by sql/schema.sql.
pub const COL_ID: usize = 1;
pub const COL_ROLE: usize = 2;
pub const COL_LABEL: usize = 3;
pub const COL_STARTED_AT: usize = 4;
pub const COL_ENDED_AT: usize = 5;
pub const COL_OUTCOME: usize = 6;
pub const NCOLS: usize = 6;

/// The OIDs of pg_quota's relations in this database.
#[derive(Clone, Copy)]
pub struct Rels {
    pub ledger: pg_sys::Oid,
    /// `ledger_pkey` on (id).
    pub ledger_pkey: pg_sys::Oid,
    /// `ledger_role_ended_idx` on (role, ended_at).
    pub ledger_idx: pg_sys::Oid,
    pub summary: pg_sys::Oid,
    /// `summary_pkey` on (role).
    pub summary_idx: pg_sys::Oid,
}

fn relid(ns: pg_sys::Oid, name: &std::ffi::CStr) -> pg_sys::Oid {
    // SAFETY: a syscache lookup; returns InvalidOid when missing.
    let oid = unsafe { pg_sys::get_relname_relid(name.as_ptr(), ns) };
    if oid == pg_sys::InvalidOid {
        pgrx::pg_sys::panic::ErrorReport::new(
            pgrx::PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            format!(
                "relation \"quota.{}\" does not exist",
                name.to_string_lossy()
            ),
            "pg_quota",
        )
        .set_hint(
            "Reinstall the extension with DROP EXTENSION pg_quota and CREATE EXTENSION pg_quota.",
        )
        .report(pgrx::PgLogLevel::ERROR);
    }
    oid
}

pub fn rels() -> Rels {
    // SAFETY: a syscache lookup; raises if the schema is missing.
    let ns = unsafe { pg_sys::get_namespace_oid(c"quota".as_ptr(), false) };
    Rels {
        ledger: relid(ns, c"ledger"),
        ledger_pkey: relid(ns, c"ledger_pkey"),
        ledger_idx: relid(ns, c"ledger_role_ended_idx"),
        summary: relid(ns, c"summary"),
        summary_idx: relid(ns, c"summary_pkey"),
    }
}

/// A registered snapshot of the latest committed state, unregistered on drop.
pub struct Latest(pub pg_sys::Snapshot);

impl Latest {
    pub fn take() -> Latest {
        // SAFETY: GetLatestSnapshot returns a static snapshot; registering copies it,
        // so later snapshot calls cannot change it under our scans.
        Latest(unsafe { pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot()) })
    }
}

impl Drop for Latest {
    fn drop(&mut self) {
        // SAFETY: registered in `take`; during an ERROR's unwind the resource owner
        // would also release it, but unregistering first is harmless.
        unsafe { pg_sys::UnregisterSnapshot(self.0) };
    }
}

pub enum Key {
    OidEq(pg_sys::Oid),
    UuidEq(pg_sys::Datum),
    IsNull,
    TsLess(pg_sys::TimestampTz),
    TsAtLeast(pg_sys::TimestampTz),
}

fn scankeys(keys: &[Key]) -> Vec<pg_sys::ScanKeyData> {
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            let attno = (i + 1) as pg_sys::AttrNumber;
            // SAFETY: ScanKeyData is plain data; the init functions fill every field.
            unsafe {
                let mut sk: pg_sys::ScanKeyData = std::mem::zeroed();
                let (strategy, proc_, arg) = match *k {
                    Key::OidEq(o) => (pg_sys::BTEqualStrategyNumber, pg_sys::F_OIDEQ, o.into()),
                    Key::UuidEq(d) => (pg_sys::BTEqualStrategyNumber, pg_sys::F_UUID_EQ, d),
                    Key::TsLess(t) => (
                        pg_sys::BTLessStrategyNumber,
                        pg_sys::F_TIMESTAMPTZ_LT,
                        t.into(),
                    ),
                    Key::TsAtLeast(t) => (
                        pg_sys::BTGreaterEqualStrategyNumber,
                        pg_sys::F_TIMESTAMPTZ_GE,
                        t.into(),
                    ),
                    Key::IsNull => {
                        pg_sys::ScanKeyEntryInitialize(
                            &mut sk,
                            (pg_sys::SK_ISNULL | pg_sys::SK_SEARCHNULL) as i32,
                            attno,
                            0, // InvalidStrategy
                            pg_sys::InvalidOid,
                            pg_sys::InvalidOid,
                            pg_sys::InvalidOid,
                            pg_sys::Datum::from(0),
                        );
                        return sk;
                    }
                };
                pg_sys::ScanKeyInit(
                    &mut sk,
                    attno,
                    strategy as u16,
                    pg_sys::Oid::from(proc_),
                    arg,
                );
                sk
            }
        })
        .collect()
}

/// Scans `index` of `heap` for tuples visible to `snap` that match `keys` on the
/// index's leading columns, and hands each to `visit` until it returns false.
pub fn scan(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    snap: &Latest,
    keys: &[Key],
    visit: impl FnMut(*mut pg_sys::TupleTableSlot) -> bool,
) {
    // SAFETY: the relations exist (looked up just now) and are opened with
    // AccessShareLock, held to the end of the transaction like any read.
    unsafe {
        let heap_rel = pg_sys::table_open(heap, pg_sys::AccessShareLock as i32);
        let index_rel = pg_sys::index_open(index, pg_sys::AccessShareLock as i32);
        scan_open(heap_rel, index_rel, snap, keys, visit);
        pg_sys::index_close(index_rel, pg_sys::NoLock as i32);
        pg_sys::table_close(heap_rel, pg_sys::NoLock as i32);
    }
}

/// `scan`, over relations the caller already has open.
pub fn scan_open(
    heap_rel: pg_sys::Relation,
    index_rel: pg_sys::Relation,
    snap: &Latest,
    keys: &[Key],
    mut visit: impl FnMut(*mut pg_sys::TupleTableSlot) -> bool,
) {
    let mut sk = scankeys(keys);
    // SAFETY: the caller holds both relations open and locked; the slot and scan are
    // released before we return, and an ERROR releases them with the transaction's
    // resources.
    unsafe {
        let slot = pg_sys::table_slot_create(heap_rel, std::ptr::null_mut());
        let desc = pg_sys::index_beginscan(heap_rel, index_rel, snap.0, sk.len() as i32, 0);
        pg_sys::index_rescan(
            desc,
            sk.as_mut_ptr(),
            sk.len() as i32,
            std::ptr::null_mut(),
            0,
        );
        while pg_sys::index_getnext_slot(desc, pg_sys::ScanDirection::ForwardScanDirection, slot) {
            if !visit(slot) {
                break;
            }
        }
        pg_sys::index_endscan(desc);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
    }
}

fn count(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    snap: &Latest,
    keys: &[Key],
    stop_at: Option<i64>,
) -> i64 {
    let mut n = 0i64;
    scan(heap, index, snap, keys, |_| {
        n += 1;
        stop_at.is_none_or(|s| n < s)
    });
    n
}

/// Column `attno` of the tuple in `slot`, or None if NULL.
fn attr(slot: *mut pg_sys::TupleTableSlot, attno: i32) -> Option<pg_sys::Datum> {
    // SAFETY: the slot holds a tuple of the scanned heap, which has at least `attno`
    // columns; slot_getsomeattrs_int deforms up to it.
    unsafe {
        pg_sys::slot_getsomeattrs_int(slot, attno);
        let i = (attno - 1) as usize;
        (!*(*slot).tts_isnull.add(i)).then(|| *(*slot).tts_values.add(i))
    }
}

/// How many unfinished tickets `role` holds, counting at most `stop_at` of them.
pub fn active(r: &Rels, snap: &Latest, role: pg_sys::Oid, stop_at: Option<i64>) -> i64 {
    count(
        r.ledger,
        r.ledger_idx,
        snap,
        &[Key::OidEq(role), Key::IsNull],
        stop_at,
    )
}

/// How many ledger rows `role` has, from its summary row.
pub fn rows(r: &Rels, snap: &Latest, role: pg_sys::Oid) -> i64 {
    let mut rows = 0i64;
    scan(
        r.summary,
        r.summary_idx,
        snap,
        &[Key::OidEq(role)],
        |slot| {
            rows = attr(slot, 2).map_or(0, |d| d.value() as i64);
            false
        },
    );
    rows
}

/// How many retained tickets `role` has: its rows less the ended ones that are past
/// `cutoff` and not purged yet (few: the writer purges them as the scope grows).
pub fn retained(r: &Rels, snap: &Latest, role: pg_sys::Oid, cutoff: pg_sys::TimestampTz) -> i64 {
    rows(r, snap, role) - expired(r, snap, role, cutoff)
}

/// How many of `role`'s ended tickets are past `cutoff`.
pub fn expired(r: &Rels, snap: &Latest, role: pg_sys::Oid, cutoff: pg_sys::TimestampTz) -> i64 {
    count(
        r.ledger,
        r.ledger_idx,
        snap,
        &[Key::OidEq(role), Key::TsLess(cutoff)],
        None,
    )
}

/// When the oldest ended, still retained ticket of `role` ended.
pub fn oldest_ended(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    cutoff: pg_sys::TimestampTz,
) -> Option<pg_sys::TimestampTz> {
    let mut oldest = None;
    scan(
        r.ledger,
        r.ledger_idx,
        snap,
        &[Key::OidEq(role), Key::TsAtLeast(cutoff)],
        |slot| {
            oldest = attr(slot, COL_ENDED_AT as i32).map(|d| d.value() as i64);
            false
        },
    );
    oldest
}

/// The scope's usage as admission needs it: each count only where its limit is set
/// (`None` means no limit, so that count is not needed to decide).
pub fn usage(
    r: &Rels,
    snap: &Latest,
    role: pg_sys::Oid,
    cutoff: pg_sys::TimestampTz,
    max_active: Option<i64>,
    count_retained: bool,
) -> Usage {
    Usage {
        active: max_active.map_or(0, |m| active(r, snap, role, Some(m))),
        retained: if count_retained {
            retained(r, snap, role, cutoff)
        } else {
            0
        },
    }
}
