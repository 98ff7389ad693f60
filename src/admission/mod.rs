//! Layer 5, the paths: start() in the caller's backend. Argument checks, the policy of
//! the charged role, the wait for capacity (waiters.rs), and one try at admission:
//! through the ledger writer (writer.rs here, the default), or in the caller's own
//! transaction (transactional.rs, 0.5.0). Both decide under the same scope lock with
//! the same counts (decide.rs); what they share with the writer's insert is in ledger/.

mod decide;
mod transactional;
mod writer;

use pgrx::pg_sys;

use crate::catalog::{database_name, role_ident, role_name};
use crate::compat::{self, nap};
use crate::core::lease::earliest;
use crate::core::stats::Counter;
use crate::core::{
    check_key, check_label, check_tenant, Limits, QuotaError, Refusal, RefusalKind, Usage,
};
use crate::encoding::server_text;
use crate::ledger::keys::{key_in_progress, retained_with_key};
use crate::ledger::leases::next_expiry;
use crate::ledger::rels::{rels, Reader};
use crate::ledger::scan::{text_datum, Latest};
use crate::policy::Policy;
use crate::queue::caller as queue;
use crate::scopes::counts::Tenant;
use crate::timestamps::{cutoff, format_ts, interval_text, lease_until};
use crate::{gucs, scopes, shmem, stats};

/// What a start() call asks for, beyond the caller's settings.
pub struct StartArgs<'a> {
    /// Text in the server encoding, passed through as bytes: a LATIN1 or SQL_ASCII
    /// database has labels that are not UTF-8, and its characters are counted by the
    /// server's rules. The same holds for the idempotency key and the tenant.
    pub label: Option<&'a [u8]>,
    pub key: Option<&'a [u8]>,
    /// An interval datum; None means quota.default_lease.
    pub lease: Option<pg_sys::Datum>,
    /// An interval datum: how long to wait for capacity; None means not at all.
    pub wait: Option<pg_sys::Datum>,
    /// 0.5.0: the tenant the ticket is charged to under its role (None: the role).
    pub tenant: Option<&'a [u8]>,
    /// 0.5.0: the charge commits or rolls back with the calling transaction.
    pub transactional: bool,
    /// 0.7.0: the units the ticket counts against its limits, active and retained (checked by
    /// core::weights::check_weight; 1 for the calls without a weight).
    pub weight: i64,
}

impl StartArgs<'_> {
    /// The arguments of 0.1.x's start(label).
    pub fn label_only(label: Option<&[u8]>) -> StartArgs<'_> {
        StartArgs {
            label,
            key: None,
            lease: None,
            wait: None,
            tenant: None,
            transactional: false,
            weight: 1,
        }
    }
}

/// Who a start is for and what it is checked against, fixed for the whole call.
pub(crate) struct Caller<'a> {
    pub args: &'a StartArgs<'a>,
    pub role: pg_sys::Oid,
    pub exempt: bool,
    pub policy: Policy,
    /// The role's limits, with its tenant's if the start has one.
    pub limits: Limits,
    /// The tenant's own limits (0.7.0), which `limits` has in place of the role's
    /// settings where they are set.
    pub own: crate::ledger::overrides::Override,
    pub tenant: Option<Tenant>,
}

impl Caller<'_> {
    /// The tenant's key, 0 for none.
    pub fn tenant_key(&self) -> u128 {
        self.tenant.map_or(0, |t| t.key)
    }

    /// Whether the limit of a refusal of `kind` is the tenant's own (0.7.0).
    fn tenant_limit_set(&self, kind: RefusalKind) -> bool {
        match kind {
            RefusalKind::TenantActive => self.own.max_active.is_some(),
            RefusalKind::TenantRetained => self.own.max_retained.is_some(),
            _ => false,
        }
    }

    /// The error of a start that can never fit the limit of `kind` (0.7.0).
    fn never_fits(&self, kind: RefusalKind) -> QuotaError {
        QuotaError::WeightNeverFits(crate::core::weights::NeverFits {
            kind,
            weight: self.args.weight,
            limit: self.limits.of(kind),
            role: role_name(self.role),
            tenant: self.args.tenant.map(server_text),
            database: database_name(shmem::my_db()),
            tenant_limit_set: self.tenant_limit_set(kind),
        })
    }

    /// The refusal error for the caller's role (and tenant), with the full numbers.
    fn refusal(&self, r: &Refused) -> QuotaError {
        let (usage, next) = r.numbers(self);
        QuotaError::Refused {
            role: role_name(self.role),
            tenant: self.args.tenant.map(server_text),
            database: database_name(shmem::my_db()),
            refusal: Refusal {
                kind: r.kind,
                usage,
                limits: self.limits,
                weight: self.args.weight,
            },
            next_ageout: next.and_then(|c| c.at).map(format_ts),
            age_out: next.map_or(crate::core::lease::AgeOut::NoneEnded, |c| c.how),
            default_retained_for: (r.kind == RefusalKind::Retained
                && self.policy.retained_is_default)
                .then(|| role_ident(self.role)),
            tenant_limit_set: self.tenant_limit_set(r.kind),
        }
    }
}

/// Counts the characters of `bytes` in the server encoding.
pub(crate) fn chars(bytes: &[u8]) -> usize {
    // Every server encoding is a superset of ASCII, a byte a character there: the common
    // label, key or tenant is counted without a call into PostgreSQL.
    if bytes.is_ascii() {
        return bytes.len();
    }
    // SAFETY: the length is that of a text datum, which fits in an int.
    unsafe { pg_sys::pg_mbstrlen_with_len(bytes.as_ptr().cast(), bytes.len() as i32) as usize }
}

/// A refusal as the start path carries it, made into an error at the end.
pub(crate) struct Refused {
    pub kind: RefusalKind,
    pub numbers: Numbers,
    /// The units of the starts waiting ahead that the numbers leave out (0.7.0): they
    /// take capacity first.
    pub ahead_units: i64,
}

/// A refusal's numbers: complete (the writer's answer), or the counts the decision was
/// made on, completed only where someone reads them (the error's DETAIL, the LOG line,
/// a wait at a retained limit), never for a try_start() that returns NULL.
pub(crate) enum Numbers {
    /// The numbers and how capacity returns, as the message gives them.
    Full(Usage, Option<crate::core::lease::Capacity>),
    /// The counts decided on at `now` (the waiters ahead apart, the database's count
    /// included), which hold the full numbers only where both role limits are set and
    /// the active one refused.
    Counted(Usage, pg_sys::TimestampTz),
    /// The active counts a refusal read from the scope counters at `now` (the waiters
    /// ahead apart; 0.6.0): the rest is counted from the ledger where it is read.
    ActiveOnly(Usage, pg_sys::TimestampTz),
}

impl Refused {
    /// The full numbers for the message, and when capacity returns if a retained limit
    /// is the one reached.
    fn numbers(&self, caller: &Caller) -> (Usage, Option<crate::core::lease::Capacity>) {
        let (counted, now) = match self.numbers {
            Numbers::Full(usage, next) => return (usage, next),
            Numbers::Counted(counted, now) => {
                let limits = caller.limits;
                let complete =
                    limits.max_active > 0 && limits.max_retained > 0 && caller.tenant.is_none();
                if complete && self.kind == RefusalKind::Active {
                    return (counted, None);
                }
                (counted, now)
            }
            Numbers::ActiveOnly(counted, now) => (counted, now),
        };
        let retention = caller.policy.retention_secs;
        let reader = Reader::open();
        let (mut usage, next) = crate::scopes::counts::refusal_numbers(
            &reader,
            caller.role,
            caller.tenant,
            now,
            cutoff(now, retention),
            retention,
            self.kind,
            caller.args.weight.saturating_add(self.ahead_units),
            caller.limits.of(self.kind),
        );
        usage.db_active = counted.db_active;
        usage.ahead = counted.ahead;
        (usage, next)
    }

    /// The clock reading the refusal was decided at, where the start's own decision
    /// made it (the writer's answer carries none).
    fn at(&self) -> Option<pg_sys::TimestampTz> {
        match self.numbers {
            Numbers::Full(..) => None,
            Numbers::Counted(_, now) | Numbers::ActiveOnly(_, now) => Some(now),
        }
    }

    /// When capacity returns without a finish, where a retained limit refused.
    fn next_ageout(&self, caller: &Caller) -> Option<pg_sys::TimestampTz> {
        match self.kind {
            RefusalKind::Retained | RefusalKind::TenantRetained => {
                self.numbers(caller).1.and_then(|c| c.at)
            }
            _ => None,
        }
    }
}

/// What a start() that is refused returns.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OnRefusal {
    /// The 53400 error, with the numbers (start()).
    Raise,
    /// None (try_start()): the numbers are never counted.
    Null,
}

/// Admits one ticket for `current_user` (and its tenant, if given). A refusal is the
/// 53400 error, or None, as `on_refusal` says. Every other error raises.
///
/// With a wait, a refused start takes a place in line (see waiters.rs) and looks again
/// whenever a finish() of its scope or database commits, when the next lease in its
/// way runs out, and at least every waiters::POLL_MS, until it is admitted or its time
/// is up. The wait sleeps on the latch, so statement_timeout and pg_cancel_backend end
/// it; nothing is charged for a wait that ends so.
pub fn start(
    args: &StartArgs,
    name: &std::ffi::CStr,
    on_refusal: OnRefusal,
) -> Result<Option<pgrx::Uuid>, QuotaError> {
    let mut placed = None;
    let result = start_placed(args, name, on_refusal, &mut placed);
    // On a Citus node, a writer-committed start's charge is committed (or was refused)
    // by now: a move of its tenant's shard may go and will see it (citus/moves.rs). A
    // transactional one's commits with its transaction, which keeps the lock, unless
    // it charged nothing.
    if !args.transactional || matches!(result, Ok(None)) {
        crate::citus::release(&placed);
    }
    result
}

/// `start`, keeping in `placed` where a Citus node found its tenant.
fn start_placed(
    args: &StartArgs,
    name: &std::ffi::CStr,
    on_refusal: OnRefusal,
    placed: &mut Option<crate::core::citus::Placement>,
) -> Result<Option<pgrx::Uuid>, QuotaError> {
    shmem::require_callable(name);
    // A standby or a read-only transaction refuses with 25006, as nextval() does:
    // the charge is a write, even though it is not the caller's own.
    // SAFETY: both raise ERROR or return; XactReadOnly is a plain backend flag, read
    // first as PreventCommandIfReadOnly() reads it, so that a refusal makes one call
    // into PostgreSQL fewer.
    unsafe {
        pg_sys::PreventCommandDuringRecovery(name.as_ptr());
        if pg_sys::XactReadOnly {
            pg_sys::PreventCommandIfReadOnly(name.as_ptr());
        }
    }
    if let Some(l) = args.label {
        check_label(chars(l), l.len())?;
    }
    if let Some(k) = args.key {
        check_key(chars(k), k.len())?;
    }
    if let Some(t) = args.tenant {
        check_tenant(chars(t), t.len())?;
    }
    // When the wait ends, None where the start does not wait (see
    // core::lease::deadline). A wait runs from the call's beginning, what the lookups
    // below may wait for included: a start that waits reads the clock for it here (one
    // that does not, start()'s default, reads none). Err: a negative wait, raised below
    // after the lease's check, as before.
    let deadline = match args.wait {
        None => Ok(None),
        Some(w) => {
            // SAFETY: an interval datum points at its Interval.
            let i = unsafe { &*w.cast_mut_ptr::<pg_sys::Interval>() };
            match crate::core::lease::wait_micros(i.month, i.day, i.time) {
                // SAFETY: plain clock read.
                Some(us) => Ok(crate::core::lease::deadline(us, || unsafe {
                    pg_sys::GetCurrentTimestamp()
                })),
                None => Err(w),
            }
        }
    };
    // SAFETY: plain reads of backend state.
    let (role, exempt) = unsafe {
        let role = pg_sys::GetUserId();
        (role, pg_sys::superuser_arg(role))
    };
    // On a Citus cluster whose starts are distributed by tenant, only the node that
    // holds the tenant counts its tickets (core::citus). Superusers are never refused
    // (I7), here either.
    let distributed = match args.tenant {
        Some(t) if !exempt => {
            let placement = crate::citus::placement(t)?;
            let distributed = placement.is_some();
            placed.clone_from(&placement);
            crate::core::citus::admit_here(&server_text(t), placement, "quota.start(tenant => …)")
                .map_err(QuotaError::TenantElsewhere)?;
            distributed
        }
        _ => false,
    };
    // The policy of the role charged (after SET ROLE, not the login's; see policy.rs).
    let policy = crate::policy::of(role);
    if distributed {
        crate::citus::warn_per_node(&policy);
    }
    let rels = rels();
    if !rels.v2() {
        // The library is newer than the database's schema: 0.1.x's calls work as
        // they did; what needs 0.2.0's columns says how to get them.
        if policy.limits.max_db > 0 && !exempt {
            rels.require_v2("quota.max_active_per_database");
        }
        if args.key.is_some() {
            rels.require_v2("an idempotency key");
        }
        if args.lease.is_some() {
            rels.require_v2("a lease");
        }
    }
    if !rels.v5() {
        if args.tenant.is_some() {
            rels.require_v5("a tenant");
        }
        if args.transactional {
            rels.require_v5("a transactional start");
        }
    }
    if args.weight > 1 {
        rels.require_v7("a weight above 1");
    }
    if args.transactional && !policy.allow_transactional {
        return Err(QuotaError::TransactionalNotAllowed {
            role: role_name(role),
        });
    }
    let tenant = args.tenant.map(|t| Tenant {
        key: scopes::tenant_key(t),
        text: text_datum(t),
    });
    // 0.7.0: the tenant's own limits, where quota.set_tenant_limits() set them, beat
    // every layer of the role's quota.max_*_per_tenant (a session's SET included).
    // Superusers are never refused, so theirs are not looked up.
    let own = match args.tenant {
        Some(t) if !exempt => crate::ledger::overrides::of(role, t),
        _ => Default::default(),
    };
    let caller = Caller {
        args,
        role,
        exempt,
        policy,
        limits: Limits {
            tenant_active: own.max_active.map_or(policy.tenant_max_active, i64::from),
            tenant_retained: own
                .max_retained
                .map_or(policy.tenant_max_retained, i64::from),
            ..policy.limits
        }
        .for_tenant(tenant.is_some()),
        own,
        tenant,
    };
    // The clock reading the first try decides on, taken after what may wait (the
    // policy's and the relations' lookups, which lock catalogs and pg_quota's tables
    // when a cache was invalidated): a lease that runs out meanwhile must not still
    // count against this start.
    // SAFETY: plain clock read.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    // Check the lease now, so that a bad one fails before any wait.
    lease_until(now, args.lease, policy.default_lease_secs)?;
    let deadline = deadline.map_err(|w| QuotaError::InvalidInterval {
        what: "wait",
        value: interval_text(w),
    })?;

    let mut place: Option<(crate::waiters::Place, WaitTimer)> = None;
    // The next lease end in the start's way, once looked up (see `next_lease_end`).
    let mut next_lease: Option<(Option<pg_sys::Oid>, Option<pg_sys::TimestampTz>)> = None;
    // The clock as the next try reads it: the first try's is the one read above.
    let mut now = now;
    loop {
        if place.is_some() {
            queue::drop_abandoned_answer();
            // SAFETY: plain clock read.
            now = unsafe { pg_sys::GetCurrentTimestamp() };
        }
        let seq = place.as_ref().map_or(u64::MAX, |p| p.0.seq);
        let r = match attempt(&caller, seq, now)? {
            Ok((id, found_here)) => {
                // The writer counts what it answers (see writer/batch.rs, count_admitted),
                // a transactional start counts its admission when it commits
                // (charges.rs); a repeat found by this session never reached either.
                if found_here {
                    stats::add(role, Counter::IdempotentHits, 1);
                }
                if let Some((p, _)) = place.as_mut() {
                    p.admitted();
                }
                return Ok(Some(id));
            }
            Err(r) => r,
        };
        // The deadline if the wait goes on.
        let waiting_until = deadline.and_then(|d| {
            // SAFETY: plain clock read.
            now = unsafe { pg_sys::GetCurrentTimestamp() };
            (now < d).then_some(d)
        });
        let Some(deadline) = waiting_until else {
            if place.is_some() {
                stats::add(role, Counter::WaitTimeouts, 1);
            }
            count_refusal(&caller, &r, r.at().unwrap_or(now));
            return match on_refusal {
                OnRefusal::Raise => Err(caller.refusal(&r)),
                OnRefusal::Null => Ok(None),
            };
        };
        let Some((p, _)) = &place else {
            // Take a place in line, then look again at once: a finish() that
            // committed before we were in line could not wake us.
            place = Some((
                crate::waiters::Place::take(role, caller.tenant_key(), r.kind, args.weight),
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
        let scope = (r.kind != RefusalKind::Database).then_some(role);
        let next = earliest(
            next_lease_end(scope, now, &mut next_lease),
            r.next_ageout(&caller),
        );
        nap(
            crate::core::lease::wait_ms(now, deadline, next, crate::waiters::POLL_MS),
            compat::Wait::Capacity,
        );
    }
}

/// When a lease in a waiting start's way runs out next, for its wake-up (waking early
/// only looks again; every wait is bounded by waiters::POLL_MS anyway, and a finish()
/// wakes it at once). For a role's or a tenant's limit: the role's counter's
/// `earliest` where the counter is live and knows one still to come (a lower bound: it
/// counts the tenant's tickets too). Else, and for the database cap, a look at the
/// role's (or the database's) unended tickets, once per wait (`looked`), and again only
/// once the lease it found has passed: 0.6.1's quota.active has no index in lease
/// order, and a poll must not walk a backlog every time. A lease that a start or a
/// renewal brings meanwhile, and that runs out sooner, is then seen at the next poll.
/// What was found is for that scope only: a refusal at another limit looks anew.
fn next_lease_end(
    scope: Option<pg_sys::Oid>,
    now: pg_sys::TimestampTz,
    looked: &mut Option<(Option<pg_sys::Oid>, Option<pg_sys::TimestampTz>)>,
) -> Option<pg_sys::TimestampTz> {
    if let Some(role) = scope {
        let known = crate::ledger::rels::current_tags()
            .and_then(|tags| crate::scopes::peek(crate::scopes::ScopeKey::role(role), tags, now))
            .filter(|p| p.earliest > now);
        if let Some(p) = known {
            return (p.earliest != crate::scopes::LEASE_NONE).then_some(p.earliest);
        }
    }
    if let Some((of, found)) = *looked {
        if of == scope && found.is_none_or(|t| t > now) {
            return found;
        }
    }
    let reader = Reader::open();
    let snap = Latest::take();
    let found = next_expiry(&reader.rels, &snap, scope, now);
    *looked = Some((scope, found));
    found
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
fn count_refusal(caller: &Caller, r: &Refused, now: pg_sys::TimestampTz) {
    let log = gucs::log_refusals();
    if let Some(suppressed) = stats::refused(caller.role, Counter::refused(r.kind), log, now) {
        let (usage, _) = r.numbers(caller);
        let tenant = caller.args.tenant.map(server_text);
        let line = crate::core::stats::refusal_log_line(
            &role_name(caller.role),
            tenant.as_deref(),
            &database_name(shmem::my_db()),
            r.kind,
            usage,
            caller.limits,
            suppressed,
            caller.tenant_limit_set(r.kind),
            caller.args.weight,
        );
        // The server log only: the refused client gets its own error, and a tenant
        // with client_min_messages = log must not read other details from here.
        crate::error::log_server_only(&line);
    }
}

/// The ticket `id` of an idempotent repeat, of weight `held`, if that is the weight the
/// repeat asks for (0.7.0): a repeat with another weight is refused (22023), and
/// charges nothing, rather than hand out a ticket that counts other than asked.
pub(crate) fn repeat_of(
    caller: &Caller,
    id: [u8; 16],
    held: i64,
) -> Result<pgrx::Uuid, QuotaError> {
    let id = pgrx::Uuid::from_bytes(id);
    if held != caller.args.weight {
        return Err(QuotaError::WeightMismatch {
            ticket: id.to_string(),
            held,
            asked: caller.args.weight,
        });
    }
    Ok(id)
}

/// Waits, outside any lock of pg_quota's, for every transaction still in progress that
/// started a ticket of the caller's scope with `key` (a transactional start, 0.5.0) to
/// commit or roll back, as an insert into a unique index waits for a conflicting one:
/// its ticket is then either there to be returned, or gone and admitted anew.
fn wait_for_key(caller: &Caller, key: &[u8]) {
    loop {
        let xid = {
            let reader = Reader::open();
            key_in_progress(&reader.rels, caller.role, caller.args.tenant, key)
        };
        let Some(xid) = xid else { return };
        // SAFETY: an ordinary lock wait on the transaction's id; lock_timeout,
        // statement_timeout, cancel and the deadlock detector all apply.
        unsafe {
            pg_sys::XactLockTableWait(
                xid,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                pg_sys::XLTW_Oper::XLTW_None,
            )
        };
    }
}

/// One try at admission, at `now`, for a caller at place `seq` in line (u64::MAX if
/// it is not waiting). The outer Result carries errors, the inner one refusals; an
/// admission says whether this session found it as an idempotent repeat.
fn attempt(
    caller: &Caller,
    seq: u64,
    mut now: pg_sys::TimestampTz,
) -> Result<Result<(pgrx::Uuid, bool), Refused>, QuotaError> {
    // When this try began, for the writer-liveness timer (queue::Patience::since).
    let began = now;
    // An idempotent repeat is answered here, whatever the limits say: it charges
    // nothing. The writer checks again, for requests racing with the same key. Where
    // synchronous standbys are named, the writer answers repeats of its tickets
    // instead (see writer.rs). A transactional start with the key that is still open
    // is waited for first.
    let mut repeat = false;
    if let Some(key) = caller.args.key {
        // A transactional start of this very transaction with the key, which its own
        // snapshots may not see (the same statement, see charges::own_with_key): a
        // transactional repeat gets its ticket, which stands or falls with the same
        // transaction; a writer-committed one may not (KeyHeldUncommitted).
        if let Some((id, held)) =
            crate::charges::own_with_key(caller.role, caller.tenant_key(), key)
        {
            if !caller.args.transactional {
                return Err(QuotaError::KeyHeldUncommitted);
            }
            return Ok(Ok((repeat_of(caller, id, held)?, true)));
        }
        wait_for_key(caller, key);
        let reader = Reader::open();
        let snap = Latest::take();
        // The wait for the key, and the Reader's for its locks, may have been long:
        // what follows (the lookup of the key's ticket, the writer's try) judges ages
        // and leases by the clock after them. Read after the snapshot, a cutoff only
        // moves later than the snapshot's moment, never earlier.
        // SAFETY: plain clock read.
        now = unsafe { pg_sys::GetCurrentTimestamp() };
        let cutoff = cutoff(now, caller.policy.retention_secs);
        if let Some((id, held)) = retained_with_key(
            &reader.rels,
            &snap,
            caller.role,
            caller.args.tenant,
            key,
            now,
            cutoff,
        ) {
            let id = repeat_of(caller, id, held)?;
            if caller.args.transactional || !crate::syncrep::standbys_defined() {
                return Ok(Ok((id, true)));
            }
            repeat = true;
        }
    }
    // 0.7.0: a start heavier than a limit that applies to it is refused at
    // once, wait or not: no ticket that ends could make room for it. Not a repeat of
    // its key, answered above whatever the limits say now (a limit lowered since the
    // first start must not make a retry look uncharged). Counted as a refusal of that
    // limit (no LOG line: the caller's own error says it all).
    // Nor a start whose key a request in the writer's hands has (its first start, whose
    // answer its client may have lost): the paths below send it to the writer, which
    // answers it as a repeat once that request commits.
    if !repeat {
        if let Some(kind) =
            crate::core::never_fits(caller.limits, caller.args.weight, caller.exempt)
        {
            let in_flight = caller
                .args
                .key
                .is_some_and(|k| queue::in_flight_with_key(caller.role, caller.tenant_key(), k));
            if !in_flight {
                stats::refused(caller.role, Counter::refused(kind), false, now);
                return Err(caller.never_fits(kind));
            }
        }
    }
    // A length: the ticket's lease runs this long from when it really starts.
    let lease_us = lease_until(now, caller.args.lease, caller.policy.default_lease_secs)?
        .map(|until| crate::core::lease::length(now, until));
    if caller.args.transactional {
        transactional::attempt(caller, seq, began, lease_us)
    } else {
        writer::attempt(caller, seq, now, began, lease_us, repeat)
    }
}
