//! Layer 1: every `quota.*` setting. The limits, retention, lease and log_refusals are
//! PGC_SUSET: only superusers (or roles granted `SET ON PARAMETER`) change them, so a
//! tenant cannot raise its own limits, and `ALTER ROLE … SET` / `ALTER DATABASE … SET`
//! give per-role and per-database values; so is writer_start_wait. writer_idle_timeout
//! is server-wide (PGC_SIGHUP); stats_max and scope_counters size shared memory
//! (PGC_POSTMASTER).
//!
//! The settings of a role's policy (`Setting`) are not read from the session as it is:
//! policy.rs resolves them for the role a charge is for (core::policy). For that it
//! needs two things PostgreSQL keeps to itself, which this file keeps: each setting's
//! server value (postgresql.conf, ALTER SYSTEM, the command line, or the default),
//! which a login role's or database's value hides from the session, captured by a
//! check hook whenever the server's layer is (re)applied; and whether the session's
//! value was set in the session itself (`set_in_session`).

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::pg_sys;

static MAX_ACTIVE_PER_ROLE: GucSetting<i32> = GucSetting::<i32>::new(100);
static MAX_RETAINED_PER_ROLE: GucSetting<i32> = GucSetting::<i32>::new(10_000);
static RETENTION: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);
static WRITER_IDLE_TIMEOUT: GucSetting<i32> = GucSetting::<i32>::new(10);
static MAX_ACTIVE_PER_DATABASE: GucSetting<i32> = GucSetting::<i32>::new(0);
static DEFAULT_LEASE: GucSetting<i32> = GucSetting::<i32>::new(24 * 3600);
static STATS_MAX: GucSetting<i32> = GucSetting::<i32>::new(5000);
static LOG_REFUSALS: GucSetting<bool> = GucSetting::<bool>::new(false);
/// This library's version, as `quota.library_version` shows it.
const LIBRARY_VERSION: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes(),
) {
    Ok(v) => v,
    Err(_) => panic!("the crate version has no NUL"),
};
static LIBRARY_VERSION_SETTING: GucSetting<Option<std::ffi::CString>> =
    GucSetting::<Option<std::ffi::CString>>::new(Some(LIBRARY_VERSION));
static WRITER_START_WAIT: GucSetting<i32> = GucSetting::<i32>::new(10_000);
static SCOPE_COUNTERS: GucSetting<i32> = GucSetting::<i32>::new(65_536);
static MAX_ACTIVE_PER_TENANT: GucSetting<i32> = GucSetting::<i32>::new(0);
static MAX_RETAINED_PER_TENANT: GucSetting<i32> = GucSetting::<i32>::new(0);
static ALLOW_TRANSACTIONAL: GucSetting<bool> = GucSetting::<bool>::new(false);

/// The settings that make up a role's policy, resolved for the charged role (see
/// policy.rs). Their order is that of `POLICY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    MaxActivePerRole,
    MaxRetainedPerRole,
    MaxActivePerDatabase,
    MaxActivePerTenant,
    MaxRetainedPerTenant,
    Retention,
    DefaultLease,
    AllowTransactional,
}

/// Each policy setting's name and, for integers, its GUC unit flags (for parse_int).
pub const POLICY: [(Setting, &std::ffi::CStr, i32); 8] = [
    (Setting::MaxActivePerRole, c"quota.max_active_per_role", 0),
    (
        Setting::MaxRetainedPerRole,
        c"quota.max_retained_per_role",
        0,
    ),
    (
        Setting::MaxActivePerDatabase,
        c"quota.max_active_per_database",
        0,
    ),
    (
        Setting::MaxActivePerTenant,
        c"quota.max_active_per_tenant",
        0,
    ),
    (
        Setting::MaxRetainedPerTenant,
        c"quota.max_retained_per_tenant",
        0,
    ),
    (
        Setting::Retention,
        c"quota.retention",
        pg_sys::GUC_UNIT_S as i32,
    ),
    (
        Setting::DefaultLease,
        c"quota.default_lease",
        pg_sys::GUC_UNIT_S as i32,
    ),
    (Setting::AllowTransactional, c"quota.allow_transactional", 0),
];

/// The server's layers of the policy settings, as this process saw them applied
/// (booleans as 0 or 1). The postmaster captures them at preload; backends inherit them
/// and capture them again when they reload the configuration file.
struct ServerLayers {
    /// Boot values, and those of the environment (PGC_S_DEFAULT to PGC_S_ENV_VAR).
    base: [i32; 8],
    /// The configuration files' (postgresql.conf, postgresql.auto.conf), as last
    /// applied: see `server_value` for when they still are.
    file: [Option<i32>; 8],
    /// The postmaster's command line (PGC_S_ARGV), which the files cannot override.
    argv: [Option<i32>; 8],
    /// PgReloadTime when the library was loaded.
    loaded_at: pg_sys::TimestampTz,
    /// Whether each setting was in the files at the last reload that applied them
    /// (GUC_IS_IN_FILE as it stood then), and that reload's PgReloadTime.
    in_file: [bool; 8],
    marks_at: pg_sys::TimestampTz,
}

// Single-threaded backend state (see ServerLayers).
static mut SERVER: ServerLayers = ServerLayers {
    base: [100, 10_000, 0, 0, 0, 7 * 24 * 3600, 24 * 3600, 0],
    file: [None; 8],
    argv: [None; 8],
    loaded_at: 0,
    in_file: [false; 8],
    marks_at: 0,
};

/// Records `value` of `s` from `source` if it belongs to the server's layers.
///
/// A file value counts only from a pass that applies the files: the postmaster's, and
/// a process's reload, which runs between statements. `ALTER SYSTEM` and the
/// `pg_file_settings` view check the files' values too (with PGC_S_FILE, inside a
/// statement), without applying them: those are not taken.
fn capture(s: Setting, value: i32, source: pg_sys::GucSource::Type) {
    // SAFETY: single-threaded backend (or postmaster) state; ActivePortal is a plain
    // read of a backend variable.
    unsafe {
        let layers = &mut *std::ptr::addr_of_mut!(SERVER);
        let i = s as usize;
        match source {
            pg_sys::GucSource::PGC_S_DEFAULT => {
                // The boot value: at definition, or as a value removed from the files
                // is reverted (PostgreSQL does so only for a value the files set).
                layers.base[i] = value;
                layers.file[i] = None;
            }
            pg_sys::GucSource::PGC_S_DYNAMIC_DEFAULT | pg_sys::GucSource::PGC_S_ENV_VAR => {
                layers.base[i] = value;
            }
            pg_sys::GucSource::PGC_S_FILE if pg_sys::ActivePortal.is_null() => {
                layers.file[i] = Some(value);
            }
            pg_sys::GucSource::PGC_S_ARGV => layers.argv[i] = Some(value),
            _ => {}
        }
    }
}

/// Notes when the library was loaded (see `server_value`).
fn note_load() {
    // SAFETY: single-threaded postmaster (or backend) state.
    unsafe { (*std::ptr::addr_of_mut!(SERVER)).loaded_at = pg_sys::PgReloadTime };
}

/// A check hook that accepts every value and captures the server's (see `capture`).
/// PostgreSQL calls check hooks for each value it applies or stacks, the server's
/// included when a login role's value hides it, and for a value removed from
/// postgresql.conf (the default, from PGC_S_DEFAULT).
macro_rules! capturing_int_hook {
    ($name:ident, $setting:expr) => {
        #[pgrx::pg_guard]
        unsafe extern "C-unwind" fn $name(
            newval: *mut i32,
            _extra: *mut *mut std::ffi::c_void,
            source: pg_sys::GucSource::Type,
        ) -> bool {
            // SAFETY: PostgreSQL passes a valid pointer to the candidate value.
            capture($setting, unsafe { *newval }, source);
            true
        }
    };
}
capturing_int_hook!(hook_max_active_per_role, Setting::MaxActivePerRole);
capturing_int_hook!(hook_max_retained_per_role, Setting::MaxRetainedPerRole);
capturing_int_hook!(hook_max_active_per_database, Setting::MaxActivePerDatabase);
capturing_int_hook!(hook_max_active_per_tenant, Setting::MaxActivePerTenant);
capturing_int_hook!(hook_max_retained_per_tenant, Setting::MaxRetainedPerTenant);
capturing_int_hook!(hook_retention, Setting::Retention);
capturing_int_hook!(hook_default_lease, Setting::DefaultLease);

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn hook_allow_transactional(
    newval: *mut bool,
    _extra: *mut *mut std::ffi::c_void,
    source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: PostgreSQL passes a valid pointer to the candidate value.
    capture(
        Setting::AllowTransactional,
        i32::from(unsafe { *newval }),
        source,
    );
    true
}

/// The server's value of `s` (a boolean as 0 or 1): the postmaster's command line,
/// else the configuration files', else the boot value.
///
/// A value removed from the files is reverted by PostgreSQL only where the files had
/// set the session's own value; where a login role's or database's setting hides it, no
/// hook hears of the removal. So a captured file value counts only while the setting
/// was still in the files at the last reload that applied them: PostgreSQL marks each
/// setting found there (GUC_IS_IN_FILE) on every pass over them, and this copies the
/// marks when a reload has applied them (PgReloadTime moved), since passes that apply
/// nothing (the `pg_file_settings` view, a reload that fails) mark too. Until this
/// process reloads after the library was loaded, no mark is set (a setting defined by a
/// library starts without it), and the captured value stands.
pub fn server_value(s: Setting) -> i32 {
    server_layer(s).0
}

/// Whether the server's value of `s` is its boot value: neither the postmaster's
/// command line nor the configuration files set it (see `server_value`).
pub fn server_is_default(s: Setting) -> bool {
    server_layer(s).1
}

/// The server's value of `s`, and whether it is the boot value (see `server_value`).
fn server_layer(s: Setting) -> (i32, bool) {
    let i = s as usize;
    // SAFETY: single-threaded backend state; a plain read of PgReloadTime and of GUC
    // records' status bits (a record, once defined, is never freed).
    unsafe {
        let layers = &mut *std::ptr::addr_of_mut!(SERVER);
        if let Some(v) = layers.argv[i] {
            return (v, false);
        }
        let Some(v) = layers.file[i] else {
            return (layers.base[i], true);
        };
        if pg_sys::PgReloadTime == layers.loaded_at {
            return (v, false);
        }
        if layers.marks_at != pg_sys::PgReloadTime {
            for (k, (setting, _, _)) in POLICY.iter().enumerate() {
                let r = record(*setting);
                layers.in_file[k] =
                    !r.is_null() && (*r).status & pg_sys::GUC_IS_IN_FILE as i32 != 0;
            }
            layers.marks_at = pg_sys::PgReloadTime;
        }
        if layers.in_file[i] {
            (v, false)
        } else {
            (layers.base[i], true)
        }
    }
}

/// The session's current value of `s` (a boolean as 0 or 1).
pub fn session_value(s: Setting) -> i32 {
    match s {
        Setting::MaxActivePerRole => MAX_ACTIVE_PER_ROLE.get(),
        Setting::MaxRetainedPerRole => MAX_RETAINED_PER_ROLE.get(),
        Setting::MaxActivePerDatabase => MAX_ACTIVE_PER_DATABASE.get(),
        Setting::MaxActivePerTenant => MAX_ACTIVE_PER_TENANT.get(),
        Setting::MaxRetainedPerTenant => MAX_RETAINED_PER_TENANT.get(),
        Setting::Retention => RETENTION.get(),
        Setting::DefaultLease => DEFAULT_LEASE.get(),
        Setting::AllowTransactional => i32::from(ALLOW_TRANSACTIONAL.get()),
    }
}

// Single-threaded backend state: each policy setting's GUC record, found once (it
// lives as long as the process).
static mut RECORDS: [*mut pg_sys::config_generic; 8] = [std::ptr::null_mut(); 8];

/// Whether the session's value of `s` was set in the session (SET, SET LOCAL, a
/// function's SET clause, the connection's options): PGC_S_CLIENT or above, where
/// PostgreSQL's own order puts it above every per-role and per-database value.
pub fn set_in_session(s: Setting) -> bool {
    let r = record(s);
    // SAFETY: a GUC record, once defined, is never freed, and its source is a plain
    // field.
    !r.is_null() && unsafe { (*r).source } >= pg_sys::GucSource::PGC_S_CLIENT
}

/// The GUC record of `s` (null before it is defined).
fn record(s: Setting) -> *mut pg_sys::config_generic {
    // SAFETY: single-threaded backend state.
    unsafe {
        let records = &mut *std::ptr::addr_of_mut!(RECORDS);
        if records[s as usize].is_null() {
            records[s as usize] = crate::compat::guc_record(POLICY[s as usize].1);
        }
        records[s as usize]
    }
}

pub fn init() {
    // 0.6.1. Read-only: the version of the library this server process runs, which a
    // preloaded library keeps until the server restarts, whatever is installed since;
    // ALTER EXTENSION pg_quota UPDATE to 0.6.1 checks for it (an older library does not
    // know 0.6.1's indexes).
    GucRegistry::define_string_guc(
        c"quota.library_version",
        c"The version of the pg_quota library this server runs.",
        c"A new build takes effect at the next server restart: run ALTER EXTENSION pg_quota UPDATE after it.",
        &LIBRARY_VERSION_SETTING,
        GucContext::Internal,
        GucFlags::default(),
    );
    note_load();
    // 0 turns the limit off; a million concurrent tickets for one role is far beyond
    // what one PostgreSQL server can run, so larger values are typos.
    // SAFETY: the hook is a check hook of the right type, valid for the process.
    unsafe {
        GucRegistry::define_int_guc_with_hooks(
        c"quota.max_active_per_role",
        c"Maximum number of active tickets per role and database (0 = no limit).",
        c"quota.start() refuses with SQLSTATE 53400 once the calling role holds this many unfinished tickets.",
        &MAX_ACTIVE_PER_ROLE,
        0,
        1_000_000,
        GucContext::Suset,
        GucFlags::default(),
        Some(hook_max_active_per_role),
        None,
        None,
    );
    }
    // 0 turns the limit off; 10^8 rows per role is about the most a ledger index can
    // serve without admission slowing down.
    // SAFETY: the hook is a check hook of the right type, valid for the process.
    unsafe {
        GucRegistry::define_int_guc_with_hooks(
        c"quota.max_retained_per_role",
        c"Maximum number of retained tickets per role and database (0 = no limit).",
        c"Retained tickets are the active ones plus those that ended less than quota.retention ago: a sliding-window rate limit.",
        &MAX_RETAINED_PER_ROLE,
        0,
        100_000_000,
        GucContext::Suset,
        GucFlags::default(),
        Some(hook_max_retained_per_role),
        None,
        None,
    );
    }
    // Seconds, with units, so '7d' and '1h' work. 0 keeps no history: an ended ticket
    // stops counting at once. The top is i32::MAX seconds (about 68 years).
    // SAFETY: the hook is a check hook of the right type, valid for the process.
    unsafe {
        GucRegistry::define_int_guc_with_hooks(
            c"quota.retention",
            c"How long an ended ticket keeps counting towards quota.max_retained_per_role.",
            c"Tickets that ended longer ago than this are purged from the ledger.",
            &RETENTION,
            0,
            i32::MAX,
            GucContext::Suset,
            GucFlags::UNIT_S,
            Some(hook_retention),
            None,
            None,
        );
    }
    // 0.2.0. The same range as the per-role limit: 0 turns the cap off.
    // SAFETY: the hook is a check hook of the right type, valid for the process.
    unsafe {
        GucRegistry::define_int_guc_with_hooks(
        c"quota.max_active_per_database",
        c"Maximum number of active tickets of all roles together in one database (0 = no limit).",
        c"quota.start() refuses with SQLSTATE 53400 once the database holds this many unfinished tickets; superusers are never refused, but their tickets count.",
        &MAX_ACTIVE_PER_DATABASE,
        0,
        1_000_000,
        GucContext::Suset,
        GucFlags::default(),
        Some(hook_max_active_per_database),
        None,
        None,
    );
    }
    // 0.2.0. Seconds, with units. 0: tickets started without a lease never expire.
    // SAFETY: the hook is a check hook of the right type, valid for the process.
    unsafe {
        GucRegistry::define_int_guc_with_hooks(
        c"quota.default_lease",
        c"How long a ticket started without a lease stays active unless it is finished or renewed (0 = for ever).",
        c"When the lease runs out the ticket stops counting as active and ends with outcome expired.",
        &DEFAULT_LEASE,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
        Some(hook_default_lease),
        None,
        None,
    );
    }
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
    // 0.5.0. The role limits' counterparts for each tenant of a role (see
    // `start(…, tenant => …)`); 0 turns them off, as for roles, and the same ranges.
    // SAFETY: the hooks are check hooks of the right type, valid for the process.
    unsafe {
        GucRegistry::define_int_guc_with_hooks(
            c"quota.max_active_per_tenant",
            c"Maximum number of active tickets per tenant of a role (0 = no limit).",
            c"quota.start(…, tenant => …) refuses with SQLSTATE 53400 once the tenant holds this many unfinished tickets; its role's limits apply too.",
            &MAX_ACTIVE_PER_TENANT,
            0,
            1_000_000,
            GucContext::Suset,
            GucFlags::default(),
            Some(hook_max_active_per_tenant),
            None,
            None,
        );
        GucRegistry::define_int_guc_with_hooks(
            c"quota.max_retained_per_tenant",
            c"Maximum number of retained tickets per tenant of a role (0 = no limit).",
            c"Retained tickets are the active ones plus those that ended less than quota.retention ago; its role's limits apply too.",
            &MAX_RETAINED_PER_TENANT,
            0,
            100_000_000,
            GucContext::Suset,
            GucFlags::default(),
            Some(hook_max_retained_per_tenant),
            None,
            None,
        );
        // 0.5.0. SUSET: a transactional charge vanishes when its transaction rolls
        // back, so a role that can launch outside work before it commits (dblink,
        // postgres_fdw, an untrusted language) could run past its limit with it; a
        // superuser allows it where the work is a row of the transaction.
        GucRegistry::define_bool_guc_with_hooks(
            c"quota.allow_transactional",
            c"Allows quota.start(…, transactional => true), whose charge commits or rolls back with the calling transaction.",
            c"Off by default: a role that can launch work outside its transaction (dblink, postgres_fdw, an untrusted language) could use a charge that vanishes on rollback to run past its limit.",
            &ALLOW_TRANSACTIONAL,
            GucContext::Suset,
            GucFlags::default(),
            Some(hook_allow_transactional),
            None,
            None,
        );
    }
    // SAFETY: called from _PG_init in the postmaster, after the settings above are
    // defined; it only marks the prefix so that misspelled quota.* names are refused.
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"quota".as_ptr()) };
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
