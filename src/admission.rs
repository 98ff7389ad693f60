//! The start path in the caller's backend: argument checks, the scope lock, the fast
//! path that refuses without bothering the writer, and the hand-off to the writer.

use pgrx::pg_sys;

use crate::core::{check_label, decide, Decision, QuotaError, Refusal, RefusalKind, Usage};
use crate::error::raise;
use crate::ledger::{self, Stmt};
use crate::writer::{self, Answer};
use crate::{gucs, shmem};

/// The scope lock's field4. SQL advisory locks use field4 = 1 or 2, so no
/// `pg_advisory_*` call can produce this tag, block admission or bypass it (I4).
pub const SCOPE_LOCK_FIELD4: u16 = 0x5153; // "QS"

static USAGE_STMT: Stmt = Stmt::new(ledger::USAGE, &[pg_sys::OIDOID, pg_sys::TIMESTAMPTZOID]);
static OLDEST_STMT: Stmt = Stmt::new(ledger::OLDEST_ENDED, &[pg_sys::OIDOID, pg_sys::TIMESTAMPTZOID]);

/// The instant before which ended tickets no longer count.
pub fn cutoff(now: pg_sys::TimestampTz, retention_secs: i64) -> pg_sys::TimestampTz {
    now.saturating_sub(retention_secs.saturating_mul(1_000_000))
}

/// Reads the scope's usage. `latest` reads with the latest committed snapshot (the
/// caller, I3); otherwise with the transaction's own (the READ COMMITTED writer, which
/// must also see its own uncommitted inserts). Returns the usage and how many rows
/// are past the cutoff but not purged yet. Must run inside SPI.
pub fn measure(role: pg_sys::Oid, cutoff: pg_sys::TimestampTz, latest: bool) -> (Usage, i64) {
    let mut args = [role.into(), cutoff.into()];
    if latest {
        USAGE_STMT.run_latest(&mut args, &[false, false], true);
    } else {
        USAGE_STMT.run(&mut args, &[false, false]);
    }
    let (active, rows, expired) = (ledger::int8(0, 1), ledger::int8(0, 2), ledger::int8(0, 3));
    (
        Usage {
            active,
            retained: rows - expired,
        },
        expired,
    )
}

/// When the oldest ended, retained ticket ages out, if there is one. Inside SPI.
pub fn next_ageout(
    role: pg_sys::Oid,
    cutoff: pg_sys::TimestampTz,
    retention_secs: i64,
    latest: bool,
) -> Option<pg_sys::TimestampTz> {
    let mut args = [role.into(), cutoff.into()];
    if latest {
        OLDEST_STMT.run_latest(&mut args, &[false, false], true);
    } else {
        OLDEST_STMT.run(&mut args, &[false, false]);
    }
    ledger::value(0, 1).map(|d| (d.value() as i64).saturating_add(retention_secs * 1_000_000))
}

/// Checks that the library was preloaded (its shared memory exists).
pub fn require_preloaded() {
    if !shmem::available() {
        raise(QuotaError::NotPreloaded);
    }
}

/// Holds the scope lock for (database, role) until dropped.
///
/// Taken under TopTransactionResourceOwner, as sequence.c's open_share_lock() does,
/// so that no subtransaction abort can release it behind our back; and released
/// explicitly as soon as start() has its answer. Holding it to the end of the
/// caller's transaction would gain nothing, since the charge is already committed
/// by then, and would serialize all of the role's long transactions.
struct ScopeLock(pg_sys::LOCKTAG);

impl ScopeLock {
    fn acquire(role: pg_sys::Oid) -> ScopeLock {
        let tag = pg_sys::LOCKTAG {
            // SAFETY: MyDatabaseId is set in every connected backend.
            locktag_field1: u32::from(unsafe { pg_sys::MyDatabaseId }),
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
    unsafe { std::ffi::CStr::from_ptr(pg_sys::timestamptz_to_str(ts)).to_string_lossy().into_owned() }
}

fn refusal(role: pg_sys::Oid, kind: RefusalKind, usage: Usage, next: Option<pg_sys::TimestampTz>) -> QuotaError {
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
pub fn start(label: Option<&str>) -> Result<pgrx::Uuid, QuotaError> {
    require_preloaded();
    // A read-only transaction or a standby refuses with 25006, as nextval() does:
    // the charge is a write, even though it is not the caller's own.
    // SAFETY: both raise ERROR or return.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(c"quota.start()".as_ptr());
        pg_sys::PreventCommandIfReadOnly(c"quota.start()".as_ptr());
    }
    if let Some(l) = label {
        check_label(l)?;
    }
    // SAFETY: plain reads of backend state.
    let (role, exempt) = unsafe {
        let role = pg_sys::GetUserId();
        (role, pg_sys::superuser_arg(role))
    };
    let limits = gucs::limits();
    let retention = gucs::retention_secs();
    let owner = ledger::owner();

    // I7: superusers skip the fast path and the scope lock; the writer still records
    // their ticket.
    let _lock = (!exempt).then(|| ScopeLock::acquire(role));
    if !exempt {
        // SAFETY: plain clock read.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let cutoff = cutoff(now, retention);
        let refused = ledger::as_owner(owner, || {
            ledger::connect(|| {
                let (usage, _) = measure(role, cutoff, true);
                match decide(limits, usage, false) {
                    Decision::Admit => None,
                    Decision::Refuse(r) => {
                        let next = (r.kind == RefusalKind::Retained)
                            .then(|| next_ageout(role, cutoff, retention, true))
                            .flatten();
                        Some((r.kind, usage, next))
                    }
                }
            })
        });
        if let Some((kind, usage, next)) = refused {
            return Err(refusal(role, kind, usage, next));
        }
    }

    let answer = writer::submit(|r| {
        r.role = role;
        r.exempt = exempt;
        r.max_active = limits.max_active;
        r.max_retained = limits.max_retained;
        r.retention_secs = retention;
        r.has_label = label.is_some();
        let bytes = label.unwrap_or("").as_bytes();
        r.label[..bytes.len()].copy_from_slice(bytes);
        r.label_len = bytes.len();
    });
    match answer {
        Answer::Admitted(id) => Ok(pgrx::Uuid::from_bytes(id)),
        Answer::Refused(kind, usage, next) => Err(refusal(role, kind, usage, next)),
    }
}
