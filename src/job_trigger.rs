//! Layer 5, the paths: the two triggers for a job queue's table (0.6.0).
//!
//! `quota.finish_job()` finishes a job's ticket when the queue ends the job, in the
//! queue's own transaction (its status update, or the delete of its row), so that no
//! transaction of the application's is needed for it. A row with no ticket (the column
//! NULL, a key missing, JSON null) and a ticket this database does not have (never
//! issued here, or purged after quota.retention) finish nothing; a ticket that has
//! ended already is left as it is (finish() returns false). A row whose value is not a
//! uuid (22P02), or whose ticket the firing role may not finish (42501), finishes
//! nothing with a WARNING: that is the job's data, and raising would fail the queue's
//! completion of every row of its statement, and have the queue run the job again, for
//! ever.
//!
//! `quota.claim_job()` renews a job's ticket to the trigger's lease when the queue
//! claims the job, in the claim's own transaction (BEFORE UPDATE). Where the ticket
//! cannot be renewed (it has ended, its lease ran out, this database does not have it,
//! the firing role may not renew it, it is not a uuid) it clears the ticket in the row
//! it returns (JSON null, or NULL), so that the run the queue hands out knows it holds
//! no slot and takes one of its own; the claim goes on. The last two with a WARNING.
//!
//! A mistake in either trigger's definition (its arguments, its column, how it fires)
//! raises, as a broken constraint would. core::job_trigger says what their arguments
//! mean.

#![allow(clippy::result_large_err)]

use std::ffi::{CStr, CString};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::core::job_trigger::{
    fires_as, parse_job_trigger, parse_uuid, Firing, JobAction, JobTrigger,
};
use crate::core::{JobFn, QuotaError};
use crate::encoding::server_text;
use crate::finish;

/// Runs a trigger of `func` whose data PostgreSQL passed: reads the ticket, and
/// finishes or renews it. Returns the row a BEFORE trigger hands back (claim_job():
/// the new row, its ticket cleared where it could not be renewed); null for finish_job().
///
/// # Safety
/// `data` is the TriggerData of a trigger call, as the trigger manager passes it.
pub unsafe fn fire(
    func: JobFn,
    data: &pg_sys::TriggerData,
) -> Result<pg_sys::HeapTuple, QuotaError> {
    // SAFETY: the trigger manager's Trigger, valid for this call.
    let trigger = unsafe { &*data.tg_trigger };
    // SAFETY: a NUL-terminated name in the trigger's descriptor.
    let name = server_text(unsafe { CStr::from_ptr(trigger.tgname) }.to_bytes());
    let event = data.tg_event;
    let op = event & pg_sys::TRIGGER_EVENT_OPMASK;
    let updated = op == pg_sys::TRIGGER_EVENT_UPDATE;
    let timing = event & pg_sys::TRIGGER_EVENT_TIMINGMASK;
    let how = Firing {
        row: event & pg_sys::TRIGGER_EVENT_ROW != 0,
        before: timing == pg_sys::TRIGGER_EVENT_BEFORE,
        instead: timing == pg_sys::TRIGGER_EVENT_INSTEAD,
        inserts: op == pg_sys::TRIGGER_EVENT_INSERT || op == pg_sys::TRIGGER_EVENT_TRUNCATE,
        updates: updated,
        deletes: op == pg_sys::TRIGGER_EVENT_DELETE,
    };
    if !fires_as(func, how) {
        return Err(QuotaError::TriggerMisfired {
            func,
            trigger: name,
        });
    }
    let args: Vec<&[u8]> = (0..trigger.tgnargs as usize)
        // SAFETY: tgargs holds tgnargs NUL-terminated strings.
        .map(|i| unsafe { CStr::from_ptr(*trigger.tgargs.add(i)) }.to_bytes())
        .collect();
    let spec = parse_job_trigger(func, &name, &args, server_text)?;
    // UPDATE: the row as the queue leaves it; DELETE: the row removed.
    let tuple = if updated {
        data.tg_newtuple
    } else {
        data.tg_trigtuple
    };
    let rel = data.tg_relation;
    match &spec.action {
        JobAction::Finish(outcome) => {
            finish::begin(c"quota.finish_job()");
            // SAFETY: the relation the trigger fired on and the row, as the trigger
            // manager passed them.
            let column = unsafe { ticket_column(&name, &spec, rel) }?;
            // SAFETY: as above; the column is one of the relation's.
            if let Some(Some(ticket)) = unsafe { job_ticket(&name, &spec, rel, column, tuple) }? {
                finish_job_ticket(&name, ticket, *outcome)?;
            }
            Ok(std::ptr::null_mut())
        }
        JobAction::Claim { lease } => {
            finish::begin(c"quota.claim_job()");
            let lease = lease_datum(&name, lease)?;
            // SAFETY: as above.
            let column = unsafe { ticket_column(&name, &spec, rel) }?;
            // SAFETY: as above.
            let Some(ticket) = (unsafe { job_ticket(&name, &spec, rel, column, tuple) })? else {
                return Ok(tuple);
            };
            let keep = match ticket {
                Some(ticket) => claim_job_ticket(&name, ticket, lease)?,
                None => false,
            };
            if keep {
                return Ok(tuple);
            }
            // SAFETY: the trigger's relation, its ticket's column and its new row.
            unsafe { cleared(&name, &spec, rel, column.0, tuple) }
        }
    }
}

/// The ticket of the job's row: None where there is none; Some(None) where the value
/// is not a uuid (a WARNING said so: the job's data, not the trigger's definition).
///
/// # Safety
/// `rel` and `tuple` are the trigger's relation and a row of it, `column` its ticket's
/// column as `ticket_column` found it.
unsafe fn job_ticket(
    name: &str,
    spec: &JobTrigger,
    rel: pg_sys::Relation,
    column: (i32, pg_sys::Oid),
    tuple: pg_sys::HeapTuple,
) -> Result<Option<Option<pgrx::Uuid>>, QuotaError> {
    // SAFETY: the caller's.
    let Some(text) = (unsafe { ticket_text(name, spec, rel, column, tuple) })? else {
        return Ok(None);
    };
    Ok(Some(match text {
        Ticket::Uuid(u) => Some(u),
        Ticket::Text(t) => match parse_uuid(&t) {
            Some(bytes) => Some(pgrx::Uuid::from_bytes(bytes)),
            None => {
                crate::error::warn(&QuotaError::TicketNotUuid {
                    func: spec.func(),
                    trigger: name.to_string(),
                    path: spec.path(server_text),
                    value: crate::core::ticket::ascii_escaped(&server_text(&t), 64),
                });
                None
            }
        },
    }))
}

/// finish_job(): finishes the ticket; one this database does not have, or that the
/// firing role may not finish (a WARNING), is left alone.
fn finish_job_ticket(
    name: &str,
    ticket: pgrx::Uuid,
    outcome: crate::core::Outcome,
) -> Result<(), QuotaError> {
    match finish::finish_ticket(ticket, outcome) {
        Ok(_) | Err(QuotaError::UnknownTicket(_)) => Ok(()),
        Err(QuotaError::ForeignTicket { ticket, .. }) => {
            warn_foreign(JobFn::Finish, name, ticket);
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// claim_job(): renews the ticket; true if it now runs to the new lease, false where
/// it must be cleared from the row (ended, lapsed, unknown here, or another role's: a
/// WARNING).
fn claim_job_ticket(
    name: &str,
    ticket: pgrx::Uuid,
    lease: pg_sys::Datum,
) -> Result<bool, QuotaError> {
    match finish::renew_ticket(ticket, lease, JobFn::Claim.action()) {
        Ok(finish::Renewal::Renewed(_)) => Ok(true),
        Ok(finish::Renewal::Ended { .. }) | Err(QuotaError::UnknownTicket(_)) => Ok(false),
        Err(QuotaError::ForeignTicket { ticket, .. }) => {
            warn_foreign(JobFn::Claim, name, ticket);
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// The WARNING for a job's ticket that the firing role may not finish or renew.
fn warn_foreign(func: JobFn, name: &str, ticket: String) {
    // SAFETY: the current user's name, from the syscache (it exists: we run as it).
    let firing_role = server_text(
        unsafe { CStr::from_ptr(pg_sys::GetUserNameFromId(pg_sys::GetUserId(), false)) }.to_bytes(),
    );
    crate::error::warn(&QuotaError::JobTicketForeign {
        func,
        trigger: name.to_string(),
        ticket,
        firing_role,
    });
}

/// The shortest lease a claim_job() trigger gives (microseconds).
const MIN_CLAIM_LEASE_US: i64 = 1_000_000;

/// claim_job()'s lease argument as an interval datum; 22023 if it is not an interval
/// longer than zero (interval input's own errors are raised as they are).
fn lease_datum(name: &str, lease: &[u8]) -> Result<pg_sys::Datum, QuotaError> {
    let text = CString::new(lease).expect("trigger arguments have no NUL");
    // SAFETY: interval_in reads a NUL-terminated string (raising on bad input, as a
    // cast would), its type's oid and typmod -1; called directly, with no catalog
    // lookup of the input function at each firing.
    let datum = unsafe {
        pgrx::direct_function_call_as_datum(
            pg_sys::interval_in,
            &[
                Some(pg_sys::Datum::from(text.as_ptr())),
                Some(pg_sys::Datum::from(pg_sys::INTERVALOID)),
                Some(pg_sys::Datum::from(-1i32)),
            ],
        )
    }
    .expect("interval input returns a value");
    // A field below zero would make the lease's length depend on the date (a month
    // less thirty days) or on IntervalStyle: each of months, days and time must be at
    // least zero, and their sum longer than zero.
    // SAFETY: interval_in returns a pointer to an Interval.
    let fields = unsafe { *datum.cast_mut_ptr::<pg_sys::Interval>() };
    // SAFETY: plain read of the clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let why = if fields.month < 0 || fields.day < 0 || fields.time < 0 {
        Some("has a field below zero")
    } else if crate::timestamps::lease_end(now, datum)
        .map_or(true, |until| until - now < MIN_CLAIM_LEASE_US)
    {
        // A lease that short would run out before the worker starts the job it
        // claimed, which would run with a ticket that holds no slot.
        Some("is shorter than a second")
    } else {
        None
    };
    if let Some(why) = why {
        return Err(QuotaError::TriggerArguments {
            func: JobFn::Claim,
            trigger: name.to_string(),
            why: format!("The lease \"{}\" {why}.", server_text(lease)),
        });
    }
    Ok(datum)
}

/// The trigger's new row with its ticket cleared: JSON null at the path in a jsonb
/// column, NULL in a uuid or text column.
///
/// # Safety
/// `rel` and `tuple` are the trigger's relation and its new row, `attnum` its ticket's
/// column as `ticket_column` found it.
unsafe fn cleared(
    name: &str,
    spec: &JobTrigger,
    rel: pg_sys::Relation,
    attnum: i32,
    tuple: pg_sys::HeapTuple,
) -> Result<pg_sys::HeapTuple, QuotaError> {
    // A NOT NULL constraint added since CREATE TRIGGER: an error that says why,
    // rather than the constraint's.
    // SAFETY: as above; attnum is one of its columns.
    unsafe { refuse_unclearable(name, spec, rel, attnum) }?;
    let (mut value, mut isnull) = (pg_sys::Datum::from(0), true);
    if !spec.keys.is_empty() {
        // SAFETY: the row's jsonb column (ticket_column checked its type for a claim),
        // not null (a ticket was read from it); jsonb_set(doc, keys, 'null', false)
        // and the inputs it takes, built from the keys' bytes.
        unsafe {
            let mut null = false;
            let doc = pg_sys::SPI_getbinval(tuple, (*rel).rd_att, attnum, &mut null);
            let keys: Vec<pg_sys::Datum> = spec
                .keys
                .iter()
                .map(|k| {
                    pg_sys::Datum::from(pg_sys::cstring_to_text_with_len(
                        k.as_ptr().cast(),
                        k.len() as i32,
                    ))
                })
                .collect();
            let path = pg_sys::construct_array(
                keys.as_ptr().cast_mut(),
                keys.len() as i32,
                pg_sys::TEXTOID,
                -1,
                false,
                pg_sys::TYPALIGN_INT as std::os::raw::c_char,
            );
            let json_null = pgrx::direct_function_call_as_datum(
                pg_sys::jsonb_in,
                &[Some(pg_sys::Datum::from(c"null".as_ptr()))],
            )
            .expect("jsonb 'null'");
            value = pgrx::direct_function_call_as_datum(
                pg_sys::jsonb_set,
                &[
                    Some(doc),
                    Some(pg_sys::Datum::from(path)),
                    Some(json_null),
                    Some(pg_sys::Datum::from(false)),
                ],
            )
            .expect("jsonb_set of a document");
            isnull = false;
        }
    }
    let mut column = attnum;
    // SAFETY: one column of the row replaced, through the relation's descriptor.
    Ok(unsafe {
        pg_sys::heap_modify_tuple_by_cols(
            tuple,
            (*rel).rd_att,
            1,
            &mut column,
            &mut value,
            &mut isnull,
        )
    })
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
            func: spec.func(),
            trigger: trigger.to_string(),
            column: server_text(&spec.column),
            // SAFETY: the open relation's name.
            relation: server_text(
                unsafe { CStr::from_ptr((*(*rel).rd_rel).relname.data.as_ptr()) }.to_bytes(),
            ),
        });
    }
    // SAFETY: attnum names a column (or a system column, below zero) of tupdesc.
    let declared = unsafe { pg_sys::SPI_gettypeid(tupdesc, attnum) };
    // SAFETY: a syscache lookup of a type that exists.
    let type_oid = unsafe { pg_sys::getBaseType(declared) };
    let with_keys = !spec.keys.is_empty();
    // claim_job() writes the column where it clears a ticket: JSON null in jsonb (not
    // json, which it would re-format), NULL in the others; not through a domain, whose
    // constraints a trigger's write would bypass.
    let claim = spec.func() == JobFn::Claim;
    let readable = attnum > 0
        && !(claim && declared != type_oid)
        && match type_oid {
            pg_sys::UUIDOID | pg_sys::TEXTOID | pg_sys::VARCHAROID => !with_keys,
            pg_sys::JSONOID => with_keys && !claim,
            pg_sys::JSONBOID => with_keys,
            _ => false,
        };
    if !readable {
        return Err(QuotaError::TicketColumnType {
            func: spec.func(),
            trigger: trigger.to_string(),
            column: server_text(&spec.column),
            // SAFETY: format_type_be names any type oid (or says ???).
            type_name: server_text(
                unsafe {
                    CStr::from_ptr(pg_sys::format_type_be(if claim {
                        declared
                    } else {
                        type_oid
                    }))
                }
                .to_bytes(),
            ),
        });
    }
    Ok((attnum, type_oid))
}

/// Refuses column `attnum` of `rel` if it is a virtual generated column (PostgreSQL
/// 18), which is never computed for triggers: it would read as NULL for every row, and
/// finish nothing, silently. Checked at CREATE TRIGGER, and at firing only for a NULL,
/// the one value such a column shows.
///
/// # Safety
/// `rel` is an open relation and `attnum` one of its columns (from ticket_column).
unsafe fn refuse_virtual(
    trigger: &str,
    spec: &JobTrigger,
    rel: pg_sys::Relation,
    attnum: i32,
) -> Result<(), QuotaError> {
    // SAFETY: the caller's.
    if unsafe { column_attr(rel, attnum) }.attgenerated as u8 == b'v' {
        return Err(QuotaError::TicketColumnVirtual {
            func: spec.func(),
            trigger: trigger.to_string(),
            column: server_text(&spec.column),
        });
    }
    Ok(())
}

/// 0.6.0: checks a quota.finish_job() or quota.claim_job() trigger (`func`) when it is
/// created (hooks/guard.rs), as its firing would: how it fires (`tgtype`, pg_trigger's
/// bits), its arguments, and the column on table `relid`, whose number it returns (the
/// hook makes the trigger depend on it). So a mistake in the definition is refused at
/// CREATE TRIGGER rather than in the queue's first completion or claim; a column
/// renamed later is met when it fires.
pub fn check_created(
    func: JobFn,
    trigger: &str,
    tgtype: i16,
    relid: pg_sys::Oid,
    args: &[&[u8]],
) -> Result<i32, QuotaError> {
    let t = tgtype as u32;
    let how = Firing {
        row: t & pg_sys::TRIGGER_TYPE_ROW != 0,
        before: t & pg_sys::TRIGGER_TYPE_BEFORE != 0,
        instead: t & pg_sys::TRIGGER_TYPE_INSTEAD != 0,
        inserts: t & (pg_sys::TRIGGER_TYPE_INSERT | pg_sys::TRIGGER_TYPE_TRUNCATE) != 0,
        updates: t & pg_sys::TRIGGER_TYPE_UPDATE != 0,
        deletes: t & pg_sys::TRIGGER_TYPE_DELETE != 0,
    };
    if !fires_as(func, how) {
        return Err(QuotaError::TriggerMisfired {
            func,
            trigger: trigger.to_string(),
        });
    }
    let spec = parse_job_trigger(func, trigger, args, server_text)?;
    if let JobAction::Claim { lease } = &spec.action {
        lease_datum(trigger, lease)?;
    }
    // SAFETY: CREATE TRIGGER holds a lock on the table; we add a weaker one.
    unsafe {
        let rel = pg_sys::relation_open(relid, pg_sys::AccessShareLock as i32);
        let checked = ticket_column(trigger, &spec, rel)
            .and_then(|(attnum, _)| refuse_virtual(trigger, &spec, rel, attnum).map(|()| attnum))
            .and_then(|attnum| refuse_unclearable(trigger, &spec, rel, attnum).map(|()| attnum));
        pg_sys::relation_close(rel, pg_sys::AccessShareLock as i32);
        checked
    }
}

/// Column `attnum` of `rel`, as its descriptor says.
///
/// # Safety
/// `rel` is an open relation and `attnum` a user column of it (from ticket_column).
unsafe fn column_attr<'a>(rel: pg_sys::Relation, attnum: i32) -> &'a pg_sys::FormData_pg_attribute {
    // SAFETY: the caller's; the descriptor lives as long as the open relation.
    unsafe { &*crate::compat::tuple_desc_attr((*rel).rd_att, attnum as usize - 1) }
}

/// Refuses, for quota.claim_job(), a column it could not clear a ticket in: a uuid or
/// text column declared NOT NULL (the trigger clears a ticket it cannot renew by
/// setting the column to NULL, which the constraint would turn into a failed claim,
/// again at every try of the queue), or a generated column (computed again after
/// BEFORE triggers, from the values the trigger cannot see changed: the cleared ticket
/// would come back).
///
/// # Safety
/// `rel` is an open relation and `attnum` one of its columns.
unsafe fn refuse_unclearable(
    trigger: &str,
    spec: &JobTrigger,
    rel: pg_sys::Relation,
    attnum: i32,
) -> Result<(), QuotaError> {
    if spec.func() != JobFn::Claim {
        return Ok(());
    }
    // SAFETY: the caller's.
    let attr = unsafe { column_attr(rel, attnum) };
    let generated = attr.attgenerated as u8 != 0;
    if generated || (attr.attnotnull && spec.keys.is_empty()) {
        return Err(QuotaError::TicketColumnNotNull {
            trigger: trigger.to_string(),
            column: server_text(&spec.column),
            generated,
        });
    }
    Ok(())
}

/// The ticket in `tuple` where `spec` says, None where there is none.
///
/// # Safety
/// `rel` and `tuple` are the trigger's relation and a row of it, `column` (number,
/// base type) its ticket's column as `ticket_column` found it.
unsafe fn ticket_text(
    trigger: &str,
    spec: &JobTrigger,
    rel: pg_sys::Relation,
    (attnum, type_oid): (i32, pg_sys::Oid),
    tuple: pg_sys::HeapTuple,
) -> Result<Option<Ticket>, QuotaError> {
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
