//! Layer 3, the ledger: the writes the ledger writer makes, below SQL (see heap.rs):
//! inserting admitted tickets, deleting rows it purges, keeping summary rows, and
//! forming the version of a ticket that its lease ended.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::core::uuid_v7;

use crate::ledger::count::{ledger_rows, remember_summary_at, summary_row, summary_rows, unfolded};
use crate::ledger::heap::OpenRel;
use crate::ledger::rels::Rels;
use crate::ledger::scan::{attr, scan_open, text_datum, weight_attr, Key, Latest};
use crate::ledger::{
    COL_ENDED_AT, COL_ID, COL_KEY, COL_LABEL, COL_LEASE_UNTIL, COL_OUTCOME, COL_PID, COL_ROLE,
    COL_STARTED_AT, COL_TENANT, COL_TXID, COL_WEIGHT, NCOLS_V2, NCOLS_V5, NCOLS_V7,
    SUMMARY_COL_FOLDED,
};

/// Deletes the rows of `rel` that `keys` select on its index `index` and `wanted`
/// accepts, under the latest snapshot, directly in the heap: no SQL, so no trigger or
/// rule a DBA added fires, as for every other write pg_quota makes. Returns how many
/// it deleted.
pub fn delete_where(
    rel: &OpenRel,
    index: pg_sys::Oid,
    keys: &[Key],
    wanted: impl Fn(*mut pg_sys::TupleTableSlot) -> bool,
) -> i64 {
    delete_counting(rel, index, keys, |slot| wanted(slot).then_some((false, 1))).0
}

/// `delete_where`, where `class` says of each row whether to delete it (Some), whether
/// to count it apart and what it weighs (Some((true, w))). Returns the weights of the
/// rows it deleted, and of those it counted apart.
pub fn delete_counting(
    rel: &OpenRel,
    index: pg_sys::Oid,
    keys: &[Key],
    class: impl Fn(*mut pg_sys::TupleTableSlot) -> Option<(bool, i64)>,
) -> (i64, i64) {
    // SAFETY: makes our earlier writes in this transaction visible to the snapshot.
    unsafe { pg_sys::CommandCounterIncrement() };
    let snap = Latest::take();
    let mut tids = Vec::new();
    scan_open(rel.heap, rel.index(index), &snap, keys, |slot| {
        if let Some((apart, weight)) = class(slot) {
            // SAFETY: the slot holds a visible tuple of `rel`.
            tids.push((unsafe { (*slot).tts_tid }, apart, weight));
        }
        true
    });
    drop(snap);
    let (mut n, mut apart_n) = (0, 0);
    for (tid, apart, weight) in tids {
        match rel.delete(tid) {
            pg_sys::TM_Result::TM_Ok => {
                n += weight;
                if apart {
                    apart_n += weight;
                }
            }
            // Changed or deleted meanwhile (a superuser's SQL, say): leave it; a
            // later purge sees its new version.
            pg_sys::TM_Result::TM_Updated
            | pg_sys::TM_Result::TM_Deleted
            | pg_sys::TM_Result::TM_SelfModified => {}
            other => pgrx::error!("pg_quota: unexpected result {other} deleting a row"),
        }
    }
    (n, apart_n)
}

/// The ledger's tables opened for writing: the one tickets start in, and (0.6.0's
/// schema) quota.history, where ended tickets go.
pub struct Tables {
    pub ledger: OpenRel,
    /// quota.history, opened when first needed (a purge with nothing to purge reads it
    /// all the same), if the schema has it.
    history: std::cell::OnceCell<OpenRel>,
    /// quota.history's OID as the `Rels` the tables were opened with say, if the schema
    /// has it.
    history_oid: Option<pg_sys::Oid>,
    /// Both tables open their indexes only where a write needs them (see
    /// OpenRel::open_lazy): Tables opened to end or renew one ticket, which look it up,
    /// then write at most its own row (`open_current_for_one`).
    lazy: bool,
}

impl Tables {
    /// Opens the table tickets start in (quota.history where needed, see `history`),
    /// as `rels` names them: `rels` must be current, as a Reader's are (or see
    /// `open_current`).
    pub fn open(rels: &Rels) -> Tables {
        Tables::open_as(rels, false)
    }

    /// `open`, with the tables opened as `OpenRel::open_lazy` if `lazy`.
    fn open_as(rels: &Rels, lazy: bool) -> Tables {
        let (relid, name) = (rels.ledger, rels.ledger_name());
        Tables {
            ledger: Tables::open_table(relid, name, lazy),
            history: std::cell::OnceCell::new(),
            history_oid: rels.split().then_some(rels.history),
            lazy,
        }
    }

    /// Opens the tables as they are once locked, and the relations they are: a `Rels`
    /// read before the lock may be one an ALTER EXTENSION UPDATE committed meanwhile
    /// made stale (quota.ledger renamed quota.history, 0.6.0), which the lock's
    /// processing of invalidations shows. Opened under a stale one, the locks stay to
    /// the end of the transaction, harmlessly.
    pub fn open_current() -> (Tables, Rels) {
        Tables::open_current_as(false)
    }

    /// `open_current` for ending or renewing one ticket (finish(), renew(),
    /// claim_job()), which looks it up by its id and then writes at most its own row:
    /// each table opens its indexes only when it is written (`OpenRel::open_lazy`), and
    /// a lookup opens the primary key alone. A finish deletes from quota.active
    /// (0.6.0), which adds no index entries; a renew updates there; neither writes
    /// anything for a ticket that had ended already.
    pub fn open_current_for_one() -> (Tables, Rels) {
        Tables::open_current_as(true)
    }

    fn open_current_as(lazy: bool) -> (Tables, Rels) {
        loop {
            let before = crate::ledger::rels::rels();
            let tables = Tables::open_as(&before, lazy);
            let now = crate::ledger::rels::rels();
            if now == before {
                return (tables, now);
            }
        }
    }

    /// The table of ended tickets: quota.history, or the one ledger table.
    pub fn history(&self) -> &OpenRel {
        let Some(oid) = self.history_oid else {
            return &self.ledger;
        };
        self.history
            .get_or_init(|| Tables::open_table(oid, "history", self.lazy))
    }

    /// One of the tables, keyed by its id, its indexes opened now or (`lazy`) at its
    /// first write.
    fn open_table(relid: pg_sys::Oid, name: &str, lazy: bool) -> OpenRel {
        if lazy {
            OpenRel::open_lazy(relid, name, COL_ID)
        } else {
            OpenRel::open(relid, name, COL_ID)
        }
    }

    /// The open table whose OID is `relid` (one of the two).
    pub fn by_oid(&self, relid: pg_sys::Oid) -> &OpenRel {
        // SAFETY: open relations; rd_id is their OID.
        if unsafe { (*self.history().heap).rd_id } == relid {
            self.history()
        } else {
            &self.ledger
        }
    }

    /// Ends the unended ticket at `tid` of the ledger, `ended` being its ended version
    /// (formed by the ledger's `form`; `changed` its columns that differ). With one
    /// table, `ended` replaces the row as an update. With two (0.6.0), the row is
    /// deleted from quota.active and `ended` inserted into quota.history, in this
    /// transaction: a concurrent count under one snapshot sees the ticket in exactly one
    /// of them, and while this transaction is open the deleted row's xmax marks it as
    /// being changed (counts::being_changed), as the update's did. The delete waits for
    /// a concurrent writer of the row, as the update did; on any result but TM_Ok
    /// nothing is inserted. Frees `ended`.
    pub fn end(
        &self,
        tid: pg_sys::ItemPointerData,
        ended: pg_sys::HeapTuple,
        changed: &[usize],
    ) -> pg_sys::TM_Result::Type {
        if self.history_oid.is_none() {
            return self.ledger.update(tid, ended, changed);
        }
        let history = self.history();
        // Its indexes are opened (and locked) before the row is deleted: no lock wait
        // while that row is locked. A finish of a ticket already ended looks it up in
        // quota.history and opens none of them.
        history.indexes();
        let result = self.ledger.delete(tid);
        if result == pg_sys::TM_Result::TM_Ok {
            // The tables have the same columns (rels.rs checks), so a tuple formed for
            // one is a tuple of the other.
            history.insert_tuple(ended);
        } else {
            // SAFETY: formed by `form`, palloc'd, not used after.
            unsafe { pg_sys::heap_freetuple(ended) };
        }
        result
    }
}

/// The units (0.7.0) of the rows a purge deleted: all of them, and those its role's
/// summary row counted (every writer-committed ticket, and the transactional ones below
/// its `folded`).
pub struct Purged {
    pub all: i64,
    pub summarized: i64,
}

/// Deletes `role`'s tickets that ended before `cutoff`.
pub fn purge_before(
    rels: &Rels,
    tables: &Tables,
    role: pg_sys::Oid,
    cutoff: pg_sys::TimestampTz,
) -> Purged {
    // SAFETY: makes our earlier writes in this transaction (a fold of this role's
    // summary row) visible to the snapshot.
    unsafe { pg_sys::CommandCounterIncrement() };
    let folded = summary_rows(rels, &Latest::take(), role, true).map_or(0, |(_, f)| f);
    let v5 = rels.v5();
    let (all, summarized) = delete_counting(
        tables.history(),
        rels.history_idx,
        &[Key::OidEq(role), Key::TsLess(cutoff)],
        |slot| {
            let txid = if v5 {
                attr(slot, COL_TXID as i32).map(|d| d.value() as u64)
            } else {
                None
            };
            Some((txid.is_none_or(|t| t < folded), weight_attr(slot)))
        },
    );
    Purged { all, summarized }
}

/// A ticket admitted: by the writer's batch, or by a transactional start (0.5.0).
pub struct Admitted<'a> {
    pub id: pgrx::Uuid,
    pub role: pg_sys::Oid,
    pub label: Option<&'a [u8]>,
    pub key: Option<&'a [u8]>,
    pub lease_until: Option<pg_sys::TimestampTz>,
    pub pid: i32,
    /// Its tenant (0.5.0's schema), in the server encoding.
    pub tenant: Option<&'a [u8]>,
    /// For a transactional start, the full id of the transaction that charges it.
    pub txid: Option<u64>,
    /// Its weight (0.7.0's schema; 1 before), stored as NULL where it is 1.
    pub weight: i64,
}

/// Inserts the admitted tickets, all started at `now`. Labels, keys and tenants are
/// stored as the caller's bytes in the database encoding, which is also the writer's:
/// no conversion, so every encoding works. With 0.1.x's schema (`ncols` = NCOLS_V1)
/// leases, keys and pids have no columns and are not recorded; tenants and
/// transactions have columns from 0.5.0's (admission refuses them before).
pub fn record(ledger: &OpenRel, ncols: usize, now: pg_sys::TimestampTz, admitted: &[Admitted]) {
    let text = |bytes: Option<&[u8]>| bytes.map(text_datum);
    for a in admitted {
        let mut values = vec![pg_sys::Datum::from(0); ncols];
        let mut nulls = vec![true; ncols];
        let mut set = |col: usize, v: Option<pg_sys::Datum>| {
            if let Some(v) = v {
                values[col - 1] = v;
                nulls[col - 1] = false;
            }
        };
        set(COL_ID, a.id.into_datum());
        set(COL_ROLE, Some(a.role.into()));
        set(COL_LABEL, text(a.label));
        set(COL_STARTED_AT, Some(now.into()));
        if ncols >= NCOLS_V2 {
            set(COL_LEASE_UNTIL, a.lease_until.map(pg_sys::Datum::from));
            set(COL_KEY, text(a.key));
            set(COL_PID, Some(a.pid.into()));
        }
        if ncols >= NCOLS_V5 {
            set(COL_TENANT, text(a.tenant));
            // xid8 is passed by value, as int8 is.
            set(COL_TXID, a.txid.map(pg_sys::Datum::from));
        }
        if a.weight > 1 {
            // Admission refuses weights on an older schema (Rels::require_v7); one that
            // went back meanwhile (DROP and CREATE EXTENSION at an older version) must
            // not record the ticket as lighter than it was counted.
            // Class 22, so that the writer fails this request alone (its group is
            // split, see writer/batch.rs).
            if ncols < NCOLS_V7 {
                pgrx::ereport!(
                    ERROR,
                    PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                    "pg_quota: quota.active has no column weight; run ALTER EXTENSION pg_quota UPDATE"
                );
            }
            set(COL_WEIGHT, Some(pg_sys::Datum::from(a.weight as i32)));
        }
        ledger.insert(&mut values, &mut nulls);
    }
}

/// The full transaction id below which every transaction had ended when `snap` was
/// taken (its xmin, with its epoch): a transactional ticket whose txid is below it is
/// committed or rolled back for good.
pub fn horizon(snap: &Latest) -> u64 {
    // SAFETY: a plain read of the snapshot and of the next transaction id.
    unsafe {
        let xmin = u64::from((*snap.0).xmin.into_inner());
        let next = pg_sys::ReadNextFullTransactionId().value;
        // xmin is at most 2^31 behind the next id: put it in that id's epoch, or the
        // one before if it wrapped.
        let candidate = (next & !0xFFFF_FFFF) | xmin;
        if candidate > next {
            candidate.saturating_sub(1 << 32)
        } else {
            candidate
        }
    }
}

/// The values of a summary row of `summary` (2 or 3 columns, see Rels::summary_ncols).
fn summary_values(
    summary: &OpenRel,
    ncols: usize,
    role: pg_sys::Oid,
    tickets: i64,
    folded: Option<u64>,
) -> pg_sys::HeapTuple {
    let mut values = vec![role.into(), tickets.into(), pg_sys::Datum::from(0)];
    let mut nulls = vec![false, false, true];
    if let Some(f) = folded {
        values[SUMMARY_COL_FOLDED - 1] = f.into();
        nulls[SUMMARY_COL_FOLDED - 1] = false;
    }
    summary.form(&mut values[..ncols], &mut nulls[..ncols])
}

/// Adds `n` to `role`'s summary row. A missing row means "unknown": the role never had
/// one, or SQL-level writes to the ledger made the summary forget it (see the triggers
/// in sql/schema.sql); we then count the role's rows, ours included, and store that.
/// The writer is the only process that writes summary rows, so a concurrent change
/// means someone edited the table by hand; we then count again from the latest version.
///
/// From 0.5.0 a row counts the role's transactional tickets below its `folded` txid
/// only (see sql/schema.sql): a row made anew counts those below the horizon of its
/// snapshot (every transaction below it has ended), and the others stay unfolded.
pub fn add_to_summary(rels: &Rels, summary: &OpenRel, role: pg_sys::Oid, n: i64) {
    update_summary(rels, summary, role, n, None);
}

/// Adds `n` to `role`'s summary row and moves its `folded` up to `folded_to` (0.5.0's
/// fold of transactional tickets, writer/fold.rs; 0 leaves it): a role without a row
/// is left alone, as it is counted from the ledger until the writer rebuilds its row.
pub fn fold_into_summary(
    rels: &Rels,
    summary: &OpenRel,
    role: pg_sys::Oid,
    n: i64,
    folded_to: u64,
) {
    update_summary(rels, summary, role, n, Some(folded_to));
}

fn update_summary(rels: &Rels, summary: &OpenRel, role: pg_sys::Oid, n: i64, fold: Option<u64>) {
    loop {
        // SAFETY: makes our writes in this transaction visible to the snapshot below.
        unsafe { pg_sys::CommandCounterIncrement() };
        let snap = Latest::take();
        let ncols = rels.summary_ncols;
        let current = summary_row(
            rels,
            summary.heap,
            summary.index(rels.summary_idx),
            &snap,
            role,
        );
        // All of the role's rows but its transactional tickets from `folded` on.
        let recount =
            |folded: u64| ledger_rows(rels, &snap, role) - unfolded(rels, &snap, role, folded);
        let Some((tid, tickets, folded)) = current else {
            if fold.is_some() {
                return;
            }
            let folded = horizon(&snap);
            let tuple = summary_values(summary, ncols, role, recount(folded), Some(folded));
            summary.insert_tuple(tuple);
            return;
        };
        let folded = match fold {
            Some(to) if to > folded.unwrap_or(0) => Some(to),
            _ => folded,
        };
        let tickets = if tickets + n >= 0 {
            tickets + n
        } else {
            recount(folded.unwrap_or(0))
        };
        let tuple = summary_values(summary, ncols, role, tickets, folded);
        match summary.update_at(tid, tuple, &[2]) {
            (pg_sys::TM_Result::TM_Ok, at) => {
                // SAFETY: an open relation.
                remember_summary_at(
                    unsafe { crate::compat::relfilenode(summary.heap) },
                    role,
                    at,
                );
                return;
            }
            (pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted, _) => continue,
            (other, _) => pgrx::error!(
                "pg_quota: unexpected result {other} updating the summary of role {}",
                u32::from(role)
            ),
        }
    }
}

/// The version of the ticket at `tid` that ends it at `until` with outcome
/// `expired`, formed from the row as it is now; None if it is no longer unfinished.
pub fn expired_version(
    ledger: &OpenRel,
    ncols: usize,
    tid: pg_sys::ItemPointerData,
    until: pg_sys::TimestampTz,
) -> Option<pg_sys::HeapTuple> {
    changed_version(ledger, ncols, tid, |values, nulls| {
        let unfinished = nulls[COL_ENDED_AT - 1];
        if unfinished {
            values[COL_ENDED_AT - 1] = until.into();
            nulls[COL_ENDED_AT - 1] = false;
            values[COL_OUTCOME - 1] = "expired".into_datum().unwrap();
            nulls[COL_OUTCOME - 1] = false;
        }
        unfinished
    })
}

/// The txid a transactional ticket from another cluster's history gets (0.5.2, see
/// `adopted_version`): FrozenTransactionId of epoch 0, "committed before anything this
/// cluster ran", below every horizon and so below every `folded` a summary row has.
pub const ADOPTED_TXID: u64 = pg_sys::FrozenTransactionId.into_inner() as u64;

/// The version of the transactional ticket at `tid` whose txid is ADOPTED_TXID, formed
/// from the row as it is now; None if its txid is below `next` meanwhile (or gone).
/// A ticket restored from a cluster further on carries a txid this cluster has not
/// issued yet, which its own transactions would reach later: counted as unfolded
/// until then, it would be walked by every count of its role, and counted twice once
/// this cluster's horizon passed it. It committed in its own cluster, so it belongs
/// below every fold (0.5.2, R2).
pub fn adopted_version(
    ledger: &OpenRel,
    ncols: usize,
    tid: pg_sys::ItemPointerData,
    next: u64,
) -> Option<pg_sys::HeapTuple> {
    changed_version(ledger, ncols, tid, |values, nulls| {
        let foreign = !nulls[COL_TXID - 1] && values[COL_TXID - 1].value() as u64 >= next;
        if foreign {
            values[COL_TXID - 1] = pg_sys::Datum::from(ADOPTED_TXID);
        }
        foreign
    })
}

/// A new version of the row at `tid`, its columns as they are now changed by
/// `change`, which returns false to leave the row alone (then None, as for a row gone).
fn changed_version(
    ledger: &OpenRel,
    ncols: usize,
    tid: pg_sys::ItemPointerData,
    change: impl FnOnce(&mut [pg_sys::Datum], &mut [bool]) -> bool,
) -> Option<pg_sys::HeapTuple> {
    // SAFETY: fetches the version at `tid` under SnapshotAny into a palloc'd copy that
    // we deform at once; the row is then replaced under heap_update's own checks.
    unsafe {
        let mut tuple: pg_sys::HeapTupleData = std::mem::zeroed();
        tuple.t_self = tid;
        let mut buffer: pg_sys::Buffer = 0;
        if !pg_sys::heap_fetch(
            ledger.heap,
            std::ptr::addr_of_mut!(pg_sys::SnapshotAnyData),
            &mut tuple,
            &mut buffer,
            false,
        ) {
            return None;
        }
        let mut values = vec![pg_sys::Datum::from(0); ncols];
        let mut nulls = vec![false; ncols];
        pg_sys::heap_deform_tuple(
            &mut tuple,
            (*ledger.heap).rd_att,
            values.as_mut_ptr(),
            nulls.as_mut_ptr(),
        );
        let out = change(&mut values, &mut nulls).then(|| ledger.form(&mut values, &mut nulls));
        pg_sys::ReleaseBuffer(buffer);
        out
    }
}

/// How many tickets' random bytes one call to pg_strong_random() fetches.
pub(crate) const RANDOM_BATCH: usize = 64;

/// Eight bytes from pg_strong_random(), taken from a batch this process fetched at
/// once: each call into the random source (OpenSSL's, where PostgreSQL is built with
/// it) costs about as much for 8 bytes as for 512, and a transactional start paid it
/// on every ticket (3% of a JOBT job's CPU in one backend). Each byte is used once.
pub(crate) fn random_bytes() -> [u8; 8] {
    thread_local! {
        static BATCH: std::cell::RefCell<([u8; 8 * RANDOM_BATCH], usize)> =
            const { std::cell::RefCell::new(([0; 8 * RANDOM_BATCH], 8 * RANDOM_BATCH)) };
    }
    BATCH.with_borrow_mut(|(bytes, used)| {
        if *used == bytes.len() {
            // SAFETY: fills the buffer we pass; returns false only if the source fails.
            if !unsafe { pg_sys::pg_strong_random(bytes.as_mut_ptr().cast(), bytes.len()) } {
                pgrx::error!("pg_quota: could not generate random bytes for a ticket id");
            }
            *used = 0;
        }
        let mut out = [0u8; 8];
        out.copy_from_slice(&bytes[*used..*used + 8]);
        // Not kept once handed out.
        bytes[*used..*used + 8].fill(0);
        *used += 8;
        out
    })
}

/// A new ticket id: a version 7 UUID of `now` (so ids sort by start time), rising in
/// this process. The writer's and a transactional start's ids come from here.
pub fn new_ticket_id(now: pg_sys::TimestampTz) -> [u8; 16] {
    thread_local! {
        /// The last id this writer issued; ids of one batch share `now`.
        static LAST_ID: std::cell::Cell<Option<[u8; 16]>> = const { std::cell::Cell::new(None) };
    }
    let random = random_bytes();
    // TimestampTz counts microseconds from 2000-01-01; UUIDv7 wants Unix time.
    const PG_EPOCH_UNIX_US: i64 = 946_684_800_000_000;
    let unix_us = (now + PG_EPOCH_UNIX_US).max(0) as u64;
    let id = uuid_v7(unix_us, random, LAST_ID.get());
    LAST_ID.set(Some(id));
    id
}
