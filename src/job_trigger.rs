//! Layer 5, the paths: `quota.finish_job()` (0.6.0), a trigger that finishes a job's
//! ticket when the queue ends the job, in the queue's own transaction (its status
//! update, or the delete of its row), so that no transaction of the application's is
//! needed for it. core::job_trigger says what its arguments mean; this reads the
//! ticket from the row and hands it to finish().
//!
//! A row with no ticket (the column NULL, a key missing, JSON null) and a ticket this
//! database does not have (never issued here, or purged after quota.retention) finish
//! nothing; a ticket that has ended already is left as it is (finish() returns false).
//! A row whose value is not a uuid (22P02), or whose ticket the firing role may not
//! finish (42501), finishes nothing with a WARNING: that is the job's data, and raising
//! would fail the queue's completion of every row of its statement, and have the queue
//! run the job again, for ever. A mistake in the trigger's definition (its arguments,
//! its column, how it fires) raises, as a broken constraint would.

#![allow(clippy::result_large_err)]

use std::ffi::{CStr, CString};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::core::job_trigger::{parse_job_trigger, parse_uuid, JobTrigger};
use crate::core::QuotaError;
use crate::encoding::server_text;
use crate::finish;

/// Runs the trigger whose data PostgreSQL passed: reads the ticket and finishes it.
///
/// # Safety
/// `data` is the TriggerData of a trigger call, as the trigger manager passes it.
pub unsafe fn fire(data: &pg_sys::TriggerData) -> Result<(), QuotaError> {
    // SAFETY: the trigger manager's Trigger, valid for this call.
    let trigger = unsafe { &*data.tg_trigger };
    // SAFETY: a NUL-terminated name in the trigger's descriptor.
    let name = server_text(unsafe { CStr::from_ptr(trigger.tgname) }.to_bytes());
    let event = data.tg_event;
    let op = event & pg_sys::TRIGGER_EVENT_OPMASK;
    let updated = op == pg_sys::TRIGGER_EVENT_UPDATE;
    let row_after = event & pg_sys::TRIGGER_EVENT_ROW != 0
        && event & pg_sys::TRIGGER_EVENT_TIMINGMASK == pg_sys::TRIGGER_EVENT_AFTER;
    if !row_after || !(updated || op == pg_sys::TRIGGER_EVENT_DELETE) {
        return Err(QuotaError::TriggerMisfired { trigger: name });
    }
    let args: Vec<&[u8]> = (0..trigger.tgnargs as usize)
        // SAFETY: tgargs holds tgnargs NUL-terminated strings.
        .map(|i| unsafe { CStr::from_ptr(*trigger.tgargs.add(i)) }.to_bytes())
        .collect();
    let spec = parse_job_trigger(&name, &args, server_text)?;
    finish::begin(c"quota.finish_job()");
    // UPDATE: the row as the queue left it; DELETE: the row removed.
    let tuple = if updated {
        data.tg_newtuple
    } else {
        data.tg_trigtuple
    };
    // SAFETY: the relation the trigger fired on and the row, as the trigger manager
    // passed them.
    let Some(text) = (unsafe { ticket_text(&name, &spec, data.tg_relation, tuple) })? else {
        return Ok(());
    };
    let ticket = match text {
        Ticket::Uuid(u) => u,
        Ticket::Text(t) => match parse_uuid(&t) {
            Some(bytes) => pgrx::Uuid::from_bytes(bytes),
            None => {
                // The job's data, not the trigger's definition: the queue's statement
                // goes on (see the module's comment).
                crate::error::warn(&QuotaError::TicketNotUuid {
                    trigger: name,
                    path: spec.path(server_text),
                    value: crate::core::ticket::ascii_escaped(&server_text(&t), 64),
                });
                return Ok(());
            }
        },
    };
    match finish::finish_ticket(ticket, spec.outcome) {
        Ok(_) | Err(QuotaError::UnknownTicket(_)) => Ok(()),
        Err(QuotaError::ForeignTicket { ticket, .. }) => {
            // SAFETY: the current user's name, from the syscache (it exists: we run as it).
            let firing_role = server_text(
                unsafe { CStr::from_ptr(pg_sys::GetUserNameFromId(pg_sys::GetUserId(), false)) }
                    .to_bytes(),
            );
            crate::error::warn(&QuotaError::JobTicketForeign {
                trigger: name,
                ticket,
                firing_role,
            });
            Ok(())
        }
        Err(e) => Err(e),
    }
}

enum Ticket {
    Uuid(pgrx::Uuid),
    /// Text in the server encoding.
    Text(Vec<u8>),
}

/// The column `spec` names in `rel`: its number and its base type, or the error that
/// says why it cannot hold a ticket.
///
/// # Safety
/// `rel` is an open relation.
unsafe fn ticket_column(
    trigger: &str,
    spec: &JobTrigger,
    rel: pg_sys::Relation,
) -> Result<(i32, pg_sys::Oid), QuotaError> {
    // SAFETY: the caller's open relation.
    let tupdesc = unsafe { (*rel).rd_att };
    let column = CString::new(spec.column.clone()).expect("trigger arguments have no NUL");
    // SAFETY: a lookup in the descriptor; dropped columns are skipped.
    let attnum = unsafe { pg_sys::SPI_fnumber(tupdesc, column.as_ptr()) };
    if attnum == pg_sys::SPI_ERROR_NOATTRIBUTE {
        return Err(QuotaError::TicketColumnMissing {
            trigger: trigger.to_string(),
            column: server_text(&spec.column),
            // SAFETY: the open relation's name.
            relation: server_text(
                unsafe { CStr::from_ptr((*(*rel).rd_rel).relname.data.as_ptr()) }.to_bytes(),
            ),
        });
    }
    // SAFETY: attnum names a column (or a system column, below zero) of tupdesc.
    let type_oid = unsafe { pg_sys::getBaseType(pg_sys::SPI_gettypeid(tupdesc, attnum)) };
    let with_keys = !spec.keys.is_empty();
    let readable = attnum > 0
        && match type_oid {
            pg_sys::UUIDOID | pg_sys::TEXTOID | pg_sys::VARCHAROID => !with_keys,
            pg_sys::JSONOID | pg_sys::JSONBOID => with_keys,
            _ => false,
        };
    if !readable {
        return Err(QuotaError::TicketColumnType {
            trigger: trigger.to_string(),
            column: server_text(&spec.column),
            // SAFETY: format_type_be names any type oid (or says ???).
            type_name: server_text(
                unsafe { CStr::from_ptr(pg_sys::format_type_be(type_oid)) }.to_bytes(),
            ),
        });
    }
    Ok((attnum, type_oid))
}

/// Refuses column `attnum` of `rel` if it is a virtual generated column (PostgreSQL
/// 18), which is never computed for triggers: it would read as NULL for every row, and
/// finish nothing, silently. A catalog lookup: made at CREATE TRIGGER, and at firing
/// only for a NULL, the one value such a column shows.
///
/// # Safety
/// `rel` is an open relation.
unsafe fn refuse_virtual(
    trigger: &str,
    spec: &JobTrigger,
    rel: pg_sys::Relation,
    attnum: i32,
) -> Result<(), QuotaError> {
    // SAFETY: a catalog lookup of the caller's relation's column.
    if unsafe { pg_sys::get_attgenerated((*rel).rd_id, attnum as i16) } as u8 == b'v' {
        return Err(QuotaError::TicketColumnVirtual {
            trigger: trigger.to_string(),
            column: server_text(&spec.column),
        });
    }
    Ok(())
}

/// 0.6.0: checks a quota.finish_job() trigger when it is created (hooks/guard.rs), as
/// its firing would: how it fires (`tgtype`, pg_trigger's bits), its arguments, and the
/// column on table `relid`, whose number it returns (the hook makes the trigger depend
/// on it). So a mistake in the definition is refused at CREATE TRIGGER rather than in
/// the queue's first completion; a column renamed later is met when it fires.
pub fn check_created(
    trigger: &str,
    tgtype: i16,
    relid: pg_sys::Oid,
    args: &[&[u8]],
) -> Result<i32, QuotaError> {
    let t = tgtype as u32;
    let row_after = t & pg_sys::TRIGGER_TYPE_ROW != 0
        && t & (pg_sys::TRIGGER_TYPE_BEFORE | pg_sys::TRIGGER_TYPE_INSTEAD) == 0;
    let ends_jobs = t & (pg_sys::TRIGGER_TYPE_UPDATE | pg_sys::TRIGGER_TYPE_DELETE) != 0
        && t & (pg_sys::TRIGGER_TYPE_INSERT | pg_sys::TRIGGER_TYPE_TRUNCATE) == 0;
    if !row_after || !ends_jobs {
        return Err(QuotaError::TriggerMisfired {
            trigger: trigger.to_string(),
        });
    }
    let spec = parse_job_trigger(trigger, args, server_text)?;
    // SAFETY: CREATE TRIGGER holds a lock on the table; we add a weaker one.
    unsafe {
        let rel = pg_sys::relation_open(relid, pg_sys::AccessShareLock as i32);
        let checked = ticket_column(trigger, &spec, rel)
            .and_then(|(attnum, _)| refuse_virtual(trigger, &spec, rel, attnum).map(|()| attnum));
        pg_sys::relation_close(rel, pg_sys::AccessShareLock as i32);
        checked
    }
}

/// The ticket in `tuple` where `spec` says, None where there is none.
///
/// # Safety
/// `rel` and `tuple` are the trigger's relation and a row of it.
unsafe fn ticket_text(
    trigger: &str,
    spec: &JobTrigger,
    rel: pg_sys::Relation,
    tuple: pg_sys::HeapTuple,
) -> Result<Option<Ticket>, QuotaError> {
    // SAFETY: the trigger's open relation.
    let (attnum, type_oid) = unsafe { ticket_column(trigger, spec, rel) }?;
    let mut isnull = false;
    // SAFETY: a column of the row, read through the relation's descriptor.
    let value = unsafe { pg_sys::SPI_getbinval(tuple, (*rel).rd_att, attnum, &mut isnull) };
    if isnull {
        // SAFETY: the trigger's open relation.
        unsafe { refuse_virtual(trigger, spec, rel, attnum) }?;
        return Ok(None);
    }
    Ok(match type_oid {
        // SAFETY: a non-null uuid datum points at its 16 bytes.
        pg_sys::UUIDOID => Some(Ticket::Uuid(
            unsafe { pgrx::Uuid::from_datum(value, false) }.expect("not null"),
        )),
        pg_sys::TEXTOID | pg_sys::VARCHAROID => Some(Ticket::Text(text_bytes(value))),
        // SAFETY: a json or jsonb datum, and the keys as text.
        json => unsafe { follow(json == pg_sys::JSONBOID, value, &spec.keys) }.map(Ticket::Text),
    })
}

/// Follows `keys` from a json (or jsonb) document: the last key's value as text, None
/// where a key is missing, a value on the way is not an object, or the value is null,
/// as `->` and `->>` answer. For `json`, PostgreSQL de-escapes the strings it walks
/// through, and raises where it cannot (`\u0000`, a lone surrogate), as `->>` does:
/// that fails the queue's statement (USER_GUIDE says so; `jsonb` stores them already
/// de-escaped, and never raises here).
///
/// # Safety
/// `doc` is a non-null json (jsonb when `jsonb`) datum.
unsafe fn follow(jsonb: bool, doc: pg_sys::Datum, keys: &[Vec<u8>]) -> Option<Vec<u8>> {
    let (field, field_text): (unsafe fn(pg_sys::FunctionCallInfo) -> pg_sys::Datum, _) = if jsonb {
        (
            pg_sys::jsonb_object_field as _,
            pg_sys::jsonb_object_field_text as _,
        )
    } else {
        (
            pg_sys::json_object_field as _,
            pg_sys::json_object_field_text as _,
        )
    };
    let mut doc = doc;
    for (i, key) in keys.iter().enumerate() {
        // SAFETY: a text datum made from the key's bytes.
        let key =
            unsafe { pg_sys::cstring_to_text_with_len(key.as_ptr().cast(), key.len() as i32) };
        let f = if i + 1 == keys.len() {
            field_text
        } else {
            field
        };
        // SAFETY: the json functions take (document, key) and return NULL for a miss;
        // they use no flinfo and no collation.
        doc = unsafe {
            pgrx::direct_function_call_as_datum(f, &[Some(doc), Some(pg_sys::Datum::from(key))])
        }?;
    }
    Some(text_bytes(doc))
}

/// The bytes of a non-null text datum (detoasted), in the server encoding.
fn text_bytes(value: pg_sys::Datum) -> Vec<u8> {
    // SAFETY: a non-null text (or varchar) datum; text_to_cstring detoasts it.
    unsafe {
        let cstr = pg_sys::text_to_cstring(value.cast_mut_ptr());
        let bytes = CStr::from_ptr(cstr).to_bytes().to_vec();
        pg_sys::pfree(cstr.cast());
        bytes
    }
}
