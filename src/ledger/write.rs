//! Layer 3, the ledger: the writes the ledger writer makes, below SQL (see heap.rs):
//! inserting admitted tickets, deleting rows it purges, keeping summary rows, and
//! forming the version of a ticket that its lease ended.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::ledger::count::ledger_rows;
use crate::ledger::heap::OpenRel;
use crate::ledger::rels::Rels;
use crate::ledger::scan::{scan_open, text_datum, Key, Latest};
use crate::ledger::{
    COL_ENDED_AT, COL_ID, COL_KEY, COL_LABEL, COL_LEASE_UNTIL, COL_OUTCOME, COL_PID, COL_ROLE,
    COL_STARTED_AT, NCOLS_V2,
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
    // SAFETY: makes our earlier writes in this transaction visible to the snapshot.
    unsafe { pg_sys::CommandCounterIncrement() };
    let snap = Latest::take();
    let mut tids = Vec::new();
    scan_open(rel.heap, rel.index(index), &snap, keys, |slot| {
        if wanted(slot) {
            // SAFETY: the slot holds a visible tuple of `rel`.
            tids.push(unsafe { (*slot).tts_tid });
        }
        true
    });
    drop(snap);
    let mut n = 0;
    for tid in tids {
        match rel.delete(tid) {
            pg_sys::TM_Result::TM_Ok => n += 1,
            // Changed or deleted meanwhile (a superuser's SQL, say): leave it; a
            // later purge sees its new version.
            pg_sys::TM_Result::TM_Updated
            | pg_sys::TM_Result::TM_Deleted
            | pg_sys::TM_Result::TM_SelfModified => {}
            other => pgrx::error!("pg_quota: unexpected result {other} deleting a row"),
        }
    }
    n
}

/// A ticket the batch admits.
pub struct Admitted<'a> {
    pub id: pgrx::Uuid,
    pub role: pg_sys::Oid,
    pub label: Option<&'a [u8]>,
    pub key: Option<&'a [u8]>,
    pub lease_until: Option<pg_sys::TimestampTz>,
    pub pid: i32,
}

/// Inserts the admitted tickets. Labels and keys are stored as the caller's bytes in
/// the database encoding, which is also the writer's: no conversion, so every encoding
/// works. With 0.1.x's schema (`ncols` = NCOLS_V1) leases, keys and pids have no
/// columns and are not recorded.
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
        if ncols == NCOLS_V2 {
            set(COL_LEASE_UNTIL, a.lease_until.map(pg_sys::Datum::from));
            set(COL_KEY, text(a.key));
            set(COL_PID, Some(a.pid.into()));
        }
        ledger.insert(&mut values, &mut nulls);
    }
}

/// Adds `n` to `role`'s summary row. A missing row means "unknown": the role never had
/// one, or SQL-level writes to the ledger made the summary forget it (see the triggers
/// in sql/schema.sql); we then count the role's rows, ours included, and store that.
/// The writer is the only process that writes summary rows, so a concurrent change
/// means someone edited the table by hand; we then count again from the latest version.
pub fn add_to_summary(rels: &Rels, summary: &OpenRel, role: pg_sys::Oid, n: i64) {
    loop {
        // SAFETY: makes our writes in this transaction visible to the snapshot below.
        unsafe { pg_sys::CommandCounterIncrement() };
        let snap = Latest::take();
        let mut current = None;
        scan_open(
            summary.heap,
            summary.index(rels.summary_idx),
            &snap,
            &[Key::OidEq(role)],
            |slot| {
                // SAFETY: the slot holds a summary tuple (role, tickets), pinned meanwhile.
                let tickets = unsafe { pg_sys::slot_getattr(slot, 2, &mut false).value() as i64 };
                // SAFETY: as above.
                current = Some((unsafe { (*slot).tts_tid }, tickets));
                false
            },
        );
        let Some((tid, tickets)) = current else {
            let rows = ledger_rows(rels, &snap, role);
            summary.insert(&mut [role.into(), rows.into()], &mut [false, false]);
            return;
        };
        let tickets = if tickets + n >= 0 {
            tickets + n
        } else {
            ledger_rows(rels, &snap, role)
        };
        let tuple = summary.form(&mut [role.into(), tickets.into()], &mut [false, false]);
        match summary.update(tid, tuple, &[2]) {
            pg_sys::TM_Result::TM_Ok => return,
            pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted => continue,
            other => pgrx::error!(
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
        let unfinished = nulls[COL_ENDED_AT - 1];
        let out = unfinished.then(|| {
            values[COL_ENDED_AT - 1] = until.into();
            nulls[COL_ENDED_AT - 1] = false;
            values[COL_OUTCOME - 1] = "expired".into_datum().unwrap();
            nulls[COL_OUTCOME - 1] = false;
            ledger.form(&mut values, &mut nulls)
        });
        pg_sys::ReleaseBuffer(buffer);
        out
    }
}
