//! Layer 4, shared state: scope counters in shared memory: each scope's active tickets
//! and ledger rows, so that admission does not walk row versions. A scope is a role of
//! a database, or (0.5.0) a tenant of such a role (`ScopeKey`).
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
//! - a transaction that finished tickets subtracts them from `active` when it commits;
//! - a transaction that took transactional charges (0.5.0) adds them when it commits.
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
//! count, since the writer answers only after applying them, or still among the
//! committing transaction's open charges, which it gives up only after applying them.
//!
//! Open charges (0.5.0): a transactional start's charge is a row of its caller's
//! transaction, invisible to everyone else until it commits. It is counted meanwhile
//! in its scopes' counters' `open` (charges.rs keeps them), which a counter that has
//! any never gives up (it is "pinned"), whatever else happens to it: a rebuild keeps
//! `open`, and only the charging backend changes it.
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
//! The counters live in a segment of their own, with their LWLock, and the key that
//! the scope lock's tag and tenants' keys are made from (`scope_tag`, `tenant_key`).
//! What a scope holds, as admission and the writer need it, is in counts.rs.

mod changes;
pub mod counts;

pub use changes::{add_change, apply_mine, publish, Change};
use changes::{all_pending, pending_key, Pending, PENDING_ABSORBED, PENDING_SET};

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering};

use pgrx::pg_sys;

use crate::core::counters::{self, Entry, Slot};
use crate::ledger::rels::Tags;
use crate::ledger::scan::Latest;
use crate::shmem::{self, Base, Layout, Segment};

/// Pending changes one backend can publish for one transaction: one per scope. A
/// transaction that touches more scopes invalidates the others' counters instead.
pub const PENDING_PER_SLOT: usize = 64;

/// A scope of this database: a role, or a tenant of it (`tenant` is the key that
/// stands for the tenant's text, see `tenant_key`; 0 for the role itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScopeKey {
    pub role: pg_sys::Oid,
    pub tenant: u128,
}

impl ScopeKey {
    pub fn role(role: pg_sys::Oid) -> ScopeKey {
        ScopeKey { role, tenant: 0 }
    }

    pub fn is_tenant(&self) -> bool {
        self.tenant != 0
    }

    /// The key in shared memory, with this database.
    fn shared(&self) -> (u32, u32, u128) {
        (u32::from(shmem::my_db()), u32::from(self.role), self.tenant)
    }
}

/// An entry's state (`Counter::state`). Never used: probing stops here.
const ENTRY_FREE: u8 = 0;
/// A scope's counter: `db`, `role` and `tenant` say whose.
const ENTRY_TAKEN: u8 = 1;
/// A removed scope's entry (dropped role or database): probing goes on past it, and a
/// new counter may take it. Its key means nothing; 0.4.0 wrote the database OID
/// 4294967295 there instead, which a database can have (0.4.1, F5).
const ENTRY_REMOVED: u8 = 2;

#[repr(C)]
pub struct Counter {
    db: AtomicU32,
    role: AtomicU32,
    valid: AtomicBool,
    /// ENTRY_FREE, ENTRY_TAKEN or ENTRY_REMOVED. Written under the lock held
    /// exclusively; every reader holds it shared at least.
    state: AtomicU8,
    ledger_node: AtomicU32,
    /// 0.6.0: quota.history's relfilenode (the ledger's with an older schema).
    history_node: AtomicU32,
    summary_node: AtomicU32,
    /// When the counter was last read, in seconds (see `now_secs`): the least recently
    /// used one gives its entry up when a scope's window is full.
    used: AtomicU32,
    /// The tenant key, low and high halves (0 for a role's counter).
    tenant: [AtomicU64; 2],
    active: AtomicI64,
    /// The units of a role's ledger rows (summary row plus unfolded transactional
    /// tickets; 0.7.0: units, each row counting its ticket's weight); not kept for a
    /// tenant (counts.rs counts a tenant's retained units from the ledger).
    rows: AtomicI64,
    /// Uncommitted transactional charges of the scope (0.5.0): the counter is pinned
    /// while they are above 0.
    open: AtomicI64,
    /// Their units (0.7.0: the sum of their weights).
    open_units: AtomicI64,
    /// (0.6.0) No ticket `active` counts has a lease that ends before this (a
    /// TimestampTz; LEASE_UNKNOWN when nothing is known, LEASE_NONE when none ends): a
    /// refusal at the active limit needs no probe for lapsed leases while it is in the
    /// future. A lower bound, so it may only go down, but where it is found anew: a
    /// rebuild, or a look at the scope's tickets (`Peeked::look`, `refresh_earliest`).
    /// What moves a counted ticket's lease end earlier goes through the changes applied
    /// after commit: an admission's lease, and a renew() that shortens one (finish.rs;
    /// a renew in a prepared transaction is refused, since nothing applies it).
    earliest: AtomicI64,
    /// Moves on whenever the entry is claimed (a rebuild, or another scope taking it):
    /// a look begun before cannot store what it found (see `refresh_earliest`).
    version: AtomicU64,
    /// 0.6.1: the earliest lease among the changes applied since the last store of
    /// `earliest` from a look at the scope's tickets (or the last claim), and the
    /// number of that stretch: what a look's snapshot may have missed, which its store
    /// takes into account (see `refresh_earliest`).
    floor_since: AtomicI64,
    floor_epoch: AtomicU64,
}

const _: () = assert!(
    std::mem::size_of::<Counter>() == 112,
    "USER_GUIDE.md gives 112 bytes"
);

/// A scope's uncommitted transactional charges (0.5.0): their units (0.7.0; its active
/// and retained counts take each one's weight).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Open {
    pub units: i64,
}

impl Open {
    /// Read before the scope's committed numbers (see `get`), since what moves it
    /// meanwhile is a charge taken (not while the counters' lock is held, which every
    /// reader holds) or ended (a committed one is applied to the numbers before it
    /// ends).
    fn of(e: &Counter) -> Open {
        Open {
            units: e.open_units.load(Ordering::Acquire),
        }
    }
}

/// `Counter::earliest` when nothing is known: every refusal probes.
const LEASE_UNKNOWN: i64 = i64::MIN;
/// `Counter::earliest` when no counted ticket has a lease that ends.
pub const LEASE_NONE: i64 = i64::MAX;

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

fn home((db, role, tenant): (u32, u32, u128)) -> usize {
    let h = (u64::from(db).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        ^ u64::from(role).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (tenant as u64).wrapping_mul(0x1656_67B1_9E37_79F9)
        ^ ((tenant >> 64) as u64).wrapping_mul(0x27D4_EB2F_1656_67C5);
    (h >> 17) as usize % n_scopes()
}

/// The entries a scope may live in: `counters::WINDOW` from its home on.
fn window(key: (u32, u32, u128)) -> impl Iterator<Item = &'static Counter> {
    let table = counters_table();
    let start = home(key);
    (0..counters::window(table.len())).map(move |k| &table[(start + k) % table.len()])
}

fn tenant_of(e: &Counter) -> u128 {
    u128::from(e.tenant[0].load(Ordering::Relaxed))
        | (u128::from(e.tenant[1].load(Ordering::Relaxed)) << 64)
}

/// What entry `e` holds, for core::counters.
fn slot(e: &Counter) -> Slot {
    match e.state.load(Ordering::Relaxed) {
        ENTRY_FREE => Slot::Free,
        ENTRY_TAKEN => Slot::Taken(
            e.db.load(Ordering::Relaxed),
            e.role.load(Ordering::Relaxed),
            tenant_of(e),
        ),
        _ => Slot::Removed,
    }
}

/// The entry of `key`. The caller holds the lock.
fn find(key: (u32, u32, u128)) -> Option<&'static Counter> {
    let k = counters::find(window(key).map(slot), key.0, key.1, key.2)?;
    window(key).nth(k)
}

/// The seconds a counter's `used` is measured in. The clock, not the transaction's
/// start: a long transaction (a DO block starting tickets in a loop) must neither make
/// the counters it reads look idle nor see every counter it read as read just now.
fn now_secs() -> u32 {
    // SAFETY: a clock read.
    secs(unsafe { pg_sys::GetCurrentTimestamp() })
}

/// A timestamp as the whole seconds a counter's `used` keeps.
fn secs(ts: pg_sys::TimestampTz) -> u32 {
    (ts / 1_000_000).clamp(0, i64::from(u32::MAX)) as u32
}

/// Marks `e` as read at `now` (seconds, see `secs`). `used` only moves forward (a reader
/// whose transaction began long ago must not make a hot counter look idle), and it is
/// written only when the second moved, so that readers of a hot scope do not all write
/// its cache line.
fn touch(e: &Counter, now: u32) {
    if e.used.load(Ordering::Relaxed) < now {
        e.used.fetch_max(now, Ordering::Relaxed);
    }
}

/// Each entry of `key`'s window as placement judges it (core::counters).
fn judged(key: (u32, u32, u128), tags: Tags) -> impl Iterator<Item = Entry> {
    window(key).map(move |e| match slot(e) {
        Slot::Free => Entry::Free,
        Slot::Removed => Entry::Removed,
        // A counter of this database built for relations that are gone (TRUNCATE,
        // VACUUM FULL) is stale too; one of another database is judged by its own
        // flag, since its relations are not ours to see.
        Slot::Taken(d, _, _) => counters::judged(
            d == key.0,
            e.valid.load(Ordering::Acquire),
            current(e, tags).is_some(),
            e.used.load(Ordering::Relaxed),
            e.open.load(Ordering::Acquire) > 0,
        ),
    })
}

/// The entry at offset `k` of `key`'s window, and the scope it would be taken from.
fn at(key: (u32, u32, u128), k: usize) -> Option<(&'static Counter, Option<(u32, u32)>)> {
    let e = window(key).nth(k)?;
    let from = match slot(e) {
        Slot::Taken(d, r, _) => Some((d, r)),
        Slot::Free | Slot::Removed => None,
    };
    Some((e, from))
}

/// The entry a new counter for `key` would take, and the scope it would take it from
/// (if any), for a scope that found no entry of its own. When its window is full, the
/// least recently read counter there gives its entry up (see core::counters): it is
/// rebuilt from the ledger if needed again, and a change published for it meanwhile
/// is applied to that rebuild or absorbed by it, as after `forget`. None when every
/// counter in the window was read lately (or is pinned). The caller holds the lock,
/// shared (to see whether there is a place) or exclusively.
fn vacancy(key: (u32, u32, u128), tags: Tags) -> Option<(&'static Counter, Option<(u32, u32)>)> {
    at(key, counters::place(judged(key, tags), now_secs())?)
}

/// The counter's numbers if it is current, marking it as read.
fn read(e: &Counter, tags: Tags) -> Option<(i64, i64)> {
    current(e, tags).inspect(|_| touch(e, now_secs()))
}

fn current(e: &Counter, tags: Tags) -> Option<(i64, i64)> {
    (e.valid.load(Ordering::Acquire)
        && e.ledger_node.load(Ordering::Relaxed) == tags.ledger
        && e.history_node.load(Ordering::Relaxed) == tags.history
        && e.summary_node.load(Ordering::Relaxed) == tags.summary)
        .then(|| {
            (
                e.active.load(Ordering::Acquire),
                e.rows.load(Ordering::Acquire),
            )
        })
}

/// (active, rows) of scope `key`: from its counter, rebuilt first with `count` (the
/// ledger's numbers under the snapshot it is given) if missing or stale. None if
/// `count` has no numbers (no summary row yet), or if the scope has no counter and
/// every counter of its window was read lately; the caller then counts from the
/// ledger itself.
///
/// `has_numbers` says, without the lock, whether `count` would have numbers now: a
/// scope without them (its summary row gone after a TRUNCATE, say) is counted by the
/// caller without taking the lock exclusively for a rebuild that would build nothing,
/// on every call, while every admission of the server queues behind it.
///
/// `open` gets the scope's open charges (0.5.0), read before its numbers: a charge that
/// commits is applied to the counter before it stops being open (charges.rs), so read
/// in this order it is counted at least once, whatever happens in between (the other
/// order could miss it in both). Counted from the ledger by the caller, a committed
/// charge shows in a snapshot taken after this read.
pub fn get(
    key: ScopeKey,
    tags: Tags,
    open: &mut Open,
    has_numbers: impl FnOnce() -> bool,
    count: impl FnOnce(&Latest) -> Option<Counted>,
) -> Option<(i64, i64)> {
    let k = key.shared();
    {
        let _s = Held::acquire(pg_sys::LWLockMode::LW_SHARED);
        match find(k) {
            Some(e) => {
                *open = Open::of(e);
                if let Some(v) = read(e, tags) {
                    return Some(v);
                }
            }
            // No counter and no place for one: count without taking the lock
            // exclusively, which every admission of the server would queue behind.
            None if vacancy(k, tags).is_none() => return None,
            None => {}
        }
    }
    if !has_numbers() {
        return None;
    }
    let (v, evicted) = {
        let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
        let (e, evicted) = match find(k) {
            Some(e) => {
                *open = Open::of(e);
                // Rebuilt by another backend since our shared look?
                if let Some(v) = read(e, tags) {
                    return Some(v);
                }
                (e, None)
            }
            // Another scope's entry (or a free one): its numbers are not ours.
            None => vacancy(k, tags)?,
        };
        (rebuild(e, k, tags, count)?, evicted)
    };
    if let Some((d, r)) = evicted {
        log_eviction(d, r, k.0, k.1);
    }
    Some(v)
}

/// The uncommitted transactional charges of scope `key` (0 if it has no counter: a
/// scope with any has one, pinned). Read it before the scope's committed numbers (see
/// `get`).
pub fn open(key: ScopeKey) -> Open {
    let _s = Held::acquire(pg_sys::LWLockMode::LW_SHARED);
    find(key.shared()).map_or(Open::default(), Open::of)
}

/// What a rebuild counts from the ledger: a scope's active tickets, its rows (a role's),
/// and the earliest lease end among those tickets (LEASE_NONE if none ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counted {
    pub active: i64,
    pub rows: i64,
    pub earliest: i64,
}

/// A live counter as a refusal reads it, without the ledger (0.6.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peeked {
    /// Committed active units, and the uncommitted transactional charges.
    pub active: i64,
    pub open: Open,
    /// No ticket of `active` has a lease that ends before this (see Counter::earliest).
    pub earliest: i64,
    /// A look at the scope's unended tickets for its counter's `earliest`, begun here:
    /// peek before taking the look's snapshot, then `refresh_earliest` with what the
    /// look found. Beginning one only reads (the entry, its version and its look
    /// number), so that looks do not cancel each other: `floor_since` holds the lease
    /// of every change applied to the counter since the last store (or claim), before
    /// this look began and after; a change applied before the peek committed before it
    /// (changes are applied after their commit), so the look's snapshot sees its ticket.
    pub look: Refresh,
}

/// A look at a scope's tickets for its counter's `earliest` (see `Peeked::look`), for
/// `refresh_earliest`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refresh {
    /// The entry, and its version and look number when the look began.
    entry: usize,
    version: u64,
    epoch: u64,
}

/// Scope `key`'s counter if it is current for `tags`, read without building it: None
/// if it is missing or stale (the caller then takes the path that counts). Marks it as
/// read at `now`, the caller's clock reading. The open charges are read before the
/// numbers, as in `get`.
pub fn peek(key: ScopeKey, tags: Tags, now: pg_sys::TimestampTz) -> Option<Peeked> {
    let _s = Held::acquire(pg_sys::LWLockMode::LW_SHARED);
    let e = find(key.shared())?;
    let open = Open::of(e);
    let (active, _) = current(e, tags)?;
    touch(e, secs(now));
    Some(Peeked {
        active,
        open,
        earliest: e.earliest.load(Ordering::Acquire),
        look: Refresh {
            entry: e as *const Counter as usize,
            version: e.version.load(Ordering::Acquire),
            epoch: e.floor_epoch.load(Ordering::Acquire),
        },
    })
}

/// Sets scope `key`'s `earliest` to `earliest`, the earliest lease end a look begun at
/// `look` found among its unended tickets, or lower to the earliest lease applied since
/// the look's number began (`floor_since`), which its snapshot may have missed; then
/// starts the next number, so that a look begun before this one stored (whose snapshot
/// may miss what was applied before this store) stores nothing, and the first look to
/// end wins. Nothing either where the entry is no longer the one the look began with,
/// or was claimed since (`version`). Under the lock held exclusively, so that no change
/// is applied meanwhile (changes are applied under it shared). A counter's `earliest`
/// only goes down otherwise: without this, the first lease it knew of to pass would
/// leave it knowing nothing.
pub fn refresh_earliest(key: ScopeKey, look: Refresh, earliest: i64) {
    let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    if let Some(e) = find(key.shared()) {
        if e as *const Counter as usize == look.entry
            && e.version.load(Ordering::Acquire) == look.version
            && e.floor_epoch.load(Ordering::Acquire) == look.epoch
        {
            let since = e.floor_since.load(Ordering::Acquire);
            e.earliest.store(earliest.min(since), Ordering::Release);
            e.floor_since.store(LEASE_NONE, Ordering::Release);
            e.floor_epoch.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// A pinned counter: the entry that holds a scope's open charges, by its index, and the
/// units of the charge that pinned it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin(usize, i64);

/// Adds one open charge of `weight` units to scope `key`'s counter, giving the scope a counter if it has
/// none (it may take the entry of one read lately, never of a pinned one; it is built
/// at its next read). None if every entry of its window is pinned: then nothing is
/// charged. The caller holds the scope's lock (admission.rs), so no other backend adds
/// to this scope meanwhile.
pub fn pin(key: ScopeKey, tags: Option<Tags>, weight: i64) -> Option<Pin> {
    let k = key.shared();
    let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    let e = match find(k) {
        Some(e) => e,
        None => {
            // Without tags (counters not usable now), every counter is judged stale.
            let tags = tags.unwrap_or(Tags {
                ledger: 0,
                history: 0,
                summary: 0,
            });
            let (e, _) = at(k, counters::place_pinned(judged(k, tags), now_secs())?)?;
            // The entry is this scope's from here on, built at its next read.
            claim(e, k);
            e
        }
    };
    e.open.fetch_add(1, Ordering::AcqRel);
    e.open_units.fetch_add(weight, Ordering::AcqRel);
    let table = counters_table();
    let index =
        (e as *const Counter as usize - table.as_ptr() as usize) / std::mem::size_of::<Counter>();
    Some(Pin(index, weight))
}

/// Takes one open charge off a pinned counter. Never raises: it runs at transaction
/// end. No lock: the entry cannot change hands while it is pinned, and `open` is the
/// charging backends' alone.
pub fn unpin(p: Pin) {
    if let Some(e) = counters_table().get(p.0) {
        e.open_units.fetch_sub(p.1, Ordering::AcqRel);
        e.open.fetch_sub(1, Ordering::AcqRel);
    }
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
/// admit where a counter would refuse. A ticket this transaction charged (0.5.0) is
/// counted among its scope's open charges until then.
pub fn others_view() -> Latest {
    let snap = Latest::take();
    // SAFETY: `take` registered a private copy of the snapshot.
    unsafe { (*snap.0).curcid = pg_sys::FirstCommandId };
    snap
}

/// Builds the counter of `key` in entry `e` (its own, or the one it takes over) from
/// `count`. The caller holds the lock exclusively. Nothing changes if `count` has no
/// numbers. The entry's open charges stay: they are its own scope's (a pinned entry is
/// never taken over).
fn rebuild(
    e: &'static Counter,
    key: (u32, u32, u128),
    tags: Tags,
    count: impl FnOnce(&Latest) -> Option<Counted>,
) -> Option<(i64, i64)> {
    // The snapshot is taken under the exclusive lock: no change is applied until we
    // are done, and every change that S sees committed was published before that.
    let snap = others_view();
    let Counted {
        active,
        rows,
        earliest,
    } = count(&snap)?;
    // A change S does not see is applied after this: the tickets it adds (or renews)
    // are not in `earliest` yet.
    let mut earliest = earliest;
    for p in all_pending() {
        if p.state.load(Ordering::Acquire) == PENDING_SET && pending_key(p) == key {
            // SAFETY: a snapshot check; the snapshot is registered.
            let seen = !unsafe {
                pg_sys::XidInMVCCSnapshot(
                    pg_sys::TransactionId::from_inner(p.xid.load(Ordering::Relaxed)),
                    snap.0,
                )
            };
            if seen {
                let _ = p.state.compare_exchange(
                    PENDING_SET,
                    PENDING_ABSORBED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            } else {
                earliest = earliest.min(p.lease_floor.load(Ordering::Relaxed));
            }
        }
    }
    // Taken over (or new): the entry is this scope's from here on.
    claim(e, key);
    e.active.store(active, Ordering::Release);
    e.rows.store(rows, Ordering::Release);
    e.earliest.store(earliest, Ordering::Release);
    e.ledger_node.store(tags.ledger, Ordering::Relaxed);
    e.history_node.store(tags.history, Ordering::Relaxed);
    e.summary_node.store(tags.summary, Ordering::Relaxed);
    e.valid.store(true, Ordering::Release);
    Some((active, rows))
}

/// Makes entry `e` scope `key`'s, not built (invalid, no numbers), read now. Its open
/// charges are kept if it was this scope's already (a stale counter rebuilt), and none
/// otherwise (an entry taken over never holds any: pinned entries are not given up).
/// The caller holds the counters' lock exclusively.
fn claim(e: &Counter, key: (u32, u32, u128)) {
    let ours = slot(e) == Slot::Taken(key.0, key.1, key.2);
    e.valid.store(false, Ordering::Relaxed);
    e.active.store(0, Ordering::Relaxed);
    e.rows.store(0, Ordering::Relaxed);
    e.earliest.store(LEASE_UNKNOWN, Ordering::Relaxed);
    e.floor_since.store(LEASE_NONE, Ordering::Relaxed);
    e.version.fetch_add(1, Ordering::AcqRel);
    if !ours {
        e.open.store(0, Ordering::Relaxed);
        e.open_units.store(0, Ordering::Relaxed);
    }
    e.db.store(key.0, Ordering::Relaxed);
    e.role.store(key.1, Ordering::Relaxed);
    e.tenant[0].store(key.2 as u64, Ordering::Relaxed);
    e.tenant[1].store((key.2 >> 64) as u64, Ordering::Relaxed);
    e.used.store(now_secs(), Ordering::Relaxed);
    e.state.store(ENTRY_TAKEN, Ordering::Release);
}

/// Marks the counters of `keys` in this database as stale: changes that did not fit
/// among the published ones (see `publish`), whose lease floors the writer's sweep
/// then cannot know either (see workers::WriterEntry::lease_floor).
pub fn invalidate(keys: &[ScopeKey]) {
    if keys.is_empty() || !shmem::available() {
        return;
    }
    crate::workers::lower_lease_floor(shmem::my_db(), i64::MIN);
    let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
    for key in keys {
        if let Some(e) = find(key.shared()) {
            e.valid.store(false, Ordering::Release);
        }
    }
}

/// How many entries `forget` looks at under one hold of the lock: every admission of
/// the server waits while the lock is held exclusively, and the table can hold
/// millions of entries.
const FORGET_CHUNK: usize = 4096;

/// Removes the counters of `db` (of `roles` and their tenants, or all of them if
/// `roles` is None), for dropped roles and databases, so that the table does not fill
/// up with them. A pinned counter (a transaction of the database still holds open
/// charges on it) is only marked stale: its charges are given back to it when that
/// transaction ends. The table is walked a chunk at a time, the lock released in
/// between (a tenant's counter lives in a window of its own, not its role's).
///
/// A counter of `db` built meanwhile behind the walk (by a session of the database
/// still running before DROP DATABASE or DROP EXTENSION commits) counts relations that
/// are about to be gone: nobody reads it again, so it gives its place up once it has
/// been idle for core::counters::MIN_IDLE_SECS, and a reinstalled extension (new
/// relfilenodes) finds it stale.
pub fn forget(db: pg_sys::Oid, roles: Option<&[pg_sys::Oid]>) {
    if !shmem::available() {
        return;
    }
    let db = u32::from(db);
    let roles: Option<Vec<u32>> = roles.map(|rs| rs.iter().map(|&r| u32::from(r)).collect());
    for chunk in counters_table().chunks(FORGET_CHUNK) {
        let _x = Held::acquire(pg_sys::LWLockMode::LW_EXCLUSIVE);
        for e in chunk {
            let Slot::Taken(d, r, _) = slot(e) else {
                continue;
            };
            if d != db || roles.as_ref().is_some_and(|rs| !rs.contains(&r)) {
                continue;
            }
            e.valid.store(false, Ordering::Release);
            if e.open.load(Ordering::Acquire) == 0 {
                e.state.store(ENTRY_REMOVED, Ordering::Relaxed);
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
    /// Random bytes drawn when the server starts, which the scope lock's tag and the
    /// tenants' keys are made from (see `scope_tag`, `tenant_key`).
    secret: [u64; 2],
}

static BASE: Base = Base::new();

/// The segment's layout for `n` backends and `scopes` counters: the header, the
/// counters, then each backend's pending changes.
fn layout(n: usize, scopes: usize) -> (Layout, usize, usize) {
    let mut l = Layout::of::<Header>();
    let at = l.array::<Counter>(scopes);
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
fn counters_table() -> &'static [Counter] {
    // SAFETY: `layout` put n_scopes counters there; zeroed is a free entry.
    unsafe { BASE.slice::<Counter>(layout(n_slots(), n_scopes()).1, n_scopes()) }
}

/// A keyed 64-bit hash of `value`, the key drawn at server start: the same in every
/// process of this server. DefaultHasher::new() is SipHash with fixed keys, the same
/// in every process of this build; the secret (and `domain`), hashed first, is what
/// keys it.
fn keyed_hash(domain: u8, value: impl std::hash::Hash) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    header().secret.hash(&mut h);
    domain.hash(&mut h);
    value.hash(&mut h);
    h.finish()
}

/// The two lock tag fields that stand for scope (db, role) in the scope lock: a keyed
/// hash of the pair, the key drawn at server start. pg_locks, which every role can
/// read, shows lock tags; the role's OID there would tell any tenant which roles are
/// being admitted right now, which the rest of pg_quota shows no tenant. Two scopes
/// whose hashes collide (a chance of one in 2^64) would only share a lock.
pub fn scope_tag(db: pg_sys::Oid, role: pg_sys::Oid) -> (u32, u32) {
    let v = keyed_hash(0, (u32::from(db), u32::from(role)));
    (v as u32, (v >> 32) as u32)
}

/// The lock field4 of the scope lock (admission's), and of the database cap's lock.
/// SQL advisory locks live in the user lock method with field4 = 1 or 2; these live in
/// the default lock method (so that transaction end and the deadlock detector treat
/// them like any table lock) with private field4 values, so no `pg_advisory_*` call can
/// produce them, block admission or bypass it (I4).
/// tests/isolation/specs/advisory_squat.spec hangs and fails if it could.
pub const SCOPE_LOCK_FIELD4: u16 = 0x5153; // "QS"
pub const CAP_LOCK_FIELD4: u16 = 0x5143; // "QC"
/// 0.7.0: the lock that serializes changes of the tenants' own limits.
pub const OVERRIDES_LOCK_FIELD4: u16 = 0x514F; // "QO"
/// 0.7.1: the lock a start holds (shared) on its tenant's Citus shard, and a move of
/// that shard off the node (exclusive), so that neither passes the other (citus/moves.rs).
pub const SHARD_LOCK_FIELD4: u16 = 0x5148; // "QH"

/// The tag of the lock that quota.set_tenant_limits() holds (exclusively, to the end
/// of its transaction) on the tenants' limits of `db` (0.7.0): changes queue one behind
/// another, each seeing every change committed before it, without a lock on the table
/// that VACUUM, ANALYZE or a concurrent index build would conflict with.
pub fn overrides_lock_tag(db: pg_sys::Oid) -> pg_sys::LOCKTAG {
    lock_tag(db, 0, 0, OVERRIDES_LOCK_FIELD4)
}

/// The tag of the lock on Citus shard `shard` of `db` (SHARD_LOCK_FIELD4).
pub fn shard_lock_tag(db: pg_sys::Oid, shard: i64) -> pg_sys::LOCKTAG {
    lock_tag(db, (shard >> 32) as u32, shard as u32, SHARD_LOCK_FIELD4)
}

/// The tag of the scope lock of (`db`, `role`) (see `scope_tag`).
pub fn scope_lock_tag(db: pg_sys::Oid, role: pg_sys::Oid) -> pg_sys::LOCKTAG {
    let (field2, field3) = scope_tag(db, role);
    lock_tag(db, field2, field3, SCOPE_LOCK_FIELD4)
}

/// The tag of `db`'s database cap lock (0.5.0): the ledger writer holds it while it
/// reads the open charges and takes its snapshot for a batch with a capped request,
/// and a transactional start holds it from its count to its charge (exclusively under
/// a cap, shared otherwise), so that none can miss what another takes (their scope
/// locks are per role; the cap spans roles).
pub fn cap_lock_tag(db: pg_sys::Oid) -> pg_sys::LOCKTAG {
    lock_tag(db, 0, 0, CAP_LOCK_FIELD4)
}

fn lock_tag(db: pg_sys::Oid, field2: u32, field3: u32, field4: u16) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        locktag_field1: u32::from(db),
        locktag_field2: field2,
        locktag_field3: field3,
        locktag_field4: field4,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::DEFAULT_LOCKMETHOD as u8,
    }
}

/// The key that stands for a tenant's text (in the server encoding) in shared memory:
/// 128 bits of two keyed hashes, never 0 (the role itself). Two tenants of one role
/// would have to collide in all 128 bits to share a counter (a chance of about one in
/// 10^29 among 100,000 tenants); the key is drawn at server start, so nobody can
/// choose tenants that collide.
pub fn tenant_key(text: &[u8]) -> u128 {
    let k = u128::from(keyed_hash(1, text)) | (u128::from(keyed_hash(2, text)) << 64);
    k.max(1)
}
