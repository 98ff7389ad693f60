//! The limit decision. The ledger writer and the caller's fast path both call
//! [`decide`], so they can never disagree about what "at the limit" means.

/// The limits in force for one request: the charged role's `quota.*` settings (see
/// core::policy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Limits {
    /// `quota.max_active_per_role`; 0 means no limit.
    pub max_active: i64,
    /// `quota.max_retained_per_role`; 0 means no limit.
    pub max_retained: i64,
    /// `quota.max_active_per_database`: active tickets of every role of the database
    /// together; 0 means no limit.
    pub max_db: i64,
    /// `quota.max_active_per_tenant` and `quota.max_retained_per_tenant`, for a start
    /// with a tenant (0.5.0); 0 means no limit, and a start without a tenant has none.
    pub tenant_active: i64,
    pub tenant_retained: i64,
}

impl Limits {
    /// These limits for a start with (`true`) or without a tenant: a start without one
    /// has no tenant limits.
    pub fn for_tenant(self, has_tenant: bool) -> Limits {
        if has_tenant {
            self
        } else {
            Limits {
                tenant_active: 0,
                tenant_retained: 0,
                ..self
            }
        }
    }

    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.max_active > 0
            || self.max_retained > 0
            || self.max_db > 0
            || self.tenant_active > 0
            || self.tenant_retained > 0
    }
}

/// What the ledger holds for one scope, read with the latest committed snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Usage {
    /// Tickets started and not finished (a finish that has not committed still counts).
    pub active: i64,
    /// Active tickets plus tickets that ended less than `quota.retention` ago.
    pub retained: i64,
    /// Active tickets of every role in the database (counted only when `max_db` is set).
    pub db_active: i64,
    /// Starts still waiting ahead of this one (see waiters.rs): they take the next free
    /// slots. Admission decides on the counts plus these; a refusal reports the counts
    /// of tickets alone, and these apart.
    pub ahead: i64,
    /// The start's tenant's active and retained tickets (0.5.0; counted only for a
    /// start with a tenant whose limit is set).
    pub tenant_active: i64,
    pub tenant_retained: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalKind {
    Active,
    Retained,
    /// `quota.max_active_per_database`.
    Database,
    /// `quota.max_active_per_tenant` and `quota.max_retained_per_tenant` (0.5.0).
    TenantActive,
    TenantRetained,
}

impl RefusalKind {
    /// Whether the refusal is a tenant's limit.
    pub fn is_tenant(self) -> bool {
        matches!(
            self,
            RefusalKind::TenantActive | RefusalKind::TenantRetained
        )
    }

    /// Whether the refusal is an active limit's, which counts units (0.7.0).
    pub fn is_active(self) -> bool {
        !matches!(self, RefusalKind::Retained | RefusalKind::TenantRetained)
    }
}

impl Limits {
    /// The limit a refusal of `kind` is at.
    pub fn of(self, kind: RefusalKind) -> i64 {
        match kind {
            RefusalKind::Active => self.max_active,
            RefusalKind::Retained => self.max_retained,
            RefusalKind::Database => self.max_db,
            RefusalKind::TenantActive => self.tenant_active,
            RefusalKind::TenantRetained => self.tenant_retained,
        }
    }
}

/// Why a start was refused, with the numbers the error report needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub kind: RefusalKind,
    pub usage: Usage,
    pub limits: Limits,
    /// The refused start's weight (0.7.0; 1 for an unweighted start).
    pub weight: i64,
}

/// Starts that are no tickets yet but take a scope's next units (0.7.0): those waiting
/// ahead of a start, or in the writer's hands. Their units count in the active and the
/// retained counts, as their tickets will.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    pub role_units: i64,
    pub tenant_units: i64,
    pub db_units: i64,
}

/// The most units one ticket may weigh (0.7.0).
pub const MAX_WEIGHT: i64 = 1_000_000;

impl Usage {
    /// The counts with `p` added, as if those starts were tickets already.
    pub fn with_pending(self, p: Pending) -> Usage {
        Usage {
            active: self.active + p.role_units,
            retained: self.retained + p.role_units,
            db_active: self.db_active + p.db_units,
            tenant_active: self.tenant_active + p.tenant_units,
            tenant_retained: self.tenant_retained + p.tenant_units,
            ahead: self.ahead,
        }
    }

    /// The counts as a start of `weight` units meets them (0.7.0): it fits a limit
    /// only where `weight` units are free below it, which is where a start of weight 1
    /// would fit with `weight - 1` more units taken. Active and retained counts are
    /// both units: a ticket counts its weight in each.
    pub fn needing(self, weight: i64) -> Usage {
        let more = weight.max(1) - 1;
        Usage {
            active: self.active.saturating_add(more),
            retained: self.retained.saturating_add(more),
            db_active: self.db_active.saturating_add(more),
            tenant_active: self.tenant_active.saturating_add(more),
            tenant_retained: self.tenant_retained.saturating_add(more),
            ahead: self.ahead,
        }
    }
}

/// The limit that a start of `weight` units can never fit, however many tickets end or
/// age out (0.7.0): one below its weight, checked in `decide`'s order (the tenant's
/// active and retained, the role's, the database's). None for an exempt start (I7)
/// and where every one is unlimited or wide enough.
pub fn never_fits(limits: Limits, weight: i64, exempt: bool) -> Option<RefusalKind> {
    let below = |limit: i64| limit > 0 && limit < weight;
    if exempt {
        None
    } else if below(limits.tenant_active) {
        Some(RefusalKind::TenantActive)
    } else if below(limits.tenant_retained) {
        Some(RefusalKind::TenantRetained)
    } else if below(limits.max_active) {
        Some(RefusalKind::Active)
    } else if below(limits.max_retained) {
        Some(RefusalKind::Retained)
    } else if below(limits.max_db) {
        Some(RefusalKind::Database)
    } else {
        None
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Admit,
    Refuse(Refusal),
}

fn at_limit(count: i64, limit: i64) -> bool {
    limit > 0 && count >= limit
}

/// Decides one start. `exempt` is true for superusers (I7): they are never refused, but
/// their tickets are still recorded and counted against their own scope.
///
/// A tenant's limits are checked first, then its role's: each is narrower than the
/// next, and a caller can fix it right away by finishing one of its tickets; active
/// before retained for the same reason; the database's cap last, because other roles
/// hold it.
pub fn decide(limits: Limits, usage: Usage, exempt: bool) -> Decision {
    decide_weighted(limits, usage, 1, exempt)
}

/// `decide` for a start of `weight` units (0.7.0): it is refused at an active limit
/// unless `weight` units are free below it. The refusal reports `usage` as counted,
/// without the start's own units.
pub fn decide_weighted(limits: Limits, usage: Usage, weight: i64, exempt: bool) -> Decision {
    if exempt {
        return Decision::Admit;
    }
    let counted = usage;
    let usage = usage.needing(weight);
    let kind = if at_limit(usage.tenant_active, limits.tenant_active) {
        RefusalKind::TenantActive
    } else if at_limit(usage.tenant_retained, limits.tenant_retained) {
        RefusalKind::TenantRetained
    } else if at_limit(usage.active, limits.max_active) {
        RefusalKind::Active
    } else if at_limit(usage.retained, limits.max_retained) {
        RefusalKind::Retained
    } else if at_limit(usage.db_active, limits.max_db) {
        RefusalKind::Database
    } else {
        return Decision::Admit;
    };
    Decision::Refuse(Refusal {
        kind,
        usage: counted,
        limits,
        weight,
    })
}

/// The refusal `decide` gives whatever the counts that `usage` leaves out are (the
/// retained ones and the database's, which need the ledger), from its active counts
/// alone (0.6.0: a refusal read from the scope counters). Some only where an active
/// limit is reached and no limit that `decide` checks before that one could be: a
/// tenant's active limit (checked first), or the role's where the tenant has no
/// retained limit.
pub fn refuse_on_active(limits: Limits, usage: Usage, weight: i64) -> Option<Refusal> {
    let needed = usage.needing(weight);
    let kind = if at_limit(needed.tenant_active, limits.tenant_active) {
        RefusalKind::TenantActive
    } else if limits.tenant_retained == 0 && at_limit(needed.active, limits.max_active) {
        RefusalKind::Active
    } else {
        return None;
    };
    Some(Refusal {
        kind,
        usage,
        limits,
        weight,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A refusal from the active counts alone is the one `decide` gives with every
        /// other count at any value.
        #[test]
        fn a_refusal_on_active_counts_holds_whatever_the_rest(
            max_active in 0i64..5, max_retained in 0i64..5, max_db in 0i64..5,
            tenant_active in 0i64..5, tenant_retained in 0i64..5,
            active in 0i64..7, t_active in 0i64..7,
            retained in 0i64..9, t_retained in 0i64..9, db in 0i64..9,
        ) {
            let limits = Limits { max_active, max_retained, max_db, tenant_active, tenant_retained };
            let known = Usage { active, tenant_active: t_active, ..Usage::default() };
            if let Some(r) = refuse_on_active(limits, known, 1) {
                let full = Usage {
                    retained: retained.max(active),
                    tenant_retained: t_retained.max(t_active),
                    db_active: db,
                    ..known
                };
                match decide(limits, full, false) {
                    Decision::Refuse(f) => prop_assert_eq!(f.kind, r.kind),
                    Decision::Admit => prop_assert!(false, "decide admitted {:?}", full),
                }
            }
        }
    }

    const LIMITS: Limits = Limits {
        max_active: 3,
        max_retained: 5,
        max_db: 0,
        tenant_active: 0,
        tenant_retained: 0,
    };

    fn usage(active: i64, retained: i64) -> Usage {
        Usage {
            active,
            retained,
            ..Usage::default()
        }
    }

    #[test]
    fn admits_below_both_limits() {
        assert_eq!(decide(LIMITS, usage(2, 4), false), Decision::Admit);
    }

    #[test]
    fn refuses_at_active_limit() {
        match decide(LIMITS, usage(3, 3), false) {
            Decision::Refuse(r) => assert_eq!(r.kind, RefusalKind::Active),
            d => panic!("expected refusal, got {d:?}"),
        }
    }

    #[test]
    fn refuses_at_retained_limit() {
        match decide(LIMITS, usage(1, 5), false) {
            Decision::Refuse(r) => assert_eq!(r.kind, RefusalKind::Retained),
            d => panic!("expected refusal, got {d:?}"),
        }
    }

    #[test]
    fn active_limit_reported_before_retained() {
        match decide(LIMITS, usage(3, 5), false) {
            Decision::Refuse(r) => assert_eq!(r.kind, RefusalKind::Active),
            d => panic!("expected refusal, got {d:?}"),
        }
    }

    #[test]
    fn zero_means_no_limit() {
        let none = Limits::default();
        assert_eq!(
            decide(none, usage(1_000_000, 100_000_000), false),
            Decision::Admit
        );
    }

    #[test]
    fn superuser_is_exempt() {
        assert_eq!(decide(LIMITS, usage(100, 100), true), Decision::Admit);
    }

    #[test]
    fn refuses_at_database_cap_after_role_limits() {
        let limits = Limits {
            max_db: 4,
            ..LIMITS
        };
        let at_cap = Usage {
            db_active: 4,
            ..usage(1, 1)
        };
        match decide(limits, at_cap, false) {
            Decision::Refuse(r) => assert_eq!(r.kind, RefusalKind::Database),
            d => panic!("expected refusal, got {d:?}"),
        }
        assert_eq!(
            decide(
                limits,
                Usage {
                    db_active: 3,
                    ..at_cap
                },
                false
            ),
            Decision::Admit
        );
        // The role's own limit is reported first: the caller can fix that one.
        match decide(
            limits,
            Usage {
                db_active: 9,
                ..usage(3, 3)
            },
            false,
        ) {
            Decision::Refuse(r) => assert_eq!(r.kind, RefusalKind::Active),
            d => panic!("expected refusal, got {d:?}"),
        }
        assert_eq!(decide(limits, at_cap, true), Decision::Admit);
    }

    /// 0.5.0: a tenant's limits are checked beside its role's, and a tenant can only
    /// restrict what its role may do.
    #[test]
    fn a_tenant_limit_only_restricts() {
        let limits = Limits {
            tenant_active: 2,
            tenant_retained: 4,
            ..LIMITS
        };
        let u = |role_active, tenant_active| Usage {
            active: role_active,
            retained: role_active,
            tenant_active,
            tenant_retained: tenant_active,
            ..Usage::default()
        };
        assert_eq!(decide(limits, u(1, 1), false), Decision::Admit);
        match decide(limits, u(1, 2), false) {
            Decision::Refuse(r) => assert_eq!(r.kind, RefusalKind::TenantActive),
            d => panic!("expected refusal, got {d:?}"),
        }
        // The role at its limit refuses though the tenant has room.
        match decide(limits, u(3, 0), false) {
            Decision::Refuse(r) => assert_eq!(r.kind, RefusalKind::Active),
            d => panic!("expected refusal, got {d:?}"),
        }
        // A tenant limit wider than the role's widens nothing.
        let wide = Limits {
            tenant_active: 100,
            ..LIMITS
        };
        assert!(matches!(decide(wide, u(3, 0), false), Decision::Refuse(_)));
        // Without a tenant, the tenant limits are off.
        assert_eq!(
            decide(limits.for_tenant(false), u(1, 9), false),
            Decision::Admit
        );
    }

    /// The model: a role may hold `n` active and `r` retained tickets where each limit
    /// is 0 (none) or bounds the count after admission.
    fn model_admits(limits: Limits, u: Usage) -> bool {
        let fits = |count: i64, limit: i64| limit == 0 || count + 1 <= limit;
        fits(u.active, limits.max_active) && fits(u.retained, limits.max_retained)
    }

    proptest! {
        #[test]
        fn decision_matches_model(
            max_active in 0i64..6,
            max_retained in 0i64..8,
            active in 0i64..10,
            extra in 0i64..10,
        ) {
            let limits = Limits { max_active, max_retained, ..Limits::default() };
            let u = usage(active, active + extra);
            let admitted = decide(limits, u, false) == Decision::Admit;
            prop_assert_eq!(admitted, model_admits(limits, u));
        }

        /// I1 as a sequence, checked against an independent model of one scope: the
        /// list of admitted tickets, each with the time it ended (if it did). The
        /// counts given to `decide` and the counts checked afterwards are both
        /// derived from that list and a clock, with tickets ageing out of the
        /// retention window; nothing is kept in step with `decide`'s own inputs.
        /// After every step: the unfinished tickets are at most `max_active`, the
        /// retained ones at most `max_retained`, and a refusal only ever happens
        /// when one more ticket would break a limit (so "never admit" cannot pass).
        #[test]
        fn admitted_sequence_never_exceeds_limits(
            max_active in 0i64..5,
            max_retained in 0i64..8,
            retention in 1i64..20,
            ops in proptest::collection::vec((0u8..4, 0usize..8, 1i64..6), 0..80),
        ) {
            let limits = Limits { max_active, max_retained, ..Limits::default() };
            let mut now = 0i64;
            let mut ended_at: Vec<Option<i64>> = Vec::new();
            let active = |t: &[Option<i64>]| t.iter().filter(|e| e.is_none()).count() as i64;
            let retained = |t: &[Option<i64>], now: i64| {
                t.iter().filter(|e| e.is_none_or(|end| end > now - retention)).count() as i64
            };
            for (op, pick, dt) in ops {
                match op {
                    // start
                    0 | 1 => {
                        let (a, r) = (active(&ended_at), retained(&ended_at, now));
                        match decide(limits, Usage { active: a, retained: r, ..Usage::default() }, false) {
                            Decision::Admit => ended_at.push(None),
                            Decision::Refuse(refusal) => {
                                let active_full = max_active > 0 && a + 1 > max_active;
                                let retained_full = max_retained > 0 && r + 1 > max_retained;
                                prop_assert!(active_full || retained_full,
                                    "refused with room: active {a}/{max_active}, retained {r}/{max_retained}");
                                let kind = if active_full { RefusalKind::Active } else { RefusalKind::Retained };
                                prop_assert_eq!(refusal.kind, kind);
                            }
                        }
                    }
                    // finish the pick-th unfinished ticket, if there is one
                    2 => {
                        if let Some(e) = ended_at.iter_mut().filter(|e| e.is_none()).nth(pick) {
                            *e = Some(now);
                        }
                    }
                    // time passes; tickets that ended long enough ago stop counting
                    _ => now += dt,
                }
                let unfinished = ended_at.iter().filter(|e| e.is_none()).count() as i64;
                let in_window = ended_at
                    .iter()
                    .filter(|e| match e {
                        None => true,
                        Some(end) => now - end < retention,
                    })
                    .count() as i64;
                prop_assert!(max_active == 0 || unfinished <= max_active,
                    "{unfinished} unfinished tickets, limit {max_active}");
                prop_assert!(max_retained == 0 || in_window <= max_retained,
                    "{in_window} retained tickets, limit {max_retained}");
            }
        }
    }
}
