//! Layer 1: the policy of the role a charge is for (0.5.0): each `quota.*` setting of
//! gucs::POLICY as it applies to that role in this database, in PostgreSQL's order of
//! precedence (core::policy), and not as the session's login happened to set it.
//!
//! The per-role and per-database layers come from pg_db_role_setting, read through its
//! unique index on (setdatabase, setrole), the way PostgreSQL reads it at login
//! (ApplySetting), and cached per role until this backend processes any invalidation
//! message: an `ALTER ROLE … SET` sends one to every backend when it commits
//! (pg_db_role_setting is a catalog whose changes invalidate snapshots), so it applies
//! from the next transaction of every session.

use pgrx::pg_sys;

use crate::core::policy::{entry_value, Layers};
use crate::core::Limits;
use crate::gucs::{self, Setting, POLICY};

/// What a charge is checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub limits: Limits,
    /// quota.max_active_per_tenant and quota.max_retained_per_tenant (0 = none).
    pub tenant_max_active: i64,
    pub tenant_max_retained: i64,
    pub retention_secs: i64,
    pub default_lease_secs: i64,
    pub allow_transactional: bool,
    /// Whether quota.max_retained_per_role is its boot value (10,000) because nothing
    /// sets it for this role: no layer above, no configuration file, no command line
    /// (0.6.0: a refusal at it says so, and how to turn it off).
    pub retained_is_default: bool,
    /// The same of quota.max_active_per_role (its boot value 100): a Citus node warns
    /// only of a limit chosen for the role that counts per node (citus/placement.rs).
    pub active_is_default: bool,
}

/// The value of each policy setting (in POLICY's order) in one row of
/// pg_db_role_setting, where it has one.
pub type Row = [Option<i32>; POLICY.len()];

/// The rows that can apply to a role in this database, in order of precedence:
/// (database, role), (0, role), (database, 0), (0, 0).
type Configured = [Row; 4];

struct Cached {
    role: pg_sys::Oid,
    invalidations: u64,
    configured: Configured,
}

/// How many roles' rows a backend keeps (a pooled connection that switches roles per
/// request meets many).
const CACHED_ROLES: usize = 64;

// Single-threaded backend state.
static mut CACHE: Vec<Cached> = Vec::new();

fn invalidations() -> u64 {
    // SAFETY: a plain read of a backend counter.
    unsafe { pg_sys::SharedInvalidMessageCounter }
}

fn configured(role: pg_sys::Oid) -> Configured {
    let now = invalidations();
    // SAFETY: single-threaded backend state.
    let cache = unsafe { &mut *std::ptr::addr_of_mut!(CACHE) };
    if cache.first().is_some_and(|c| c.invalidations != now) {
        cache.clear();
    }
    if let Some(c) = cache.iter().find(|c| c.role == role) {
        return c.configured;
    }
    // SAFETY: a plain read of backend state.
    let db = unsafe { pg_sys::MyDatabaseId };
    let none = pg_sys::InvalidOid;
    let configured = [
        row(db, role),
        row(none, role),
        row(db, none),
        row(none, none),
    ];
    if cache.len() == CACHED_ROLES {
        cache.remove(0);
    }
    cache.push(Cached {
        role,
        invalidations: now,
        configured,
    });
    configured
}

/// The policy of `role` in this database.
pub fn of(role: pg_sys::Oid) -> Policy {
    let c = configured(role);
    let layers = |s: Setting| {
        let i = s as usize;
        Layers {
            session: gucs::set_in_session(s).then(|| gucs::session_value(s)),
            database_role: c[0][i],
            role: c[1][i],
            database: c[2][i],
            all_roles: c[3][i],
            server: gucs::server_value(s),
        }
    };
    let value = |s: Setting| -> i64 { i64::from(layers(s).resolve()) };
    let is_default = |s: Setting| layers(s).configured().is_none() && gucs::server_is_default(s);
    let retained_is_default = is_default(Setting::MaxRetainedPerRole);
    let active_is_default = is_default(Setting::MaxActivePerRole);
    Policy {
        limits: Limits {
            max_active: value(Setting::MaxActivePerRole),
            max_retained: value(Setting::MaxRetainedPerRole),
            max_db: value(Setting::MaxActivePerDatabase),
            ..Limits::default()
        },
        tenant_max_active: value(Setting::MaxActivePerTenant),
        tenant_max_retained: value(Setting::MaxRetainedPerTenant),
        retention_secs: value(Setting::Retention),
        default_lease_secs: value(Setting::DefaultLease),
        allow_transactional: value(Setting::AllowTransactional) != 0,
        retained_is_default,
        active_is_default,
    }
}

/// pg_db_role_setting and its unique index on (setdatabase, setrole), whose OIDs have
/// been fixed since PostgreSQL 9.0.
const DB_ROLE_SETTING: pg_sys::Oid = pg_sys::Oid::from_u32(2964);
const DB_ROLE_SETTING_INDEX: pg_sys::Oid = pg_sys::Oid::from_u32(2965);

/// The policy settings in the pg_db_role_setting row of (`db`, `role`), InvalidOid
/// meaning "every": what `ALTER ROLE role IN DATABASE db SET` and its kin stored. One
/// probe of the catalog's unique index, under the catalog snapshot, as PostgreSQL's
/// own readers of this catalog do. Values that do not parse are skipped: PostgreSQL
/// checked them when they were set.
pub fn row(db: pg_sys::Oid, role: pg_sys::Oid) -> Row {
    let mut out: Row = [None; POLICY.len()];
    // SAFETY: an index scan of a catalog; every datum is read while the tuple is
    // current, and the text is copied before the scan moves on.
    unsafe {
        let rel = pg_sys::table_open(DB_ROLE_SETTING, pg_sys::AccessShareLock as i32);
        let desc = (*rel).rd_att;
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        for (k, (attno, value)) in [(1, db), (2, role)].into_iter().enumerate() {
            pg_sys::ScanKeyInit(
                &mut keys[k],
                attno,
                pg_sys::BTEqualStrategyNumber as u16,
                pg_sys::Oid::from(pg_sys::F_OIDEQ),
                value.into(),
            );
        }
        let scan = pg_sys::systable_beginscan(
            rel,
            DB_ROLE_SETTING_INDEX,
            true,
            std::ptr::null_mut(),
            2,
            keys.as_mut_ptr(),
        );
        let tup = pg_sys::systable_getnext(scan);
        if !tup.is_null() {
            let mut isnull = false;
            let config = pg_sys::heap_getattr(tup, 3, desc, &mut isnull);
            if !isnull {
                parse_settings(config, &mut out);
            }
        }
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as i32);
    }
    out
}

/// Fills `out` from a setconfig array (text[] of name=value). The last entry of a name
/// wins, as in ApplySetting.
///
/// # Safety
/// `config` is a non-null text[] datum of a tuple that is current.
unsafe fn parse_settings(config: pg_sys::Datum, out: &mut Row) {
    // SAFETY: the caller's promise; deconstruct_array fills the pointers we pass.
    unsafe {
        let arr = pg_sys::pg_detoast_datum(config.cast_mut_ptr()) as *mut pg_sys::ArrayType;
        let mut elems: *mut pg_sys::Datum = std::ptr::null_mut();
        let mut nulls: *mut bool = std::ptr::null_mut();
        let mut n = 0;
        pg_sys::deconstruct_array(
            arr,
            pg_sys::TEXTOID,
            -1,
            false,
            b'i' as _,
            &mut elems,
            &mut nulls,
            &mut n,
        );
        for k in 0..n as usize {
            if *nulls.add(k) {
                continue;
            }
            let item =
                std::ffi::CStr::from_ptr(pg_sys::text_to_cstring((*elems.add(k)).cast_mut_ptr()));
            for (i, &(setting, name, unit)) in POLICY.iter().enumerate() {
                let Some(value) = entry_value(item.to_bytes(), &name.to_string_lossy()) else {
                    continue;
                };
                let Ok(value) = std::ffi::CString::new(value) else {
                    continue;
                };
                if setting == Setting::AllowTransactional {
                    let mut b = false;
                    if pg_sys::parse_bool(value.as_ptr(), &mut b) {
                        out[i] = Some(i32::from(b));
                    }
                } else {
                    let mut v = 0;
                    if pg_sys::parse_int(value.as_ptr(), &mut v, unit, std::ptr::null_mut()) {
                        out[i] = Some(v);
                    }
                }
            }
        }
    }
}
