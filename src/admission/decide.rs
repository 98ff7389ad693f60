//! Layer 5: the decision both kinds of start share. Refusals come from the committed
//! counts without a lock; an admission is decided under the role's scope lock, with
//! everything that could take a slot counted: the committed tickets, the open
//! transactional charges (0.5.0), the requests in the writer's hands, and the starts
//! waiting ahead. What admits (a request handed to the writer, or a charge inserted in
//! the caller's transaction) happens under the lock too, so that count-and-take is
//! atomic per role and its tenants.

use pgrx::pg_sys;

use super::{Caller, Numbers, Refused};
use crate::compat::{self, nap};
use crate::core::{decide_weighted, refuse_on_active, Decision, RefusalKind, Usage};
use crate::ledger::keys::{key_in_progress, retained_with_key};
use crate::ledger::leases::db_active;
use crate::ledger::rels::Reader;
use crate::ledger::scan::Latest;
use crate::queue::caller::{self as queue, Patience};
use crate::scopes::counts;
use crate::timestamps::cutoff;
use crate::waiters::Ahead;
use crate::{scopes, shmem};

/// How long a caller sleeps while requests of its scope that could tip it over the
/// limit are in the writer's hands. They resolve within one writer commit.
const INFLIGHT_POLL_MS: i64 = 1;

/// What admission needs to count for the caller's limits: the role's (and its
/// tenant's) counts where a limit needs them, open charges included, and the database's
/// active tickets if it is capped: the committed ones under `snap`, plus `open_db`, the
/// database's open charges. `snap` is a `scopes::others_view()`: this transaction's own
/// transactional tickets are among the open charges until it commits, and a snapshot
/// that saw their rows too (0.5.1 counted under the latest snapshot at the current
/// command) counted each of them twice, so that a transaction enqueueing several jobs
/// got half the room the cap left (0.5.2, R1). An upper bound where `fits` accepts it
/// (see counts::usage), the exact counts otherwise.
pub(crate) fn usage_for(
    r: &Reader,
    snap: &Latest,
    open_db: i64,
    caller: &Caller,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    fits: impl Fn(Usage) -> bool,
) -> Usage {
    let limits = caller.limits;
    let db_active = if limits.max_db > 0 {
        db_active(&r.rels, snap, now, limits.max_db) + open_db
    } else {
        0
    };
    let with_db = |mut u: Usage| {
        u.db_active = db_active;
        u
    };
    with_db(counts::usage(
        r,
        caller.role,
        caller.tenant,
        now,
        cutoff,
        limits,
        |u| fits(with_db(u)),
    ))
}

/// Holds the scope lock for (database, role) until dropped (or the database cap's lock,
/// see scopes::cap_lock_tag). A tenant's starts take their role's lock: a role's count
/// includes its tenants', so they must not race.
///
/// It makes "count, then take" atomic per scope, so that two callers cannot both take
/// the last slot. Taken under TopTransactionResourceOwner, as sequence.c's
/// open_share_lock() does, so that no subtransaction abort can release it behind our
/// back; and released explicitly as soon as the slot is taken (handed to the writer,
/// or counted among the scope's open charges). Holding it while the writer commits
/// would serialize the role's starts behind one WAL flush each; holding it to the end
/// of the caller's transaction would serialize the role's long transactions, for
/// nothing, since what it protects is counted by then.
struct ScopeLock(pg_sys::LOCKTAG, i32);

impl ScopeLock {
    fn acquire(role: pg_sys::Oid) -> ScopeLock {
        // The role is not in the tag as its OID: see scopes::scope_tag.
        ScopeLock::take(scopes::scope_lock_tag(shmem::my_db(), role))
    }

    /// The database cap's lock, taken after the role's.
    fn cap() -> ScopeLock {
        ScopeLock::take(scopes::cap_lock_tag(shmem::my_db()))
    }

    /// The database cap's lock in a mode that only keeps its exclusive holders out.
    fn cap_shared() -> ScopeLock {
        ScopeLock::take_in(
            scopes::cap_lock_tag(shmem::my_db()),
            pg_sys::RowShareLock as i32,
        )
    }

    fn take(tag: pg_sys::LOCKTAG) -> ScopeLock {
        ScopeLock::take_in(tag, pg_sys::ExclusiveLock as i32)
    }

    fn take_in(tag: pg_sys::LOCKTAG, mode: i32) -> ScopeLock {
        with_top_owner(|| {
            // SAFETY: an ordinary transaction-level lock; lock_timeout, cancel and the
            // deadlock detector all apply while we wait for it.
            unsafe { pg_sys::LockAcquire(&tag, mode, false, false) };
        });
        ScopeLock(tag, mode)
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
            unsafe { pg_sys::LockRelease(&self.0, self.1, false) };
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

/// A refusal at an active limit (the tenant's, or the role's) read from the scope
/// counters alone, without opening, locking or scanning any of pg_quota's relations
/// (0.6.0): where each counter it needs is live (built for the relations as they are,
/// see rels::current_tags) and no ticket it counts can have lapsed (its `earliest`
/// lease end is still to come), its count plus the open charges and the starts waiting
/// ahead is exact, or above (a finish not applied yet), as the lock-free refusal below
/// counts it; and no limit that `decide` checks first could refuse instead (see
/// core::refuse_on_active). None sends the start down the path that counts. Its
/// numbers are counted again from the ledger only where someone reads them (start()'s
/// error, a LOG line).
fn refuse_from_counters(
    caller: &Caller,
    ahead: Ahead,
    now: pg_sys::TimestampTz,
) -> Option<Refused> {
    let limits = caller.limits;
    if limits.max_active == 0 && limits.tenant_active == 0 {
        return None;
    }
    let tags = crate::ledger::rels::current_tags()?;
    let weight = caller.args.weight;
    let live = |key: scopes::ScopeKey| {
        scopes::peek(key, tags, now)
            .filter(|p| p.earliest > now)
            .map(|p| p.active + p.open.units)
    };
    let mut counted = Usage::default();
    if let (Some(t), true) = (caller.tenant, limits.tenant_active > 0) {
        counted.tenant_active = live(scopes::ScopeKey {
            role: caller.role,
            tenant: t.key,
        })?;
    }
    let mut refusal = refuse_on_active(limits, with_ahead(counted, ahead), weight);
    if refusal.is_none() && limits.max_active > 0 {
        counted.active = live(scopes::ScopeKey::role(caller.role))?;
        refusal = refuse_on_active(limits, with_ahead(counted, ahead), weight);
    }
    let kind = refusal?.kind;
    let (starts, units) = ahead_for(kind, ahead);
    counted.ahead = starts;
    Some(Refused {
        kind,
        numbers: Numbers::ActiveOnly(counted, now),
        ahead_units: units,
    })
}

/// What the limited path found instead of a decision.
pub(crate) enum Repeat {
    /// The key's ticket, committed and retained, and its weight.
    Found([u8; 16], i64),
    /// A start with the key, in the writer's hands: the writer must answer this one.
    InFlight,
    /// A transactional start with the key whose transaction is still open: wait for it
    /// without the lock, then look again.
    InProgress,
    /// The database has no writer, to take the request or to answer the requests in
    /// flight it waited for; one is to be started without the scope lock.
    NoWriter,
}

/// The starts waiting ahead of a start refused at a limit of `kind`: how many, which
/// its refusal names beside its tickets, and their units, which take what frees up
/// below that limit before it (0.7.0: when capacity returns for it).
fn ahead_for(kind: RefusalKind, ahead: Ahead) -> (i64, i64) {
    match kind {
        RefusalKind::Database => (ahead.of_db, ahead.db_units),
        RefusalKind::TenantActive | RefusalKind::TenantRetained => {
            (ahead.of_tenant, ahead.tenant_units)
        }
        RefusalKind::Active | RefusalKind::Retained => (ahead.of_role, ahead.role_units),
    }
}

/// The counts plus the starts waiting ahead, which take the next free slots: their
/// units in the active and the retained counts (0.7.0).
fn with_ahead(u: Usage, a: Ahead) -> Usage {
    Usage {
        ahead: a.of_role + a.of_db,
        ..u.with_pending(a.pending())
    }
}

/// Refuses, or admits with `take` under the scope lock once the start surely fits.
/// `before_lock` runs before the lock is taken (the writer path waits there for an
/// answer its session abandoned: nothing under the lock waits for anything but the
/// counts). Err carries a repeat of the caller's key found meanwhile, or says that a
/// writer must be started (without the lock) first.
pub(crate) fn under_lock<T>(
    caller: &Caller,
    now: pg_sys::TimestampTz,
    seq: u64,
    waited: &mut Patience,
    before_lock: impl FnOnce(),
    take: impl FnOnce(&Reader) -> Result<T, Repeat>,
) -> Result<Result<T, Refused>, Repeat> {
    let role = caller.role;
    let tenant = caller.tenant_key();
    let limits = caller.limits;
    let weight = caller.args.weight;
    let retention = caller.policy.retention_secs;
    let key = caller.args.key;
    // The clock after a wait for pg_quota's locks (a Reader's, bounded, behind
    // maintenance; the scope lock, behind the role's other starts): the counts and a
    // key's lookup after it judge leases and ages by this reading, not `now`.
    // SAFETY: plain clock read.
    let clock = || unsafe { pg_sys::GetCurrentTimestamp() };
    // `counted`: the counts the decision was made on, without the waiters ahead. Where
    // both role limits are set they are the full numbers the message needs, and an
    // active-limit refusal (the common one) reports them without counting again.
    let refuse = |reader: &Reader,
                  kind: RefusalKind,
                  ahead: Ahead,
                  counted: Usage,
                  now: pg_sys::TimestampTz| {
        if let Some(key) = key {
            // A start with our key may have committed after our last look, and the
            // counts we refuse on may include its ticket: look again, under a snapshot
            // taken after those counts, before refusing a repeat.
            // The requests in flight first, then the snapshot: a start with our key
            // that leaves the writer's hands in between has committed, and the
            // snapshot sees it.
            if queue::in_flight_with_key(role, tenant, key) {
                return Err(Repeat::InFlight);
            }
            if key_in_progress(&reader.rels, role, caller.args.tenant, key).is_some() {
                return Err(Repeat::InProgress);
            }
            if let Some((id, weight)) = retained_with_key(
                &reader.rels,
                &Latest::take(),
                role,
                caller.args.tenant,
                key,
                now,
                cutoff(now, retention),
            ) {
                return Err(Repeat::Found(id, weight));
            }
        }
        // The counts stay tickets; the starts waiting ahead are named apart (see
        // core::errors), so that a refusal never reads "2 of 1". The full numbers are
        // counted only if read (see Numbers).
        let mut counted = counted;
        let (starts, units) = ahead_for(kind, ahead);
        counted.ahead = starts;
        Ok(Err(Refused {
            kind,
            numbers: Numbers::Counted(counted, now),
            ahead_units: units,
        }))
    };

    // Refusals need no lock: a committed count at the limit is a correct answer at
    // the moment of the snapshot. This keeps a role hammering at its limit from
    // queueing on its own scope lock. The Reader's table locks end with the reads.
    if !caller.exempt {
        let ahead = crate::waiters::ahead(role, tenant, seq);
        // At an active limit, the scope counters may refuse alone (0.6.0). A key is
        // looked for in the ledger before any refusal (see `refuse`).
        if key.is_none() {
            if let Some(r) = refuse_from_counters(caller, ahead, now) {
                return Ok(Err(r));
            }
        }
        let reader = Reader::open();
        let now = clock();
        let cutoff = cutoff(now, retention);
        let snap = scopes::others_view();
        // After the snapshot: a charge that commits in between is missed here, which
        // only lets the locked path below count again; counted twice, it could refuse
        // a start that fits.
        let open_db = if limits.max_db > 0 {
            crate::charges::open_in_db()
        } else {
            0
        };
        let decide = |u: Usage| decide_weighted(limits, u, weight, false);
        let admits = |u: Usage| decide(with_ahead(u, ahead)) == Decision::Admit;
        let usage = usage_for(&reader, &snap, open_db, caller, now, cutoff, admits);
        if let Decision::Refuse(r) = decide(with_ahead(usage, ahead)) {
            // So that the next refusals of the scope read its counter alone.
            counts::refresh_earliest(&reader, role, caller.tenant, r.kind, now);
            return refuse(&reader, r.kind, ahead, usage, now);
        }
    }

    // Admission: under the scope lock, count the committed tickets plus the scope's
    // open charges and requests still in the writer's hands, and take ours only if all
    // of them fit. The lock makes count-and-take atomic per scope, so the decision here
    // is exact; it is released before anyone waits for the writer, so one role's
    // starts share the writer's commits. The writer checks again in any case (it is
    // the single authority for what it inserts: for the database cap, which spans
    // scopes, it is the only exact check), so this only keeps refusals off the writer.
    //
    // Nothing under the lock waits for anything but the counts: `before_lock` is waited
    // for first, and a writer that must be started is started after the lock is
    // released (Repeat::NoWriter). Every other start of the role, refusals included,
    // queues behind this lock.
    before_lock();
    let _lock = ScopeLock::acquire(role);
    loop {
        // The tables first, as the writer takes them before the cap's lock.
        let reader = Reader::open();
        // A transactional start takes the database cap's lock (see
        // scopes::cap_lock_tag) until its charge is taken: exclusively where the cap
        // is checked, since the role's lock cannot keep starts of other roles, or the
        // writer, from taking the database's last slot meanwhile, and nothing counts a
        // transactional charge again; shared otherwise (a superuser's, or a start
        // without a cap of its own), so that no charge is taken between a capped
        // start's count and its charge. Never held while waiting for the writer.
        let cap = caller.args.transactional.then(|| {
            if limits.max_db > 0 && !caller.exempt {
                ScopeLock::cap()
            } else {
                ScopeLock::cap_shared()
            }
        });
        let now = clock();
        let cutoff = cutoff(now, retention);
        // Read the requests in flight BEFORE taking the snapshot: a request that the
        // writer commits in between is then counted twice (we wait and count again),
        // never missed. The other order could miss it in both places. The same for
        // the database's open charges: one that commits in between is counted twice.
        // Waiters ahead first: one moves from the line (slot free) into flight, never
        // back, so read in this order it is counted at least once.
        let ahead = crate::waiters::ahead(role, tenant, seq);
        let inflight = queue::inflight(role, tenant);
        let (inflight_db, open_db) = if limits.max_db > 0 {
            (queue::inflight_db(), crate::charges::open_in_db())
        } else {
            (0, 0)
        };
        if let Some(key) = key {
            // A start with our key still open (transactional) or in the writer's
            // hands: looked for before the snapshot, so that one that commits in
            // between is in it. A writer-committed start is answered by the writer
            // (InFlight); the writer path hands its repeat to the writer too.
            if key_in_progress(&reader.rels, role, caller.args.tenant, key).is_some() {
                return Err(Repeat::InProgress);
            }
            if caller.args.transactional && queue::in_flight_with_key(role, tenant, key) {
                return Err(Repeat::InFlight);
            }
        }
        // As every other backend sees the ledger (see usage_for); a ticket this
        // transaction charged with our key is found by charges::own_with_key first.
        let snap = scopes::others_view();
        if let Some(key) = key {
            // A start with our key committed while we waited for in-flight ones.
            if let Some((id, weight)) = retained_with_key(
                &reader.rels,
                &snap,
                role,
                caller.args.tenant,
                key,
                now,
                cutoff,
            ) {
                return Err(Repeat::Found(id, weight));
            }
        }
        if caller.exempt {
            // I7: superusers are never refused; what they take is still recorded.
            return take(&reader).map(Ok);
        }
        // In units, for the active and the retained counts (0.7.0).
        let with_inflight = |u: Usage| {
            u.with_pending(crate::core::Pending {
                db_units: inflight_db,
                ..inflight
            })
        };
        let decide = |u: Usage| decide_weighted(limits, u, weight, false);
        // An upper bound that admits with everything in flight admits exactly.
        let admits = |u: Usage| decide(with_inflight(with_ahead(u, ahead))) == Decision::Admit;
        let counted = usage_for(&reader, &snap, open_db, caller, now, cutoff, admits);
        let usage = with_ahead(counted, ahead);
        if let Decision::Refuse(r) = decide(usage) {
            return refuse(&reader, r.kind, ahead, counted, now);
        }
        if decide(with_inflight(usage)) == Decision::Admit {
            return take(&reader).map(Ok);
        }
        // Requests in flight would take the last slots; wait for them to be
        // committed (then counted) or refused, and count again. If their writer is
        // gone, a new one is brought up (or the call fails clearly) rather than wait
        // for ever, in line for a slot without the lock.
        drop(snap);
        drop(reader);
        drop(cap);
        nap(INFLIGHT_POLL_MS, compat::Wait::InFlight);
        if waited.writer_needed() {
            return Err(Repeat::NoWriter);
        }
    }
}
