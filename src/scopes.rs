//! Layer 4, shared state: scope counters in shared memory: each (database, role)'s active tickets and ledger
//! rows, so that admission does not walk row versions.
//!
//! Counting with index scans under the latest snapshot is exact but walks every dead
//! row version that an old snapshot keeps alive (a `pg_dump`, an idle REPEATABLE READ
//! session): the index entry that each finished ticket leaves behind, and each version
//! of a role's summary row. Admission slowed down by 3x to 10x while one was open. The
//! counters make admission cost independent of that. The ledger stays the truth: a
//! counter is built from it (`rebuild`) when missing or stale, and kept up to date by
//! the changes that commit:
//!
//! - the writer's batch adds its admissions (and subtracts its purges) to `active` and
//!   `rows` right after it commits, before it answers anyone;
//! - a transaction that finished tickets subtracts them from `active` when it commits.
//!
//! A rebuild counts under a snapshot S, while such changes may commit around it. Each
//! change is therefore published before its transaction commits (`publish`), with the
//! transaction's id, and applied after (`apply_mine`). A rebuild holds the lock
//! exclusively, so no change is applied while it runs; it marks every published change
//! whose transaction S already sees as absorbed, and those are not applied again. A
//! change whose transaction S does not see yet is applied to the rebuilt value. So
//! nothing is counted twice or lost. Between a commit and its application a counter is
//! one behind: it over-counts active tickets for a moment (a finish not yet applied),
//! which is allowed; admissions not yet applied are still in the callers' in-flight
//! count, since the writer answers only after applying them.
//!
//! A counter is valid only for the relations it was built from: each carries the
//! relfilenodes of the ledger and the summary. TRUNCATE of either (the triggers
//! truncate the summary after any SQL-level write to the ledger), VACUUM FULL or a
//! reinstall gives them new ones, and the next reader rebuilds.
//!
//! The table holds `quota.scope_counters` counters (0.4.0; 16,384 before, and a scope
//! beyond them was counted from the ledger on every call, walking a whole full table
//! first). A scope lives within a bounded window of its home entry, so a lookup costs
//! the same however full the table is; when the window is full, its least recently
//! used counter gives its entry up (core::counters) and is rebuilt when read again.
//!
//! The counters live in a segment of their own, with their
//! LWLock and the key of the scope lock's tag (`scope_tag`). Beside the counters, this
//! file answers what a scope holds as admission and the writer need it: from the
//! counter, or from the ledger where there is none (`scope`, `usage`,
//! `refusal_numbers`).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU8, Ordering};

use pgrx::pg_sys;

use crate::core::counters::{self, Entry, Slot};
use crate::core::lease::earliest;
use crate::core::{RefusalKind, Usage};
use crate::ledger::count::{active, expired, lapsed, oldest_ended, rows, summary_rows};
use crate::ledger::rels::{Reader, Tags};
use crate::ledger::scan::Latest;
use crate::shmem::{self, Base, Layout, Segment};
use crate::workers;

/// Pending changes one backend can publish for one transaction: one per role. A
/// transaction that touches more roles invalidates the others' counters instead.
pub const PENDING_PER_SLOT: usize = 64;

/// An entry's state (`Scope::state`). Never used: probing stops here.
const ENTRY_FREE: u8 = 0;
/// A scope's counter: `db` and `role` say whose.
const ENTRY_TAKEN: u8 = 1;
/// A removed scope's entry (dropped role or database): probing goes on past it, and a
/// new counter may take it. Its `db` and `role` mean nothing; 0.4.0 wrote the database
/// OID 4294967295 there instead, which a database can have (0.4.1, F5).
const ENTRY_REMOVED: u8 = 2;

#[repr(C)]
pub struct Scope {
    db: AtomicU32,
    role: AtomicU32,
    valid: AtomicBool,
    /// ENTRY_FREE, ENTRY_TAKEN or ENTRY_REMOVED. Written under the lock held
    /// exclusively; every reader holds it shared at least. Beside `valid`, in what was
    /// padding: an entry is still 40 bytes.
    state: AtomicU8,
    ledger_node: AtomicU32,
    summary_node: AtomicU32,
    /// When the counter was last read, in seconds (see `now_secs`): the least recently
    /// used one gives its entry up when a scope's window is full.
    used: AtomicU32,
    active: AtomicI64,
    rows: AtomicI64,
}

const PENDING_FREE: u32 = 0;
const PENDING_SET: u32 = 1;
const PENDING_ABSORBED: u32 = 2;

const _: () = assert!(
    std::mem::size_of::<Scope>() == 40,
    "USER_GUIDE.md gives 40 bytes"
);

#[repr(C)]
pub struct Pending {
    state: AtomicU32,
    db: AtomicU32,
    role: AtomicU32,
    xid: AtomicU32,
    d_active: AtomicI64,
    d_rows: AtomicI64,
}

/// Holds the scope lock. Lock order: never take it while holding the writer-table
/// lock (workers::TableLock); taking the table lock while holding this one is allowed (a
/// rebuild may ask the writer to rebuild summary rows).
struct Held;

impl Held {
    fn acquire(mode: pg_sys::LWLockMode::Type) -> Held {
        // SAFETY: the lock was set up at startup; abort releases it after an ERROR.
        unsafe { pg_sys::LWLockAcquire(scope_lock(), mode) };
        Held
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: held since `acquire`, unless an abort released it already.
        unsafe {
            if pg_sys::LWLockHeldByMe(scope_lock()) {
                pg_sys::LWLockRelease(scope_lock());
            }
        }
    }
}

fn home(db: u32, role: u32) -> usize {
    let h = (u64::from(db).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        ^ u64::from(role).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    (h >> 17) as usize % n_scopes()
}

/// The entries a scope may live in: `counters::WINDOW` from its home on.
fn window(db: u32, role: u32) -> impl Iterator<Item = &'static Scope> {
    let table = scopes();
    let start = home(db, role);
    (0..counters::window(table.len())).map(move |k| &table[(start + k) % table.len()])
}

/// What entry `e` holds, for core::counters.
fn slot(e: &Scope) -> Slot {
    match e.state.load(Ordering::Relaxed) {
        ENTRY_FREE => Slot::Free,
        ENTRY_TAKEN => Slot::Taken(e.db.load(Ordering::Relaxed), e.role.load(Ordering::Relaxed)),
        _ => Slot::Removed,
    }
}

/// The entry of (db, role). The caller holds the lock.
fn find(db: u32, role: u32) -> Option<&'static Scope> {
    let k = counters::find(window(db, role).map(slot), db, role)?;
    window(db, role).nth(k)
}

/// The seconds a counter's `used` is measured in. The clock, not the transaction's
/// start: a long transaction (a DO block starting tickets in a loop) must neither make
/// the counters it reads look idle nor see every counter it read as read just now.
fn now_secs() -> u32 {
    // SAFETY: a clock read.
    let ts = unsafe { pg_sys::GetCurrentTimestamp() };
    (ts / 1_000_000).clamp(0, i64::from(u32::MAX)) as u32
}

/// Marks `e` as read now. `used` only moves forward (a reader whose transaction began
/// long ago must not make a hot counter look idle), and it is written only when the
/// second moved, so that readers of a hot scope do not all write its cache line.
fn touch(e: &Scope) {
    let now = now_secs();
    if e.used.load(Ordering::Relaxed) < now {
        e.used.fetch_max(now, Ordering::Relaxed);
    }
}

/// The entry a new counter for (db, role) would take, and the scope it would take it
/// from (if any), for a scope that found no entry of its own. When its window is full,
/// the least recently read counter there gives its entry up (see core::counters): it
/// is rebuilt from the ledger if needed again, and a change published for it meanwhile
/// is applied to that rebuild or absorbed by it, as after `forget`. None when every
/// counter in the window was read lately. The caller holds the lock, shared (to see
/// whether there is a place) or exclusively.
fn vacancy(db: u32, role: u32, tags: Tags) -> Option<(&'static Scope, Option<(u32, u32)>)> {
    let k = counters::place(
        window(db, role).map(|e| match slot(e) {
            Slot::Free => Entry::Free,
            Slot::Removed => Entry::Removed,
            // A counter of this database built for relations that are gone (TRUNCATE,
            // VACUUM FULL) is stale too; one of another database is judged by its own
            // flag, since its relations are not ours to see.
            Slot::Taken(d, _) => counters::judged(
                d == db,
                e.valid.load(Ordering::Acquire),
                current(e, tags).is_some(),
                e.used.load(Ordering::Relaxed),
            ),
        }),
        now_secs(),
    )?;
    let e = window(db, role).nth(k)?;
    let from = match slot(e) {
        Slot::Taken(d, r) => Some((d, r)),
        Slot::Free | Slot::Removed => None,
    };
    Some((e, from))
}

/// The counter's numbers if it is current, marking it as read.
fn read(e: &Scope, tags: Tags) -> Option<(i64, i64)> {
    current(e, tags).inspect(|_| touch(e))
}

fn current(e: &Scope, tags: Tags) -> Option<(i64, i64)> {
    (e.valid.load(Ordering::Acquire)
        && e.ledger_node.load(Ordering::Relaxed) == tags.ledger
        && e.summary_node.load(Ordering::Relaxed) == tags.summary)
        .then(|| {
            (
                e.active.load(Ordering::Acquire),
                e.rows.load(Ordering::Acquire),
            )
        })
}

/// (active, rows) of (db, role): from its counter, rebuilt first with `count` (the
/// ledger's numbers under the snapshot it is given) if missing or stale. None if
/// `count` has no numbers (no summary row yet), or if the scope has no counter and
/// every counter of its window was read lately; the caller then counts from the
/// ledger itself.
///
/// `has_numbers` says, without the lock, whether `count` would have numbers now: a
/// scope without them (its summary row gone after a TRUNCATE, say) is counted by the
/// caller without taking the lock exclusively for a rebuild that would build nothing,
/// on every call, while every admission of the server queues behind it.
pub fn get(
    db: pg_sys::Oid,
    role: pg_sys::Oid,
    tags: Tags,
    has_numbers: impl FnOnce() -> bool,
    count: impl FnOnce(&Latest) -> Option<(i64, i64)>,
) -> Option<(i64, i64)> {
    let (db, role) = (u32::from(db), u32::from(role));
    {
        let _s = Held::acquire(pg_sys::LWLockMode::LW_SHARED);
        match find(db, role) {
            Some(e) => {
                if let Some(v) = read(e, tags) {
                    return Some(v);
                }
            }
            // No counter and no place for one: count without taking the lock
            // exclusively, which every admission of the server would queue behind.
            None if vacancy(db, role, tags).is_none() => return None,
            None => {}
        }
    }
    if !has_numbers() {
        return None;
    }
    let (v, evicted) = {
        let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
        let (e, evicted) = match find(db, role) {
            Some(e) => {
                // Rebuilt by another backend since our shared look?
                if let Some(v) = read(e, tags) {
                    return Some(v);
                }
                (e, None)
            }
            // Another scope's entry (or a free one): its numbers are not ours.
            None => vacancy(db, role, tags)?,
        };
        (rebuild(e, db, role, tags, count)?, evicted)
    };
    if let Some((d, r)) = evicted {
        log_eviction(d, r, db, role);
    }
    Some(v)
}

/// Writes a line to the server log, when it keeps DEBUG1 lines, that a scope's counter
/// gave its place up. The server log only, at LOG: the OIDs would tell a tenant with
/// client_min_messages = debug1 which roles were admitted lately (see `scope_tag`).
fn log_eviction(d: u32, r: u32, db: u32, role: u32) {
    // SAFETY: a plain read of a GUC variable.
    if unsafe { pg_sys::log_min_messages } > pg_sys::DEBUG1 as i32 {
        return;
    }
    pgrx::pg_sys::panic::ErrorReport::new(
        pgrx::PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
        format!("pg_quota: the scope counter of role {r} in database {d} gave its place up to role {role} in database {db}"),
        "pg_quota",
    )
    .report(pgrx::PgLogLevel::LOG_SERVER_ONLY);
}

/// The snapshot a count is made under: the latest, without this transaction's own
/// uncommitted changes, as every other backend sees the ledger. A ticket this
/// transaction finished is still active until it commits (its finish is applied to
/// the counter then, and published only at commit, so no rebuild can absorb it);
/// counting it as ended here would count that finish twice, or, without a counter,
/// admit where a counter would refuse.
fn others_view() -> Latest {
    let snap = Latest::take();
    // SAFETY: `take` registered a private copy of the snapshot.
    unsafe { (*snap.0).curcid = pg_sys::FirstCommandId };
    snap
}

/// Builds the counter of (db, role) in entry `e` (its own, or the one it takes over)
/// from `count`. The caller holds the lock exclusively. Nothing changes if `count`
/// has no numbers.
fn rebuild(
    e: &'static Scope,
    db: u32,
    role: u32,
    tags: Tags,
    count: impl FnOnce(&Latest) -> Option<(i64, i64)>,
) -> Option<(i64, i64)> {
    // The snapshot is taken under the exclusive lock: no change is applied until we
    // are done, and every change that S sees committed was published before that.
    let snap = others_view();
    let (active, rows) = count(&snap)?;
    for p in all_pending() {
        if p.state.load(Ordering::Acquire) == PENDING_SET
            && p.db.load(Ordering::Relaxed) == db
            && p.role.load(Ordering::Relaxed) == role
            // SAFETY: a snapshot check; the snapshot is registered.
            && !unsafe { pg_sys::XidInMVCCSnapshot(pg_sys::TransactionId::from_inner(p.xid.load(Ordering::Relaxed)), snap.0) }
        {
            let _ = p.state.compare_exchange(
                PENDING_SET,
                PENDING_ABSORBED,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }
    // Taken over (or new): the entry is this scope's from here on.
    e.valid.store(false, Ordering::Relaxed);
    e.role.store(role, Ordering::Relaxed);
    e.db.store(db, Ordering::Relaxed);
    e.state.store(ENTRY_TAKEN, Ordering::Relaxed);
    e.used.store(now_secs(), Ordering::Relaxed);
    e.active.store(active, Ordering::Release);
    e.rows.store(rows, Ordering::Release);
    e.ledger_node.store(tags.ledger, Ordering::Relaxed);
    e.summary_node.store(tags.summary, Ordering::Relaxed);
    e.valid.store(true, Ordering::Release);
    Some((active, rows))
}

/// Publishes this backend's changes of the transaction that is about to commit, as
/// (role, Δactive, Δrows). Returns the roles that did not fit; their counters must be
/// invalidated once the transaction has committed (`invalidate`).
pub fn publish(changes: &[(pg_sys::Oid, i64, i64)]) -> Vec<pg_sys::Oid> {
    let mine = pending(shmem::my_procno());
    // SAFETY: plain reads of backend state; the transaction wrote, so it has an id.
    let (db, xid) = unsafe { (shmem::my_db(), pg_sys::GetTopTransactionIdIfAny()) };
    let mut overflow = Vec::new();
    for (k, &(role, d_active, d_rows)) in changes.iter().enumerate() {
        let Some(p) = mine.get(k) else {
            overflow.push(role);
            continue;
        };
        p.db.store(u32::from(db), Ordering::Relaxed);
        p.role.store(u32::from(role), Ordering::Relaxed);
        p.xid.store(xid.into_inner(), Ordering::Relaxed);
        p.d_active.store(d_active, Ordering::Relaxed);
        p.d_rows.store(d_rows, Ordering::Relaxed);
        p.state.store(PENDING_SET, Ordering::Release);
    }
    overflow
}

/// After a transaction of this backend ended: applies each of its published changes
/// whose transaction committed (those a rebuild absorbed are not applied again), and
/// clears them all. Each change is judged by the transaction id it was published with,
/// not by what the caller believes ended: the writer's exit callback cannot know
/// whether its last change was a batch's or the expiry sweep's, and a transaction
/// still in progress (a FATAL in the middle of it) has not committed. Never raises an
/// error: it runs inside commit.
pub fn apply_mine() {
    if !shmem::available() {
        return;
    }
    let mine = pending(shmem::my_procno());
    if mine
        .iter()
        .all(|p| p.state.load(Ordering::Acquire) == PENDING_FREE)
    {
        return;
    }
    let _s = Held::acquire(pg_sys::LWLockMode::LW_SHARED);
    for p in mine {
        let set = p
            .state
            .compare_exchange(
                PENDING_SET,
                PENDING_FREE,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        // SAFETY: a commit log lookup of a transaction that has ended or is ours.
        let committed = set
            && unsafe {
                pg_sys::TransactionIdDidCommit(pg_sys::TransactionId::from_inner(
                    p.xid.load(Ordering::Relaxed),
                ))
            };
        if committed {
            if let Some(e) = find(p.db.load(Ordering::Relaxed), p.role.load(Ordering::Relaxed)) {
                e.active
                    .fetch_add(p.d_active.load(Ordering::Relaxed), Ordering::AcqRel);
                e.rows
                    .fetch_add(p.d_rows.load(Ordering::Relaxed), Ordering::AcqRel);
            }
        }
        p.state.store(PENDING_FREE, Ordering::Release);
    }
}

/// Marks the counters of `roles` in this database as stale.
pub fn invalidate(roles: &[pg_sys::Oid]) {
    if roles.is_empty() || !shmem::available() {
        return;
    }
    let db = u32::from(shmem::my_db());
    let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    for &r in roles {
        if let Some(e) = find(db, u32::from(r)) {
            e.valid.store(false, Ordering::Release);
        }
    }
}

/// How many entries `forget` looks at under one hold of the lock, when it walks the
/// whole table for a database: every admission of the server waits while the lock is
/// held exclusively, and the table can hold millions of entries.
const FORGET_CHUNK: usize = 4096;

/// Removes the counters of `db` (all roles if `roles` is None), for dropped roles and
/// databases, so that the table does not fill up with them.
pub fn forget(db: pg_sys::Oid, roles: Option<&[pg_sys::Oid]>) {
    if !shmem::available() {
        return;
    }
    let db = u32::from(db);
    let remove = |e: &Scope| {
        e.valid.store(false, Ordering::Release);
        e.state.store(ENTRY_REMOVED, Ordering::Relaxed);
    };
    match roles {
        // A role's counter is in its window: no walk over the whole table.
        Some(rs) => {
            let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
            rs.iter()
                .filter_map(|&r| find(db, u32::from(r)))
                .for_each(remove);
        }
        // The whole table, a chunk at a time, the lock released in between. A counter
        // of `db` built meanwhile behind the walk (by a session of the database still
        // running before DROP DATABASE or DROP EXTENSION commits) counts relations that
        // are about to be gone: nobody reads it again, so it gives its place up once it
        // has been idle for core::counters::MIN_IDLE_SECS, and a reinstalled extension
        // (new relfilenodes) finds it stale.
        None => {
            for chunk in scopes().chunks(FORGET_CHUNK) {
                let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
                chunk
                    .iter()
                    .filter(|e| matches!(slot(e), Slot::Taken(d, _) if d == db))
                    .for_each(remove);
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// The segment
// ---------------------------------------------------------------------------------

#[repr(C)]
struct Header {
    lock: *mut pg_sys::LWLock,
    n_slots: usize,
    /// Counters in the table: quota.scope_counters when the server started.
    n_scopes: usize,
    /// Random bytes drawn when the server starts, which the scope lock's tag is made
    /// from (see `scope_tag`).
    secret: [u64; 2],
}

static BASE: Base = Base::new();

/// The segment's layout for `n` backends and `scopes` counters: the header, the
/// counters, then each backend's pending changes.
fn layout(n: usize, scopes: usize) -> (Layout, usize, usize) {
    let mut l = Layout::of::<Header>();
    let at = l.array::<Scope>(scopes);
    let pending = l.array::<Pending>(n * PENDING_PER_SLOT);
    (l, at, pending)
}

fn size() -> usize {
    layout(shmem::max_backends(), crate::gucs::scope_counters())
        .0
        .size()
}

/// # Safety
/// See shmem::Segment::attach.
unsafe fn attach(base: *mut u8, found: bool, locks: *mut pg_sys::LWLockPadded) {
    // SAFETY: the segment is ours and zeroed when not `found`; zero is a valid state of
    // every counter and pending change (all atomics).
    unsafe {
        if !found {
            let h = base as *mut Header;
            (*h).lock = &mut (*locks).lock;
            (*h).n_slots = shmem::max_backends();
            (*h).n_scopes = crate::gucs::scope_counters();
            if !pg_sys::pg_strong_random(
                (*h).secret.as_mut_ptr().cast(),
                std::mem::size_of::<[u64; 2]>(),
            ) {
                pgrx::error!("pg_quota: could not generate random bytes for its lock tags");
            }
        }
    }
    BASE.set(base);
}

/// The scope counters' segment (see shmem.rs).
pub static SEGMENT: Segment = Segment {
    name: c"pg_quota scopes",
    size,
    extra: shmem::nothing,
    locks: 1,
    attach,
};

fn header() -> &'static Header {
    // SAFETY: the segment starts with a Header (see `layout`).
    unsafe { BASE.header::<Header>() }
}

fn n_slots() -> usize {
    header().n_slots
}

fn n_scopes() -> usize {
    header().n_scopes
}

fn scope_lock() -> *mut pg_sys::LWLock {
    header().lock
}

/// The scope counters, quota.scope_counters of them.
fn scopes() -> &'static [Scope] {
    // SAFETY: `layout` put n_scopes counters there; zeroed is a free entry.
    unsafe { BASE.slice::<Scope>(layout(n_slots(), n_scopes()).1, n_scopes()) }
}

/// Every backend's pending counter changes, PENDING_PER_SLOT per PGPROC number.
fn all_pending() -> &'static [Pending] {
    // SAFETY: `layout` put them there; zeroed is PENDING_FREE.
    unsafe {
        BASE.slice::<Pending>(
            layout(n_slots(), n_scopes()).2,
            n_slots() * PENDING_PER_SLOT,
        )
    }
}

/// The pending counter changes published by backend `procno`.
fn pending(procno: usize) -> &'static [Pending] {
    &all_pending()[procno * PENDING_PER_SLOT..(procno + 1) * PENDING_PER_SLOT]
}

/// The two lock tag fields that stand for scope (db, role) in the scope lock: a keyed
/// hash of the pair, the key drawn at server start. pg_locks, which every role can
/// read, shows lock tags; the role's OID there would tell any tenant which roles are
/// being admitted right now, which the rest of pg_quota shows no tenant. Two scopes
/// whose hashes collide (a chance of one in 2^64) would only share a lock.
pub fn scope_tag(db: pg_sys::Oid, role: pg_sys::Oid) -> (u32, u32) {
    use std::hash::{Hash, Hasher};
    // DefaultHasher::new() is SipHash with fixed keys, the same in every process of
    // this build; the secret, hashed first, is what keys it.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    header().secret.hash(&mut h);
    (u32::from(db), u32::from(role)).hash(&mut h);
    let v = h.finish();
    (v as u32, (v >> 32) as u32)
}

// ---------------------------------------------------------------------------------
// A scope's counts, as admission and the writer need them
// ---------------------------------------------------------------------------------

/// (active tickets, ledger rows) of `role`: from its scope counter (see scopes.rs),
/// which is built from the ledger if missing or stale, or, where it has none (see
/// `get`), counted from the ledger under a snapshot taken now.
pub fn scope(reader: &Reader, role: pg_sys::Oid) -> (i64, i64) {
    let r = &reader.rels;
    reader
        .tags
        .and_then(|tags| {
            let has_numbers = || summary_rows(r, &Latest::take(), role).is_some();
            get(shmem::my_db(), role, tags, has_numbers, |s| {
                // A rebuild holds the counters' lock: never count a whole history
                // under it. Without a summary row, count this once without a
                // counter; the writer rebuilds the summary row meanwhile.
                let rows = summary_rows(r, s, role)?;
                Some((active(r, s, role, None), rows))
            })
        })
        .unwrap_or_else(|| {
            // Counted as a counter would be (see `others_view`), in a snapshot taken
            // now: after whatever the caller read before (its requests in flight).
            let own = others_view();
            let (rows, rebuild) = rows(r, &own, role);
            if rebuild {
                workers::request_summary_rebuild();
            }
            (active(r, &own, role, None), rows)
        })
}

/// The scope's usage as admission needs it: each count only where its limit is set
/// (`None` means no limit, so that count is not needed to decide). Tickets whose lease
/// ran out by `now` are neither active nor, once past the cutoff, retained.
pub fn usage(
    reader: &Reader,
    role: pg_sys::Oid,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    max_active: Option<i64>,
    count_retained: bool,
) -> Usage {
    if max_active.is_none() && !count_retained {
        return Usage::default();
    }
    let (active, rows) = scope(reader, role);
    // A snapshot taken after the counter was read: it sees every purge and every
    // expiry sweep the counter already reflects, so nothing is subtracted twice.
    let after = Latest::take();
    let lapsed = lapsed(&reader.rels, &after, role, now);
    Usage {
        active: if max_active.is_some() {
            active - lapsed.expired()
        } else {
            0
        },
        retained: if count_retained {
            rows - expired(&reader.rels, &after, role, cutoff) - lapsed.aged_out(cutoff)
        } else {
            0
        },
        ..Usage::default()
    }
}

/// The full numbers for a refusal's message, and when capacity returns if the
/// retained limit is the one reached.
pub fn refusal_numbers(
    reader: &Reader,
    snap: &Latest,
    role: pg_sys::Oid,
    now: pg_sys::TimestampTz,
    cutoff: pg_sys::TimestampTz,
    retention_secs: i64,
    kind: RefusalKind,
) -> (Usage, Option<pg_sys::TimestampTz>) {
    let r = &reader.rels;
    let (active, rows) = scope(reader, role);
    // As in counts::usage: a snapshot that sees every purge and sweep the counter
    // reflects.
    let after = Latest::take();
    let lapsed = lapsed(r, &after, role, now);
    let usage = Usage {
        active: active - lapsed.expired(),
        retained: rows - expired(r, &after, role, cutoff) - lapsed.aged_out(cutoff),
        ..Usage::default()
    };
    let next = (kind == RefusalKind::Retained)
        .then(|| {
            earliest(
                oldest_ended(r, snap, role, cutoff),
                lapsed.oldest_retained(cutoff),
            )
        })
        .flatten()
        .map(|t| t.saturating_add(retention_secs.saturating_mul(1_000_000)));
    (usage, next)
}
