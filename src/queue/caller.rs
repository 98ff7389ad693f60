//! Layer 4: the caller's half of the request queue (see mod.rs). A start() fills its
//! own slot, marks it PENDING, wakes its database's writer (registering one when there
//! is none) and sleeps on its latch until the answer is DONE; it makes sure meanwhile
//! that a writer is there for it, and withdraws a request the writer has not claimed
//! when it is cancelled or its session ends.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::*;
use crate::catalog::database_name;
use crate::compat::{self, nap};
use crate::core::{Pending, QuotaError, RefusalKind, Usage};
use crate::error::raise;
use crate::gucs;
use crate::workers::{self, TableLock, WriterState};

/// How often a waiting caller looks around without being woken.
const POLL_MS: i64 = 250;
/// How often a waiting caller makes sure its writer is still there.
const LIVENESS_EVERY: Duration = Duration::from_millis(500);
/// How often the first caller in line for a writer slot tries again (a writer that
/// leaves wakes it at once), and how often the others look whether their database got
/// a writer meanwhile.
const HEAD_POLL_MS: i64 = 10;
const LINE_POLL_MS: i64 = 50;
/// How many writers a caller starts for one request before it gives up: a writer
/// that keeps exiting before it serves anything will not do better the next time.
const MAX_WRITER_STARTS: u32 = 3;

/// The writer's answer to one start.
pub enum Answer {
    /// The ticket (new, or the one the request's idempotency key already had), and its
    /// weight (0.7.0).
    Admitted([u8; 16], i64),
    Refused(RefusalKind, Usage, Option<crate::core::lease::Capacity>),
}

// Single-threaded backend state.
static mut EXIT_CALLBACK_REGISTERED: bool = false;

/// Runs at backend exit, FATAL included (pg_terminate_backend, idle_session_timeout,
/// client_connection_check_interval), where no Rust destructor runs: a request the
/// writer has not claimed yet is withdrawn, so it can never become a ticket that
/// nobody holds. A claimed one is the writer's to finish (over-count at worst).
#[pg_guard]
unsafe extern "C-unwind" fn withdraw_at_exit(_code: i32, _arg: pg_sys::Datum) {
    if !shmem::available() {
        return;
    }
    let me = shmem::my_procno();
    if me < n_slots() {
        let _ = slot(me).state.compare_exchange(
            SLOT_PENDING,
            SLOT_FREE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        slot(me).slot_line.store(0, Ordering::Release);
    }
}

/// This backend's request slot, with the exit callback that withdraws what a FATAL
/// leaves behind registered.
fn my_slot() -> &'static Slot {
    let me = shmem::my_procno();
    if me >= n_slots() {
        pgrx::error!("pg_quota: process number {me} has no request slot");
    }
    // SAFETY: single-threaded backend state; the callback is registered once.
    unsafe {
        if !EXIT_CALLBACK_REGISTERED {
            pg_sys::before_shmem_exit(Some(withdraw_at_exit), pg_sys::Datum::from(0));
            EXIT_CALLBACK_REGISTERED = true;
        }
    }
    slot(me)
}

/// Fills this backend's slot with a request of this database, the current role,
/// `tenant` (a key of scopes::tenant_key, 0 for none) and `weight` (0.7.0).
fn prepare(tenant: u128, weight: i64, fill: impl FnOnce(&mut Request)) -> &'static Slot {
    let slot = my_slot();
    reclaim(slot);

    // SAFETY: the slot is FREE and ours (indexed by our PGPROC number), so nobody
    // else reads its payload until we publish it with the Release store below.
    unsafe { fill(&mut *slot.request.get()) };
    slot.dboid
        .store(u32::from(shmem::my_db()), Ordering::Relaxed);
    // SAFETY: a plain read of backend state.
    let role = unsafe { pg_sys::GetUserId() };
    slot.role.store(u32::from(role), Ordering::Relaxed);
    slot.tenant[0].store(tenant as u64, Ordering::Relaxed);
    slot.tenant[1].store((tenant >> 64) as u64, Ordering::Relaxed);
    slot.weight.store(weight as u32, Ordering::Relaxed);
    slot
}

/// Hands one start request to this database's writer, starting one (in line for a
/// writer slot) if need be. The caller then calls `wait`.
pub fn enqueue(tenant: u128, weight: i64, fill: impl FnOnce(&mut Request)) {
    let slot = prepare(tenant, weight, fill);
    // Callers publish under the table lock, so a writer deciding to leave
    // (exclusively) sees every request queued for it. The request is not published
    // before, so a cancel while waiting in line leaves nothing behind.
    let (_lock, i) = writer_in_line(slot, shmem::my_db()).unwrap_or_else(|e| raise(e));
    publish(slot, i);
}

/// Hands one start request to this database's writer if one runs; false (nothing
/// handed over) if none does. For callers holding a lock that a wait in line must not
/// be made under.
pub fn enqueue_to_running(tenant: u128, weight: i64, fill: impl FnOnce(&mut Request)) -> bool {
    let slot = prepare(tenant, weight, fill);
    let _shared = TableLock::acquire_shared();
    match workers::writer_of(shmem::my_db()) {
        Some(i) => {
            publish(slot, i);
            true
        }
        None => false,
    }
}

/// Makes sure this database has a writer, waiting in line for a slot if need be. For
/// a limited start that found no writer under its scope lock: it waits here, without
/// that lock, which would otherwise hold up every other start of the scope.
pub fn ensure_writer() {
    let _ = writer_in_line(my_slot(), shmem::my_db()).unwrap_or_else(|e| raise(e));
}

/// This database's writer, with the table lock held to publish to it. The common case,
/// a running writer, needs only the shared lock. Without one, a writer is started;
/// when every writer slot is taken, a writer of another database gives its up once it
/// has nothing to do (workers::try_start_writer), and callers wait in line for the
/// slots, for at most quota.writer_start_wait: the first in line starts the next
/// writer, so databases get slots in the order their callers asked, and a caller
/// whose database gets a writer meanwhile (another caller of it started one) leaves
/// the line. A writer that leaves wakes the first in line.
fn writer_in_line(slot: &'static Slot, db: pg_sys::Oid) -> Result<(TableLock, usize), QuotaError> {
    {
        let shared = TableLock::acquire_shared();
        if let Some(i) = workers::writer_of(db) {
            return Ok((shared, i));
        }
    }
    let began = Instant::now();
    let mut place: Option<InLine> = None;
    loop {
        let head = line_head();
        let my_turn = match &place {
            None => head == 0,
            Some(p) => head == p.0,
        };
        let found = if my_turn {
            let lock = TableLock::acquire();
            workers::writer_of(db)
                .or_else(workers::try_start_writer)
                .map(|i| (lock, i))
        } else {
            let lock = TableLock::acquire_shared();
            workers::writer_of(db).map(|i| (lock, i))
        };
        if let Some(found) = found {
            if let Some(place) = place {
                // Entries still free (a burst of databases in line after writers left
                // together): the next in line may take one now rather than at its
                // next look, LINE_POLL_MS away (0.4.0 let the line drain at 20 to 40
                // databases a second while slots stood free).
                place.leave_served(workers::has_free_entry());
            }
            return Ok(found);
        }
        let waited = began.elapsed();
        if waited >= gucs::writer_start_wait() {
            return Err(QuotaError::NoWorkerSlot {
                waited_ms: waited.as_millis() as u64,
            });
        }
        if place.is_none() {
            place = Some(InLine::join(slot));
        }
        let poll = if my_turn { HEAD_POLL_MS } else { LINE_POLL_MS };
        nap(poll, compat::Wait::WriterStart);
    }
}

/// A caller's place in the line for writer slots, left when dropped (an ERROR
/// unwinds through it; a FATAL goes through withdraw_at_exit), or by `leave_served`.
struct InLine(u64, &'static Slot);

impl InLine {
    fn join(slot: &'static Slot) -> InLine {
        let place = next_place_in_line();
        slot.slot_line.store(place, Ordering::Release);
        InLine(place, slot)
    }

    /// Leaves the line with a writer for our database, without waking the next in
    /// line unless `wake_next` (a writer entry is free, so the next can be served at
    /// once): it finds its turn at its next look (LINE_POLL_MS). Woken now with no slot
    /// free, it would ask at once for another writer to yield (a slot just taken lets the next yield be
    /// asked at once, see workers::try_start_writer), and slots would change hands as
    /// fast as writers may yield (MIN_TENURE): each database served for about 50 ms
    /// between waits of a whole round of hand-overs, many more starts waiting in line,
    /// and a process start per hand-over.
    fn leave_served(self, wake_next: bool) {
        self.1.slot_line.store(0, Ordering::Release);
        std::mem::forget(self);
        if wake_next {
            wake_line_head();
        }
    }
}

impl Drop for InLine {
    fn drop(&mut self) {
        self.1.slot_line.store(0, Ordering::Release);
        // Left without a writer (an error, a cancel): the next in line may be first
        // now, and may start one.
        wake_line_head();
    }
}

/// The first in line for writer slots: its place and its slot's index.
fn first_in_line() -> Option<(u64, usize)> {
    slots()
        .iter()
        .enumerate()
        .map(|(i, s)| (s.slot_line.load(Ordering::Acquire), i))
        .filter(|&(p, _)| p != 0)
        .min()
}

/// Wakes the first caller in line for a writer slot, if any: a writer just left.
pub fn wake_line_head() {
    if let Some((_, i)) = first_in_line() {
        shmem::wake(i);
    }
}

/// The first place in the line for writer slots; 0 when nobody waits.
pub fn line_head() -> u64 {
    first_in_line().map_or(0, |(p, _)| p)
}

fn publish(slot: &Slot, idx: usize) {
    slot.state.store(SLOT_PENDING, Ordering::Release);
    if let Ok(p) = usize::try_from(workers::writer(idx).procno) {
        shmem::wake(p);
    }
}

/// The requests of `role` in this database in the writer's hands (handed over and not
/// yet answered), all of them and those of its tenant `tenant` (a key; 0: none asked),
/// in units (0.7.0). Callers hold the role's scope lock, so none of their
/// scope can be added meanwhile; a read that races with a slot being reused only
/// miscounts a request that is not of this scope, and the writer's own check is exact
/// in any case.
pub fn inflight(role: pg_sys::Oid, tenant: u128) -> Pending {
    let db = shmem::my_db();
    let mut f = Pending::default();
    for s in slots()
        .iter()
        .filter(|s| in_writers_hands(s) && s.dboid() == db && s.role() == role)
    {
        let w = s.weight();
        f.role_units += w;
        if tenant != 0 && s.tenant() == tenant {
            f.tenant_units += w;
        }
    }
    f
}

/// Whether slot `s` holds a request handed over to a writer and not yet answered.
fn in_writers_hands(s: &Slot) -> bool {
    matches!(load_state(s), SLOT_PENDING | SLOT_CLAIMED)
}

/// The units of the requests of any role in this database in the writer's hands: what
/// the database cap must count besides the committed tickets. Unlike `inflight`, no
/// lock keeps other scopes from adding to it; the writer's check is the exact one.
pub fn inflight_db() -> i64 {
    let db = shmem::my_db();
    slots()
        .iter()
        .filter(|s| in_writers_hands(s) && s.dboid() == db)
        .map(Slot::weight)
        .sum()
}

/// Whether a request of `role` in this database with idempotency key `key` is in the
/// writer's hands (handed over, not yet answered): a start whose client may have gone
/// (a connection cut, a timeout) and whose charge may still commit. A repeat of the key
/// must not be refused meanwhile, or the application would think nothing was charged.
/// A slot reused while we read it can only make this say yes wrongly, which sends the
/// repeat to the writer, whose check is exact.
pub fn in_flight_with_key(role: pg_sys::Oid, tenant: u128, key: &[u8]) -> bool {
    let db = shmem::my_db();
    slots().iter().any(|s| {
        if !(in_writers_hands(s) && s.dboid() == db && s.role() == role && s.tenant() == tenant) {
            return false;
        }
        // SAFETY: the owner writes the request only while the slot is FREE, so while it
        // is busy the bytes stand still; volatile byte reads, checked busy again after,
        // give that request's key, or, if the slot was freed and reused in between,
        // harmlessly another's (see above). The bool is read as its byte.
        let same = unsafe {
            let r = s.request.get();
            let has = std::ptr::read_volatile((&raw const (*r).has_key).cast::<u8>()) != 0;
            let len = std::ptr::read_volatile(&raw const (*r).key_len);
            has && len == key.len()
                && key
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| std::ptr::read_volatile(&raw const (*r).key[i]) == b)
        };
        same && in_writers_hands(s)
    })
}

/// A caller's wait for the writer: every LIVENESS_EVERY it makes sure a writer is
/// there for the requests of this database, starting a new one when the last one is
/// gone, and gives up with a clear error when writers keep failing to start.
pub struct Patience {
    /// None until the first look of one made `since` a clock reading.
    last_check: Option<Instant>,
    /// For one made `since`: that reading, which its first look counts from.
    began: pg_sys::TimestampTz,
    starts: u32,
    never_started: u32,
}

impl Patience {
    pub fn new() -> Patience {
        Patience {
            last_check: Some(Instant::now()),
            began: 0,
            starts: 0,
            never_started: 0,
        }
    }

    /// A Patience whose timer runs from `began`, a clock reading the caller took when
    /// its try began, but reads the clock only at its first look: a path that seldom
    /// looks (a start decided under its scope lock waits for requests in flight only
    /// when they could take the last slots) then reads none for a refusal, and a try
    /// that already spent LIVENESS_EVERY queueing for the scope lock checks the writer
    /// at its first look, as one timed from the try's beginning did.
    pub fn since(began: pg_sys::TimestampTz) -> Patience {
        Patience {
            last_check: None,
            began,
            starts: 0,
            never_started: 0,
        }
    }

    /// Returns true if it found the writer gone (and started a new one, in line for a
    /// writer slot if need be).
    pub fn check_writer(&mut self) -> bool {
        if !self.writer_needed() {
            return false;
        }
        // Requests of this database may be waiting for a writer: ours, or others'
        // that this caller's scope waits on. Bring one up, in line with the other
        // callers that wait for a writer slot.
        if let Err(e) = writer_in_line(slot(shmem::my_procno()), shmem::my_db()) {
            withdraw_mine();
            raise(e);
        }
        true
    }

    /// The look of `check_writer` without its wait: true when the writer is gone and
    /// one must be started, which the caller then does with `ensure_writer` once it
    /// holds no lock that others wait for (a start under its scope lock). Raises when
    /// writers keep failing to start.
    pub fn writer_needed(&mut self) -> bool {
        let last = *self.last_check.get_or_insert_with(|| {
            // SAFETY: plain clock read.
            let waited = unsafe { pg_sys::GetCurrentTimestamp() }.saturating_sub(self.began);
            let now = Instant::now();
            // A wall clock stepped back counts as no time waited.
            now.checked_sub(Duration::from_micros(waited.max(0) as u64))
                .unwrap_or(now)
        });
        if last.elapsed() < LIVENESS_EVERY {
            return false;
        }
        self.last_check = Some(Instant::now());
        match workers::writer_state() {
            WriterState::Alive => return false,
            WriterState::Gone => {}
            WriterState::NeverStarted => self.never_started += 1,
        }
        if self.never_started >= 2 || self.starts >= MAX_WRITER_STARTS {
            let gave_up = if self.never_started >= 2 {
                QuotaError::WriterDidNotStart {
                    db: database_name(shmem::my_db()),
                }
            } else {
                QuotaError::WriterGone
            };
            withdraw_mine();
            raise(gave_up);
        }
        self.starts += 1;
        true
    }
}

/// Waits until this backend's slot holds no request of an earlier call (one abandoned
/// while the writer had it: its answer is waited for and dropped). A start under its
/// scope lock calls it before it takes the lock, so that this wait, which lasts as long
/// as the writer's batch, holds up no other start of the scope.
pub fn reclaim_mine() {
    reclaim(my_slot());
}

/// Withdraws our own request if the writer has not claimed it.
fn withdraw_mine() {
    let slot = slot(shmem::my_procno());
    let _ =
        slot.state
            .compare_exchange(SLOT_PENDING, SLOT_FREE, Ordering::AcqRel, Ordering::Acquire);
}

/// Waits for the writer's answer to the request `enqueue` handed over. `admitted` runs
/// once an admission is read, before the slot looks free (see `take_reply`).
pub fn wait(admitted: impl FnOnce()) -> Answer {
    let slot = slot(shmem::my_procno());

    // Until DONE, an ERROR (cancel, statement_timeout) withdraws the request if the
    // writer has not claimed it yet. If it has, the writer finishes it and the next
    // request from this backend reclaims the slot: the charge, if any, stays counted
    // (over-count, never under-count). FATAL is covered by withdraw_at_exit.
    struct Withdraw;
    impl Drop for Withdraw {
        fn drop(&mut self) {
            withdraw_mine();
        }
    }
    let guard = Withdraw;
    let mut patience = Patience::new();
    loop {
        if load_state(slot) == SLOT_DONE {
            std::mem::forget(guard);
            return take_reply(slot, admitted);
        }
        nap(POLL_MS, compat::Wait::WriterReply);
        if load_state(slot) != SLOT_DONE {
            patience.check_writer();
        }
    }
}

/// Frees this backend's slot if it holds an answer nobody took back: that of a
/// request abandoned while the writer had it (a cancel, or a previous backend with
/// our PGPROC number). Waiters call it, so that their slot looks free and they count
/// as waiting in line (see waiters::ahead). Only the owner moves DONE to FREE.
pub fn drop_abandoned_answer() {
    let me = shmem::my_procno();
    if me < n_slots() {
        let _ = slot(me).state.compare_exchange(
            SLOT_DONE,
            SLOT_FREE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// Waits for an answer owed to a request this backend abandoned (it was cancelled
/// after the writer claimed it), then frees the slot. The answer is dropped. A claim
/// is always answered: a writer that exits answers or hands back every request it
/// claimed (on_exit), and a crash resets shared memory. The request may belong to
/// another database (a previous backend with our PGPROC number), so its writer is not
/// ours to judge.
fn reclaim(slot: &'static Slot) {
    loop {
        match load_state(slot) {
            SLOT_FREE => return,
            SLOT_DONE => {
                slot.state.store(SLOT_FREE, Ordering::Release);
                return;
            }
            SLOT_PENDING => {
                // Ours, from a call that errored out between enqueue and wait.
                withdraw_mine();
            }
            _ => {
                nap(POLL_MS, compat::Wait::WriterReply);
            }
        }
    }
}

fn take_reply(slot: &'static Slot, admitted: impl FnOnce()) -> Answer {
    // SAFETY: DONE was stored with Release after the writer wrote the reply, and we
    // loaded it with Acquire; the slot is ours until we store FREE.
    let answer = unsafe {
        let r = &*slot.reply.get();
        match r.kind {
            REPLY_ADMITTED => Ok(Answer::Admitted(r.ticket, r.weight)),
            REPLY_REFUSED => {
                let kind = match r.refusal_kind {
                    1 => RefusalKind::Active,
                    2 => RefusalKind::Retained,
                    4 => RefusalKind::TenantActive,
                    5 => RefusalKind::TenantRetained,
                    _ => RefusalKind::Database,
                };
                Ok(Answer::Refused(
                    kind,
                    Usage {
                        active: r.active,
                        retained: r.retained,
                        db_active: r.db_active,
                        tenant_active: r.tenant_active,
                        tenant_retained: r.tenant_retained,
                        ahead: 0,
                    },
                    r.capacity,
                ))
            }
            REPLY_ERROR => Err((
                r.sqlerrcode,
                String::from_utf8_lossy(&r.error[..r.error_len]).into_owned(),
            )),
            REPLY_UNCONFIRMED => Err((-1, String::new())),
            _ => Err((0, String::new())),
        }
    };
    if matches!(answer, Ok(Answer::Admitted(..)) | Err((-1, _))) {
        // Admitted (confirmed or not, the charge is counted): the start leaves the line
        // of waiters (waiters.rs) before the slot looks free, so that nobody counts it
        // both as an active ticket and as a start waiting ahead of them.
        admitted();
    }
    slot.state.store(SLOT_FREE, Ordering::Release);
    let (code, msg) = match answer {
        Ok(a) => return a,
        Err((0, _)) => raise(QuotaError::WriterGone),
        Err((-1, _)) => raise(QuotaError::CommitUnconfirmed),
        Err(e) => e,
    };
    raise(QuotaError::WriterFailed { code, message: msg })
}

impl Default for Patience {
    fn default() -> Self {
        Self::new()
    }
}
