//! Layer 1: time arithmetic as the server does it (in the session's time zone, with its
//! ranges and errors), and timestamps as text.

use pgrx::pg_sys;

use crate::core::QuotaError;

/// The instant before which ended tickets no longer count.
pub fn cutoff(now: pg_sys::TimestampTz, retention_secs: i64) -> pg_sys::TimestampTz {
    now.saturating_sub(retention_secs.saturating_mul(1_000_000))
}

/// `ts + interval`, as PostgreSQL computes `timestamptz + interval` in this session
/// (months and days follow the calendar in the session's time zone).
pub fn plus(ts: pg_sys::TimestampTz, interval: pg_sys::Datum) -> pg_sys::TimestampTz {
    // SAFETY: timestamptz_pl_interval takes a timestamptz and an interval datum, and
    // raises 22008 when the result is out of range.
    unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(
            pg_sys::timestamptz_pl_interval,
            &[Some(ts.into()), Some(interval)],
        )
        .expect("timestamptz + interval is not null")
        .value() as i64
    }
}

/// The interval's text, for error messages.
pub fn interval_text(interval: pg_sys::Datum) -> String {
    // SAFETY: interval_out returns a palloc'd C string.
    unsafe {
        let p =
            pgrx::fcinfo::direct_function_call_as_datum(pg_sys::interval_out, &[Some(interval)])
                .expect("interval_out is not null");
        std::ffi::CStr::from_ptr(p.cast_mut_ptr())
            .to_string_lossy()
            .into_owned()
    }
}

/// `now + lease`, for a lease that must be longer than zero (22023 otherwise): what
/// start() and renew() give a ticket.
pub fn lease_end(
    now: pg_sys::TimestampTz,
    lease: pg_sys::Datum,
) -> Result<pg_sys::TimestampTz, QuotaError> {
    let until = plus(now, lease);
    if until <= now {
        return Err(QuotaError::InvalidInterval {
            what: "lease",
            value: interval_text(lease),
        });
    }
    Ok(until)
}

/// When the lease of a ticket started at `now` runs out: `now + lease`, or, without
/// one, `now + default_secs` (quota.default_lease as it applies to the charged role;
/// None when that is 0: the ticket never expires). A lease must be longer than zero.
pub fn lease_until(
    now: pg_sys::TimestampTz,
    lease: Option<pg_sys::Datum>,
    default_secs: i64,
) -> Result<Option<pg_sys::TimestampTz>, QuotaError> {
    match lease {
        Some(l) => lease_end(now, l).map(Some),
        None => Ok(match default_secs {
            0 => None,
            secs => Some(now.saturating_add(secs.saturating_mul(1_000_000))),
        }),
    }
}

/// A timestamptz as PostgreSQL prints it in this session.
pub fn format_ts(ts: pg_sys::TimestampTz) -> String {
    // SAFETY: timestamptz_to_str formats into a static buffer that we copy at once.
    unsafe {
        std::ffi::CStr::from_ptr(pg_sys::timestamptz_to_str(ts))
            .to_string_lossy()
            .into_owned()
    }
}
