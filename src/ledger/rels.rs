//! Layer 3, the ledger: finding and checking pg_quota's relations (the indexes it reads
//! are found in indexes.rs, and locked as locks.rs says).
//!
//! Relations are found by name in schema `quota`, and each must be a member of
//! extension pg_quota with the columns pg_quota writes (I5: not redirectable). Anything
//! else (a renamed schema with look-alike tables in its place, a column dropped by
//! hand) is an error, never a crash. A caller never queues without bound behind
//! maintenance (VACUUM FULL, REINDEX, CLUSTER): every lock is taken with a bounded wait,
//! and the read locks of start() are released as soon as its reads are done.

use pgrx::pg_sys;

use crate::compat;
use crate::core::QuotaError;
use crate::error::raise;
use crate::ledger::indexes::{find_index, missing, table_indexes};
use crate::ledger::locks::Locks;
use crate::ledger::{NCOLS_V1, NCOLS_V2, NCOLS_V5, NCOLS_V7, SUMMARY_COL_FOLDED};

/// The OIDs of pg_quota's relations in this database, and the valid indexes that
/// serve its scans. Indexes are chosen by what they index, not by name, so that
/// REINDEX CONCURRENTLY (which swaps names) and renames do not matter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rels {
    /// Where tickets are inserted and stay while they have not ended: quota.active
    /// (0.6.0's schema), or the one table quota.ledger of the older schemas. Its
    /// indexes below.
    pub ledger: pg_sys::Oid,
    /// A valid btree index whose first column is the ledger's id.
    pub ledger_pkey: pg_sys::Oid,
    /// A valid btree index on (role, ended_at, …): a role's unended tickets.
    pub ledger_idx: pg_sys::Oid,
    /// Whether `ledger_idx` has lease_until next, as 0.2.0 to 0.6.0 created it: then a
    /// role's lapsed leases, and its next one, are one probe away. 0.6.1 takes
    /// lease_until out of quota.active's indexes (a renewal is then a heap-only
    /// update), and they are found by walking the role's unended tickets.
    pub ledger_idx_leased: bool,
    /// 0.2.0 to 0.6.0: a valid btree index on (ended_at, lease_until, …), for the
    /// database's unended tickets (the database cap, the expiry sweep) in lease order,
    /// without walking the one table's history before 0.6.0. InvalidOid with an older
    /// schema, and on 0.6.1's quota.active, whose rows are all unended: they are read
    /// through `ledger_idx` (see count::each_unended).
    pub ledger_open_idx: pg_sys::Oid,
    /// 0.2.0: a valid btree index on (role, idempotency_key, …) (0.6.0: WHERE
    /// idempotency_key IS NOT NULL). InvalidOid with an older schema.
    pub ledger_key_idx: pg_sys::Oid,
    /// 0.5.0: a valid btree index on (role, tenant, ended_at, …) WHERE tenant IS NOT
    /// NULL. InvalidOid with an older schema.
    pub ledger_tenant_idx: pg_sys::Oid,
    /// Whether `ledger_tenant_idx` has lease_until next (0.5.0 to 0.6.0), as
    /// `ledger_idx_leased`.
    pub ledger_tenant_idx_leased: bool,
    /// 0.5.0: a valid btree index on (role, txid, …) WHERE txid IS NOT NULL: a role's
    /// transactional tickets by the transaction that charged them. InvalidOid with an
    /// older schema.
    pub ledger_txid_idx: pg_sys::Oid,
    /// Where ended tickets are: quota.history (0.6.0's schema, whose rows all have
    /// ended), or the same table as `ledger` before, and its indexes with the same
    /// meanings (history_key_idx on every row).
    pub history: pg_sys::Oid,
    pub history_pkey: pg_sys::Oid,
    pub history_idx: pg_sys::Oid,
    pub history_key_idx: pg_sys::Oid,
    pub history_tenant_idx: pg_sys::Oid,
    pub history_txid_idx: pg_sys::Oid,
    /// The ledger's column count: NCOLS_V1 (0.1.x's schema, still in place until
    /// ALTER EXTENSION pg_quota UPDATE), NCOLS_V2 (0.2.0 to 0.4.x), NCOLS_V5 (0.5.0 to
    /// 0.6.x, both tables) or NCOLS_V7 (0.7.0 on: weights).
    pub ncols: usize,
    pub summary: pg_sys::Oid,
    /// A valid btree index whose first column is the summary's role.
    pub summary_idx: pg_sys::Oid,
    /// The summary's column count: 2 before 0.5.0, 3 with its column `folded`.
    pub summary_ncols: usize,
    /// Whether the scope counters may be used: only when the triggers that mark them
    /// stale after SQL-level writes to the ledger exist and fire always (0.1.0's schema
    /// has none; a DBA may disable them, and session_replication_role = replica skips
    /// triggers that are not ENABLE ALWAYS).
    pub counters_ok: bool,
}

impl Rels {
    /// Whether the database has 0.2.0's schema (leases, idempotency keys, pids), or
    /// a later one.
    pub fn v2(&self) -> bool {
        self.ncols >= NCOLS_V2
    }

    /// Whether the database has 0.5.0's schema (tenants, transactional starts).
    pub fn v5(&self) -> bool {
        self.ncols >= NCOLS_V5 && self.summary_ncols > SUMMARY_COL_FOLDED - 1
    }

    /// Whether the database has 0.7.0's schema: tickets with weights.
    pub fn v7(&self) -> bool {
        self.ncols >= NCOLS_V7 && self.v5()
    }

    /// Whether the database has 0.6.0's schema: the ledger in two tables, quota.active
    /// and quota.history. Before, both fields name the one table.
    pub fn split(&self) -> bool {
        self.history != self.ledger
    }

    /// The name of the table tickets start in, for messages: "active" or "ledger".
    pub fn ledger_name(&self) -> &'static str {
        if self.split() {
            "active"
        } else {
            "ledger"
        }
    }

    /// Raises the clear error of a 0.5.0 feature used on an older schema.
    pub fn require_v5(&self, feature: &'static str) {
        if !self.v5() {
            raise(QuotaError::NeedsUpdate {
                feature,
                needs: "0.5.0",
            });
        }
    }

    /// Raises the clear error of a 0.7.0 feature used on an older schema.
    pub fn require_v7(&self, feature: &'static str) {
        if !self.v7() {
            raise(QuotaError::NeedsUpdate {
                feature,
                needs: "0.7.0",
            });
        }
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

// Backend-local cache of `Rels`, cleared by relcache invalidations of any of them,
// and (0.6.0) of the tags a Reader found for them. A backend runs one thread, so plain
// statics suffice.
static mut CACHED: Option<Rels> = None;
static mut CACHED_TAGS: Option<Tags> = None;
static mut CALLBACK_REGISTERED: bool = false;

/// This module's crate::inval::Handler.
unsafe fn relcache_changed(relid: pg_sys::Oid) {
    // SAFETY: single-threaded backend state.
    unsafe {
        // Tags found while the relations were not cached (an invalidation came in
        // while a Reader took its locks) cannot be told apart: they go with any.
        if (*std::ptr::addr_of!(CACHED)).is_none() {
            CACHED_TAGS = None;
        }
        if let Some(r) = CACHED {
            let ours = [
                r.ledger,
                r.ledger_pkey,
                r.ledger_idx,
                r.ledger_open_idx,
                r.ledger_key_idx,
                r.ledger_tenant_idx,
                r.ledger_txid_idx,
                r.history,
                r.history_pkey,
                r.history_idx,
                r.history_key_idx,
                r.history_tenant_idx,
                r.history_txid_idx,
                r.summary,
                r.summary_idx,
            ];
            if relid == pg_sys::InvalidOid || ours.contains(&relid) {
                CACHED = None;
                CACHED_TAGS = None;
            }
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
    // SAFETY: a syscache lookup.
    if unsafe { pg_sys::get_rel_relkind(oid) } != pg_sys::RELKIND_RELATION as std::ffi::c_char {
        raise(QuotaError::BadShape {
            relation: shown,
            why: "It is not a table".into(),
        });
    }
    oid
}

/// The column types pg_quota reads and writes, by table. `role` is `oid` in 0.1.0's
/// schema and `regrole` from 0.1.1 on; both are the same four bytes. `counts` are the
/// column counts of the schemas this library runs on: the table must have one of them,
/// and its columns must match the first that many of `want`.
pub(super) fn check_shape(
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
                    crate::catalog::name_text(pg_sys::format_type_be((*att).atttypid))
                ));
            }
        }
        natts
    }
}

/// The shape of a ledger table (see `check_shape`).
///
/// # Safety
/// `l` is an open, locked relation.
unsafe fn ledger_shape(l: pg_sys::Relation, name: &str) -> usize {
    let role_types: &[pg_sys::Oid] = &[pg_sys::OIDOID, pg_sys::REGROLEOID];
    check_shape(
        l,
        name,
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
            ("tenant", &[pg_sys::TEXTOID]),
            ("txid", &[pg_sys::XID8OID]),
            ("weight", &[pg_sys::INT4OID]),
        ],
        &[NCOLS_V1, NCOLS_V2, NCOLS_V5, NCOLS_V7],
    )
}

/// Whether `ns` has 0.6.0's schema, the ledger in two tables (then checked by
/// `relid`): quota.ledger is not a table there (0.6.0's is a view), or quota.history is
/// a member of extension `ext`. Otherwise the schema is an older one, whose ledger is
/// the one table quota.ledger (then checked by `relid`). Either way a relation that is
/// missing, swapped or renamed away is named in the error.
fn has_history(ns: pg_sys::Oid, ext: pg_sys::Oid) -> bool {
    // SAFETY: syscache and pg_depend lookups.
    unsafe {
        let ledger = pg_sys::get_relname_relid(c"ledger".as_ptr(), ns);
        if ledger != pg_sys::InvalidOid
            && pg_sys::get_rel_relkind(ledger) != pg_sys::RELKIND_RELATION as std::ffi::c_char
        {
            return true;
        }
        let oid = pg_sys::get_relname_relid(c"history".as_ptr(), ns);
        oid != pg_sys::InvalidOid
            && ext != pg_sys::InvalidOid
            && pg_sys::getExtensionOfObject(pg_sys::RelationRelationId, oid) == ext
    }
}

/// pg_quota's relations as the catalogs say now: found by name, then locked, then found
/// again until the names lead to the relations locked (0.6.0: ALTER EXTENSION UPDATE
/// renames quota.ledger to quota.history, so a name found before the lock, from a
/// syscache that had not yet processed the rename's invalidation, can be a table that
/// is something else by the time it is locked), as RangeVarGetRelidExtended does.
fn discover() -> Rels {
    loop {
        // SAFETY: processes the shared invalidation queue, as any lock acquisition does.
        unsafe { pg_sys::AcceptInvalidationMessages() };
        let (found, locks) = discover_once();
        // SAFETY: as above; after the locks, every change committed before them is seen.
        unsafe { pg_sys::AcceptInvalidationMessages() };
        let (again, _) = discover_once();
        drop(locks);
        if again == found {
            return found;
        }
    }
}

fn discover_once() -> (Rels, Locks) {
    // SAFETY: catalog lookups; the heaps are locked before they are opened.
    unsafe {
        let ext = pg_sys::get_extension_oid(c"pg_quota".as_ptr(), true);
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        if ns == pg_sys::InvalidOid {
            raise(QuotaError::NotExtensionMember {
                relation: "quota.ledger".into(),
            });
        }
        let split = has_history(ns, ext);
        let (ledger, ledger_name, history) = if split {
            (
                relid(ns, c"active", ext),
                "active",
                relid(ns, c"history", ext),
            )
        } else {
            let l = relid(ns, c"ledger", ext);
            (l, "ledger", l)
        };
        let summary = relid(ns, c"summary", ext);
        let mut locks = Locks::new();
        locks.take(ledger, pg_sys::AccessShareLock);
        if split {
            locks.take(history, pg_sys::AccessShareLock);
        }
        locks.take(summary, pg_sys::AccessShareLock);
        let triggers: &[&std::ffi::CStr] = &[c"ledger_written", c"ledger_truncated"];
        let l = pg_sys::table_open(ledger, pg_sys::NoLock as i32);
        let ncols = ledger_shape(l, ledger_name);
        let own = table_indexes(l, ledger_name, ncols, split, true);
        let mut counters_ok = triggers_always(l, triggers);
        pg_sys::table_close(l, pg_sys::NoLock as i32);
        let hist = if split {
            let h = pg_sys::table_open(history, pg_sys::NoLock as i32);
            let hcols = ledger_shape(h, "history");
            if hcols != ncols {
                raise(QuotaError::BadShape {
                    relation: "quota.history".into(),
                    why: format!("It has {hcols} columns; quota.active has {ncols}"),
                });
            }
            let hist = table_indexes(h, "history", ncols, false, false);
            counters_ok &= triggers_always(h, triggers);
            pg_sys::table_close(h, pg_sys::NoLock as i32);
            hist
        } else {
            own
        };
        let s = pg_sys::table_open(summary, pg_sys::NoLock as i32);
        let role_types: &[pg_sys::Oid] = &[pg_sys::OIDOID, pg_sys::REGROLEOID];
        let summary_ncols = check_shape(
            s,
            "summary",
            &[
                ("role", role_types),
                ("tickets", &[pg_sys::INT8OID]),
                ("folded", &[pg_sys::XID8OID]),
            ],
            &[2, 3],
        );
        let summary_idx = find_index(s, &[1], &[]);
        pg_sys::table_close(s, pg_sys::NoLock as i32);
        let rels = Rels {
            ledger,
            ledger_pkey: own.pkey,
            ledger_idx: own.idx,
            ledger_idx_leased: own.idx_leased,
            ledger_open_idx: own.open,
            ledger_key_idx: own.key,
            ledger_tenant_idx: own.tenant,
            ledger_tenant_idx_leased: own.tenant_leased,
            ledger_txid_idx: own.txid,
            history,
            history_pkey: hist.pkey,
            history_idx: hist.idx,
            history_key_idx: hist.key,
            history_tenant_idx: hist.tenant,
            history_txid_idx: hist.txid,
            ncols,
            summary,
            summary_idx: summary_idx.unwrap_or_else(|| missing("summary", "role")),
            summary_ncols,
            counters_ok,
        };
        (rels, locks)
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
            crate::inval::on_relcache(relcache_changed);
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
    pub tags: Option<Tags>,
    _locks: Locks,
}

/// The relfilenodes a scope counter was built from (see scopes.rs): a counter is valid
/// only while the ledger and the summary still have them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Tags {
    pub ledger: u32,
    /// 0.6.0: quota.history's (the ledger's again with an older schema).
    pub history: u32,
    pub summary: u32,
}

/// The tags scope counters must carry, or None if counters must not be used: the
/// triggers are missing or not ENABLE ALWAYS, or this transaction gave either table a
/// relfilenode that is not committed yet (a TRUNCATE, say), which a counter built now
/// would carry after the transaction commits, though built without its changes.
fn tags_of(rels: &Rels) -> Option<Tags> {
    if !rels.counters_ok {
        return None;
    }
    // SAFETY: both relations are locked by the caller.
    unsafe {
        let l = pg_sys::table_open(rels.ledger, pg_sys::NoLock as i32);
        let h = pg_sys::table_open(rels.history, pg_sys::NoLock as i32);
        let s = pg_sys::table_open(rels.summary, pg_sys::NoLock as i32);
        let fresh = |r: pg_sys::Relation| compat::has_uncommitted_relfilenode(r);
        let tags = (!fresh(l) && !fresh(h) && !fresh(s)).then(|| Tags {
            ledger: compat::relfilenode(l),
            history: compat::relfilenode(h),
            summary: compat::relfilenode(s),
        });
        pg_sys::table_close(s, pg_sys::NoLock as i32);
        pg_sys::table_close(h, pg_sys::NoLock as i32);
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
        if first.split() {
            locks.take(first.history, pg_sys::AccessShareLock);
        }
        locks.take(first.summary, pg_sys::AccessShareLock);
        let rels = rels();
        if rels.ledger != first.ledger
            || rels.history != first.history
            || rels.summary != first.summary
        {
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
        if rels.v5() {
            // 0.5.0's partial indexes are counted in (the unfolded transactional
            // tickets of a role's count, a tenant's tickets), also where a rebuild
            // holds the counters' lock and must not wait for a lock (see scopes::get).
            locks.take(rels.ledger_txid_idx, pg_sys::AccessShareLock);
            locks.take(rels.ledger_tenant_idx, pg_sys::AccessShareLock);
            // 0.6.0: a role's unfolded transactional tickets may have ended, so a
            // rebuild counts them in quota.history's partial index too.
            if rels.split() {
                locks.take(rels.history_txid_idx, pg_sys::AccessShareLock);
            }
        }
        let tags = tags_of(&rels);
        // SAFETY: single-threaded backend state. Found under the tables' locks, so
        // with every invalidation processed: current until the next one, which clears
        // them (kept only while the relations they were found for are the cached ones).
        unsafe {
            if *std::ptr::addr_of!(CACHED) == Some(rels) {
                CACHED_TAGS = tags;
            }
        }
        Reader {
            rels,
            tags,
            _locks: locks,
        }
    }
}

/// The tags scope counters must carry (see `Reader::tags`) as the last Reader of this
/// backend found them, where nothing has invalidated pg_quota's relations since, with
/// the invalidations other sessions sent processed first, but without opening or
/// locking a relation (0.6.0: a refusal read from the counters). A change committed
/// between that processing and its invalidation message (a TRUNCATE commits before it
/// sends it) can leave them one change behind for that moment: a refusal made on them
/// is one that the counters would have made a moment before, never an admission.
pub fn current_tags() -> Option<Tags> {
    // SAFETY: processes the shared invalidation queue, as any lock acquisition does
    // (nothing to do in the common case); then a plain read of backend state.
    unsafe {
        pg_sys::AcceptInvalidationMessages();
        (*std::ptr::addr_of!(CACHED))?;
        CACHED_TAGS
    }
}
