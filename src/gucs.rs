//! Layer 1: every `quota.*` setting. The limits, retention, lease and log_refusals are
//! PGC_SUSET: only superusers (or roles granted `SET ON PARAMETER`) change them, so a
//! tenant cannot raise its own limits, and `ALTER ROLE … SET` / `ALTER DATABASE … SET`
//! give per-role and per-database values; so is writer_start_wait. writer_idle_timeout
//! is server-wide (PGC_SIGHUP); stats_max and scope_counters size shared memory
//! (PGC_POSTMASTER).

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};

use crate::core::Limits;

static MAX_ACTIVE_PER_ROLE: GucSetting<i32> = GucSetting::<i32>::new(100);
static MAX_RETAINED_PER_ROLE: GucSetting<i32> = GucSetting::<i32>::new(10_000);
static RETENTION: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);
static WRITER_IDLE_TIMEOUT: GucSetting<i32> = GucSetting::<i32>::new(10);
static MAX_ACTIVE_PER_DATABASE: GucSetting<i32> = GucSetting::<i32>::new(0);
static DEFAULT_LEASE: GucSetting<i32> = GucSetting::<i32>::new(24 * 3600);
static STATS_MAX: GucSetting<i32> = GucSetting::<i32>::new(5000);
static LOG_REFUSALS: GucSetting<bool> = GucSetting::<bool>::new(false);
static WRITER_START_WAIT: GucSetting<i32> = GucSetting::<i32>::new(10_000);
static SCOPE_COUNTERS: GucSetting<i32> = GucSetting::<i32>::new(65_536);

pub fn init() {
    // 0 turns the limit off; a million concurrent tickets for one role is far beyond
    // what one PostgreSQL server can run, so larger values are typos.
    GucRegistry::define_int_guc(
        c"quota.max_active_per_role",
        c"Maximum number of active tickets per role and database (0 = no limit).",
        c"quota.start() refuses with SQLSTATE 53400 once the calling role holds this many unfinished tickets.",
        &MAX_ACTIVE_PER_ROLE,
        0,
        1_000_000,
        GucContext::Suset,
        GucFlags::default(),
    );
    // 0 turns the limit off; 10^8 rows per role is about the most a ledger index can
    // serve without admission slowing down.
    GucRegistry::define_int_guc(
        c"quota.max_retained_per_role",
        c"Maximum number of retained tickets per role and database (0 = no limit).",
        c"Retained tickets are the active ones plus those that ended less than quota.retention ago: a sliding-window rate limit.",
        &MAX_RETAINED_PER_ROLE,
        0,
        100_000_000,
        GucContext::Suset,
        GucFlags::default(),
    );
    // Seconds, with units, so '7d' and '1h' work. 0 keeps no history: an ended ticket
    // stops counting at once. The top is i32::MAX seconds (about 68 years).
    GucRegistry::define_int_guc(
        c"quota.retention",
        c"How long an ended ticket keeps counting towards quota.max_retained_per_role.",
        c"Tickets that ended longer ago than this are purged from the ledger.",
        &RETENTION,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    // 0.2.0. The same range as the per-role limit: 0 turns the cap off.
    GucRegistry::define_int_guc(
        c"quota.max_active_per_database",
        c"Maximum number of active tickets of all roles together in one database (0 = no limit).",
        c"quota.start() refuses with SQLSTATE 53400 once the database holds this many unfinished tickets; superusers are never refused, but their tickets count.",
        &MAX_ACTIVE_PER_DATABASE,
        0,
        1_000_000,
        GucContext::Suset,
        GucFlags::default(),
    );
    // 0.2.0. Seconds, with units. 0: tickets started without a lease never expire.
    GucRegistry::define_int_guc(
        c"quota.default_lease",
        c"How long a ticket started without a lease stays active unless it is finished or renewed (0 = for ever).",
        c"When the lease runs out the ticket stops counting as active and ends with outcome expired.",
        &DEFAULT_LEASE,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    // Server-wide (SIGHUP): how long an idle ledger writer keeps its background
    // worker slot. Short enough that parallel query and other workers get the slot
    // back soon; long enough that a steady trickle of starts keeps one writer.
    GucRegistry::define_int_guc(
        c"quota.writer_idle_timeout",
        c"How long a ledger writer with nothing to do waits before it exits.",
        c"Each database that uses pg_quota has one writer, which holds one of max_worker_processes while it runs.",
        &WRITER_IDLE_TIMEOUT,
        1,
        86_400,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    // 0.4.0. SUSET: while a caller waits for a writer slot, writers of other databases
    // give theirs up in turn, so a tenant must not stretch that wait itself.
    GucRegistry::define_int_guc(
        c"quota.writer_start_wait",
        c"How long quota.start() waits for a ledger writer slot before it fails with 53000.",
        c"When every background worker slot is taken, the ledger writers of other databases give theirs up, one at a time, as soon as they have nothing to do.",
        &WRITER_START_WAIT,
        0,
        600_000,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
    // 0.3.0. Set at server start: it sizes quota.stats in shared memory. About 200
    // bytes per entry; pg_stat_statements.max has the same default and bounds.
    GucRegistry::define_int_guc(
        c"quota.stats_max",
        c"How many (database, role) entries quota.stats keeps.",
        c"When the table is full, the least recently used entries are evicted (see quota.stats_info).",
        &STATS_MAX,
        100,
        1_000_000,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    // 0.4.0. Set at server start: it sizes the scope counters in shared memory (40
    // bytes each, 2.5 MiB by default). The bottom lets a test fill the table; 2^22
    // (160 MiB) is far beyond the (database, role) pairs any server serves.
    GucRegistry::define_int_guc(
        c"quota.scope_counters",
        c"How many (database, role) pairs keep their ticket counts in shared memory.",
        c"A new pair takes the place of the least recently read counter near its hash, unless all of those were read in the last 2 s; then it is counted from the ledger on each call.",
        &SCOPE_COUNTERS,
        16,
        1 << 22,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    // 0.3.0. SUSET: a tenant cannot turn its own refusals into log lines (or off).
    GucRegistry::define_bool_guc(
        c"quota.log_refusals",
        c"Writes a LOG line when quota.start() refuses, at most one per second per role and database.",
        c"Lines held back by the rate limit are counted in the next line and in quota.stats_info.",
        &LOG_REFUSALS,
        GucContext::Suset,
        GucFlags::default(),
    );
    // SAFETY: called from _PG_init in the postmaster, after the settings above are
    // defined; it only marks the prefix so that misspelled quota.* names are refused.
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"quota".as_ptr()) };
}

/// The limits of the calling session, handed to the ledger writer with each request.
pub fn limits() -> Limits {
    Limits {
        max_active: i64::from(MAX_ACTIVE_PER_ROLE.get()),
        max_retained: i64::from(MAX_RETAINED_PER_ROLE.get()),
        max_db: i64::from(MAX_ACTIVE_PER_DATABASE.get()),
    }
}

pub fn default_lease_secs() -> i64 {
    i64::from(DEFAULT_LEASE.get())
}

pub fn retention_secs() -> i64 {
    i64::from(RETENTION.get())
}

pub fn writer_idle_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(WRITER_IDLE_TIMEOUT.get().max(1) as u64)
}

pub fn writer_start_wait() -> std::time::Duration {
    std::time::Duration::from_millis(WRITER_START_WAIT.get().max(0) as u64)
}

pub fn stats_max() -> usize {
    STATS_MAX.get().max(0) as usize
}

pub fn scope_counters() -> usize {
    SCOPE_COUNTERS.get().max(1) as usize
}

pub fn log_refusals() -> bool {
    LOG_REFUSALS.get()
}
