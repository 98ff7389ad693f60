//! Finding pg_quota's relations and counting a scope's tickets with direct index scans
//! under the latest snapshot.
//!
//! Admission runs on every start(), including every refusal, so it must be cheap: an
//! SPI query would build and tear down an executor tree each time. Instead we probe
//! the indexes directly, as PostgreSQL's own catalog code does with systable scans.
//!
//! Three rules hold for every read here:
//! - **Not redirectable (I5).** Relations are found by name in schema `quota`, and
//!   each must be a member of extension pg_quota with the columns pg_quota writes.
//!   Anything else (a renamed schema with look-alike tables in its place, a column
//!   dropped by hand) is an error, never a crash.
//! - **No SSI (I3).** Under SERIALIZABLE, a scan with an MVCC snapshot takes
//!   predicate locks and checks rw-conflicts, so two sessions that each start and
//!   finish in one SERIALIZABLE transaction would fail each other with 40001. There we
//!   scan with SnapshotAny, which predicate locking ignores, and decide visibility
//!   ourselves against the latest snapshot (see `scan_open`). pg_quota's reads then take
//!   no predicate locks, and the caller's own statements keep full SERIALIZABLE
//!   semantics.
//! - **Bounded lock waits.** A caller never queues without bound behind maintenance
//!   (VACUUM FULL, REINDEX, CLUSTER): every lock is taken with a bounded wait, and the
//!   read locks of start() are released as soon as its reads are done.

use std::time::Duration;

use pgrx::pg_sys;

use crate::compat;
use crate::core::lease::Lapsed;
use crate::core::QuotaError;
use crate::error::raise;

/// Ledger columns, 1-based, as created by sql/schema.sql.
pub const COL_ID: usize = 1;
pub const COL_ROLE: usize = 2;
pub const COL_LABEL: usize = 3;
pub const COL_STARTED_AT: usize = 4;
pub const COL_ENDED_AT: usize = 5;
pub const COL_OUTCOME: usize = 6;
/// Columns added by 0.2.0 (sql/pg_quota--0.1.1--0.2.0.sql appends them).
pub const COL_LEASE_UNTIL: usize = 7;
pub const COL_KEY: usize = 8;
pub const COL_PID: usize = 9;
/// The ledger's columns in the schemas of 0.1.x and of 0.2.0.
pub const NCOLS_V1: usize = 6;
pub const NCOLS_V2: usize = 9;

/// How long a caller waits for a lock on one of pg_quota's relations before it gives
/// up with 55P03 (or the session's lock_timeout, if shorter).
pub const LOCK_WAIT: Duration = Duration::from_secs(5);

/// The OIDs of pg_quota's relations in this database, and the valid indexes that
/// serve its scans. Indexes are chosen by what they index, not by name, so that
/// REINDEX CONCURRENTLY (which swaps names) and renames do not matter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rels {
    pub ledger: pg_sys::Oid,
    /// A valid btree index whose first column is the ledger's id.
    pub ledger_pkey: pg_sys::Oid,
    /// A valid btree index on (role, ended_at, …); from 0.2.0 on (role, ended_at,
    /// lease_until, …), so that a role's active tickets whose lease ran out are one
    /// probe away.
    pub ledger_idx: pg_sys::Oid,
    /// 0.2.0: a valid btree index on (ended_at, lease_until, …): the database's active
    /// tickets (the database cap) and its leases that ran out (the expiry sweep).
    /// InvalidOid with an older schema.
    pub ledger_open_idx: pg_sys::Oid,
    /// 0.2.0: a valid btree index on (role, idempotency_key, …). InvalidOid with an
    /// older schema.
    pub ledger_key_idx: pg_sys::Oid,
    /// The ledger's column count: NCOLS_V1 (0.1.x's schema, still in place until
    /// ALTER EXTENSION pg_quota UPDATE) or NCOLS_V2.
    pub ncols: usize,
    pub summary: pg_sys::Oid,
    /// A valid btree index whose first column is the summary's role.
    pub summary_idx: pg_sys::Oid,
    /// Whether the scope counters may be used: only when the triggers that mark them
    /// stale after SQL-level writes to the ledger exist and fire always (0.1.0's schema
    /// has none; a DBA may disable them, and session_replication_role = replica skips
    /// triggers that are not ENABLE ALWAYS).
    pub counters_ok: bool,
}

impl Rels {
    /// Whether the database has 0.2.0's schema (leases, idempotency keys, pids).
    pub fn v2(&self) -> bool {
        self.ncols == NCOLS_V2
    }

    /// Raises the clear error of a 0.2.0 feature used on an older schema.
    pub fn require_v2(&self, feature: &'static str) {
        if !self.v2() {
            raise(QuotaError::NeedsUpdate {
                feature,
                needs: "0.2.0",
            });
        }
    }
}

// Backend-local cache of `Rels`, cleared by relcache invalidations of any of them.
// A backend runs one thread, so plain statics suffice.
static mut CACHED: Option<Rels> = None;
static mut CALLBACK_REGISTERED: bool = false;

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn relcache_changed(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // SAFETY: single-threaded backend state.
    unsafe {
        if let Some(r) = CACHED {
            let ours = [
                r.ledger,
                r.ledger_pkey,
                r.ledger_idx,
                r.ledger_open_idx,
                r.ledger_key_idx,
                r.summary,
                r.summary_idx,
            ];
            if relid == pg_sys::InvalidOid || ours.contains(&relid) {
                CACHED = None;
            }
        }
    }
}

/// Locks `relid` in `mode`, waiting at most LOCK_WAIT (or lock_timeout, if shorter).
/// The wait is an ordinary lock wait, so it shows in pg_locks and pg_stat_activity and
/// the deadlock detector sees it; only its length is bounded, by lowering
/// lock_timeout for the duration of the wait. A caller that queues behind a VACUUM
/// FULL waiting for someone else thus gets 55P03 after a few seconds, naming the table.
pub fn lock_bounded(relid: pg_sys::Oid, mode: u32) {
    // SAFETY: a plain lock request; it processes invalidations once granted.
    if unsafe { pg_sys::ConditionalLockRelationOid(relid, mode as i32) } {
        return;
    }
    // SAFETY: a syscache lookup, made before we wait so that the error path needs none.
    let name = unsafe {
        let p = pg_sys::get_rel_name(relid);
        if p.is_null() {
            u32::from(relid).to_string()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    struct Restore(i32);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts back the session's own setting.
            unsafe { pg_sys::LockTimeout = self.0 };
        }
    }
    // SAFETY: the GUC variable behind lock_timeout (milliseconds, 0 = off), read by
    // the lock manager when it starts to wait; restored right after the wait.
    let session = unsafe { pg_sys::LockTimeout };
    let bound = LOCK_WAIT.as_millis() as i32;
    let limit = if session > 0 {
        session.min(bound)
    } else {
        bound
    };
    let _restore = Restore(session);
    // SAFETY: as above.
    unsafe { pg_sys::LockTimeout = limit };
    pgrx::PgTryBuilder::new(|| {
        // SAFETY: an ordinary lock wait; cancel and statement_timeout still apply.
        unsafe { pg_sys::LockRelationOid(relid, mode as i32) }
    })
    .catch_when(pgrx::PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, |_| {
        // The transaction is aborted by this ERROR, which also takes us out of the
        // lock's wait queue.
        raise(QuotaError::LockTimeout {
            relation: format!("quota.{name}"),
            seconds: i64::from((limit / 1000).max(1)),
        })
    })
    .execute();
}

/// Relation locks taken with `lock_bounded` and released when dropped (or kept to the
/// end of the transaction, for write locks, as the executor keeps them).
pub struct Locks {
    held: Vec<(pg_sys::Oid, u32)>,
}

impl Locks {
    pub fn new() -> Locks {
        Locks { held: Vec::new() }
    }

    pub fn take(&mut self, relid: pg_sys::Oid, mode: u32) {
        lock_bounded(relid, mode);
        if mode == pg_sys::AccessShareLock {
            self.held.push((relid, mode));
        }
    }
}

impl Drop for Locks {
    /// Read locks end with the reads: a transaction that called start() and stays
    /// open holds nothing that maintenance would queue behind.
    fn drop(&mut self) {
        for &(relid, mode) in self.held.iter().rev() {
            // SAFETY: we took exactly this lock in `take`; the lock manager counts
            // repeated acquisitions, so a lock the transaction held before stays.
            unsafe { pg_sys::UnlockRelationOid(relid, mode as i32) };
        }
    }
}

fn relid(ns: pg_sys::Oid, name: &std::ffi::CStr, ext: pg_sys::Oid) -> pg_sys::Oid {
    // SAFETY: a syscache lookup; returns InvalidOid when missing.
    let oid = unsafe { pg_sys::get_relname_relid(name.as_ptr(), ns) };
    let shown = format!("quota.{}", name.to_string_lossy());
    if oid == pg_sys::InvalidOid {
        pgrx::pg_sys::panic::ErrorReport::new(
            pgrx::PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            format!("relation \"{shown}\" does not exist"),
            "pg_quota",
        )
        .set_hint(
            "Reinstall the extension with DROP EXTENSION pg_quota and CREATE EXTENSION pg_quota.",
        )
        .report(pgrx::PgLogLevel::ERROR);
    }
    // SAFETY: a pg_depend lookup.
    if ext == pg_sys::InvalidOid
        || unsafe { pg_sys::getExtensionOfObject(pg_sys::RelationRelationId, oid) } != ext
    {
        raise(QuotaError::NotExtensionMember { relation: shown });
    }
    oid
}

/// The column types pg_quota reads and writes, by table. `role` is `oid` in 0.1.0's
/// schema and `regrole` from 0.1.1 on; both are the same four bytes. `counts` are the
/// column counts of the schemas this library runs on: the table must have one of them,
/// and its columns must match the first that many of `want`.
fn check_shape(
    rel: pg_sys::Relation,
    name: &str,
    want: &[(&str, &[pg_sys::Oid])],
    counts: &[usize],
) -> usize {
    // SAFETY: an open relation's tuple descriptor.
    unsafe {
        let desc = (*rel).rd_att;
        let natts = (*desc).natts as usize;
        let bad = |why: String| -> ! {
            raise(QuotaError::BadShape {
                relation: format!("quota.{name}"),
                why,
            })
        };
        if !counts.contains(&natts) {
            bad(format!(
                "It has {natts} columns; pg_quota writes exactly {}",
                want.len()
            ));
        }
        for (i, (col, types)) in want.iter().take(natts).enumerate() {
            let att = compat::tuple_desc_attr(desc, i);
            if (*att).attisdropped {
                bad(format!("Column {} ({col}) was dropped", i + 1));
            }
            if !types.contains(&(*att).atttypid) {
                bad(format!(
                    "Column {} ({col}) has type {}",
                    i + 1,
                    std::ffi::CStr::from_ptr(pg_sys::format_type_be((*att).atttypid))
                        .to_string_lossy()
                ));
            }
        }
        natts
    }
}

/// The first valid, plain btree index of `heap` whose leading key columns are `keys`.
fn find_index(heap: pg_sys::Relation, keys: &[usize]) -> Option<pg_sys::Oid> {
    // SAFETY: `heap` is open and locked; each index is locked before it is opened and
    // unlocked after, as the planner does when it inspects indexes.
    unsafe {
        let list = pg_sys::RelationGetIndexList(heap);
        let n = if list.is_null() {
            0
        } else {
            (*list).length as usize
        };
        for i in 0..n {
            let oid = (*(*list).elements.add(i)).oid_value;
            lock_bounded(oid, pg_sys::AccessShareLock);
            let idx = pg_sys::index_open(oid, pg_sys::NoLock as i32);
            let ix = &*(*idx).rd_index;
            let nkeys = ix.indnkeyatts as usize;
            let key = |k: usize| *ix.indkey.values.as_ptr().add(k) as usize;
            // The scans assume ascending order with the type's default operators: a
            // DBA's index on (role DESC, …) or with another operator class would
            // return rows in another order, or compare them differently.
            let plain_order = |k: usize| {
                let typ = (*compat::tuple_desc_attr((*idx).rd_att, k)).atttypid;
                let default = pg_sys::GetDefaultOpClass(typ, pg_sys::BTREE_AM_OID);
                *(*idx).rd_indoption.add(k) == 0
                    && default != pg_sys::InvalidOid
                    && *(*idx).rd_opfamily.add(k) == pg_sys::get_opclass_family(default)
            };
            let usable = (*(*idx).rd_rel).relam == pg_sys::BTREE_AM_OID
                && ix.indisvalid
                && ix.indisready
                && ix.indislive
                && nkeys >= keys.len()
                && keys
                    .iter()
                    .enumerate()
                    .all(|(k, &col)| key(k) == col && plain_order(k))
                && pg_sys::RelationGetIndexExpressions(idx).is_null()
                && pg_sys::RelationGetIndexPredicate(idx).is_null();
            pg_sys::index_close(idx, pg_sys::NoLock as i32);
            pg_sys::UnlockRelationOid(oid, pg_sys::AccessShareLock as i32);
            if usable {
                return Some(oid);
            }
        }
        None
    }
}

fn discover() -> Rels {
    // SAFETY: catalog lookups; the heaps are locked before they are opened.
    unsafe {
        let ext = pg_sys::get_extension_oid(c"pg_quota".as_ptr(), true);
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        if ns == pg_sys::InvalidOid {
            raise(QuotaError::NotExtensionMember {
                relation: "quota.ledger".into(),
            });
        }
        let ledger = relid(ns, c"ledger", ext);
        let summary = relid(ns, c"summary", ext);
        let mut locks = Locks::new();
        locks.take(ledger, pg_sys::AccessShareLock);
        locks.take(summary, pg_sys::AccessShareLock);
        let role_types: &[pg_sys::Oid] = &[pg_sys::OIDOID, pg_sys::REGROLEOID];
        let l = pg_sys::table_open(ledger, pg_sys::NoLock as i32);
        let ncols = check_shape(
            l,
            "ledger",
            &[
                ("id", &[pg_sys::UUIDOID]),
                ("role", role_types),
                ("label", &[pg_sys::TEXTOID]),
                ("started_at", &[pg_sys::TIMESTAMPTZOID]),
                ("ended_at", &[pg_sys::TIMESTAMPTZOID]),
                ("outcome", &[pg_sys::TEXTOID]),
                ("lease_until", &[pg_sys::TIMESTAMPTZOID]),
                ("idempotency_key", &[pg_sys::TEXTOID]),
                ("pid", &[pg_sys::INT4OID]),
            ],
            &[NCOLS_V1, NCOLS_V2],
        );
        let v2 = ncols == NCOLS_V2;
        let ledger_pkey = find_index(l, &[COL_ID]);
        let ledger_idx = if v2 {
            find_index(l, &[COL_ROLE, COL_ENDED_AT, COL_LEASE_UNTIL])
        } else {
            find_index(l, &[COL_ROLE, COL_ENDED_AT])
        };
        let ledger_open_idx = v2.then(|| find_index(l, &[COL_ENDED_AT, COL_LEASE_UNTIL]));
        let ledger_key_idx = v2.then(|| find_index(l, &[COL_ROLE, COL_KEY]));
        let counters_ok = triggers_always(l, &[c"ledger_written", c"ledger_truncated"]);
        pg_sys::table_close(l, pg_sys::NoLock as i32);
        let s = pg_sys::table_open(summary, pg_sys::NoLock as i32);
        check_shape(
            s,
            "summary",
            &[("role", role_types), ("tickets", &[pg_sys::INT8OID])],
            &[2],
        );
        let summary_idx = find_index(s, &[1]);
        pg_sys::table_close(s, pg_sys::NoLock as i32);
        let missing = |table: &str, cols: &str| -> ! {
            raise(QuotaError::BadShape {
                relation: format!("quota.{table}"),
                why: format!(
                    "It has no valid btree index on ({cols}), which pg_quota created and needs"
                ),
            })
        };
        Rels {
            ledger,
            ledger_pkey: ledger_pkey.unwrap_or_else(|| missing("ledger", "id")),
            ledger_idx: ledger_idx.unwrap_or_else(|| {
                missing(
                    "ledger",
                    if v2 {
                        "role, ended_at, lease_until"
                    } else {
                        "role, ended_at"
                    },
                )
            }),
            ledger_open_idx: ledger_open_idx.map_or(pg_sys::InvalidOid, |i| {
                i.unwrap_or_else(|| missing("ledger", "ended_at, lease_until"))
            }),
            ledger_key_idx: ledger_key_idx.map_or(pg_sys::InvalidOid, |i| {
                i.unwrap_or_else(|| missing("ledger", "role, idempotency_key"))
            }),
            ncols,
            summary,
            summary_idx: summary_idx.unwrap_or_else(|| missing("summary", "role")),
            counters_ok,
        }
    }
}

/// Whether `rel` has every trigger in `names`, each enabled ALWAYS ('A').
fn triggers_always(rel: pg_sys::Relation, names: &[&std::ffi::CStr]) -> bool {
    // SAFETY: an open relation's relcache trigger descriptor, read only.
    unsafe {
        let td = (*rel).trigdesc;
        if td.is_null() {
            return false;
        }
        let trigs = std::slice::from_raw_parts((*td).triggers, (*td).numtriggers as usize);
        names.iter().all(|n| {
            trigs.iter().any(|t| {
                std::ffi::CStr::from_ptr(t.tgname) == *n && t.tgenabled == b'A' as std::ffi::c_char
            })
        })
    }
}

/// pg_quota's relations, from the backend's cache or looked up afresh.
pub fn rels() -> Rels {
    // SAFETY: single-threaded backend state; the callback is registered once.
    unsafe {
        if !CALLBACK_REGISTERED {
            pg_sys::CacheRegisterRelcacheCallback(Some(relcache_changed), pg_sys::Datum::from(0));
            CALLBACK_REGISTERED = true;
        }
        if let Some(r) = CACHED {
            return r;
        }
        let r = discover();
        CACHED = Some(r);
        r
    }
}

/// pg_quota's relations, read-locked (bounded) until dropped.
pub struct Reader {
    pub rels: Rels,
    /// The relfilenodes of the ledger and the summary, which scope counters must match;
    /// None when counters must not be used or stored now (see `tags_of`).
    pub tags: Option<crate::scopes::Tags>,
    _locks: Locks,
}

/// The tags scope counters must carry, or None if counters must not be used: the
/// triggers are missing or not ENABLE ALWAYS, or this transaction gave either table a
/// relfilenode that is not committed yet (a TRUNCATE, say), which a counter built now
/// would carry after the transaction commits, though built without its changes.
fn tags_of(rels: &Rels) -> Option<crate::scopes::Tags> {
    if !rels.counters_ok {
        return None;
    }
    // SAFETY: both relations are locked by the caller.
    unsafe {
        let l = pg_sys::table_open(rels.ledger, pg_sys::NoLock as i32);
        let s = pg_sys::table_open(rels.summary, pg_sys::NoLock as i32);
        let fresh = |r: pg_sys::Relation| compat::has_uncommitted_relfilenode(r);
        let tags = (!fresh(l) && !fresh(s)).then(|| crate::scopes::Tags {
            ledger: compat::relfilenode(l),
            summary: compat::relfilenode(s),
        });
        pg_sys::table_close(s, pg_sys::NoLock as i32);
        pg_sys::table_close(l, pg_sys::NoLock as i32);
        tags
    }
}

impl Reader {
    pub fn open() -> Reader {
        let mut locks = Locks::new();
        // Lock the tables first: once they are locked, invalidations are processed,
        // so the cached index choice is current, and no index we pick can be dropped
        // under us (REINDEX CONCURRENTLY waits for the tables' lockers first).
        let first = rels();
        locks.take(first.ledger, pg_sys::AccessShareLock);
        locks.take(first.summary, pg_sys::AccessShareLock);
        let rels = rels();
        if rels.ledger != first.ledger || rels.summary != first.summary {
            // Reinstalled in between: start over with the new tables.
            drop(locks);
            return Reader::open();
        }
        locks.take(rels.ledger_idx, pg_sys::AccessShareLock);
        locks.take(rels.ledger_pkey, pg_sys::AccessShareLock);
        // 0.2.0's other two indexes are locked where they are scanned (`scan_index`):
        // most starts never touch them, and every lock taken here is paid on every
        // start, refusals included.
        locks.take(rels.summary_idx, pg_sys::AccessShareLock);
        Reader {
            rels,
            tags: tags_of(&rels),
            _locks: locks,
        }
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
    OidGreater(pg_sys::Oid),
    UuidEq(pg_sys::Datum),
    IsNull,
    TsLess(pg_sys::TimestampTz),
    TsAtLeast(pg_sys::TimestampTz),
    /// Equal text, compared with the index column's collation.
    TextEq(pg_sys::Datum),
}

/// Scan keys on the leading columns of `index_rel`, each with that column's collation
/// (ScanKeyInit would give every key the C collation, which orders text differently
/// from the index).
fn scankeys(index_rel: pg_sys::Relation, keys: &[Key]) -> Vec<pg_sys::ScanKeyData> {
    let mut sks = scankeys_c(keys);
    for (i, sk) in sks.iter_mut().enumerate() {
        // SAFETY: an open index has one collation per key column; i is below the
        // number of keys, which find_index checked against the index's key columns.
        sk.sk_collation = unsafe { *(*index_rel).rd_indcollation.add(i) };
    }
    sks
}

fn scankeys_c(keys: &[Key]) -> Vec<pg_sys::ScanKeyData> {
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            let attno = (i + 1) as pg_sys::AttrNumber;
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
    mut visit: impl FnMut(*mut pg_sys::TupleTableSlot) -> bool,
) {
    let mut sk = scankeys(index_rel, keys);
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
        let desc = compat::index_beginscan(heap_rel, index_rel, scan_snap, sk.len() as i32);
        pg_sys::index_rescan(
            desc,
            sk.as_mut_ptr(),
            sk.len() as i32,
            std::ptr::null_mut(),
            0,
        );
        while pg_sys::index_getnext_slot(desc, pg_sys::ScanDirection::ForwardScanDirection, slot) {
            if filter {
                let bslot = slot as *mut pg_sys::BufferHeapTupleTableSlot;
                let buffer = (*bslot).buffer;
                pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
                let visible =
                    pg_sys::HeapTupleSatisfiesVisibility((*bslot).base.tuple, snap.0, buffer);
                pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_UNLOCK as i32);
                if !visible {
                    continue;
                }
            }
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
pub fn attr(slot: *mut pg_sys::TupleTableSlot, attno: i32) -> Option<pg_sys::Datum> {
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

/// How many ledger rows `role` has: from its summary row, or, where SQL-level writes
/// to the ledger made the summary forget it (see sql/schema.sql), by counting.
pub fn rows(r: &Rels, snap: &Latest, role: pg_sys::Oid) -> i64 {
    summary_rows(r, snap, role).unwrap_or_else(|| {
        let n = ledger_rows(r, snap, role);
        if n > REBUILD_ABOVE {
            // Counting a long history on every call is what the summary avoids: ask
            // the writer to give the role its summary row back.
            crate::writer::request_summary_rebuild();
        }
        n
    })
}

/// A role without a summary row and more ledger rows than this makes the writer
/// rebuild the missing summary rows.
const REBUILD_ABOVE: i64 = 100;

/// `role`'s summary row, if it has one.
pub fn summary_rows(r: &Rels, snap: &Latest, role: pg_sys::Oid) -> Option<i64> {
    let mut rows = None;
    scan(
        r.summary,
        r.summary_idx,
        snap,
        &[Key::OidEq(role)],
        |slot| {
            rows = attr(slot, 2).map(|d| d.value() as i64);
            false
        },
    );
    rows
}

/// How many ledger rows `role` has, counted one by one.
pub fn ledger_rows(r: &Rels, snap: &Latest, role: pg_sys::Oid) -> i64 {
    count(r.ledger, r.ledger_idx, snap, &[Key::OidEq(role)], None)
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

/// Whether the version of a row in `slot` (visible to the scan's snapshot) is being
/// replaced or was replaced by a transaction that has not aborted: a finish() or
/// renew() still open, or the writer's expiry sweep. Such a ticket whose lease ran
/// out still counts as active: a renew() that began before the lease ran out and
/// commits later keeps it active (see finish::renew), so counting it as expired now
/// could admit past the limit. Over-counting for that moment is allowed (I2).
fn being_changed(slot: *mut pg_sys::TupleTableSlot) -> bool {
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

/// A text datum (palloc'd) holding `bytes`, which are in the server encoding.
pub fn text_datum(bytes: &[u8]) -> pg_sys::Datum {
    // SAFETY: copies the bytes; a label or key is far below the 1 GB text limit.
    pg_sys::Datum::from(unsafe {
        pg_sys::cstring_to_text_with_len(bytes.as_ptr().cast(), bytes.len() as i32)
    })
}

/// A timestamp column of the tuple in `slot`.
fn ts_attr(slot: *mut pg_sys::TupleTableSlot, col: usize) -> Option<pg_sys::TimestampTz> {
    attr(slot, col as i32).map(|d| d.value() as i64)
}

/// `role`'s unfinished tickets whose lease ran out by `now` (0.2.0's schema only):
/// one probe of (role, ended_at IS NULL, lease_until <= now), which the sweep keeps
/// short. Their counter and their unfinished rows still include them until the sweep
/// ends them. Take `snap` after reading the role's counter, so that it sees every sweep
/// the counter reflects and nothing is subtracted twice. The result serves every
/// retention cutoff (see core::lease::Lapsed).
pub fn lapsed(r: &Rels, snap: &Latest, role: pg_sys::Oid, now: pg_sys::TimestampTz) -> Lapsed {
    let mut expiries = Vec::new();
    if r.v2() {
        scan(
            r.ledger,
            r.ledger_idx,
            snap,
            &[
                Key::OidEq(role),
                Key::IsNull,
                Key::TsLess(now.saturating_add(1)),
            ],
            |slot| {
                if !being_changed(slot) {
                    expiries.extend(ts_attr(slot, COL_LEASE_UNTIL));
                }
                true
            },
        );
    }
    Lapsed::new(expiries)
}

/// The database's active tickets, all roles together, counting at most `stop_at`
/// (0.2.0's schema only): the unfinished rows whose lease has not run out.
pub fn db_active(r: &Rels, snap: &Latest, now: pg_sys::TimestampTz, stop_at: i64) -> i64 {
    let mut n = 0;
    if !r.v2() {
        return n;
    }
    scan_index(r.ledger, r.ledger_open_idx, snap, &[Key::IsNull], |slot| {
        let active = ts_attr(slot, COL_LEASE_UNTIL).is_none_or(|l| l > now) || being_changed(slot);
        if active {
            n += 1;
        }
        n < stop_at
    });
    n
}

/// The earliest lease that runs out after `now` among the active tickets of `role`, or
/// of the whole database when `role` is None: when a waiter should look again.
pub fn next_expiry(
    r: &Rels,
    snap: &Latest,
    role: Option<pg_sys::Oid>,
    now: pg_sys::TimestampTz,
) -> Option<pg_sys::TimestampTz> {
    if !r.v2() {
        return None;
    }
    let after = Key::TsAtLeast(now.saturating_add(1));
    let (index, keys) = match role {
        Some(role) => (r.ledger_idx, vec![Key::OidEq(role), Key::IsNull, after]),
        None => (r.ledger_open_idx, vec![Key::IsNull, after]),
    };
    let mut first = None;
    scan_index(r.ledger, index, snap, &keys, |slot| {
        first = ts_attr(slot, COL_LEASE_UNTIL);
        first.is_none()
    });
    first
}

/// A ticket found by its idempotency key.
pub struct Keyed {
    pub id: [u8; 16],
    pub started_at: pg_sys::TimestampTz,
    pub ended_at: Option<pg_sys::TimestampTz>,
    pub lease_until: Option<pg_sys::TimestampTz>,
}

/// The tickets of `role` with idempotency key `key` (a text datum) (0.2.0's schema
/// only).
pub fn with_key(r: &Rels, snap: &Latest, role: pg_sys::Oid, key: pg_sys::Datum) -> Vec<Keyed> {
    let mut out = Vec::new();
    scan_index(
        r.ledger,
        r.ledger_key_idx,
        snap,
        &[Key::OidEq(role), Key::TextEq(key)],
        |slot| {
            if let (Some(d), Some(started_at)) =
                (attr(slot, COL_ID as i32), ts_attr(slot, COL_STARTED_AT))
            {
                out.push(Keyed {
                    // SAFETY: a uuid datum points at its 16 bytes.
                    id: unsafe { *(d.cast_mut_ptr::<[u8; 16]>()) },
                    started_at,
                    ended_at: ts_attr(slot, COL_ENDED_AT),
                    lease_until: ts_attr(slot, COL_LEASE_UNTIL),
                });
            }
            true
        },
    );
    out
}

/// The smallest role above `after` that has a ledger row visible to `snap`: one
/// index probe per role, so walking every role of the ledger costs one probe each.
pub fn next_role(r: &Rels, snap: &Latest, after: pg_sys::Oid) -> Option<pg_sys::Oid> {
    let mut found = None;
    scan(
        r.ledger,
        r.ledger_idx,
        snap,
        &[Key::OidGreater(after)],
        |slot| {
            found = attr(slot, COL_ROLE as i32).map(|d| pg_sys::Oid::from(d.value() as u32));
            false
        },
    );
    found
}

/// (active tickets, ledger rows) of `role`: from its scope counter (see scopes.rs),
/// which is built from the ledger if missing or stale, or, if the counter table is
/// full, counted from the ledger under `snap`.
pub fn scope(reader: &Reader, snap: &Latest, role: pg_sys::Oid) -> (i64, i64) {
    let r = &reader.rels;
    reader
        .tags
        .and_then(|tags| {
            crate::scopes::get(crate::shmem::my_db(), role, tags, |s| {
                // A rebuild holds the counters' lock: never count a whole history
                // under it. Without a summary row, count this once without a
                // counter; the writer rebuilds the summary row meanwhile.
                let rows = summary_rows(r, s, role)?;
                Some((active(r, s, role, None), rows))
            })
        })
        .unwrap_or_else(|| (active(r, snap, role, None), rows(r, snap, role)))
}

/// The roles with ledger rows visible to `snap` that `keep` accepts, walking the
/// ledger with `next_role` (one index probe per role).
pub fn roles_where(
    r: &Rels,
    snap: &Latest,
    mut keep: impl FnMut(pg_sys::Oid) -> bool,
) -> Vec<pg_sys::Oid> {
    let mut out = Vec::new();
    let mut after = pg_sys::InvalidOid;
    while let Some(role) = next_role(r, snap, after) {
        if keep(role) {
            out.push(role);
        }
        after = role;
    }
    out
}

/// The scope's usage as admission needs it: each count only where its limit is set
/// (`None` means no limit, so that count is not needed to decide). Tickets whose lease
/// ran out by `now` are neither active nor, once past the cutoff, retained.
pub fn usage(
    reader: &Reader,
    snap: &Latest,
    role: pg_sys::Oid,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    max_active: Option<i64>,
    count_retained: bool,
) -> crate::core::Usage {
    if max_active.is_none() && !count_retained {
        return crate::core::Usage::default();
    }
    let (active, rows) = scope(reader, snap, role);
    // A snapshot taken after the counter was read: it sees every purge and every
    // expiry sweep the counter already reflects, so nothing is subtracted twice.
    let after = Latest::take();
    let lapsed = lapsed(&reader.rels, &after, role, now);
    crate::core::Usage {
        active: if max_active.is_some() {
            active - lapsed.expired()
        } else {
            0
        },
        retained: if count_retained {
            rows - expired(&reader.rels, &after, role, cutoff) - lapsed.aged_out(cutoff)
        } else {
            0
        },
        ..crate::core::Usage::default()
    }
}
