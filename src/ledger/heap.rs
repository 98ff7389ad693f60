//! Layer 3, the ledger: writing pg_quota's tables directly through the heap and index
//! access methods, the way PostgreSQL's catalog code writes catalog rows: an SQL
//! statement would build and tear down an executor for each one-row change, which cost
//! more than the change.
//!
//! Only pg_quota's own code reaches these writes, so no privilege check applies, and
//! no SQL is involved, so the search_path cannot affect them (I5). CHECK constraints
//! are not evaluated here: the pure core validates what goes into each column.

use pgrx::pg_sys;

use crate::compat::{self, IndexUpdate};

/// Each index of a table that takes inserts, its IndexInfo, and its predicate as
/// indexes::null_tests gives it (empty for a full index).
pub type Indexes = Vec<(pg_sys::Relation, *mut pg_sys::IndexInfo, Vec<(usize, bool)>)>;

/// A table opened for writing, and its indexes once a write needs them; closed on
/// drop, keeping the locks to the end of the transaction as the executor does.
pub struct OpenRel {
    pub heap: pg_sys::Relation,
    /// The indexes that take inserts, opened at the first insert or update: a delete
    /// needs none, as DELETE opens none (0.6.x: a finish deletes its ticket from
    /// quota.active, whose indexes a transactional ticket's finish locked and opened
    /// for nothing).
    indexes: std::cell::OnceCell<Indexes>,
    /// Indexes opened alone for a lookup (`index`) before the others were needed.
    looked_up: std::cell::RefCell<Vec<pg_sys::Relation>>,
    /// For the error that names the table.
    name: String,
    key_col: usize,
    /// The memory context the table was opened in, which the indexes' IndexInfo must
    /// live in too, however later they are opened.
    context: pg_sys::MemoryContext,
    ncols: usize,
}

impl OpenRel {
    /// Opens `relid` and its indexes with RowExclusiveLock, what INSERT, UPDATE and
    /// DELETE take, each lock with a bounded wait (see locks::lock_bounded) and every
    /// one taken here, before any row is written. `key_col` is the table's identity
    /// column (the ledger's id, the summary's role), the only column a unique index
    /// may cover.
    pub fn open(relid: pg_sys::Oid, name: &str, key_col: usize) -> OpenRel {
        let rel = OpenRel::open_lazy(relid, name, key_col);
        rel.indexes();
        rel
    }

    /// `open`, but the indexes are opened only when a write first needs them, which a
    /// table that only sees deletes never does (0.6.x: quota.active when a ticket
    /// ends). A write that needs them opens them before it writes its row.
    pub fn open_lazy(relid: pg_sys::Oid, name: &str, key_col: usize) -> OpenRel {
        crate::ledger::locks::lock_bounded(relid, pg_sys::RowExclusiveLock);
        // The lock processed invalidations: make sure the table still has the shape
        // and membership pg_quota checked.
        crate::ledger::rels::rels();
        // SAFETY: the relation exists and is locked.
        unsafe {
            let heap = pg_sys::table_open(relid, pg_sys::NoLock as i32);
            let ncols = (*(*heap).rd_att).natts as usize;
            OpenRel {
                heap,
                indexes: std::cell::OnceCell::new(),
                looked_up: std::cell::RefCell::new(Vec::new()),
                name: name.to_string(),
                key_col,
                context: pg_sys::CurrentMemoryContext,
                ncols,
            }
        }
    }

    /// The indexes that take inserts, opened with RowExclusiveLock (bounded waits) at
    /// the first call, each checked to be one pg_quota can keep up to date (else
    /// 0A000, naming it).
    ///
    /// As ExecOpenIndices and CatalogIndexInsert do, indexes that are not ready for
    /// inserts (`indisready = false`: a CREATE INDEX or REINDEX CONCURRENTLY in its
    /// first phase, or an index being dropped) get no entries: their storage may not
    /// exist yet, and the concurrent build adds our rows itself. Indexes that are
    /// ready but not valid (a build that was cancelled) do get entries.
    pub fn indexes(&self) -> &Indexes {
        self.indexes.get_or_init(|| self.open_indexes())
    }

    fn open_indexes(&self) -> Indexes {
        struct Restore(pg_sys::MemoryContext);
        impl Drop for Restore {
            fn drop(&mut self) {
                // SAFETY: puts back the context current before `open_indexes`.
                unsafe { pg_sys::CurrentMemoryContext = self.0 };
            }
        }
        let (heap, key_col) = (self.heap, self.key_col);
        // SAFETY: the table is open and locked, and `context` (current when it was
        // opened) outlives it; the index list comes from the relcache, and each index
        // is locked before it is opened.
        unsafe {
            let _restore = Restore(pg_sys::CurrentMemoryContext);
            pg_sys::CurrentMemoryContext = self.context;
            let list = pg_sys::RelationGetIndexList(heap);
            let n = if list.is_null() {
                0
            } else {
                (*list).length as usize
            };
            let mut indexes = Vec::with_capacity(n);
            for i in 0..n {
                let oid = (*(*list).elements.add(i)).oid_value;
                crate::ledger::locks::lock_bounded(oid, pg_sys::RowExclusiveLock);
                let idx = pg_sys::index_open(oid, pg_sys::NoLock as i32);
                let info = pg_sys::BuildIndexInfo(idx);
                let predicate = check_index(idx, info, key_col);
                if let Err(e) = predicate {
                    pg_sys::index_close(idx, pg_sys::NoLock as i32);
                    let table = format!("quota.{}", self.name);
                    let index = crate::catalog::name_text(pg_sys::get_rel_name(oid));
                    crate::error::raise(crate::core::QuotaError::UnsupportedIndex {
                        table,
                        index,
                        what: e,
                    });
                }
                if !(*info).ii_ReadyForInserts {
                    pg_sys::index_close(idx, pg_sys::NoLock as i32);
                    continue;
                }
                indexes.push((idx, info, predicate.unwrap_or_default()));
            }
            indexes
        }
    }

    /// Index `oid` of this table, open for a lookup: one of `indexes` if they are open,
    /// else opened alone, with the lock they take, and kept open with the table.
    pub fn index(&self, oid: pg_sys::Oid) -> pg_sys::Relation {
        // SAFETY: open relations; rd_id is their OID.
        let is = |idx: pg_sys::Relation| unsafe { (*idx).rd_id } == oid;
        if let Some(indexes) = self.indexes.get() {
            return indexes
                .iter()
                .find(|&&(idx, _, _)| is(idx))
                .map(|&(idx, _, _)| idx)
                .unwrap_or_else(|| pgrx::error!("pg_quota: index {} is not open", u32::from(oid)));
        }
        let mut looked_up = self.looked_up.borrow_mut();
        if let Some(&idx) = looked_up.iter().find(|&&idx| is(idx)) {
            return idx;
        }
        crate::ledger::locks::lock_bounded(oid, pg_sys::RowExclusiveLock);
        // SAFETY: locked above; closed (the lock kept) when the table is. rd_index is
        // set for an index relation.
        let idx = unsafe { pg_sys::index_open(oid, pg_sys::NoLock as i32) };
        looked_up.push(idx);
        // As the set of the table's own indexes vouched for it: an index of this table.
        if unsafe { (*(*idx).rd_index).indrelid != (*self.heap).rd_id } {
            pgrx::error!(
                "pg_quota: index {} is not one of quota.{}",
                u32::from(oid),
                self.name
            );
        }
        idx
    }

    /// Deletes the version at `tid`, waiting for a concurrent writer of the same row
    /// to commit or abort first. Index entries are left to VACUUM, as for any delete.
    pub fn delete(&self, mut tid: pg_sys::ItemPointerData) -> pg_sys::TM_Result::Type {
        // SAFETY: the relation is open with RowExclusiveLock; heap_delete WAL-logs the
        // change and takes the tuple lock.
        unsafe {
            let mut tmfd: pg_sys::TM_FailureData = std::mem::zeroed();
            pg_sys::heap_delete(
                self.heap,
                &mut tid,
                pg_sys::GetCurrentCommandId(true),
                std::ptr::null_mut(),
                true,
                &mut tmfd,
                false,
            )
        }
    }

    /// Locks the row version at `tid` for update unless another transaction holds or
    /// awaits a conflicting lock on it (SKIP LOCKED): true if we now hold the lock, so
    /// that `update` of that version cannot wait for anyone. heap_update itself has no
    /// such mode (it asserts that callers wait), so the writer locks first, as
    /// SELECT … FOR UPDATE SKIP LOCKED does, and never waits for a caller's open
    /// transaction. False too if the version was updated or deleted meanwhile.
    pub fn lock_nowait(&self, tid: pg_sys::ItemPointerData) -> bool {
        // SAFETY: the relation is open with RowExclusiveLock; heap_lock_tuple fills
        // `tuple` and pins `buffer`, which we release.
        unsafe {
            let mut tuple: pg_sys::HeapTupleData = std::mem::zeroed();
            tuple.t_self = tid;
            let mut buffer: pg_sys::Buffer = 0;
            let mut tmfd: pg_sys::TM_FailureData = std::mem::zeroed();
            let r = pg_sys::heap_lock_tuple(
                self.heap,
                &mut tuple,
                pg_sys::GetCurrentCommandId(true),
                // Exclusive, as a delete needs (0.6.0: the sweep's end of a ticket is a
                // delete from quota.active); more than an update needs, never less.
                pg_sys::LockTupleMode::LockTupleExclusive,
                pg_sys::LockWaitPolicy::LockWaitSkip,
                false,
                &mut buffer,
                &mut tmfd,
            );
            if buffer != 0 {
                pg_sys::ReleaseBuffer(buffer);
            }
            r == pg_sys::TM_Result::TM_Ok
        }
    }

    /// Forms a tuple of this table from `values` and `nulls` (one per column).
    pub fn form(&self, values: &mut [pg_sys::Datum], nulls: &mut [bool]) -> pg_sys::HeapTuple {
        assert_eq!(values.len(), self.ncols);
        assert_eq!(nulls.len(), self.ncols);
        // SAFETY: the arrays match the tuple descriptor's width; values are copied.
        unsafe {
            pg_sys::heap_form_tuple((*self.heap).rd_att, values.as_mut_ptr(), nulls.as_mut_ptr())
        }
    }

    /// Inserts a new row and its index entries.
    pub fn insert(&self, values: &mut [pg_sys::Datum], nulls: &mut [bool]) {
        self.insert_tuple(self.form(values, nulls));
    }

    /// Inserts `tuple` (formed by `form`) and its index entries, and frees it.
    pub fn insert_tuple(&self, tuple: pg_sys::HeapTuple) {
        // Opened (and locked) before the row is written, where they were not yet.
        self.indexes();
        // SAFETY: the relation is open with RowExclusiveLock; heap_insert WAL-logs the
        // row and sets its t_self, which the index entries point to.
        unsafe {
            pg_sys::heap_insert(
                self.heap,
                tuple,
                pg_sys::GetCurrentCommandId(true),
                0,
                std::ptr::null_mut(),
            );
            self.insert_index_entries(tuple, &[], false);
            pg_sys::heap_freetuple(tuple);
        }
    }

    /// Replaces the version at `tid` with `new_tuple`, waiting for a concurrent writer
    /// of the same row to commit or abort first, and adds the new version's index
    /// entries where heap_update says they are needed: none after a HOT update; only
    /// the summarizing (BRIN) indexes' after a HOT update that changed a column only
    /// they cover (PostgreSQL 16+, see compat::IndexUpdate); every index's otherwise.
    /// This is what simple_heap_update plus CatalogIndexInsert, and ExecUpdate plus
    /// ExecInsertIndexTuples(onlySummarizing), do. `changed` lists the 1-based columns
    /// that may differ, for the indexes' bottom-up deletion hint. Frees `new_tuple`.
    pub fn update(
        &self,
        tid: pg_sys::ItemPointerData,
        new_tuple: pg_sys::HeapTuple,
        changed: &[usize],
    ) -> pg_sys::TM_Result::Type {
        self.update_at(tid, new_tuple, changed).0
    }

    /// `update`, also returning where the new version went (meaningful on TM_Ok only).
    pub fn update_at(
        &self,
        mut tid: pg_sys::ItemPointerData,
        new_tuple: pg_sys::HeapTuple,
        changed: &[usize],
    ) -> (pg_sys::TM_Result::Type, pg_sys::ItemPointerData) {
        // Opened (and locked) before the row is written, where they were not yet.
        self.indexes();
        // SAFETY: the relation is open with RowExclusiveLock; heap_update WAL-logs the
        // change, takes the tuple lock, and checks SSI conflicts. No crosscheck
        // snapshot: callers act on the latest committed version.
        unsafe {
            let mut tmfd: pg_sys::TM_FailureData = std::mem::zeroed();
            let mut lockmode: pg_sys::LockTupleMode::Type = 0;
            let cid = pg_sys::GetCurrentCommandId(true);
            let (result, which) = compat::heap_update(
                self.heap,
                &mut tid,
                new_tuple,
                cid,
                &mut tmfd,
                &mut lockmode,
            );
            if result == pg_sys::TM_Result::TM_Ok {
                match which {
                    IndexUpdate::None => {}
                    IndexUpdate::All => self.insert_index_entries(new_tuple, changed, false),
                    IndexUpdate::Summarizing => self.insert_index_entries(new_tuple, changed, true),
                }
            }
            let at = (*new_tuple).t_self;
            pg_sys::heap_freetuple(new_tuple);
            (result, at)
        }
    }

    /// Inserts the index entries of a tuple just stored in the heap into every index,
    /// or, with `only_summarizing`, into the summarizing ones only (a HOT version,
    /// which the other indexes reach through its chain's root).
    unsafe fn insert_index_entries(
        &self,
        tuple: pg_sys::HeapTuple,
        changed: &[usize],
        only_summarizing: bool,
    ) {
        let indexes = self.indexes();
        if indexes.is_empty() {
            return;
        }
        // SAFETY: the caller passes a tuple just stored in our heap, so t_self is set;
        // every index was checked in `open` to be on plain columns.
        unsafe {
            let mut values = vec![pg_sys::Datum::from(0); self.ncols];
            let mut nulls = vec![false; self.ncols];
            pg_sys::heap_deform_tuple(
                tuple,
                (*self.heap).rd_att,
                values.as_mut_ptr(),
                nulls.as_mut_ptr(),
            );
            for (idx, info, predicate) in indexes {
                let (idx, info) = (*idx, *info);
                if only_summarizing && !compat::index_is_summarizing(info) {
                    continue;
                }
                // A partial index takes the rows its predicate accepts, as
                // ExecInsertIndexTuples checks ii_Predicate.
                if !predicate
                    .iter()
                    .all(|&(col, is_null)| nulls[col - 1] == is_null)
                {
                    continue;
                }
                let natts = (*info).ii_NumIndexAttrs as usize;
                let mut ivalues = [pg_sys::Datum::from(0); pg_sys::INDEX_MAX_KEYS as usize];
                let mut inulls = [false; pg_sys::INDEX_MAX_KEYS as usize];
                let mut unchanged = !changed.is_empty();
                for k in 0..natts {
                    let attno = (*info).ii_IndexAttrNumbers[k] as usize;
                    ivalues[k] = values[attno - 1];
                    inulls[k] = nulls[attno - 1];
                    unchanged &= !changed.contains(&attno);
                }
                // check_index admitted only immediate unique indexes on the key.
                let unique = if (*(*idx).rd_index).indisunique {
                    pg_sys::IndexUniqueCheck::UNIQUE_CHECK_YES
                } else {
                    pg_sys::IndexUniqueCheck::UNIQUE_CHECK_NO
                };
                pg_sys::index_insert(
                    idx,
                    ivalues.as_mut_ptr(),
                    inulls.as_mut_ptr(),
                    &mut (*tuple).t_self,
                    self.heap,
                    unique,
                    unchanged,
                    info,
                );
            }
        }
    }
}

/// Why pg_quota cannot keep index `idx` up to date, if it cannot; else the index's
/// predicate (indexes::null_tests). We form index entries from plain columns only, and
/// evaluate only predicates of IS NULL and IS NOT NULL tests on columns (0.5.0's own
/// partial indexes); a unique index on anything but the table's key would let one
/// tenant's row fail another tenant's charge (or, deferred, not be checked at all);
/// exclusion constraints are not checked by plain index inserts.
///
/// # Safety
/// `idx` is an open index and `info` its IndexInfo.
unsafe fn check_index(
    idx: pg_sys::Relation,
    info: *mut pg_sys::IndexInfo,
    key_col: usize,
) -> Result<Vec<(usize, bool)>, &'static str> {
    // SAFETY: per the contract above.
    unsafe {
        let ix = &*(*idx).rd_index;
        if !pg_sys::RelationGetIndexExpressions(idx).is_null() {
            return Err("the expression index");
        }
        let Some(predicate) = crate::ledger::indexes::null_tests(idx) else {
            return Err("the partial index");
        };
        if ix.indisexclusion || !(*info).ii_ExclusionOps.is_null() {
            return Err("the exclusion constraint");
        }
        if ix.indisunique {
            let on_key = ix.indnkeyatts == 1 && *ix.indkey.values.as_ptr() as usize == key_col;
            if !on_key || !ix.indimmediate || !predicate.is_empty() {
                return Err("the unique index");
            }
        }
        Ok(predicate)
    }
}

impl Drop for OpenRel {
    fn drop(&mut self) {
        // SAFETY: opened in `open`; NoLock keeps the locks to the end of the
        // transaction. As ExecCloseIndices, the access method frees what its inserts
        // cached first.
        unsafe {
            for &(idx, info, _) in self.indexes.get().into_iter().flatten() {
                compat::index_insert_cleanup(idx, info);
                pg_sys::index_close(idx, pg_sys::NoLock as i32);
            }
            for &idx in self.looked_up.borrow().iter() {
                pg_sys::index_close(idx, pg_sys::NoLock as i32);
            }
            pg_sys::table_close(self.heap, pg_sys::NoLock as i32);
        }
    }
}
