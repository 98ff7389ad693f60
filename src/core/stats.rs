//! Admission statistics (0.3.0): what each counter is, the refusal log line and its
//! rate limit, which entries to evict when the table is full, and the file that keeps
//! the counters across a clean restart. Plain Rust; src/stats.rs keeps them in shared
//! memory.

use super::decision::{Limits, RefusalKind, Usage};
use super::ticket::Outcome;

/// One counter of a (database, role) entry. The order is that of quota.stats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Counter {
    Admitted,
    RefusedActive,
    RefusedRetained,
    RefusedDatabase,
    FinishedSucceeded,
    FinishedFailed,
    FinishedCancelled,
    Expired,
    Renewed,
    IdempotentHits,
    Waits,
    /// Microseconds; quota.stats shows milliseconds.
    WaitTime,
    WaitTimeouts,
}

pub const N_COUNTERS: usize = 13;

impl Counter {
    /// The counter of a refusal. Statistics are per role: a refusal at a tenant's
    /// limit counts in its role's refused_active or refused_retained (there can be
    /// 100,000 tenants of a role; nothing keeps a row per tenant).
    pub fn refused(kind: RefusalKind) -> Counter {
        match kind {
            RefusalKind::Active | RefusalKind::TenantActive => Counter::RefusedActive,
            RefusalKind::Retained | RefusalKind::TenantRetained => Counter::RefusedRetained,
            RefusalKind::Database => Counter::RefusedDatabase,
        }
    }

    pub fn finished(outcome: Outcome) -> Counter {
        match outcome {
            Outcome::Succeeded => Counter::FinishedSucceeded,
            Outcome::Failed => Counter::FinishedFailed,
            Outcome::Cancelled => Counter::FinishedCancelled,
        }
    }
}

/// The upper bounds, in milliseconds, of the wait-time histogram's buckets; a last
/// bucket takes longer waits (Prometheus' `+Inf`).
pub const WAIT_BUCKETS_MS: [f64; 6] = [1.0, 10.0, 100.0, 1_000.0, 10_000.0, 60_000.0];
pub const N_WAIT_BUCKETS: usize = WAIT_BUCKETS_MS.len() + 1;

/// The bucket of a wait of `us` microseconds: the first whose bound it does not exceed.
pub fn wait_bucket(us: u64) -> usize {
    WAIT_BUCKETS_MS
        .iter()
        .position(|&ms| us as f64 <= ms * 1000.0)
        .unwrap_or(WAIT_BUCKETS_MS.len())
}

/// At most one refusal line per (database, role) per this many microseconds.
pub const LOG_INTERVAL_US: i64 = 1_000_000;
/// At most this many refusal lines per second in the whole server.
pub const LOG_LINES_PER_SECOND: u32 = 10;

/// Whether a refusal at `now` may write a line, given when its entry last wrote one.
pub fn may_log(last_logged: i64, now: i64) -> bool {
    last_logged == 0 || now.saturating_sub(last_logged) >= LOG_INTERVAL_US
}

/// The LOG line for a refusal, in the manner of log_lock_waits: who, where, which
/// limit, and the counts (active ones in units, 0.7.0), with the start's `weight` where
/// it is above 1 and an active limit refused it; `suppressed` refusals of the same role
/// and database were not logged since its previous line.
#[allow(clippy::too_many_arguments)]
pub fn refusal_log_line(
    role: &str,
    tenant: Option<&str>,
    database: &str,
    kind: RefusalKind,
    usage: Usage,
    limits: Limits,
    suppressed: u64,
    tenant_limit_set: bool,
    weight: i64,
) -> String {
    // 0.7.0: a tenant's own limit, set by quota.set_tenant_limits().
    let tenant_setting = |guc: &str, limit: i64| {
        if tenant_limit_set {
            format!("set for the tenant by quota.set_tenant_limits: {limit}")
        } else {
            format!("{guc} = {limit}")
        }
    };
    // 0.7.0: the counts are units; a weighted start names them so, and its weight.
    let n = if weight > 1 { "units" } else { "tickets" };
    let what = match kind {
        RefusalKind::Active => format!(
            "{} of {} active {n} (quota.max_active_per_role = {})",
            usage.active, limits.max_active, limits.max_active
        ),
        RefusalKind::Retained => format!(
            "{} of {} retained {n} (quota.max_retained_per_role = {})",
            usage.retained, limits.max_retained, limits.max_retained
        ),
        RefusalKind::Database => format!(
            "{} of {} active {n} in the database (quota.max_active_per_database = {})",
            usage.db_active, limits.max_db, limits.max_db
        ),
        RefusalKind::TenantActive => format!(
            "tenant \"{}\" holds {} of {} active {n} ({})",
            tenant.unwrap_or_default(),
            usage.tenant_active,
            limits.tenant_active,
            tenant_setting("quota.max_active_per_tenant", limits.tenant_active)
        ),
        RefusalKind::TenantRetained => format!(
            "tenant \"{}\" holds {} of {} retained {n} ({})",
            tenant.unwrap_or_default(),
            usage.tenant_retained,
            limits.tenant_retained,
            tenant_setting("quota.max_retained_per_tenant", limits.tenant_retained)
        ),
    };
    let mut line =
        format!("pg_quota refused a start for role \"{role}\" in database \"{database}\": {what}");
    if weight > 1 {
        line.push_str(&format!(", for a start of weight {weight}"));
    }
    if suppressed > 0 {
        line.push_str(&format!(
            " ({suppressed} similar refusal{} {} not logged)",
            if suppressed == 1 { "" } else { "s" },
            if suppressed == 1 { "was" } else { "were" }
        ));
    }
    line
}

/// The entries to evict from a full table: the `share` least recently used of
/// `entries` (index, last use), at least one.
pub fn victims(mut entries: Vec<(usize, i64)>, share_percent: usize) -> Vec<usize> {
    let n = (entries.len() * share_percent / 100)
        .max(1)
        .min(entries.len());
    entries.sort_by_key(|&(i, last)| (last, i));
    entries.into_iter().take(n).map(|(i, _)| i).collect()
}

/// Whether pg_control (its first bytes, as the file holds them) says the server shut
/// down cleanly: `state` (after the system identifier and two version numbers) is
/// DB_SHUTDOWNED or DB_SHUTDOWNED_IN_RECOVERY. These fields open ControlFileData in
/// every release since 9.x, in the machine's byte order.
pub fn shut_down_cleanly(control: &[u8]) -> bool {
    const DB_SHUTDOWNED: u32 = 1;
    const DB_SHUTDOWNED_IN_RECOVERY: u32 = 2;
    control
        .get(16..20)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_ne_bytes)
        .is_some_and(|state| state == DB_SHUTDOWNED || state == DB_SHUTDOWNED_IN_RECOVERY)
}

/// One (database, role) entry as the stats file keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Saved {
    pub db: u32,
    pub role: u32,
    pub since: i64,
    pub last_used: i64,
    pub counters: [u64; N_COUNTERS],
    pub wait_buckets: [u64; N_WAIT_BUCKETS],
}

/// What the stats file holds.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SavedStats {
    pub reset_at: i64,
    pub evicted: u64,
    pub log_suppressed: u64,
    pub entries: Vec<Saved>,
}

// The file's layout is written out here rather than derived with serde and a binary
// codec (issue 19 looked): it is one fixed record type, and the codecs that would do
// it (postcard; bincode ends at 3.0.0, a crate that only fails to compile) would add
// crates to the build, and change the format, so that the first restart after an
// update from 0.3.x would drop every counter unless this reader stayed beside them.
const MAGIC: u32 = 0x5051_5354; // "PQST"
const FORMAT: u32 = 1;
const ENTRY_VALUES: u32 = (N_COUNTERS + N_WAIT_BUCKETS) as u32;

fn checksum(bytes: &[u8]) -> u64 {
    // FNV-1a: enough to tell a torn or foreign file from ours.
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl SavedStats {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(40 + self.entries.len() * (24 + 8 * N_COUNTERS));
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&FORMAT.to_le_bytes());
        b.extend_from_slice(&ENTRY_VALUES.to_le_bytes());
        b.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.reset_at.to_le_bytes());
        b.extend_from_slice(&self.evicted.to_le_bytes());
        b.extend_from_slice(&self.log_suppressed.to_le_bytes());
        for e in &self.entries {
            b.extend_from_slice(&e.db.to_le_bytes());
            b.extend_from_slice(&e.role.to_le_bytes());
            b.extend_from_slice(&e.since.to_le_bytes());
            b.extend_from_slice(&e.last_used.to_le_bytes());
            for c in e.counters.iter().chain(&e.wait_buckets) {
                b.extend_from_slice(&c.to_le_bytes());
            }
        }
        let sum = checksum(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    /// None for anything that is not a complete file of this format.
    pub fn decode(bytes: &[u8]) -> Option<SavedStats> {
        let body = bytes.get(..bytes.len().checked_sub(8)?)?;
        let sum = u64::from_le_bytes(bytes[body.len()..].try_into().ok()?);
        if checksum(body) != sum {
            return None;
        }
        let mut r = Reader(body);
        if r.u32()? != MAGIC || r.u32()? != FORMAT || r.u32()? != ENTRY_VALUES {
            return None;
        }
        let n = r.u32()? as usize;
        let mut s = SavedStats {
            reset_at: r.i64()?,
            evicted: r.u64()?,
            log_suppressed: r.u64()?,
            entries: Vec::with_capacity(n.min(1 << 20)),
        };
        for _ in 0..n {
            let mut e = Saved {
                db: r.u32()?,
                role: r.u32()?,
                since: r.i64()?,
                last_used: r.i64()?,
                counters: [0; N_COUNTERS],
                wait_buckets: [0; N_WAIT_BUCKETS],
            };
            for c in e.counters.iter_mut().chain(e.wait_buckets.iter_mut()) {
                *c = r.u64()?;
            }
            s.entries.push(e);
        }
        r.0.is_empty().then_some(s)
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_at_checked(N)?;
        self.0 = rest;
        head.try_into().ok()
    }
    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    fn i64(&mut self) -> Option<i64> {
        self.take::<8>().map(i64::from_le_bytes)
    }
}

/// What quota.usage_totals reports (0.5.1): the database's tickets, all roles
/// together, counted without reading the ledger's history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsageTotals {
    /// Active units (0.7.0: each active ticket counts its weight): unfinished tickets
    /// whose lease has not run out.
    pub active: i64,
    /// Retained units at the caller's quota.retention, as quota.usage counts them
    /// (0.7.0: each retained ticket counts its weight).
    pub retained: i64,
    /// The units of the ledger's rows: the retained tickets and the history the writer
    /// has not purged yet (kept for a longer retention of another session, or not
    /// reached); with tickets of weight 1 only, the rows.
    pub ledger_rows: i64,
}

impl UsageTotals {
    /// From the active units, the units of the ledger's rows (the summary's counts),
    /// and those that no longer count as retained at the caller's cutoff (`gone`).
    /// Every ledger row is either retained or gone, so retained is the difference; the
    /// floor at the active units only guards a summary that SQL-level writes left
    /// wrong until it is rebuilt (an active ticket is always retained).
    pub fn new(active: i64, ledger_rows: i64, gone: i64) -> UsageTotals {
        UsageTotals {
            active,
            retained: ledger_rows.saturating_sub(gone).max(active),
            ledger_rows: ledger_rows.max(active),
        }
    }
}

/// The units of the `total` units (0.7.0: items weigh one or more) that lie before a
/// cutoff, from two counters that each stop at a limit of items: `before(limit)` counts
/// the items before it and `since(limit)` those at or after it, each reading at most
/// `limit` items and returning how many it read and their units. A side that reads
/// fewer than `limit` items has counted all of them. Both sides are counted up to the same limit,
/// `first` at first, which grows fourfold until one side comes out below it, so the
/// work is a small multiple of the smaller side (or of `first`), however large the
/// other (quota.usage_totals: a role's tickets ended before the caller's retention, or
/// those ended since; it counts role by role, so `first` is small: 0.5.1 counted all
/// roles at once from 1,024).
pub fn smaller_side(
    total: i64,
    first: i64,
    mut before: impl FnMut(i64) -> (i64, i64),
    mut since: impl FnMut(i64) -> (i64, i64),
) -> i64 {
    let mut limit = first.max(1);
    loop {
        let (b, b_units) = before(limit);
        if b < limit {
            return b_units;
        }
        let (s, s_units) = since(limit);
        if s < limit {
            return total.saturating_sub(s_units).max(0);
        }
        limit = limit.saturating_mul(4);
    }
}

#[cfg(test)]
mod tests {
    /// `smaller_side` over items of one unit each.
    fn ss(
        total: i64,
        first: i64,
        mut before: impl FnMut(i64) -> i64,
        mut since: impl FnMut(i64) -> i64,
    ) -> i64 {
        super::smaller_side(
            total,
            first,
            |l| {
                let n = before(l);
                (n, n)
            },
            |l| {
                let n = since(l);
                (n, n)
            },
        )
    }

    #[test]
    fn smaller_side_counts_units() {
        // 3 items of 5 units before, 40 of 1 since: the units before, from either side.
        let before = |l: i64| (3.min(l), 5 * 3.min(l));
        let since = |l: i64| (40.min(l), 40.min(l));
        assert_eq!(super::smaller_side(55, 2, before, since), 15);
        assert_eq!(super::smaller_side(55, 4, before, since), 15);
        // 40 items of 2 units before, 1 of 7 since: total less the side since.
        let before = |l: i64| (40.min(l), 2 * 40.min(l));
        let since = |l: i64| (1.min(l), 7 * 1.min(l));
        assert_eq!(super::smaller_side(87, 4, before, since), 80);
    }

    #[test]
    fn smaller_side_counts_the_smaller_side_only() {
        // 10 before, 1,000,000 since: the answer comes from the small side, and the
        // large one is never counted past the first limit.
        let mut read = 0i64;
        let total = 1_000_010;
        let n = ss(
            total,
            1024,
            |limit| {
                read += 10.min(limit);
                10.min(limit)
            },
            |_| unreachable!("the side before came out below the limit"),
        );
        assert_eq!((n, read), (10, 10));
        // 1,000,000 before, 10 since: both sides read once up to 1024, then the small one
        // answers.
        let (mut b_read, mut s_read) = (0i64, 0i64);
        let n = ss(
            total,
            1024,
            |limit| {
                let c = 1_000_000.min(limit);
                b_read += c;
                c
            },
            |limit| {
                let c = 10.min(limit);
                s_read += c;
                c
            },
        );
        assert_eq!((n, b_read, s_read), (1_000_000, 1024, 10));
        // Both large: the limit grows until one side fits; the reads stay within a
        // small multiple of the smaller side (300,000).
        let reads = std::cell::Cell::new(0i64);
        let (before, since) = (300_000i64, 700_000i64);
        let side = |n: i64| {
            let reads = &reads;
            move |limit: i64| {
                reads.set(reads.get() + n.min(limit));
                n.min(limit)
            }
        };
        let n = ss(before + since, 1024, side(before), side(since));
        assert_eq!(n, before);
        assert!(reads.get() < 4 * before, "{} entries read", reads.get());
        // Exactly at a limit is not below it: both sides go on.
        assert_eq!(ss(2048, 1024, |l| 1024.min(l), |l| 1024.min(l)), 1024);
        // From a small first limit (a role at a time): 200 before and none since reads
        // 16 and 0, not the 200; 5 before reads 5.
        reads.set(0);
        assert_eq!(ss(200, 16, side(200), side(0)), 200);
        assert_eq!(reads.get(), 16);
        reads.set(0);
        assert_eq!(ss(30, 16, side(5), side(25)), 5);
        assert_eq!(reads.get(), 5);
        // The side since is the smaller and over the first limit: the side before is
        // read up to the limit that fits it, so about 8 times it, besides the first
        // limit's 32 (monitoring_scale.sh bounds its reads so).
        reads.set(0);
        assert_eq!(ss(1020, 16, side(1000), side(20)), 1000);
        assert!(reads.get() <= 32 + 8 * 20, "{} entries read", reads.get());
    }
    #[test]
    fn usage_totals_retained_is_rows_less_gone() {
        let t = UsageTotals::new(3, 1_000_000, 400_000);
        assert_eq!(
            (t.active, t.retained, t.ledger_rows),
            (3, 600_000, 1_000_000)
        );
        // A summary that undercounts (SQL-level writes, until it is rebuilt) never
        // reports fewer retained units or rows than the active ones.
        let t = UsageTotals::new(5, 2, 0);
        assert_eq!((t.retained, t.ledger_rows), (5, 5));
        assert_eq!(UsageTotals::new(0, 0, 0).retained, 0);
        // 0.7.0: one active ticket of weight 50 and 2 ended ones of weight 1: 52 units
        // retained, 50 of them active.
        let t = UsageTotals::new(50, 52, 0);
        assert_eq!((t.active, t.retained, t.ledger_rows), (50, 52, 52));
    }
    use super::*;

    fn sample() -> SavedStats {
        SavedStats {
            reset_at: 42,
            evicted: 3,
            log_suppressed: 7,
            entries: vec![
                Saved {
                    db: 5,
                    role: 10,
                    since: 100,
                    last_used: 200,
                    counters: std::array::from_fn(|i| i as u64 * 11),
                    wait_buckets: std::array::from_fn(|i| i as u64 + 1000),
                },
                Saved {
                    db: 5,
                    role: 11,
                    since: 101,
                    last_used: 201,
                    counters: [u64::MAX; N_COUNTERS],
                    wait_buckets: [3; N_WAIT_BUCKETS],
                },
            ],
        }
    }

    #[test]
    fn clean_shutdown_is_read_from_pg_control_state() {
        let control = |state: u32| {
            let mut b = vec![0u8; 16];
            b.extend_from_slice(&state.to_ne_bytes());
            b.extend_from_slice(&[0u8; 200]);
            b
        };
        assert!(shut_down_cleanly(&control(1)));
        assert!(shut_down_cleanly(&control(2)));
        for crashed in [0, 3, 4, 5, 6] {
            assert!(!shut_down_cleanly(&control(crashed)), "state {crashed}");
        }
        assert!(!shut_down_cleanly(&[0u8; 10]));
    }

    #[test]
    fn stats_file_round_trips() {
        let s = sample();
        assert_eq!(SavedStats::decode(&s.encode()), Some(s));
        let empty = SavedStats::default();
        assert_eq!(SavedStats::decode(&empty.encode()), Some(empty));
    }

    #[test]
    fn stats_file_rejects_torn_or_altered_files() {
        let b = sample().encode();
        for cut in [0, 1, 8, b.len() / 2, b.len() - 1] {
            assert_eq!(SavedStats::decode(&b[..cut]), None, "cut at {cut}");
        }
        let mut flipped = b.clone();
        flipped[30] ^= 1;
        assert_eq!(SavedStats::decode(&flipped), None);
        let mut longer = b.clone();
        longer.insert(20, 0);
        assert_eq!(SavedStats::decode(&longer), None);
    }

    #[test]
    fn counters_follow_refusal_kinds_and_outcomes() {
        assert_eq!(
            Counter::refused(RefusalKind::Retained),
            Counter::RefusedRetained
        );
        assert_eq!(
            Counter::finished(Outcome::Cancelled),
            Counter::FinishedCancelled
        );
        assert_eq!(Counter::WaitTimeouts as usize, N_COUNTERS - 1);
    }

    #[test]
    fn wait_buckets_take_waits_up_to_their_bound() {
        assert_eq!(wait_bucket(0), 0);
        assert_eq!(wait_bucket(1_000), 0);
        assert_eq!(wait_bucket(1_001), 1);
        assert_eq!(wait_bucket(250_000), 3);
        assert_eq!(wait_bucket(60_000_000), 5);
        assert_eq!(wait_bucket(60_000_001), 6);
        assert_eq!(wait_bucket(u64::MAX), N_WAIT_BUCKETS - 1);
    }

    #[test]
    fn log_rate_limit_is_one_line_per_interval() {
        assert!(may_log(0, 5));
        assert!(!may_log(1_000_000, 1_999_999));
        assert!(may_log(1_000_000, 2_000_000));
    }

    #[test]
    fn log_line_names_role_database_limit_and_counts() {
        let limits = Limits {
            max_active: 3,
            max_retained: 10,
            max_db: 4,
            tenant_active: 2,
            ..Limits::default()
        };
        let usage = Usage {
            active: 3,
            retained: 10,
            db_active: 4,
            tenant_active: 2,
            ..Usage::default()
        };
        assert_eq!(
            refusal_log_line(
                "alice",
                Some("acme"),
                "app",
                RefusalKind::TenantActive,
                usage,
                limits,
                0,
                false,
                1
            ),
            "pg_quota refused a start for role \"alice\" in database \"app\": tenant \"acme\" holds 2 of 2 active tickets (quota.max_active_per_tenant = 2)"
        );
        // 0.7.0: at a tenant's own limit.
        assert_eq!(
            refusal_log_line(
                "alice",
                Some("acme"),
                "app",
                RefusalKind::TenantActive,
                usage,
                limits,
                0,
                true,
                1
            ),
            "pg_quota refused a start for role \"alice\" in database \"app\": tenant \"acme\" holds 2 of 2 active tickets (set for the tenant by quota.set_tenant_limits: 2)"
        );
        assert_eq!(
            refusal_log_line("alice", None, "app", RefusalKind::Active, usage, limits, 0, false, 1),
            "pg_quota refused a start for role \"alice\" in database \"app\": 3 of 3 active tickets (quota.max_active_per_role = 3)"
        );
        // 0.7.0: a weighted start, which may be refused below the limit.
        assert_eq!(
            refusal_log_line("alice", None, "app", RefusalKind::Active, Usage { active: 2, ..usage }, limits, 0, false, 2),
            "pg_quota refused a start for role \"alice\" in database \"app\": 2 of 3 active units (quota.max_active_per_role = 3), for a start of weight 2"
        );
        assert_eq!(
            refusal_log_line("alice", None, "app", RefusalKind::Retained, usage, limits, 1, false, 2),
            "pg_quota refused a start for role \"alice\" in database \"app\": 10 of 10 retained units (quota.max_retained_per_role = 10), for a start of weight 2 (1 similar refusal was not logged)"
        );
        assert_eq!(
            refusal_log_line("b", None, "d", RefusalKind::Database, usage, limits, 12, false, 1),
            "pg_quota refused a start for role \"b\" in database \"d\": 4 of 4 active tickets in the database (quota.max_active_per_database = 4) (12 similar refusals were not logged)"
        );
    }

    #[test]
    fn victims_are_the_least_recently_used() {
        let entries = (0..40).map(|i| (i, 1000 - i as i64)).collect();
        assert_eq!(victims(entries, 5), vec![39, 38]);
        assert_eq!(victims(vec![(7, 5)], 5), vec![7]);
        assert_eq!(victims(vec![], 5), Vec::<usize>::new());
    }
}
