//! The finish path. Unlike start(), finish is transactional: it updates the ticket in
//! the caller's own transaction, so a rolled-back finish leaves the ticket active (I2).
//!
//! The update goes straight to the heap and the indexes, as PostgreSQL's catalog code
//! updates catalog rows, instead of through an SQL UPDATE: finish runs once per unit
//! of work, and building an executor for a one-row update cost more than the update.
//! Since no SQL is involved, the search_path cannot affect it (I5), and the ledger's
//! privileges are not checked: the role check below is the access rule.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::admission::{require_preloaded, role_name};
use crate::core::{parse_outcome, Outcome, QuotaError};
use crate::counts::{self, Key, Latest, Rels};

/// Ledger columns, 1-based, as created by sql/schema.sql.
const COL_ROLE: usize = 2;
const COL_ENDED_AT: usize = 5;
const COL_OUTCOME: usize = 6;
const NCOLS: usize = 6;

/// Ends `ticket` with `outcome`. Returns true if this call ended it, false if it had
/// already ended (so a retried finish never releases twice).
pub fn finish(ticket: Option<pgrx::Uuid>, outcome: Option<&str>) -> Result<bool, QuotaError> {
    require_preloaded();
    let ticket = ticket.ok_or(QuotaError::NullArgument("ticket"))?;
    let outcome = parse_outcome(outcome.ok_or(QuotaError::NullArgument("outcome"))?)?;
    // SAFETY: both raise 25006 (on a standby, in a read-only transaction) or return.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(c"quota.finish()".as_ptr());
        pg_sys::PreventCommandIfReadOnly(c"quota.finish()".as_ptr());
    }
    // SAFETY: plain reads of backend state and the clock.
    let (me, now) = unsafe { (pg_sys::GetUserId(), pg_sys::GetCurrentTimestamp()) };
    let rels = counts::rels();
    let ledger = OpenLedger::open(&rels);

    loop {
        // The latest snapshot, not the transaction's: under REPEATABLE READ a ticket
        // committed by the writer after our snapshot must still be found (I3).
        let snap = Latest::take();
        let Some(found) = ledger.find(&rels, &snap, ticket, outcome, now) else {
            return Err(QuotaError::UnknownTicket(ticket.to_string()));
        };
        // I5: only the holder, a member of it, or a superuser (is_member_of_role
        // says yes for them) may end a ticket.
        // SAFETY: a catalog lookup.
        if found.holder != me && !unsafe { pg_sys::is_member_of_role(me, found.holder) } {
            return Err(QuotaError::ForeignTicket {
                ticket: ticket.to_string(),
                owner: role_name(found.holder),
            });
        }
        if found.ended {
            return Ok(false);
        }
        match ledger.update(found) {
            pg_sys::TM_Result::TM_Ok => return Ok(true),
            // Ended by an earlier call in this same statement.
            pg_sys::TM_Result::TM_SelfModified => return Ok(false),
            // A concurrent finish committed first (or, long after, a purge): look
            // again with a fresh snapshot, which sees what it did. Under any isolation
            // level this returns false rather than a serialization failure.
            pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted => continue,
            other => pgrx::error!("pg_quota: unexpected result {other} updating ticket {ticket}"),
        }
    }
}

/// The ticket as found, and its replacement tuple.
struct Found {
    tid: pg_sys::ItemPointerData,
    holder: pg_sys::Oid,
    ended: bool,
    new_tuple: pg_sys::HeapTuple,
}

/// The ledger opened for an update, with its indexes; closed (locks kept to the end
/// of the transaction, as for any UPDATE) on drop.
struct OpenLedger {
    heap: pg_sys::Relation,
    indexes: Vec<(pg_sys::Relation, *mut pg_sys::IndexInfo)>,
}

impl OpenLedger {
    fn open(rels: &Rels) -> OpenLedger {
        // SAFETY: RowExclusiveLock is what an UPDATE takes; the relations exist (just
        // looked up). The index list comes from the relcache and is copied.
        unsafe {
            let heap = pg_sys::table_open(rels.ledger, pg_sys::RowExclusiveLock as i32);
            let list = pg_sys::RelationGetIndexList(heap);
            let n = if list.is_null() { 0 } else { (*list).length as usize };
            let mut indexes = Vec::with_capacity(n);
            for i in 0..n {
                let oid = (*(*list).elements.add(i)).oid_value;
                let idx = pg_sys::index_open(oid, pg_sys::RowExclusiveLock as i32);
                indexes.push((idx, pg_sys::BuildIndexInfo(idx)));
                // We form index entries from plain columns only. A DBA who adds an
                // expression or partial index to the ledger gets a clear error here
                // rather than a silently incomplete index.
                if !pg_sys::RelationGetIndexExpressions(idx).is_null()
                    || !pg_sys::RelationGetIndexPredicate(idx).is_null()
                {
                    pg_sys::panic::ErrorReport::new(
                        PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                        "pg_quota cannot maintain an expression or partial index on quota.ledger",
                        "pg_quota",
                    )
                    .set_hint("Drop the index; pg_quota creates the indexes it needs.")
                    .report(PgLogLevel::ERROR);
                }
            }
            OpenLedger { heap, indexes }
        }
    }

    /// Finds the ticket through the primary key under `snap`, and forms the tuple
    /// that would end it.
    fn find(&self, rels: &Rels, snap: &Latest, ticket: pgrx::Uuid, outcome: Outcome, now: pg_sys::TimestampTz) -> Option<Found> {
        let key = ticket.into_datum().unwrap();
        let mut found = None;
        counts::scan(rels.ledger, rels.ledger_pkey, snap, &[Key::UuidEq(key)], |slot| {
            // SAFETY: the slot holds a ledger tuple, pinned while we read it;
            // heap_form_tuple copies every value into the new tuple.
            unsafe {
                pg_sys::slot_getallattrs(slot);
                let mut values = std::slice::from_raw_parts((*slot).tts_values, NCOLS).to_vec();
                let mut nulls = std::slice::from_raw_parts((*slot).tts_isnull, NCOLS).to_vec();
                let holder = pg_sys::Oid::from(values[COL_ROLE - 1].value() as u32);
                let ended = !nulls[COL_ENDED_AT - 1];
                values[COL_ENDED_AT - 1] = now.into();
                nulls[COL_ENDED_AT - 1] = false;
                values[COL_OUTCOME - 1] = outcome.as_str().into_datum().unwrap();
                nulls[COL_OUTCOME - 1] = false;
                let desc = (*self.heap).rd_att;
                found = Some(Found {
                    tid: (*slot).tts_tid,
                    holder,
                    ended,
                    new_tuple: pg_sys::heap_form_tuple(desc, values.as_mut_ptr(), nulls.as_mut_ptr()),
                });
            }
            false
        });
        found
    }

    /// Replaces the found version with the ended one, waiting for a concurrent
    /// finish of the same ticket to commit or abort first, and adds the new
    /// version's index entries.
    fn update(&self, mut found: Found) -> pg_sys::TM_Result::Type {
        // SAFETY: the relation is open with RowExclusiveLock; heap_update WAL-logs the
        // change, takes the tuple lock, and checks SSI conflicts. No crosscheck
        // snapshot: we act on the latest committed version.
        unsafe {
            let mut tmfd: pg_sys::TM_FailureData = std::mem::zeroed();
            let mut lockmode: pg_sys::LockTupleMode::Type = 0;
            let cid = pg_sys::GetCurrentCommandId(true);
            #[cfg(feature = "pg15")]
            let (result, hot) = {
                let r = pg_sys::heap_update(
                    self.heap, &mut found.tid, found.new_tuple, cid, std::ptr::null_mut(), true,
                    &mut tmfd, &mut lockmode,
                );
                let hot = (*(*found.new_tuple).t_data).t_infomask2 as u32 & pg_sys::HEAP_ONLY_TUPLE != 0;
                (r, hot)
            };
            #[cfg(not(feature = "pg15"))]
            let (result, hot) = {
                let mut update_indexes = pg_sys::TU_UpdateIndexes::TU_None;
                let r = pg_sys::heap_update(
                    self.heap, &mut found.tid, found.new_tuple, cid, std::ptr::null_mut(), true,
                    &mut tmfd, &mut lockmode, &mut update_indexes,
                );
                (r, update_indexes == pg_sys::TU_UpdateIndexes::TU_None)
            };
            if result == pg_sys::TM_Result::TM_Ok && !hot {
                self.insert_index_entries(found.new_tuple);
            }
            pg_sys::heap_freetuple(found.new_tuple);
            result
        }
    }

    /// Inserts the index entries of a new, non-HOT tuple version into every index.
    unsafe fn insert_index_entries(&self, tuple: pg_sys::HeapTuple) {
        // SAFETY: the caller passes a tuple just stored by heap_update in our heap;
        // every index was checked in `open` to be on plain columns.
        unsafe {
            let mut values = [pg_sys::Datum::from(0); NCOLS];
            let mut nulls = [false; NCOLS];
            pg_sys::heap_deform_tuple(tuple, (*self.heap).rd_att, values.as_mut_ptr(), nulls.as_mut_ptr());
            for &(idx, info) in &self.indexes {
                let natts = (*info).ii_NumIndexAttrs as usize;
                let mut ivalues = [pg_sys::Datum::from(0); pg_sys::INDEX_MAX_KEYS as usize];
                let mut inulls = [false; pg_sys::INDEX_MAX_KEYS as usize];
                let mut unchanged = true;
                for k in 0..natts {
                    let attno = (*info).ii_IndexAttrNumbers[k] as usize;
                    ivalues[k] = values[attno - 1];
                    inulls[k] = nulls[attno - 1];
                    unchanged &= attno != COL_ENDED_AT && attno != COL_OUTCOME;
                }
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

impl Drop for OpenLedger {
    fn drop(&mut self) {
        // SAFETY: opened in `open`; NoLock keeps the locks to the end of the
        // transaction, as the executor does.
        unsafe {
            for &(idx, _) in &self.indexes {
                pg_sys::index_close(idx, pg_sys::NoLock as i32);
            }
            pg_sys::table_close(self.heap, pg_sys::NoLock as i32);
        }
    }
}
