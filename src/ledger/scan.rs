//! Layer 3, the ledger: reading pg_quota's tables with direct index scans under the
//! latest snapshot.
//!
//! Admission runs on every start(), including every refusal, so it must be cheap: an
//! SPI query would build and tear down an executor tree each time. Instead we probe
//! the indexes directly, as PostgreSQL's own catalog code does with systable scans.
//! **No SSI (I3).** Under SERIALIZABLE, a scan with an MVCC snapshot takes predicate
//! locks and checks rw-conflicts, so two sessions that each start and finish in one
//! SERIALIZABLE transaction would fail each other with 40001. There we scan with
//! SnapshotAny, which predicate locking ignores, and decide visibility ourselves against
//! the latest snapshot (see `scan_open`). pg_quota's reads then take no predicate locks,
//! and the caller's own statements keep full SERIALIZABLE semantics.

use pgrx::pg_sys;

use crate::compat;
use crate::ledger::locks::Locks;

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

#[derive(Clone, Copy)]
pub enum Key {
    OidEq(pg_sys::Oid),
    OidGreater(pg_sys::Oid),
    UuidEq(pg_sys::Datum),
    IsNull,
    TsLess(pg_sys::TimestampTz),
    TsAtLeast(pg_sys::TimestampTz),
    /// Equal text, compared with the index column's collation.
    TextEq(pg_sys::Datum),
    /// An xid8 (a full transaction id) at least this (0.5.0's ledger_txid_idx).
    Xid8AtLeast(u64),
    /// An xid8 below this, on the same column as the key before it (after an
    /// Xid8AtLeast, a range; 0.5.2).
    Xid8Below(u64),
}

/// Scan keys on the leading columns of `index_rel`, each with that column's collation
/// (ScanKeyInit would give every key the C collation, which orders text differently
/// from the index).
fn scankeys(index_rel: pg_sys::Relation, keys: &[Key]) -> Vec<pg_sys::ScanKeyData> {
    let mut sks = scankeys_c(keys);
    for sk in sks.iter_mut() {
        let column = (sk.sk_attno - 1) as usize;
        // SAFETY: an open index has one collation per key column; the key's column is
        // among the leading ones, which find_index checked against the index's key
        // columns.
        sk.sk_collation = unsafe { *(*index_rel).rd_indcollation.add(column) };
    }
    sks
}

/// The index column (1-based) each key is on: the next one, but for a key that bounds
/// the column of the key before it.
fn columns(keys: &[Key]) -> Vec<pg_sys::AttrNumber> {
    let mut attno = 0;
    keys.iter()
        .map(|k| {
            if !matches!(k, Key::Xid8Below(_)) || attno == 0 {
                attno += 1;
            }
            attno
        })
        .collect()
}

fn scankeys_c(keys: &[Key]) -> Vec<pg_sys::ScanKeyData> {
    keys.iter()
        .zip(columns(keys))
        .map(|(k, attno)| {
            // SAFETY: ScanKeyData is plain data; the init functions fill every field.
            unsafe {
                let mut sk: pg_sys::ScanKeyData = std::mem::zeroed();
                let (strategy, proc_, arg) = match *k {
                    Key::OidEq(o) => (pg_sys::BTEqualStrategyNumber, pg_sys::F_OIDEQ, o.into()),
                    Key::OidGreater(o) => {
                        (pg_sys::BTGreaterStrategyNumber, pg_sys::F_OIDGT, o.into())
                    }
                    Key::UuidEq(d) => (pg_sys::BTEqualStrategyNumber, pg_sys::F_UUID_EQ, d),
                    Key::TextEq(d) => (pg_sys::BTEqualStrategyNumber, pg_sys::F_TEXTEQ, d),
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
                    // xid8 is passed by value, as int8 is.
                    Key::Xid8AtLeast(x) => (
                        pg_sys::BTGreaterEqualStrategyNumber,
                        pg_sys::F_XID8GE,
                        pg_sys::Datum::from(x),
                    ),
                    Key::Xid8Below(x) => (
                        pg_sys::BTLessStrategyNumber,
                        pg_sys::F_XID8LT,
                        pg_sys::Datum::from(x),
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
/// index's leading columns, and hands each to `visit` until it returns false. The
/// caller holds locks on both (see `Reader` and `heap::OpenRel`).
pub fn scan(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    snap: &Latest,
    keys: &[Key],
    visit: impl FnMut(*mut pg_sys::TupleTableSlot) -> bool,
) {
    // SAFETY: the caller holds locks on both relations.
    unsafe {
        let heap_rel = pg_sys::table_open(heap, pg_sys::NoLock as i32);
        let index_rel = pg_sys::index_open(index, pg_sys::NoLock as i32);
        scan_open(heap_rel, index_rel, snap, keys, visit);
        pg_sys::index_close(index_rel, pg_sys::NoLock as i32);
        pg_sys::table_close(heap_rel, pg_sys::NoLock as i32);
    }
}

/// `scan`, holding a read lock on `index` for the scan only: for the indexes that only
/// some calls use, which `Reader::open` does not lock (see there).
pub fn scan_index(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    snap: &Latest,
    keys: &[Key],
    visit: impl FnMut(*mut pg_sys::TupleTableSlot) -> bool,
) {
    let mut locks = Locks::new();
    locks.take(index, pg_sys::AccessShareLock);
    scan(heap, index, snap, keys, visit);
}

/// Whether this backend's transaction takes part in SSI: only SERIALIZABLE ones do
/// (IsolationIsSerializable(), a macro without a binding).
fn serializable() -> bool {
    // SAFETY: a plain read of a backend variable.
    unsafe { pg_sys::XactIsoLevel == pg_sys::XACT_SERIALIZABLE as i32 }
}

/// `scan`, over relations the caller already has open.
///
/// Outside SERIALIZABLE (the writer, and callers at READ COMMITTED or REPEATABLE READ)
/// the index scan runs under `snap` itself, as any catalog scan would, and marks the
/// index entries of rows dead to everyone as it passes them, so that later scans skip
/// them cheaply.
///
/// Under SERIALIZABLE, a scan under an MVCC snapshot would take predicate locks and
/// check rw-conflicts. So the scan runs under SnapshotAny, which predicate locking
/// ignores, returns every version of every matching row (walking HOT chains too), and
/// we keep the versions visible to `snap`, checking each under a share lock on its
/// buffer as heap_hot_search_buffer would.
pub fn scan_open(
    heap_rel: pg_sys::Relation,
    index_rel: pg_sys::Relation,
    snap: &Latest,
    keys: &[Key],
    visit: impl FnMut(*mut pg_sys::TupleTableSlot) -> bool,
) {
    rescans(heap_rel, index_rel, snap, keys.len(), |scan| {
        scan.run(keys, visit)
    });
}

/// One index scan over relations the caller has open, set up once and run by `f`
/// for as many sets of `nkeys` keys as it likes (`Rescan::run`), as an executor
/// rescans a nested loop's inner index scan: for a probe per role, where setting up a
/// scan for each cost more than the probe. Visibility as in `scan_open`.
pub fn rescans<R>(
    heap_rel: pg_sys::Relation,
    index_rel: pg_sys::Relation,
    snap: &Latest,
    nkeys: usize,
    f: impl FnOnce(&mut Rescan) -> R,
) -> R {
    let filter = serializable();
    // SAFETY: the caller holds both relations open and locked; the slot and scan are
    // released before we return, and an ERROR releases them with the transaction's
    // resources. A heap relation's slot is a BufferHeapTupleTableSlot, whose tuple
    // lives in the pinned buffer it names.
    unsafe {
        let slot = pg_sys::table_slot_create(heap_rel, std::ptr::null_mut());
        let scan_snap = if filter {
            std::ptr::addr_of_mut!(pg_sys::SnapshotAnyData)
        } else {
            snap.0
        };
        let desc = compat::index_beginscan(heap_rel, index_rel, scan_snap, nkeys as i32);
        let mut scan = Rescan {
            index_rel,
            desc,
            slot,
            snap,
            filter,
            nkeys,
        };
        let r = f(&mut scan);
        pg_sys::index_endscan(desc);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        r
    }
}

/// An index scan set up by `rescans`.
pub struct Rescan<'a> {
    index_rel: pg_sys::Relation,
    desc: pg_sys::IndexScanDesc,
    slot: *mut pg_sys::TupleTableSlot,
    snap: &'a Latest,
    filter: bool,
    nkeys: usize,
}

impl Rescan<'_> {
    /// Runs the scan from the start with `keys` (as many as the scan was set up
    /// for), handing each row visible to the snapshot to `visit` until it returns
    /// false.
    pub fn run(
        &mut self,
        keys: &[Key],
        mut visit: impl FnMut(*mut pg_sys::TupleTableSlot) -> bool,
    ) {
        assert_eq!(
            keys.len(),
            self.nkeys,
            "a rescan takes the keys it was set up for"
        );
        let mut sk = scankeys(self.index_rel, keys);
        // SAFETY: the scan and slot are live for `rescans`' call; the keys outlive the
        // rescan, which copies them.
        unsafe {
            pg_sys::index_rescan(
                self.desc,
                sk.as_mut_ptr(),
                sk.len() as i32,
                std::ptr::null_mut(),
                0,
            );
            while pg_sys::index_getnext_slot(
                self.desc,
                pg_sys::ScanDirection::ForwardScanDirection,
                self.slot,
            ) {
                // Below the executor nothing else checks: a long count (a scan of a
                // role's history) stays cancellable.
                pgrx::check_for_interrupts!();
                if self.filter && !visible_to(self.slot, self.snap) {
                    continue;
                }
                if !visit(self.slot) {
                    break;
                }
            }
        }
    }

    /// How many ledger rows `keys` select, reading up to `stop_at` of them, and their
    /// units (0.7.0: the sum of their weights).
    pub fn count_units(&mut self, keys: &[Key], stop_at: Option<i64>) -> (i64, i64) {
        let (mut n, mut units) = (0i64, 0i64);
        self.run(keys, |slot| {
            n += 1;
            units += weight_attr(slot);
            stop_at.is_none_or(|s| n < s)
        });
        (n, units)
    }
}

/// The version of `heap_rel` at `tid`, if it exists and `snap` sees it, handed to
/// `visit` in a slot: a fetch by location, where `scan_open` would walk every version
/// an index entry leads to. Not under SERIALIZABLE (None: the fetch would take a
/// predicate lock on the tuple; scan instead). A `tid` past the relation's end, or
/// naming no tuple, finds nothing. The caller holds `heap_rel` open and locked.
pub fn fetch_visible<T>(
    heap_rel: pg_sys::Relation,
    tid: pg_sys::ItemPointerData,
    snap: &Latest,
    visit: impl FnOnce(*mut pg_sys::TupleTableSlot) -> T,
) -> Option<T> {
    if serializable() {
        return None;
    }
    let mut tid = tid;
    // SAFETY: the caller holds the relation open and locked. The block number is
    // checked against the relation's length first (reading past it is an ERROR);
    // heap_fetch itself checks the offset and that the item is a tuple. The slot is
    // dropped before we return, and an ERROR releases it with the transaction.
    unsafe {
        let blocks =
            pg_sys::RelationGetNumberOfBlocksInFork(heap_rel, pg_sys::ForkNumber::MAIN_FORKNUM);
        let block = pgrx::itemptr::item_pointer_get_block_number_no_check(tid);
        if block >= blocks {
            return None;
        }
        // As an index scan's first visit to a page does (heapam_index_fetch_tuple): a
        // page whose free space ran low loses its dead versions, so that a row updated
        // over and over keeps to its page (heap_fetch never prunes).
        let buffer = pg_sys::ReadBuffer(heap_rel, block);
        pg_sys::heap_page_prune_opt(heap_rel, buffer);
        pg_sys::ReleaseBuffer(buffer);
        let slot = pg_sys::table_slot_create(heap_rel, std::ptr::null_mut());
        let found = pg_sys::table_tuple_fetch_row_version(heap_rel, &mut tid, snap.0, slot);
        let out = found.then(|| visit(slot));
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        out
    }
}

/// Whether the row version a SnapshotAny scan put in `slot` is visible to `snap`,
/// checked under a share lock on its buffer, as heap_hot_search_buffer would.
///
/// # Safety
/// `slot` holds a heap tuple in a buffer it pins (a BufferHeapTupleTableSlot).
unsafe fn visible_to(slot: *mut pg_sys::TupleTableSlot, snap: &Latest) -> bool {
    // SAFETY: per the contract above.
    unsafe {
        let bslot = slot as *mut pg_sys::BufferHeapTupleTableSlot;
        let buffer = (*bslot).buffer;
        pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
        let visible = pg_sys::HeapTupleSatisfiesVisibility((*bslot).base.tuple, snap.0, buffer);
        pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_UNLOCK as i32);
        visible
    }
}

/// The distinct values of `index`'s first column, an oid that is column `col` of
/// `heap`, among the rows visible to `snap`, smallest first, each handed to `visit`
/// with the value's first row in the index's order (0.5.1, for quota.usage_totals). A loose index scan over one scan descriptor: from
/// each value it steps on through the index, and only where a value has more than
/// `STEPS` entries does it descend again, past that value. So a value with one entry
/// costs one step, and one with millions a descent (a descent per value reads its whole
/// leaf page, and cost four times as much with 100,000 roles of one ticket each).
/// Visibility as in `scan_open`. The caller holds locks on both relations.
pub fn distinct_oids(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    col: usize,
    snap: &Latest,
    mut visit: impl FnMut(pg_sys::Oid, *mut pg_sys::TupleTableSlot),
) {
    const STEPS: u32 = 16;
    let filter = serializable();
    // SAFETY: the caller holds locks on both relations; the slot and scan are released
    // before we return, and an ERROR releases them with the transaction's resources.
    unsafe {
        let heap_rel = pg_sys::table_open(heap, pg_sys::NoLock as i32);
        let index_rel = pg_sys::index_open(index, pg_sys::NoLock as i32);
        let mut sk = scankeys(index_rel, &[Key::OidGreater(pg_sys::InvalidOid)]);
        let slot = pg_sys::table_slot_create(heap_rel, std::ptr::null_mut());
        let scan_snap = if filter {
            std::ptr::addr_of_mut!(pg_sys::SnapshotAnyData)
        } else {
            snap.0
        };
        let desc = compat::index_beginscan(heap_rel, index_rel, scan_snap, 1);
        let mut current = None;
        let mut after = pg_sys::InvalidOid;
        'descend: loop {
            // The rescan copies the key, so changing its argument between rescans is
            // how a descent starts past the last value.
            sk[0].sk_argument = after.into();
            pg_sys::index_rescan(desc, sk.as_mut_ptr(), 1, std::ptr::null_mut(), 0);
            let mut steps = 0;
            loop {
                pgrx::check_for_interrupts!();
                if !pg_sys::index_getnext_slot(
                    desc,
                    pg_sys::ScanDirection::ForwardScanDirection,
                    slot,
                ) {
                    break 'descend;
                }
                let Some(oid) = attr(slot, col as i32).map(|d| pg_sys::Oid::from(d.value() as u32))
                else {
                    continue;
                };
                // A version invisible to `snap` (SERIALIZABLE's SnapshotAny scan) is
                // never a new value; it counts as a step only if it is of the current
                // value, already visited: a descent starts past that value, so it always
                // gets further than the last one (counting other invisible versions as
                // steps descended past the current value again and again, for good).
                if filter && !visible_to(slot, snap) {
                    if current == Some(oid) {
                        steps += 1;
                        if steps >= STEPS {
                            after = oid;
                            continue 'descend;
                        }
                    }
                    continue;
                }
                if current != Some(oid) {
                    current = Some(oid);
                    visit(oid, slot);
                    steps = 0;
                    continue;
                }
                steps += 1;
                if steps >= STEPS {
                    after = oid;
                    continue 'descend;
                }
            }
        }
        pg_sys::index_endscan(desc);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_close(index_rel, pg_sys::NoLock as i32);
        pg_sys::table_close(heap_rel, pg_sys::NoLock as i32);
    }
}

/// Every version of every row of `heap` that `keys` select on `index`, whatever its
/// visibility (SnapshotAny, which takes no predicate lock), that was inserted as a new
/// row (not as an UPDATE's new version) by a transaction not known to have committed,
/// handed to `visit` with that transaction's id, until `visit` returns false. For
/// finding rows that transactions still in progress inserted: the caller asks whether
/// the id is still running (a version whose xmin is hinted committed, or frozen, is
/// skipped here, so that an old frozen id is never taken for a running one).
pub fn scan_any(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    keys: &[Key],
    mut visit: impl FnMut(*mut pg_sys::TupleTableSlot, pg_sys::TransactionId) -> bool,
) {
    let mut locks = Locks::new();
    locks.take(index, pg_sys::AccessShareLock);
    // SAFETY: the caller holds a lock on the heap, and `locks` one on the index; the
    // slot and scan are released before we return. A heap relation's slot is a
    // BufferHeapTupleTableSlot, whose tuple lives in the buffer it pins; its header is
    // read under a share lock on that buffer.
    unsafe {
        let heap_rel = pg_sys::table_open(heap, pg_sys::NoLock as i32);
        let index_rel = pg_sys::index_open(index, pg_sys::NoLock as i32);
        let mut sk = scankeys(index_rel, keys);
        let slot = pg_sys::table_slot_create(heap_rel, std::ptr::null_mut());
        let desc = compat::index_beginscan(
            heap_rel,
            index_rel,
            std::ptr::addr_of_mut!(pg_sys::SnapshotAnyData),
            sk.len() as i32,
        );
        pg_sys::index_rescan(
            desc,
            sk.as_mut_ptr(),
            sk.len() as i32,
            std::ptr::null_mut(),
            0,
        );
        while pg_sys::index_getnext_slot(desc, pg_sys::ScanDirection::ForwardScanDirection, slot) {
            let bslot = slot as *mut pg_sys::BufferHeapTupleTableSlot;
            let buffer = (*bslot).buffer;
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
            let header = (*(*bslot).base.tuple).t_data;
            let xmin = (*header).t_choice.t_heap.t_xmin;
            let infomask = u32::from((*header).t_infomask);
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_UNLOCK as i32);
            let inserted = infomask & pg_sys::HEAP_UPDATED == 0;
            let known_committed = infomask & pg_sys::HEAP_XMIN_COMMITTED != 0;
            if !inserted || known_committed {
                continue;
            }
            if !visit(slot, xmin) {
                break;
            }
        }
        pg_sys::index_endscan(desc);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_close(index_rel, pg_sys::NoLock as i32);
        pg_sys::table_close(heap_rel, pg_sys::NoLock as i32);
    }
}

/// The units (0.7.0: the sum of their weights, see `weight_attr`) of the ledger rows
/// that `keys` select.
pub fn units(heap: pg_sys::Oid, index: pg_sys::Oid, snap: &Latest, keys: &[Key]) -> i64 {
    let mut n = 0i64;
    scan(heap, index, snap, keys, |slot| {
        n += weight_attr(slot);
        true
    });
    n
}

/// Column `attno` of the tuple in `slot`, or None if NULL.
pub fn attr(slot: *mut pg_sys::TupleTableSlot, attno: i32) -> Option<pg_sys::Datum> {
    // SAFETY: the slot holds a tuple of the scanned heap, which has at least `attno`
    // columns; slot_getsomeattrs_int deforms up to it.
    unsafe {
        pg_sys::slot_getsomeattrs_int(slot, attno);
        let i = (attno - 1) as usize;
        (!*(*slot).tts_isnull.add(i)).then(|| *(*slot).tts_values.add(i))
    }
}

/// The weight of the ledger tuple in `slot` (0.7.0): its weight column, NULL for 1,
/// and 1 where the table has no such column (an older schema). A value outside the
/// range start() accepts (a superuser's SQL past the table's check) counts as the
/// nearest bound, never as nothing or less.
pub fn weight_attr(slot: *mut pg_sys::TupleTableSlot) -> i64 {
    // SAFETY: the slot's descriptor is the scanned heap's.
    let natts = unsafe { (*(*slot).tts_tupleDescriptor).natts } as usize;
    if natts < crate::ledger::COL_WEIGHT {
        return 1;
    }
    attr(slot, crate::ledger::COL_WEIGHT as i32).map_or(1, |d| {
        i64::from(d.value() as i32).clamp(1, crate::core::MAX_WEIGHT)
    })
}

/// A text datum (palloc'd) holding `bytes`, which are in the server encoding.
pub fn text_datum(bytes: &[u8]) -> pg_sys::Datum {
    // SAFETY: copies the bytes; a label or key is far below the 1 GB text limit.
    pg_sys::Datum::from(unsafe {
        pg_sys::cstring_to_text_with_len(bytes.as_ptr().cast(), bytes.len() as i32)
    })
}

/// The bytes of a text column of the tuple in `slot` (in the server encoding), or None
/// if NULL.
pub fn text_attr(slot: *mut pg_sys::TupleTableSlot, col: usize) -> Option<Vec<u8>> {
    attr(slot, col as i32).map(|d| {
        // SAFETY: a text datum of a tuple the slot pins; detoasted into a copy that we
        // read at once.
        unsafe {
            let t = pg_sys::pg_detoast_datum_packed(d.cast_mut_ptr());
            let len = pgrx::varlena::varsize_any_exhdr(t);
            let data = pgrx::varlena::vardata_any(t) as *const u8;
            std::slice::from_raw_parts(data, len).to_vec()
        }
    })
}

/// A timestamp column of the tuple in `slot`.
pub fn ts_attr(slot: *mut pg_sys::TupleTableSlot, col: usize) -> Option<pg_sys::TimestampTz> {
    attr(slot, col as i32).map(|d| d.value() as i64)
}
