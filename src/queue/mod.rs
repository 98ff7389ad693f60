//! Layer 4, shared state: the request queue. One request slot per backend, indexed by
//! its PGPROC number, in a segment of its own; both halves of the protocol live in
//! this module: the caller's (caller.rs) and the ledger writer's (serve.rs).
//!
//! A caller owns the slot whose index is its PGPROC number, so no two callers ever
//! share a slot and the slot array needs no lock of its own: ownership hand-offs go
//! through the slot's atomic `state` (FREE → PENDING by the caller, PENDING → CLAIMED
//! and CLAIMED → DONE by the writer, DONE → FREE by the caller).

pub mod caller;
pub mod serve;

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;

use crate::core::ticket::{MAX_KEY_BYTES, MAX_LABEL_BYTES, MAX_TENANT_BYTES};
use crate::shmem::{self, Base, Layout, Segment};

pub const SLOT_FREE: u32 = 0;
pub const SLOT_PENDING: u32 = 1;
pub const SLOT_CLAIMED: u32 = 2;
pub const SLOT_DONE: u32 = 3;

/// What a caller asks of the writer. Written by the caller while the slot is FREE.
/// The database and the role live in the slot as atomics, because the writer and
/// other callers read them from slots that are not theirs (see `Slot`).
#[repr(C)]
pub struct Request {
    pub exempt: bool,
    pub max_active: i64,
    pub max_retained: i64,
    pub retention_secs: i64,
    pub has_label: bool,
    pub label_len: usize,
    pub label: [u8; MAX_LABEL_BYTES],
    /// `quota.max_active_per_database` of the calling session; 0 = none.
    pub max_db: i64,
    /// How long the ticket's lease lasts, in microseconds, if it has one (0.2.0's
    /// schema): the lease the caller asked for, as the caller's session computes
    /// `now + lease` (months and days by its calendar and time zone), made a length.
    /// The writer ends the lease this long after the instant it stamps as the ticket's
    /// start, so that no wait before then (a slot in line, a new writer, an abandoned
    /// answer) shortens it; 0.4.0 sent an instant, and a ticket could be born expired.
    pub lease_us: Option<i64>,
    /// The idempotency key, in the server encoding, if any.
    pub has_key: bool,
    pub key_len: usize,
    pub key: [u8; MAX_KEY_BYTES],
    /// The starting backend's process id, recorded in the ledger (0.2.0's schema).
    pub pid: i32,
    /// The tenant (0.5.0), in the server encoding, if any, and its limits.
    pub has_tenant: bool,
    pub tenant_len: usize,
    pub tenant: [u8; MAX_TENANT_BYTES],
    pub tenant_active: i64,
    pub tenant_retained: i64,
}

impl Request {
    pub fn key(&self) -> Option<&[u8]> {
        self.has_key.then(|| &self.key[..self.key_len])
    }

    pub fn tenant(&self) -> Option<&[u8]> {
        self.has_tenant.then(|| &self.tenant[..self.tenant_len])
    }
}

pub const REPLY_ADMITTED: u32 = 1;
pub const REPLY_REFUSED: u32 = 2;
pub const REPLY_ERROR: u32 = 3;
/// The charge committed on this server, but the writer was stopped while its commit
/// waited for synchronous replication (see writer/batch.rs, `unconfirmed`).
pub const REPLY_UNCONFIRMED: u32 = 4;

pub const ERROR_TEXT_BYTES: usize = 512;

/// The writer's answer. Written by the writer while the slot is CLAIMED.
#[repr(C)]
pub struct Reply {
    pub kind: u32,
    pub ticket: [u8; 16],
    /// The admitted ticket's weight (0.7.0): a repeat's is its first start's.
    pub weight: i64,
    /// For refusals: 1 = active limit, 2 = retained limit, 3 = database cap, 4 and 5
    /// = the tenant's active and retained limits (0.5.0).
    pub refusal_kind: u32,
    pub active: i64,
    pub retained: i64,
    pub db_active: i64,
    pub tenant_active: i64,
    pub tenant_retained: i64,
    /// For admissions: the ticket already existed under the request's idempotency key,
    /// and nothing was charged.
    pub reused: bool,
    /// For refusals at the retained limit: how and when capacity returns (0.7.0; see
    /// core::lease::capacity).
    pub capacity: Option<crate::core::lease::Capacity>,
    /// For errors: the writer's SQLSTATE (as PostgreSQL encodes it) and message.
    pub sqlerrcode: i32,
    pub error_len: usize,
    pub error: [u8; ERROR_TEXT_BYTES],
}

#[repr(C)]
pub struct Slot {
    pub state: AtomicU32,
    /// The request's database and role. Written by the owner before its Release store
    /// of PENDING; read by writers to claim and by callers to count requests in flight,
    /// who must check `state` again after reading them (the slot may be reused).
    pub dboid: AtomicU32,
    pub role: AtomicU32,
    /// The request's tenant key (scopes::tenant_key; 0 for none), low and high halves,
    /// written and read as `role` is.
    pub tenant: [AtomicU64; 2],
    /// The request's weight (0.7.0), written and read as `role` is.
    pub weight: AtomicU32,
    pub request: UnsafeCell<Request>,
    pub reply: UnsafeCell<Reply>,
    /// The owner's place in the line for writer slots (0: not in it); see
    /// caller::writer_in_line. Written only by the owner, read by every caller in line.
    pub slot_line: AtomicU64,
}

impl Slot {
    pub fn dboid(&self) -> pg_sys::Oid {
        pg_sys::Oid::from(self.dboid.load(Ordering::Acquire))
    }

    pub fn role(&self) -> pg_sys::Oid {
        pg_sys::Oid::from(self.role.load(Ordering::Acquire))
    }

    pub fn tenant(&self) -> u128 {
        u128::from(self.tenant[0].load(Ordering::Acquire))
            | (u128::from(self.tenant[1].load(Ordering::Acquire)) << 64)
    }

    /// The request's weight, at least 1 (a slot never written has 0).
    pub fn weight(&self) -> i64 {
        i64::from(self.weight.load(Ordering::Acquire).max(1))
    }
}

#[repr(C)]
struct Header {
    n_slots: usize,
    /// The last place handed out in the line for writer slots.
    line_last: AtomicU64,
}

static BASE: Base = Base::new();

/// The segment's layout for `n` slots: the header, then the slots.
fn layout(n: usize) -> (Layout, usize) {
    let mut l = Layout::of::<Header>();
    let slots = l.array::<Slot>(n);
    (l, slots)
}

fn size() -> usize {
    layout(shmem::max_backends()).0.size()
}

/// # Safety
/// See shmem::Segment::attach.
unsafe fn attach(base: *mut u8, found: bool, _locks: *mut pg_sys::LWLockPadded) {
    // SAFETY: the segment is ours and zeroed when not `found`; a zeroed slot is FREE.
    unsafe {
        if !found {
            (*(base as *mut Header)).n_slots = shmem::max_backends();
        }
    }
    BASE.set(base);
}

/// The request queue's segment (see shmem.rs).
pub static SEGMENT: Segment = Segment {
    name: c"pg_quota queue",
    size,
    extra: shmem::nothing,
    locks: 0,
    attach,
};

/// A new place at the end of the line for writer slots (never 0).
pub fn next_place_in_line() -> u64 {
    // SAFETY: the segment starts with a Header (see `layout`).
    unsafe { BASE.header::<Header>() }
        .line_last
        .fetch_add(1, Ordering::AcqRel)
        + 1
}

pub fn n_slots() -> usize {
    // SAFETY: the segment starts with a Header (see `layout`).
    unsafe { BASE.header::<Header>() }.n_slots
}

/// Every slot, indexed by PGPROC number.
pub fn slots() -> &'static [Slot] {
    let n = n_slots();
    // SAFETY: `layout` put `n` slots there; a zeroed slot is FREE.
    unsafe { BASE.slice::<Slot>(layout(n).1, n) }
}

pub fn slot(i: usize) -> &'static Slot {
    &slots()[i]
}

/// Ordering helper: the payload written before a Release store is seen after the
/// matching Acquire load.
pub fn load_state(s: &Slot) -> u32 {
    s.state.load(Ordering::Acquire)
}
