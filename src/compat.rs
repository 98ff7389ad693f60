//! Layer 1: everything that differs between the PostgreSQL majors pg_quota builds for,
//! in one place, and the latch sleep that reports pg_quota's wait events. Each `cfg`
//! branch says what changed in PostgreSQL and in which release. The rest of the crate
//! calls these functions and never names a pgNN feature itself.
//!
//! Tested: 15 and 18. 16 and 17 are type-checked against pgrx's bindings of those
//! majors (see README), not run.
//!
//! Every other pg_sys item the crate uses was compared across pgrx 0.18's bindings of
//! 15, 16, 17 and 18: functions, hook types, structs and constants. These are the same
//! in all four, among them the hooks pg_quota installs (object_access_hook,
//! ProcessUtility_hook, shmem_request_hook, shmem_startup_hook) and before_shmem_exit,
//! LockAcquire, GetLatestSnapshot, heap_insert, heap_delete, index_insert, table_open,
//! systable_beginscan, RegisterDynamicBackgroundWorker and
//! BackgroundWorkerInitializeConnectionByOid. These changed in ways that need no code
//! here: GUC_UNIT_S (16) and BackendState (18, STATE_STARTING) changed values but are
//! used only by name; BackgroundWorker.bgw_library_name grew to MAXPGPATH (17) and is
//! filled by length; FormData_pg_database gained dathasloginevt (17) and is read by
//! field name; DefElem.location became ParseLoc (17) and is not read; PlannedStmt
//! gained fields (16, 18) and only its utilityStmt is read, by name; heap_form_tuple
//! takes const pointers (17); LockTagType gained a value (16). Two facts were read in PostgreSQL 18's source: backends and background
//! workers still have PGPROC numbers below MaxBackends (shmem.rs sizes its slots so),
//! and AddinShmemInitLock is still MainLWLockArray[21].

use pgrx::pg_sys;

#[cfg(not(any(feature = "pg15", feature = "pg16", feature = "pg17", feature = "pg18")))]
compile_error!("build pg_quota with one of the features pg15, pg16, pg17 or pg18");

/// Which index entries a heap update needs (PostgreSQL 16's TU_UpdateIndexes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "pg15", allow(dead_code))] // 15 never reports Summarizing
pub enum IndexUpdate {
    /// A HOT update that changed no indexed column: no index entries at all.
    None,
    /// Not HOT: every index gets an entry for the new version.
    All,
    /// A HOT update that changed only columns of summarizing indexes (BRIN): those
    /// indexes, and only those, get an entry. The new version is heap-only, so the
    /// other indexes must not point at it; they reach it through the HOT chain.
    Summarizing,
}

/// heap_update with the tuple lock and no crosscheck snapshot, reporting which index
/// entries the new version needs, as simple_heap_update and ExecUpdate use it.
///
/// # Safety
/// `rel` is open with RowExclusiveLock; `tid` names a version of it; `new_tuple` is a
/// tuple of its descriptor.
pub unsafe fn heap_update(
    rel: pg_sys::Relation,
    tid: &mut pg_sys::ItemPointerData,
    new_tuple: pg_sys::HeapTuple,
    cid: pg_sys::CommandId,
    tmfd: &mut pg_sys::TM_FailureData,
    lockmode: &mut pg_sys::LockTupleMode::Type,
) -> (pg_sys::TM_Result::Type, IndexUpdate) {
    // SAFETY: per the contract above.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            // Through 15, a BRIN index blocks HOT like any other index, so an update is
            // either HOT with no index entries or not HOT with all of them; the new
            // version's HEAP_ONLY_TUPLE bit says which (CatalogIndexInsert reads it).
            let r = pg_sys::heap_update(
                rel,
                tid,
                new_tuple,
                cid,
                std::ptr::null_mut(),
                true,
                tmfd,
                lockmode,
            );
            let hot = (*(*new_tuple).t_data).t_infomask2 as u32 & pg_sys::HEAP_ONLY_TUPLE != 0;
            (
                r,
                if hot {
                    IndexUpdate::None
                } else {
                    IndexUpdate::All
                },
            )
        }
        #[cfg(not(feature = "pg15"))]
        {
            // From 16, summarizing indexes (BRIN) no longer block
            // HOT, and heap_update reports through TU_UpdateIndexes whether the
            // HOT version still needs entries in them (TU_Summarizing).
            let mut update_indexes = pg_sys::TU_UpdateIndexes::TU_None;
            let r = pg_sys::heap_update(
                rel,
                tid,
                new_tuple,
                cid,
                std::ptr::null_mut(),
                true,
                tmfd,
                lockmode,
                &mut update_indexes,
            );
            let which = match update_indexes {
                pg_sys::TU_UpdateIndexes::TU_None => IndexUpdate::None,
                pg_sys::TU_UpdateIndexes::TU_Summarizing => IndexUpdate::Summarizing,
                _ => IndexUpdate::All,
            };
            (r, which)
        }
    }
}

/// Whether an index is summarizing (its access method's amsummarizing, BRIN's), the
/// indexes an IndexUpdate::Summarizing update inserts into.
///
/// # Safety
/// `info` is the IndexInfo of an open index.
pub unsafe fn index_is_summarizing(info: *const pg_sys::IndexInfo) -> bool {
    #[cfg(feature = "pg15")]
    {
        // Through 15 there are no summarizing updates: IndexInfo has no
        // ii_Summarizing, and heap_update never asks for them.
        let _ = info;
        false
    }
    #[cfg(not(feature = "pg15"))]
    // SAFETY: per the contract above. ii_Summarizing is new in 16.
    unsafe {
        (*info).ii_Summarizing
    }
}

/// Lets the index's access method free what its inserts cached, before the index is
/// closed, as ExecCloseIndices does.
///
/// # Safety
/// `idx` is open and `info` is its IndexInfo, which index_insert was given.
pub unsafe fn index_insert_cleanup(idx: pg_sys::Relation, info: *mut pg_sys::IndexInfo) {
    #[cfg(any(feature = "pg15", feature = "pg16"))]
    {
        // Through 16, no access method keeps state across index_insert calls.
        let _ = (idx, info);
    }
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    // SAFETY: per the contract above. From 17, BRIN's insert keeps
    // its revmap, with a pin on the metapage, in ii_AmCache until aminsertcleanup;
    // without this call the pin leaks to the end of the transaction ("resource was
    // not closed" at commit).
    unsafe {
        pg_sys::index_insert_cleanup(idx, info)
    }
}

/// Whether this transaction holds a lock on relation `relid` (of this database) in
/// exactly `mode`: C's CheckRelationLockedByMe() without the open relation, a look
/// into the backend's own lock table.
pub fn relation_lock_held(relid: pg_sys::Oid, mode: u32) -> bool {
    let tag = pg_sys::LOCKTAG {
        // SAFETY: a plain read of backend state.
        locktag_field1: u32::from(unsafe { pg_sys::MyDatabaseId }),
        locktag_field2: u32::from(relid),
        locktag_field3: 0,
        locktag_field4: 0,
        locktag_type: pg_sys::LockTagType::LOCKTAG_RELATION as u8,
        locktag_lockmethodid: pg_sys::DEFAULT_LOCKMETHOD as u8,
    };
    // SAFETY: a lookup in the backend's local lock table.
    unsafe {
        // 17 added `orstronger`; false asks for exactly `mode`, as before.
        #[cfg(any(feature = "pg15", feature = "pg16"))]
        {
            pg_sys::LockHeldByMe(&tag, mode as i32)
        }
        #[cfg(any(feature = "pg17", feature = "pg18"))]
        {
            pg_sys::LockHeldByMe(&tag, mode as i32, false)
        }
    }
}

/// Attribute `i` (0-based) of a tuple descriptor: C's TupleDescAttr().
///
/// # Safety
/// `desc` is a valid tuple descriptor with more than `i` attributes.
pub unsafe fn tuple_desc_attr(
    desc: pg_sys::TupleDesc,
    i: usize,
) -> *const pg_sys::FormData_pg_attribute {
    // SAFETY: per the contract above.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        {
            (*desc).attrs.as_ptr().add(i)
        }
        #[cfg(feature = "pg18")]
        {
            // 18 put an array of CompactAttribute first (compact_attrs) and moved the
            // full attributes behind it; only the TupleDescAttr() inline finds them
            // (pgrx binds it through its C shim).
            pg_sys::TupleDescAttr(desc, i as i32)
        }
    }
}

/// The relfilenode of an open relation.
///
/// # Safety
/// `rel` is an open relation.
pub unsafe fn relfilenode(rel: pg_sys::Relation) -> u32 {
    // SAFETY: per the contract above.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            u32::from((*rel).rd_node.relNode)
        }
        #[cfg(not(feature = "pg15"))]
        {
            // 16 renamed RelFileNode rd_node to RelFileLocator rd_locator.
            u32::from((*rel).rd_locator.relNumber)
        }
    }
}

/// Whether this transaction (or a subtransaction of it) gave `rel` a relfilenode
/// that is not committed yet, for instance by TRUNCATE.
///
/// # Safety
/// `rel` is an open relation.
pub unsafe fn has_uncommitted_relfilenode(rel: pg_sys::Relation) -> bool {
    // SAFETY: per the contract above.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            (*rel).rd_newRelfilenodeSubid != 0 || (*rel).rd_firstRelfilenodeSubid != 0
        }
        #[cfg(not(feature = "pg15"))]
        {
            // 16 renamed rd_*RelfilenodeSubid to rd_*RelfilelocatorSubid.
            (*rel).rd_newRelfilelocatorSubid != 0 || (*rel).rd_firstRelfilelocatorSubid != 0
        }
    }
}

/// Whether the current user owns database `db` (superusers own everything).
pub fn database_ownercheck(db: pg_sys::Oid) -> bool {
    // SAFETY: catalog lookups.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            pg_sys::pg_database_ownercheck(db, pg_sys::GetUserId())
        }
        #[cfg(not(feature = "pg15"))]
        {
            // 16 replaced the per-class pg_*_ownercheck functions with object_ownercheck.
            pg_sys::object_ownercheck(pg_sys::DatabaseRelationId, db, pg_sys::GetUserId())
        }
    }
}

/// index_beginscan with no ORDER BY keys and no instrumentation.
///
/// # Safety
/// Both relations are open and locked; `snapshot` is registered or static.
pub unsafe fn index_beginscan(
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    nkeys: i32,
) -> pg_sys::IndexScanDesc {
    // SAFETY: per the contract above.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        {
            pg_sys::index_beginscan(heap, index, snapshot, nkeys, 0)
        }
        #[cfg(feature = "pg18")]
        {
            // 18 added an IndexScanInstrumentation argument (EXPLAIN's index searches);
            // NULL, as systable_beginscan passes.
            pg_sys::index_beginscan(heap, index, snapshot, std::ptr::null_mut(), nkeys, 0)
        }
    }
}

/// Installs a signal handler in a background worker, as pqsignal() in C.
///
/// # Safety
/// Called in a background worker before BackgroundWorkerUnblockSignals.
pub unsafe fn pqsignal(signo: i32, handler: pg_sys::pqsigfunc) {
    // SAFETY: per the contract above.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        {
            pg_sys::pqsignal(signo, handler);
        }
        #[cfg(feature = "pg18")]
        {
            // In 18, pqsignal() became a macro for pqsignal_be() in the backend (and
            // pqsignal_fe() in frontends), so there is no pqsignal symbol to bind.
            pg_sys::pqsignal_be(signo, handler);
        }
    }
}

/// The session timeouts a background worker can inherit from `ALTER DATABASE|ROLE …
/// SET` and that would end it or its transactions: the ledger writer sets each to 0.
/// PostgreSQL 17 added transaction_timeout, which, unlike statement_timeout, is armed
/// in background workers too (StartTransaction) and ends them with FATAL.
#[cfg(any(feature = "pg15", feature = "pg16"))]
pub const SESSION_TIMEOUTS: &[&std::ffi::CStr] =
    &[c"statement_timeout", c"idle_in_transaction_session_timeout"];
#[cfg(not(any(feature = "pg15", feature = "pg16")))]
pub const SESSION_TIMEOUTS: &[&std::ffi::CStr] = &[
    c"statement_timeout",
    c"idle_in_transaction_session_timeout",
    c"transaction_timeout",
];

/// What a pg_quota process waits for, as pg_stat_activity names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// A start() waiting for its ledger writer to answer.
    WriterReply,
    /// A start() waiting for capacity (its `wait` argument).
    Capacity,
    /// A start() waiting, under its scope lock, for requests of its scope that the
    /// writer has not answered yet.
    InFlight,
    /// The ledger writer waiting for requests.
    WriterMain,
    /// A new ledger writer waiting for its predecessor to leave.
    WriterStart,
    /// DROP DATABASE waiting for the database's ledger writer to be gone.
    WriterExit,
}

/// The wait event to report for `w`. From PostgreSQL 17 each has a name of its own
/// in pg_stat_activity (WaitEventExtensionNew; wait_event_type "Extension"), so that a
/// DBA tells a quota wait from any other; through 16 all are "Extension".
pub fn wait_event(w: Wait) -> u32 {
    #[cfg(any(feature = "pg15", feature = "pg16"))]
    {
        let _ = w;
        pg_sys::PG_WAIT_EXTENSION
    }
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    {
        const NAMES: [(Wait, &std::ffi::CStr); 6] = [
            (Wait::WriterReply, c"QuotaWriterReply"),
            (Wait::Capacity, c"QuotaCapacity"),
            (Wait::InFlight, c"QuotaInFlight"),
            (Wait::WriterMain, c"QuotaWriterMain"),
            (Wait::WriterStart, c"QuotaWriterStart"),
            (Wait::WriterExit, c"QuotaWriterExit"),
        ];
        // Backend-local cache of the ids the shared registry gave out: a lookup there
        // takes a lock, and a backend runs one thread.
        static mut IDS: [u32; 6] = [0; 6];
        let k = NAMES
            .iter()
            .position(|(n, _)| *n == w)
            .expect("every wait is named");
        // SAFETY: single-threaded backend state; WaitEventExtensionNew returns the same
        // id for the same name in every process (a shared hash table).
        unsafe {
            if IDS[k] == 0 {
                IDS[k] = pg_sys::WaitEventExtensionNew(NAMES[k].1.as_ptr());
            }
            IDS[k]
        }
    }
}

/// Sleeps up to `ms` milliseconds on our latch, reporting `wait` meanwhile, then checks
/// for interrupts. Returns true if the time ran out, false if the latch was set.
pub fn nap(ms: i64, wait: Wait) -> bool {
    // SAFETY: our own latch; WL_EXIT_ON_PM_DEATH ends us with the postmaster.
    let rc = unsafe {
        let rc = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            ms,
            wait_event(wait),
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        rc
    };
    pgrx::check_for_interrupts!();
    rc & pg_sys::WL_TIMEOUT as i32 != 0
}

/// The GUC record of setting `name`, or null if there is none. PostgreSQL 16 made
/// find_option() public and keeps the records in a hash table; 15 has only the sorted
/// array of get_guc_variables(). A record is never freed once defined.
pub fn guc_record(name: &std::ffi::CStr) -> *mut pg_sys::config_generic {
    // SAFETY: reads of the GUC tables of this process; the names are NUL-terminated.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            let vars = pg_sys::get_guc_variables();
            let n = pg_sys::GetNumConfigOptions().max(0) as usize;
            (0..n)
                .map(|i| *vars.add(i))
                .find(|&r| {
                    !r.is_null()
                        && std::ffi::CStr::from_ptr((*r).name)
                            .to_bytes()
                            .eq_ignore_ascii_case(name.to_bytes())
                })
                .unwrap_or(std::ptr::null_mut())
        }
        #[cfg(not(feature = "pg15"))]
        {
            pg_sys::find_option(name.as_ptr(), false, true, pg_sys::DEBUG1 as i32)
        }
    }
}

/// Whether `role` may EXECUTE function `func` (pg_proc_aclcheck through 15,
/// object_aclcheck from 16).
pub fn may_execute(func: pg_sys::Oid, role: pg_sys::Oid) -> bool {
    #[cfg(feature = "pg15")]
    // SAFETY: an ACL lookup through the syscache; a missing function raises ERROR.
    let r = unsafe { pg_sys::pg_proc_aclcheck(func, role, pg_sys::ACL_EXECUTE as pg_sys::AclMode) };
    #[cfg(not(feature = "pg15"))]
    // SAFETY: as above; object_aclcheck replaced pg_proc_aclcheck in 16.
    let r = unsafe {
        pg_sys::object_aclcheck(
            pg_sys::ProcedureRelationId,
            func,
            role,
            pg_sys::ACL_EXECUTE as pg_sys::AclMode,
        )
    };
    r == pg_sys::AclResult::ACLCHECK_OK
}
