//! Layer 5, the paths: start() in the caller's backend. Argument checks, the scope
//! lock, the fast path that refuses without bothering the writer, the hand-off to the
//! writer (queue/caller.rs), and the wait for capacity (waiters.rs).

use pgrx::pg_sys;

use crate::catalog::{database_name, role_name};
use crate::compat::{self, nap};
use crate::core::lease::earliest;
use crate::core::stats::Counter;
use crate::core::{
    check_key, check_label, decide, Decision, Limits, QuotaError, Refusal, RefusalKind, Usage,
};
use crate::ledger::count::{db_active, next_expiry, retained_with_key};
use crate::ledger::rels::{rels, Reader};
use crate::ledger::scan::Latest;
use crate::queue::caller::{self as queue, Answer, Patience};
use crate::queue::Request;
use crate::timestamps::{cutoff, format_ts, interval_text, lease_until};
use crate::{gucs, scopes, shmem, stats};

/// The scope lock's field4. SQL advisory locks live in the user lock method with
/// field4 = 1 or 2; ours lives in the default lock method (so that transaction end
/// and the deadlock detector treat it like any table lock) with a private field4. No
/// `pg_advisory_*` call can produce this tag, block admission or bypass it (I4).
/// tests/isolation/specs/advisory_squat.spec hangs and fails if it could.
pub const SCOPE_LOCK_FIELD4: u16 = 0x5153; // "QS"

/// How long a caller sleeps while requests of its scope that could tip it over the
/// limit are in the writer's hands. They resolve within one writer commit.
const INFLIGHT_POLL_MS: i64 = 1;

/// What admission needs to count for `limits`: the active count up to the limit (one
/// more would not change the decision), the retained count only if it is limited.
pub fn usage_for(
    r: &Reader,
    snap: &Latest,
    role: pg_sys::Oid,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    limits: Limits,
) -> Usage {
    let max_active = (limits.max_active > 0).then_some(limits.max_active);
    let mut u = scopes::usage(r, role, now, cutoff, max_active, limits.max_retained > 0);
    if limits.max_db > 0 {
        u.db_active = db_active(&r.rels, snap, now, limits.max_db);
    }
    u
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
        // The role is not in the tag as its OID: see scopes::scope_tag.
        let (field2, field3) = scopes::scope_tag(shmem::my_db(), role);
        let tag = pg_sys::LOCKTAG {
            locktag_field1: u32::from(shmem::my_db()),
            locktag_field2: field2,
            locktag_field3: field3,
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

fn refusal(
    role: pg_sys::Oid,
    limits: Limits,
    kind: RefusalKind,
    usage: Usage,
    next: Option<pg_sys::TimestampTz>,
) -> QuotaError {
    QuotaError::Refused {
        role: role_name(role),
        database: database_name(shmem::my_db()),
        refusal: Refusal {
            kind,
            usage,
            limits,
        },
        next_ageout: next.map(format_ts),
    }
}

/// What a start() call asks for, beyond the caller's settings.
pub struct StartArgs<'a> {
    /// Text in the server encoding, passed through as bytes: a LATIN1 or SQL_ASCII
    /// database has labels that are not UTF-8, and its characters are counted by the
    /// server's rules. The same holds for the idempotency key.
    pub label: Option<&'a [u8]>,
    pub key: Option<&'a [u8]>,
    /// An interval datum; None means quota.default_lease.
    pub lease: Option<pg_sys::Datum>,
    /// An interval datum: how long to wait for capacity; None means not at all.
    pub wait: Option<pg_sys::Datum>,
}

impl StartArgs<'_> {
    /// The arguments of 0.1.x's start(label).
    pub fn label_only(label: Option<&[u8]>) -> StartArgs<'_> {
        StartArgs {
            label,
            key: None,
            lease: None,
            wait: None,
        }
    }
}

/// Counts the characters of `bytes` in the server encoding.
fn chars(bytes: &[u8]) -> usize {
    // SAFETY: the length is that of a text datum, which fits in an int.
    unsafe { pg_sys::pg_mbstrlen_with_len(bytes.as_ptr().cast(), bytes.len() as i32) as usize }
}

/// A refusal as the start path carries it, made into an error at the end.
struct Refused {
    kind: RefusalKind,
    usage: Usage,
    next: Option<pg_sys::TimestampTz>,
}

/// Admits one ticket for `current_user`, or returns the refusal (53400) as an error
/// value so that try_start can turn it into NULL. Every other error raises.
///
/// With a wait, a refused start takes a place in line (see waiters.rs) and looks again
/// whenever a finish() of its scope or database commits, when the next lease in its
/// way runs out, and at least every waiters::POLL_MS, until it is admitted or its time
/// is up. The wait sleeps on the latch, so statement_timeout and pg_cancel_backend end
/// it; nothing is charged for a wait that ends so.
pub fn start(args: &StartArgs, name: &std::ffi::CStr) -> Result<pgrx::Uuid, QuotaError> {
    shmem::require_callable(name);
    // A standby or a read-only transaction refuses with 25006, as nextval() does:
    // the charge is a write, even though it is not the caller's own.
    // SAFETY: both raise ERROR or return.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(name.as_ptr());
        pg_sys::PreventCommandIfReadOnly(name.as_ptr());
    }
    if let Some(l) = args.label {
        check_label(chars(l), l.len())?;
    }
    if let Some(k) = args.key {
        check_key(chars(k), k.len())?;
    }
    // SAFETY: plain reads of backend state and the clock.
    let (role, exempt, now) = unsafe {
        let role = pg_sys::GetUserId();
        (
            role,
            pg_sys::superuser_arg(role),
            pg_sys::GetCurrentTimestamp(),
        )
    };
    // The policy of the role charged (after SET ROLE, not the login's; see policy.rs).
    let policy = crate::policy::of(role);
    let limits = policy.limits;
    let rels = rels();
    if !rels.v2() {
        // The library is newer than the database's schema: 0.1.x's calls work as
        // they did; what needs 0.2.0's columns says how to get them.
        if limits.max_db > 0 && !exempt {
            rels.require_v2("quota.max_active_per_database");
        }
        if args.key.is_some() {
            rels.require_v2("an idempotency key");
        }
        if args.lease.is_some() {
            rels.require_v2("a lease");
        }
    }
    // Check the lease now, so that a bad one fails before any wait.
    lease_until(now, args.lease, policy.default_lease_secs)?;
    let deadline = match args.wait {
        None => now,
        Some(w) => {
            // SAFETY: an interval datum points at its Interval.
            let i = unsafe { &*w.cast_mut_ptr::<pg_sys::Interval>() };
            let Some(us) = crate::core::lease::wait_micros(i.month, i.day, i.time) else {
                return Err(QuotaError::InvalidInterval {
                    what: "wait",
                    value: interval_text(w),
                });
            };
            now.saturating_add(us)
        }
    };

    let mut place: Option<(crate::waiters::Place, WaitTimer)> = None;
    loop {
        if place.is_some() {
            queue::drop_abandoned_answer();
        }
        let seq = place.as_ref().map_or(u64::MAX, |p| p.0.seq);
        let r = match attempt(args, role, exempt, &policy, seq)? {
            Ok((id, found_here)) => {
                // The writer counts what it answers (see writer/batch.rs, count_admitted); a
                // repeat found by this session never reached it.
                if found_here {
                    stats::add(role, Counter::IdempotentHits, 1);
                }
                return Ok(id);
            }
            Err(r) => r,
        };
        // SAFETY: plain clock read.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        if now >= deadline {
            if place.is_some() {
                stats::add(role, Counter::WaitTimeouts, 1);
            }
            count_refusal(role, limits, &r);
            return Err(refusal(role, limits, r.kind, r.usage, r.next));
        }
        let Some((p, _)) = &place else {
            // Take a place in line, then look again at once: a finish() that
            // committed before we were in line could not wake us.
            place = Some((
                crate::waiters::Place::take(role, r.kind),
                WaitTimer::start(role),
            ));
            continue;
        };
        p.refused_by(r.kind);
        if p.woken() {
            continue;
        }
        // The next change that could admit us without anyone finishing: a lease in our
        // way running out, or, at the retained limit, the oldest ticket ageing out.
        let next = {
            let reader = Reader::open();
            let snap = Latest::take();
            let scope = (r.kind != RefusalKind::Database).then_some(role);
            earliest(next_expiry(&reader.rels, &snap, scope, now), r.next)
        };
        nap(
            crate::core::lease::wait_ms(now, deadline, next, crate::waiters::POLL_MS),
            compat::Wait::Capacity,
        );
    }
}

/// Adds the time a start() spent in line to its role's wait_time when the wait ends,
/// however it ends (admitted, refused, or an error's unwind).
struct WaitTimer {
    role: pg_sys::Oid,
    since: std::time::Instant,
}

impl WaitTimer {
    fn start(role: pg_sys::Oid) -> WaitTimer {
        // The entry the wait is counted in when it ends, made now: the end may be an
        // error's unwind, where no lock is taken to create one.
        stats::ensure(role);
        WaitTimer {
            role,
            since: std::time::Instant::now(),
        }
    }
}

impl Drop for WaitTimer {
    fn drop(&mut self) {
        // The entry exists unless a reset or an eviction took it meanwhile; then the
        // wait goes uncounted, in waits, wait_time and the histogram alike.
        let us = self.since.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
        stats::waited(self.role, us.max(1));
    }
}

/// Counts a refusal, and writes its LOG line if quota.log_refusals asks for one and
/// the rate limit lets it through.
fn count_refusal(role: pg_sys::Oid, limits: Limits, r: &Refused) {
    let log = gucs::log_refusals();
    if let Some(suppressed) = stats::refused(role, Counter::refused(r.kind), log) {
        let line = crate::core::stats::refusal_log_line(
            &role_name(role),
            &database_name(shmem::my_db()),
            r.kind,
            r.usage,
            limits,
            suppressed,
        );
        pgrx::pg_sys::panic::ErrorReport::new(
            pgrx::PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            line,
            "pg_quota",
        )
        // The server log only: the refused client gets its own error, and a tenant
        // with client_min_messages = log must not read other details from here.
        .report(pgrx::PgLogLevel::LOG_SERVER_ONLY);
    }
}

/// One try at admission for a caller at place `seq` in line (u64::MAX if it is not
/// waiting). The outer Result carries errors, the inner one refusals; an admission
/// says whether this session found it as an idempotent repeat, without the writer.
fn attempt(
    args: &StartArgs,
    role: pg_sys::Oid,
    exempt: bool,
    policy: &crate::policy::Policy,
    seq: u64,
) -> Result<Result<(pgrx::Uuid, bool), Refused>, QuotaError> {
    let limits = policy.limits;
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let retention = policy.retention_secs;
    let cutoff = cutoff(now, retention);
    // An idempotent repeat is answered here, whatever the limits say: it charges
    // nothing. The writer checks again, for requests racing with the same key. Where
    // synchronous standbys are named, the writer answers it instead (see `repeat`).
    let mut repeat = false;
    if let Some(key) = args.key {
        let reader = Reader::open();
        let snap = Latest::take();
        if let Some(id) = retained_with_key(&reader.rels, &snap, role, key, now, cutoff) {
            if !crate::syncrep::standbys_defined() {
                return Ok(Ok((pgrx::Uuid::from_bytes(id), true)));
            }
            repeat = true;
        }
    }
    // A length: the writer ends the lease this long after the ticket really starts.
    let lease_us = lease_until(now, args.lease, policy.default_lease_secs)?
        .map(|until| crate::core::lease::length(now, until));
    // SAFETY: a plain read of backend state.
    let pid = unsafe { pg_sys::MyProcPid };
    let fill = |r: &mut Request| {
        r.exempt = exempt;
        r.max_active = limits.max_active;
        r.max_retained = limits.max_retained;
        r.max_db = limits.max_db;
        r.retention_secs = retention;
        r.has_label = args.label.is_some();
        let bytes = args.label.unwrap_or(b"");
        r.label[..bytes.len()].copy_from_slice(bytes);
        r.label_len = bytes.len();
        r.has_key = args.key.is_some();
        let key = args.key.unwrap_or(b"");
        r.key[..key.len()].copy_from_slice(key);
        r.key_len = key.len();
        r.lease_us = lease_us;
        r.pid = pid;
    };

    let unlimited = limits.max_active == 0 && limits.max_retained == 0 && limits.max_db == 0;
    // A repeat goes to the writer, which answers it without a limit check, when the
    // ticket may not be confirmed yet: synchronous standbys are named, and the ticket
    // may be one whose commit a terminated writer could not confirm (40003); the writer
    // waits for the standbys before it answers (writer/batch.rs, `settle`). So does a
    // repeat of a key whose first start is still in the writer's hands: refused here,
    // its caller would think nothing was charged, and then the first start commits.
    let through_writer = || {
        queue::enqueue(fill);
        queue::wait(crate::waiters::leave)
    };
    let answer = if exempt || unlimited || repeat {
        // I7: superusers are never refused; the writer still records their ticket.
        // With every limit off there is nothing to count either.
        through_writer()
    } else {
        // Kept across the tries below, so that writers that keep failing to start
        // end the call (see Patience).
        let mut waited = Patience::new();
        loop {
            match admit_under_lock(args, role, limits, now, retention, seq, &mut waited, fill) {
                Ok(Ok(())) => break queue::wait(crate::waiters::leave),
                Ok(Err(refused)) => return Ok(Err(refused)),
                Err(Repeat::Found(id)) if !crate::syncrep::standbys_defined() => {
                    return Ok(Ok((id, true)))
                }
                // The database had no writer, or the one that the requests in flight
                // waited for is gone: wait in line for one without the scope lock, then
                // decide again (the counts may have moved meanwhile).
                Err(Repeat::NoWriter) => queue::ensure_writer(),
                Err(_) => break through_writer(),
            }
        }
    };
    Ok(match answer {
        Answer::Admitted(id) => Ok((pgrx::Uuid::from_bytes(id), false)),
        Answer::Refused(kind, usage, next) => Err(Refused { kind, usage, next }),
    })
}

/// What the limited path found instead of a decision: a repeat of the caller's key.
enum Repeat {
    /// The key's ticket, committed and retained.
    Found(pgrx::Uuid),
    /// A start with the key, in the writer's hands: the writer must answer this one.
    InFlight,
    /// Not a repeat: the database has no writer, to take the request or to answer the
    /// requests in flight it waited for; one is to be started without the scope lock.
    NoWriter,
}

/// The limited path of start(): refuses from the committed state without a lock, or
/// hands the request to the writer under the scope lock once it surely fits. Err
/// carries a repeat of the caller's key found meanwhile, or says that the database
/// has no writer to hand the request to.
#[allow(clippy::too_many_arguments)]
fn admit_under_lock(
    args: &StartArgs,
    role: pg_sys::Oid,
    limits: Limits,
    now: pg_sys::TimestampTz,
    retention: i64,
    seq: u64,
    waited: &mut Patience,
    fill: impl FnOnce(&mut Request),
) -> Result<Result<(), Refused>, Repeat> {
    let cutoff = cutoff(now, retention);
    // `counted`: the counts the decision was made on, without the waiters ahead. Where
    // both role limits are set they are the full numbers the message needs, and an
    // active-limit refusal (the common one) reports them without counting again.
    let refuse =
        |reader: &Reader, snap: &Latest, kind, ahead: (i64, i64), db_active, counted: Usage| {
            if let Some(key) = args.key {
                // A start with our key may have committed after our last look, and the
                // counts we refuse on may include its ticket: look again, under a snapshot
                // taken after those counts, before refusing a repeat.
                // The requests in flight first, then the snapshot: a start with our key
                // that leaves the writer's hands in between has committed, and the
                // snapshot sees it.
                if queue::in_flight_with_key(role, key) {
                    return Err(Repeat::InFlight);
                }
                if let Some(id) =
                    retained_with_key(&reader.rels, &Latest::take(), role, key, now, cutoff)
                {
                    return Err(Repeat::Found(pgrx::Uuid::from_bytes(id)));
                }
            }
            let complete = limits.max_active > 0 && limits.max_retained > 0;
            let (mut usage, next) = if complete && kind != RefusalKind::Retained {
                (counted, None)
            } else {
                scopes::refusal_numbers(reader, snap, role, now, cutoff, retention, kind)
            };
            // The counts stay tickets; the starts waiting ahead are named apart (see
            // core::errors), so that a refusal never reads "2 of 1".
            usage.db_active = db_active;
            usage.ahead = if kind == RefusalKind::Database {
                ahead.1
            } else {
                ahead.0
            };
            Ok(Err(Refused { kind, usage, next }))
        };
    // Starts waiting ahead of this one take the next free slots (see waiters.rs).
    let with_ahead = |u: Usage, (of_role, of_db): (i64, i64)| Usage {
        active: u.active + of_role,
        retained: u.retained + of_role,
        db_active: u.db_active + of_db,
        ahead: of_role + of_db,
    };

    // Refusals need no lock: a committed count at the limit is a correct answer at
    // the moment of the snapshot. This keeps a role hammering at its limit from
    // queueing on its own scope lock. The Reader's table locks end with the reads.
    {
        let ahead = crate::waiters::ahead(role, seq);
        let reader = Reader::open();
        let snap = Latest::take();
        let usage = usage_for(&reader, &snap, role, now, cutoff, limits);
        if let Decision::Refuse(r) = decide(limits, with_ahead(usage, ahead), false) {
            return refuse(&reader, &snap, r.kind, ahead, usage.db_active, usage);
        }
    }

    // Admission: under the scope lock, count the committed tickets plus this scope's
    // requests still in the writer's hands, and hand ours over only if all of them
    // fit. The lock makes count-and-enqueue atomic per scope, so the decision here is
    // exact; it is released before we wait for the writer, so one role's starts share
    // the writer's commits. The writer checks again in any case (it is the single
    // authority: for the database cap, which spans scopes, it is the only exact
    // check), so this only keeps refusals off the writer.
    //
    // Nothing under the lock waits for anything but the counts: the answer to a request
    // this session abandoned earlier is waited for before the lock is taken, and a
    // writer that must be started is started after it is released (Repeat::NoWriter).
    // Every other start of the scope, refusals included, queues behind this lock.
    queue::reclaim_mine();
    let _lock = ScopeLock::acquire(role);
    loop {
        // Read the requests in flight BEFORE taking the snapshot: a request that the
        // writer commits in between is then counted twice (we wait and count again),
        // never missed. The other order could miss it in both places.
        // Waiters ahead first: one moves from the line (slot free) into flight, never
        // back, so read in this order it is counted at least once.
        let ahead = crate::waiters::ahead(role, seq);
        let inflight = queue::inflight(role);
        let inflight_db = if limits.max_db > 0 {
            queue::inflight_db()
        } else {
            0
        };
        let reader = Reader::open();
        let snap = Latest::take();
        if let Some(key) = args.key {
            // A request with our key, committed while we waited for in-flight ones.
            if let Some(id) = retained_with_key(&reader.rels, &snap, role, key, now, cutoff) {
                return Err(Repeat::Found(pgrx::Uuid::from_bytes(id)));
            }
        }
        let counted = usage_for(&reader, &snap, role, now, cutoff, limits);
        let usage = with_ahead(counted, ahead);
        if let Decision::Refuse(r) = decide(limits, usage, false) {
            return refuse(&reader, &snap, r.kind, ahead, counted.db_active, counted);
        }
        let with_inflight = Usage {
            active: usage.active + inflight,
            retained: usage.retained + inflight,
            db_active: usage.db_active + inflight_db,
            ahead: usage.ahead,
        };
        if decide(limits, with_inflight, false) == Decision::Admit {
            break;
        }
        // Requests in flight would take the last slots; wait for them to be
        // committed (then counted) or refused, and count again. If their writer is
        // gone, a new one is brought up (or the call fails clearly) rather than wait
        // for ever, in line for a slot without the lock.
        drop(snap);
        drop(reader);
        nap(INFLIGHT_POLL_MS, compat::Wait::InFlight);
        if waited.writer_needed() {
            return Err(Repeat::NoWriter);
        }
    }
    // Handed over only to a running writer: a wait in line for a writer slot under the
    // scope lock would hold up every other start of the scope (see attempt).
    if queue::enqueue_to_running(fill) {
        Ok(Ok(()))
    } else {
        Err(Repeat::NoWriter)
    }
}
