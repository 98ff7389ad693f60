//! The start path in the caller's backend: argument checks, the scope lock, the fast
//! path that refuses without bothering the writer, and the hand-off to the writer.

use pgrx::pg_sys;

use crate::core::{check_label, decide, Decision, Limits, QuotaError, Refusal, RefusalKind, Usage};
use crate::counts::{self, Latest, Reader};
use crate::error::raise;
use crate::writer::{self, Answer};
use crate::{gucs, shmem};

/// The scope lock's field4. SQL advisory locks live in the user lock method with
/// field4 = 1 or 2; ours lives in the default lock method (so that transaction end
/// and the deadlock detector treat it like any table lock) with a private field4. No
/// `pg_advisory_*` call can produce this tag, block admission or bypass it (I4).
/// tests/isolation/specs/advisory_squat.spec hangs and fails if it could.
pub const SCOPE_LOCK_FIELD4: u16 = 0x5153; // "QS"

/// How long a caller sleeps while requests of its scope that could tip it over the
/// limit are in the writer's hands. They resolve within one writer commit.
const INFLIGHT_POLL_MS: i64 = 1;

/// The instant before which ended tickets no longer count.
pub fn cutoff(now: pg_sys::TimestampTz, retention_secs: i64) -> pg_sys::TimestampTz {
    now.saturating_sub(retention_secs.saturating_mul(1_000_000))
}

/// What admission needs to count for `limits`: the active count up to the limit (one
/// more would not change the decision), the retained count only if it is limited.
pub fn usage_for(
    r: &Reader,
    snap: &Latest,
    role: pg_sys::Oid,
    cutoff: pg_sys::TimestampTz,
    limits: Limits,
) -> Usage {
    let max_active = (limits.max_active > 0).then_some(limits.max_active);
    counts::usage(r, snap, role, cutoff, max_active, limits.max_retained > 0)
}

/// The full numbers for a refusal's message, and when capacity returns if the
/// retained limit is the one reached.
pub fn refusal_numbers(
    reader: &Reader,
    snap: &Latest,
    role: pg_sys::Oid,
    cutoff: pg_sys::TimestampTz,
    retention_secs: i64,
    kind: RefusalKind,
) -> (Usage, Option<pg_sys::TimestampTz>) {
    let r = &reader.rels;
    let (active, rows) = counts::scope(reader, snap, role);
    // As in counts::usage: a snapshot that sees every purge the counter reflects.
    let usage = Usage {
        active,
        retained: rows - counts::expired(r, &Latest::take(), role, cutoff),
    };
    let next = (kind == RefusalKind::Retained)
        .then(|| counts::oldest_ended(r, snap, role, cutoff))
        .flatten()
        .map(|t| t.saturating_add(retention_secs.saturating_mul(1_000_000)));
    (usage, next)
}

/// Checks that the library was preloaded (its shared memory exists).
pub fn require_preloaded() {
    if !shmem::available() {
        raise(QuotaError::NotPreloaded);
    }
}

/// The checks every pg_quota function makes first: the library is preloaded, and we
/// are not in a parallel operation. A parallel worker cannot write, nor hand a request
/// to the writer on the leader's behalf, so pg_quota refuses there as nextval() does
/// (25000), even when a user's wrapper function is wrongly marked PARALLEL SAFE.
pub fn require_callable(name: &std::ffi::CStr) {
    require_preloaded();
    // SAFETY: raises ERROR or returns.
    unsafe { pg_sys::PreventCommandIfParallelMode(name.as_ptr()) };
}

/// Holds the scope lock for (database, role) until dropped.
///
/// It makes "count, then hand over" atomic per scope, so that two callers cannot both
/// take the last slot. Taken under TopTransactionResourceOwner, as sequence.c's
/// open_share_lock() does, so that no subtransaction abort can release it behind our
/// back; and released explicitly as soon as our request is handed to the writer.
/// Holding it while the writer commits would serialize the role's starts behind one
/// WAL flush each; holding it to the end of the caller's transaction would serialize
/// the role's long transactions, for nothing, since the charge is committed by then.
struct ScopeLock(pg_sys::LOCKTAG);

impl ScopeLock {
    fn acquire(role: pg_sys::Oid) -> ScopeLock {
        let tag = pg_sys::LOCKTAG {
            locktag_field1: u32::from(shmem::my_db()),
            locktag_field2: u32::from(role),
            locktag_field3: 0,
            locktag_field4: SCOPE_LOCK_FIELD4,
            locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
            locktag_lockmethodid: pg_sys::DEFAULT_LOCKMETHOD as u8,
        };
        with_top_owner(|| {
            // SAFETY: an ordinary transaction-level lock; lock_timeout, cancel and the
            // deadlock detector all apply while we wait for it.
            unsafe { pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as i32, false, false) };
        });
        ScopeLock(tag)
    }
}

impl Drop for ScopeLock {
    /// Runs on return and on an ERROR's unwind alike. In the second case a
    /// subtransaction abort would not release a TopTransactionResourceOwner lock, so
    /// a PL/pgSQL block that catches the error would hold up the scope until its top
    /// transaction ends; releasing here avoids that.
    fn drop(&mut self) {
        with_top_owner(|| {
            // SAFETY: we took this lock under the same owner in `acquire`.
            unsafe { pg_sys::LockRelease(&self.0, pg_sys::ExclusiveLock as i32, false) };
        });
    }
}

fn with_top_owner<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(pg_sys::ResourceOwner);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts back the owner saved below.
            unsafe { pg_sys::CurrentResourceOwner = self.0 };
        }
    }
    // SAFETY: inside a transaction TopTransactionResourceOwner is valid.
    let _restore = unsafe {
        let saved = pg_sys::CurrentResourceOwner;
        pg_sys::CurrentResourceOwner = pg_sys::TopTransactionResourceOwner;
        Restore(saved)
    };
    f()
}

pub fn role_name(role: pg_sys::Oid) -> String {
    // SAFETY: returns a palloc'd copy; noerr so a dropped role prints its oid.
    unsafe {
        let p = pg_sys::GetUserNameFromId(role, true);
        if p.is_null() {
            u32::from(role).to_string()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

fn format_ts(ts: pg_sys::TimestampTz) -> String {
    // SAFETY: timestamptz_to_str formats into a static buffer that we copy at once.
    unsafe {
        std::ffi::CStr::from_ptr(pg_sys::timestamptz_to_str(ts))
            .to_string_lossy()
            .into_owned()
    }
}

fn refusal(
    role: pg_sys::Oid,
    kind: RefusalKind,
    usage: Usage,
    next: Option<pg_sys::TimestampTz>,
) -> QuotaError {
    QuotaError::Refused {
        role: role_name(role),
        refusal: Refusal {
            kind,
            usage,
            limits: gucs::limits(),
        },
        next_ageout: next.map(format_ts),
    }
}

/// Admits one ticket for `current_user`, or returns the refusal (53400) as an error
/// value so that try_start can turn it into NULL. Every other error raises.
///
/// `label` is text in the server encoding, passed through as bytes: a LATIN1 or
/// SQL_ASCII database has labels that are not UTF-8, and its characters are counted
/// by the server's rules.
pub fn start(label: Option<&[u8]>, name: &std::ffi::CStr) -> Result<pgrx::Uuid, QuotaError> {
    require_callable(name);
    // A standby or a read-only transaction refuses with 25006, as nextval() does:
    // the charge is a write, even though it is not the caller's own.
    // SAFETY: both raise ERROR or return.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(name.as_ptr());
        pg_sys::PreventCommandIfReadOnly(name.as_ptr());
    }
    if let Some(l) = label {
        // SAFETY: counts the characters of `l` in the server encoding; the length is
        // that of a text datum, which fits in an int.
        let chars = unsafe { pg_sys::pg_mbstrlen_with_len(l.as_ptr().cast(), l.len() as i32) };
        check_label(chars as usize, l.len())?;
    }
    // SAFETY: plain reads of backend state.
    let (role, exempt) = unsafe {
        let role = pg_sys::GetUserId();
        (role, pg_sys::superuser_arg(role))
    };
    let limits = gucs::limits();
    let retention = gucs::retention_secs();
    let fill = |r: &mut shmem::Request| {
        r.exempt = exempt;
        r.max_active = limits.max_active;
        r.max_retained = limits.max_retained;
        r.retention_secs = retention;
        r.has_label = label.is_some();
        let bytes = label.unwrap_or(b"");
        r.label[..bytes.len()].copy_from_slice(bytes);
        r.label_len = bytes.len();
    };

    let unlimited = limits.max_active == 0 && limits.max_retained == 0;
    let answer = if exempt || unlimited {
        // I7: superusers are never refused; the writer still records their ticket.
        // With both limits off there is nothing to count either.
        writer::enqueue(fill);
        writer::wait()
    } else {
        match admit_under_lock(role, limits, retention, fill) {
            Ok(()) => writer::wait(),
            Err(refused) => return Err(refused),
        }
    };
    match answer {
        Answer::Admitted(id) => Ok(pgrx::Uuid::from_bytes(id)),
        Answer::Refused(kind, usage, next) => Err(refusal(role, kind, usage, next)),
    }
}

/// The limited path of start(): refuses from the committed state without a lock, or
/// hands the request to the writer under the scope lock once it surely fits.
fn admit_under_lock(
    role: pg_sys::Oid,
    limits: Limits,
    retention: i64,
    fill: impl FnOnce(&mut shmem::Request),
) -> Result<(), QuotaError> {
    // SAFETY: plain clock read.
    let cutoff = cutoff(unsafe { pg_sys::GetCurrentTimestamp() }, retention);
    let refuse = |reader: &Reader, snap: &Latest, kind| {
        let (usage, next) = refusal_numbers(reader, snap, role, cutoff, retention, kind);
        Err(refusal(role, kind, usage, next))
    };

    // Refusals need no lock: a committed count at the limit is a correct answer at
    // the moment of the snapshot. This keeps a role hammering at its limit from
    // queueing on its own scope lock. The Reader's table locks end with the reads.
    {
        let reader = Reader::open();
        let snap = Latest::take();
        if let Decision::Refuse(r) = decide(
            limits,
            usage_for(&reader, &snap, role, cutoff, limits),
            false,
        ) {
            return refuse(&reader, &snap, r.kind);
        }
    }

    // Admission: under the scope lock, count the committed tickets plus this scope's
    // requests still in the writer's hands, and hand ours over only if all of them
    // fit. The lock makes count-and-enqueue atomic per scope, so the decision here is
    // exact; it is released before we wait for the writer, so one role's starts share
    // the writer's commits. The writer checks again in any case (it is the single
    // authority), so this only keeps refusals off the writer.
    let _lock = ScopeLock::acquire(role);
    let mut waited = writer::Patience::new();
    loop {
        // Read the requests in flight BEFORE taking the snapshot: a request that the
        // writer commits in between is then counted twice (we wait and count again),
        // never missed. The other order could miss it in both places.
        let inflight = writer::inflight(role);
        let reader = Reader::open();
        let snap = Latest::take();
        let usage = usage_for(&reader, &snap, role, cutoff, limits);
        if let Decision::Refuse(r) = decide(limits, usage, false) {
            return refuse(&reader, &snap, r.kind);
        }
        let with_inflight = Usage {
            active: usage.active + inflight,
            retained: usage.retained + inflight,
        };
        if decide(limits, with_inflight, false) == Decision::Admit {
            break;
        }
        // Requests in flight would take the last slots; wait for them to be
        // committed (then counted) or refused, and count again. If their writer is
        // gone, bring up a new one (or fail clearly) rather than wait for ever.
        drop(snap);
        drop(reader);
        writer::nap(INFLIGHT_POLL_MS);
        waited.check_writer();
    }
    writer::enqueue(fill);
    Ok(())
}
