//! Layer 4, shared state: starts that wait for capacity (`start(…, wait =>
//! interval)`), and their order, in a segment of their own.
//!
//! A waiting start() takes a place in line: a number from one cluster-wide counter,
//! kept in its backend's entry with its database, its role, its tenant (0.5.0) and the
//! limit that refused it. While it waits, every other start() of its scope (or, for
//! the database cap, of its database) that arrives later counts it as if its ticket
//! were already active: a stream of newcomers cannot take each freed slot before it, so
//! it is not starved. A start refused by its tenant's limit waits ahead of the later
//! starts of that tenant only: the other tenants of its role are not held up by a limit
//! that is not theirs.
//!
//! Among themselves, the waiters of a role go in turns across its tenants (0.7.0), not
//! in arrival order: each waiter gets a turn when it takes its place, one past its
//! tenant's last waiter's, and no earlier than the turn of the role's first waiter in
//! line; the line is ordered by turn, then by place. So one tenant's 1,000 waiting
//! starts do not go before another tenant's one: a tenant's first waiter is at most as
//! many slots from the front as there are tenants waiting. Within a tenant, arrival
//! order stays (its turns rise with its places). Starts without a tenant take turns as
//! one more tenant. Waiters for the database cap go in the order of their places.
//!
//! A finish() that frees a slot wakes the waiters of its scope and database when its
//! transaction commits, as does the writer's expiry sweep; a waiter also looks again
//! when the next lease in its way runs out, and at least every POLL_MS. The entry is
//! cleared when the start() returns or raises (a Drop guard), and at backend exit
//! (before_shmem_exit: FATAL runs no destructor).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;

use crate::core::RefusalKind;
use crate::queue;
use crate::shmem::{self, Base, Layout, Segment};

/// The longest a waiter sleeps without looking again, in milliseconds: it bounds the
/// cost of a wake-up that arrives while it is busy elsewhere.
pub const POLL_MS: i64 = 200;

const KIND_ROLE: u32 = 1;
const KIND_DATABASE: u32 = 2;
const KIND_TENANT: u32 = 3;

#[repr(C)]
pub struct Waiter {
    /// Its place in line; 0 when this backend is not waiting.
    seq: AtomicU64,
    db: AtomicU32,
    role: AtomicU32,
    /// Its tenant's key (0 for none), low and high halves.
    tenant: [AtomicU64; 2],
    /// KIND_ROLE (a role limit refused it), KIND_TENANT (its tenant's limit) or
    /// KIND_DATABASE (the database cap).
    kind: AtomicU32,
    /// Its turn among the waiters of its role (0.7.0; see the module's comment).
    turn: AtomicU64,
    /// The front turn of its role's line when it joined: giving back turns never moves
    /// it before that (see core::turns::moved_up).
    floor: AtomicU64,
    /// Set by `wake`; the waiter looks again before it sleeps.
    woken: AtomicBool,
    /// Its start's weight (0.7.0): the units it takes of the slots it waits for.
    weight: AtomicU64,
}

#[repr(C)]
struct Header {
    n: usize,
    /// The last place handed to a waiting start().
    wait_seq: AtomicU64,
    /// How many backends are in the line right now.
    waiting: AtomicU64,
}

static BASE: Base = Base::new();

/// The segment's layout for `n` backends: the header, then one entry per backend.
fn layout(n: usize) -> (Layout, usize) {
    let mut l = Layout::of::<Header>();
    let waiters = l.array::<Waiter>(n);
    (l, waiters)
}

fn size() -> usize {
    layout(shmem::max_backends()).0.size()
}

/// # Safety
/// See shmem::Segment::attach.
unsafe fn attach(base: *mut u8, found: bool, _locks: *mut pg_sys::LWLockPadded) {
    // SAFETY: the segment is ours and zeroed when not `found`; zero is a valid state of
    // every entry (all atomics): not waiting.
    unsafe {
        if !found {
            (*(base as *mut Header)).n = shmem::max_backends();
        }
    }
    BASE.set(base);
}

/// The line's segment (see shmem.rs).
pub static SEGMENT: Segment = Segment {
    name: c"pg_quota waiters",
    size,
    extra: shmem::nothing,
    locks: 0,
    attach,
};

fn header() -> &'static Header {
    // SAFETY: the segment starts with a Header (see `layout`).
    unsafe { BASE.header::<Header>() }
}

/// The waiting starts, one entry per backend.
fn waiters() -> &'static [Waiter] {
    let n = header().n;
    // SAFETY: `layout` put `n` entries there; zeroed is "not waiting".
    unsafe { BASE.slice::<Waiter>(layout(n).1, n) }
}

fn mine() -> &'static Waiter {
    &waiters()[shmem::my_procno()]
}

// Single-threaded backend state.
static mut EXIT_CALLBACK_REGISTERED: bool = false;

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn leave_at_exit(_code: i32, _arg: pg_sys::Datum) {
    if shmem::available() && shmem::my_procno() < header().n {
        leave_unserved();
    }
}

/// This backend's place in line while a start() waits; leaves the line when dropped.
pub struct Place {
    pub seq: u64,
    /// Whether the start was admitted (see `admitted`).
    served: bool,
}

impl Place {
    /// Takes a place in line for a start of `weight` units of `role` (and its tenant
    /// `tenant`, a key, 0 for none) of this database, refused by `kind`.
    pub fn take(role: pg_sys::Oid, tenant: u128, kind: RefusalKind, weight: i64) -> Place {
        // SAFETY: single-threaded backend state; the callback is registered once.
        unsafe {
            if !EXIT_CALLBACK_REGISTERED {
                pg_sys::before_shmem_exit(Some(leave_at_exit), pg_sys::Datum::from(0));
                EXIT_CALLBACK_REGISTERED = true;
            }
        }
        let w = mine();
        w.db.store(u32::from(shmem::my_db()), Ordering::Relaxed);
        w.role.store(u32::from(role), Ordering::Relaxed);
        w.tenant[0].store(tenant as u64, Ordering::Relaxed);
        w.tenant[1].store((tenant >> 64) as u64, Ordering::Relaxed);
        w.kind.store(kind_of(kind), Ordering::Relaxed);
        w.weight.store(weight.max(1) as u64, Ordering::Relaxed);
        let (turn, floor) = next_turn(role, tenant);
        w.turn.store(turn, Ordering::Relaxed);
        w.floor.store(floor, Ordering::Relaxed);
        let seq = header().wait_seq.fetch_add(1, Ordering::AcqRel) + 1;
        // Counted before the place is published (see `ahead`).
        if w.seq.load(Ordering::Acquire) == 0 {
            header().waiting.fetch_add(1, Ordering::AcqRel);
        }
        w.seq.store(seq, Ordering::Release);
        Place { seq, served: false }
    }

    /// Marks the start admitted: it leaves the line having had its turn. One that
    /// leaves otherwise (its wait ran out, an error, a cancel) gives its turn back.
    pub fn admitted(&mut self) {
        self.served = true;
    }

    /// Records the limit that refused the waiter last.
    pub fn refused_by(&self, kind: RefusalKind) {
        mine().kind.store(kind_of(kind), Ordering::Release);
    }

    /// Whether someone woke this waiter since it last asked; clears the mark.
    pub fn woken(&self) -> bool {
        mine().woken.swap(false, Ordering::AcqRel)
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.served {
            leave();
        } else {
            leave_unserved();
        }
    }
}

fn kind_of(kind: RefusalKind) -> u32 {
    match kind {
        RefusalKind::Database => KIND_DATABASE,
        RefusalKind::TenantActive | RefusalKind::TenantRetained => KIND_TENANT,
        RefusalKind::Active | RefusalKind::Retained => KIND_ROLE,
    }
}

/// The turn of a new waiter of `role` and its tenant `tenant` in this database (one past
/// its tenant's last waiter's, and no earlier than the front of the role's line; see
/// core::turns), and that front. Two waiters that take their places at once may get
/// the same turn; their places order them.
fn next_turn(role: pg_sys::Oid, tenant: u128) -> (u64, u64) {
    let (db, role) = (u32::from(shmem::my_db()), u32::from(role));
    let me = shmem::my_procno();
    let mut first: Option<u64> = None;
    let mut any: Option<u64> = None;
    let mut tenant_last: Option<u64> = None;
    for (i, (w, slot)) in waiters().iter().zip(queue::slots()).enumerate() {
        if i == me
            || w.seq.load(Ordering::Acquire) == 0
            || w.db.load(Ordering::Relaxed) != db
            || w.role.load(Ordering::Relaxed) != role
        {
            continue;
        }
        let turn = w.turn.load(Ordering::Relaxed);
        any = Some(any.map_or(turn, |f| f.min(turn)));
        // The front is that of the waiters in the role's line (refused by a role
        // limit, request not in flight): one held back by its tenant's own limit or
        // by the database cap is not served in the role's turns, and must not hold
        // the front back for everybody.
        if w.kind.load(Ordering::Relaxed) == KIND_ROLE
            && queue::load_state(slot) == queue::SLOT_FREE
        {
            first = Some(first.map_or(turn, |f| f.min(turn)));
        }
        if tenant_of(w) == tenant {
            tenant_last = Some(tenant_last.map_or(turn, |l| l.max(turn)));
        }
    }
    let front = crate::core::turns::front(first, any);
    (
        crate::core::turns::next_turn(front, tenant_last),
        front.unwrap_or(0),
    )
}

fn tenant_of(w: &Waiter) -> u128 {
    u128::from(w.tenant[0].load(Ordering::Relaxed))
        | (u128::from(w.tenant[1].load(Ordering::Relaxed)) << 64)
}

/// The starts waiting ahead of a newcomer, as its admission counts them: how many (a
/// refusal names them) and their units (0.7.0: the active and retained counts take
/// each one's weight).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ahead {
    /// Of its role: they take its role's next free slots.
    pub of_role: i64,
    /// Of its tenant: they take its tenant's next free slots.
    pub of_tenant: i64,
    /// Of any role, waiting for the database cap.
    pub of_db: i64,
    pub role_units: i64,
    pub tenant_units: i64,
    pub db_units: i64,
}

impl Ahead {
    /// What these starts take of the next free units (core::Pending).
    pub fn pending(&self) -> crate::core::Pending {
        crate::core::Pending {
            role_units: self.role_units,
            tenant_units: self.tenant_units,
            db_units: self.db_units,
        }
    }
}

/// Leaves the line without having been admitted (0.7.0): the later waiters of its
/// tenant move up one turn each, so that a tenant whose waiters give up does not keep
/// the turns they held (1,000 waiters of which 999 time out leave one waiter at the
/// turn of the first, not of the 1,000th). Then as `leave`.
fn leave_unserved() {
    let w = mine();
    if w.seq.load(Ordering::Acquire) != 0 {
        let (db, role, tenant) = (
            w.db.load(Ordering::Relaxed),
            w.role.load(Ordering::Relaxed),
            tenant_of(w),
        );
        let turn = w.turn.load(Ordering::Relaxed);
        let me = shmem::my_procno();
        for (i, o) in waiters().iter().enumerate() {
            if i != me
                && o.seq.load(Ordering::Acquire) != 0
                && o.db.load(Ordering::Relaxed) == db
                && o.role.load(Ordering::Relaxed) == role
                && tenant_of(o) == tenant
            {
                // Only down to this waiter's turn: a racing join may have read it.
                let _ = o
                    .turn
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                        crate::core::turns::moved_up(t, turn, o.floor.load(Ordering::Relaxed))
                    });
            }
        }
    }
    leave();
}

/// Leaves the line, if this backend is in it, having been admitted (or charged, for a
/// transactional start). Idempotent.
pub fn leave() {
    let w = mine();
    let was = w.seq.swap(0, Ordering::AcqRel);
    w.woken.store(false, Ordering::Release);
    if was != 0 {
        header().waiting.fetch_sub(1, Ordering::AcqRel);
        // Those behind us counted us as ahead of them: let them look again.
        let (db, role) = (
            pg_sys::Oid::from(w.db.load(Ordering::Relaxed)),
            pg_sys::Oid::from(w.role.load(Ordering::Relaxed)),
        );
        wake(db, role);
    }
}

/// The starts waiting ahead of place `seq` (u64::MAX for a start that is not
/// waiting) in this database, for a start of `role` and its tenant `tenant` (a key, 0
/// for none): those of the role refused by a role limit, which take the role's next
/// slots (and the tenant's, if theirs); those of the tenant refused by its limit, which
/// take the tenant's next slots and, admitted, the role's too; and those of any role
/// refused by the database cap. A waiter with a request in the writer's hands, or
/// answered and not yet taken back, is not counted: callers count requests in flight
/// already, and an admitted one is an active ticket by then.
pub fn ahead(role: pg_sys::Oid, tenant: u128, seq: u64) -> Ahead {
    let db = u32::from(shmem::my_db());
    let role = u32::from(role);
    let mut a = Ahead::default();
    // Nobody in line, the common case: no walk over every backend's entry. A waiter
    // counts itself here before it publishes its place, so a place published before
    // this load is counted.
    if header().waiting.load(Ordering::Acquire) == 0 {
        return a;
    }
    // A waiter's own turn (a start that does not wait comes after every waiter).
    let my_turn = (seq != u64::MAX).then(|| mine().turn.load(Ordering::Relaxed));
    for (w, slot) in waiters().iter().zip(queue::slots()) {
        let s = w.seq.load(Ordering::Acquire);
        if s == 0 || s == seq || w.db.load(Ordering::Relaxed) != db {
            continue;
        }
        // The database cap's line goes by places, a role's by turns, then places.
        let before = |by_turn: bool| match my_turn {
            None => true,
            Some(t) if by_turn => {
                crate::core::turns::goes_first((w.turn.load(Ordering::Relaxed), s), (t, seq))
            }
            Some(_) => s < seq,
        };
        if queue::load_state(slot) != queue::SLOT_FREE {
            continue;
        }
        let kind = w.kind.load(Ordering::Relaxed);
        let units = w.weight.load(Ordering::Relaxed).max(1) as i64;
        if kind == KIND_DATABASE {
            if before(false) {
                a.of_db += 1;
                a.db_units += units;
            }
            continue;
        }
        if w.role.load(Ordering::Relaxed) != role || !before(true) {
            continue;
        }
        let same_tenant = tenant != 0 && tenant_of(w) == tenant;
        if kind == KIND_ROLE || same_tenant {
            a.of_role += 1;
            a.role_units += units;
        }
        if same_tenant {
            a.of_tenant += 1;
            a.tenant_units += units;
        }
    }
    a
}

/// Wakes the starts waiting in database `db` for `role`, and those waiting for the
/// database cap: a slot of theirs may have freed. Never raises: it runs at commit.
pub fn wake(db: pg_sys::Oid, role: pg_sys::Oid) {
    if !shmem::available() || header().waiting.load(Ordering::Acquire) == 0 {
        return;
    }
    let (db, role) = (u32::from(db), u32::from(role));
    for (procno, w) in waiters().iter().enumerate() {
        if w.seq.load(Ordering::Acquire) == 0 || w.db.load(Ordering::Relaxed) != db {
            continue;
        }
        if w.kind.load(Ordering::Relaxed) == KIND_DATABASE || w.role.load(Ordering::Relaxed) == role
        {
            w.woken.store(true, Ordering::Release);
            shmem::wake(procno);
        }
    }
}
