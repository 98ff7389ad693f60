//! The ledger writer's decision over one batch of requests.
//!
//! The writer is the single authority for I1: it is the only process that inserts
//! tickets, so the committed counts it reads plus what the batch itself admits are
//! exact. A scope is (database, role) whatever settings the requesting sessions run
//! with: sessions of one role may pass different limits and different
//! `quota.retention` values, and every admission counts against all of them. 0.1.0
//! keyed its counts by (role, retention), so two requests of one role with different
//! retentions in one batch did not see each other.

use std::collections::HashMap;

use super::decision::{decide_weighted, Decision, Limits, Usage};

/// One start request as the writer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRequest {
    pub role: u32,
    /// The request's tenant (0.5.0), by the key that stands for its text (see
    /// core::tenant); None for the role itself.
    pub tenant: Option<u128>,
    pub limits: Limits,
    pub retention_secs: i64,
    pub exempt: bool,
    /// Its weight (0.7.0): the units it takes of each count it is admitted to.
    pub weight: i64,
}

/// A tenant of a role, as the batch counts it.
pub type TenantOf = (u32, u128);

/// What the writer must count for one role to decide every request of the batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// Count active tickets up to this many (the highest active limit among the
    /// role's requests); `None` when no request of the role limits active tickets.
    pub active_cap: Option<i64>,
    /// The retentions whose retained count a request of the role is limited by.
    pub retentions: Vec<i64>,
}

/// Committed counts of one role, as read under one snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counted {
    /// Active tickets, exact below `Needs::active_cap` and at least the cap otherwise.
    pub active: i64,
    /// Retained tickets for each retention in `Needs::retentions`.
    pub retained: Vec<(i64, i64)>,
}

/// What each tenant of the batch needs counted (by its own limits), as `needs` for roles.
pub fn tenant_needs(requests: &[BatchRequest]) -> HashMap<TenantOf, Needs> {
    let mut out: HashMap<TenantOf, Needs> = HashMap::new();
    for r in requests.iter().filter(|r| !r.exempt) {
        let Some(t) = r.tenant else { continue };
        let n = out.entry((r.role, t)).or_default();
        if r.limits.tenant_active > 0 {
            n.active_cap = Some(
                n.active_cap
                    .map_or(r.limits.tenant_active, |c| c.max(r.limits.tenant_active)),
            );
        }
        if r.limits.tenant_retained > 0 && !n.retentions.contains(&r.retention_secs) {
            n.retentions.push(r.retention_secs);
        }
    }
    out
}

/// What each role of the batch needs counted. Exempt requests need nothing.
pub fn needs(requests: &[BatchRequest]) -> HashMap<u32, Needs> {
    let mut out: HashMap<u32, Needs> = HashMap::new();
    for r in requests.iter().filter(|r| !r.exempt) {
        let n = out.entry(r.role).or_default();
        if r.limits.max_active > 0 {
            n.active_cap = Some(
                n.active_cap
                    .map_or(r.limits.max_active, |c| c.max(r.limits.max_active)),
            );
        }
        if r.limits.max_retained > 0 && !n.retentions.contains(&r.retention_secs) {
            n.retentions.push(r.retention_secs);
        }
    }
    out
}

/// The highest database cap among the batch's limited requests: the database's active
/// tickets must be counted up to it. `None` when no request is limited by one.
pub fn db_cap(requests: &[BatchRequest]) -> Option<i64> {
    requests
        .iter()
        .filter(|r| !r.exempt && r.limits.max_db > 0)
        .map(|r| r.limits.max_db)
        .max()
}

/// Decides every request in order. Each admission adds its weight's units to its role's
/// active and retained counts (for every retention; 0.7.0), so later requests
/// of the same role in the batch count it, whatever their own settings; and its units
/// to the database's count (`db_active`, the committed count of every role), which every
/// later request limited by `quota.max_active_per_database` counts, whatever its role.
/// Exempt (superuser) requests are always admitted, and their tickets count towards
/// the database's total too.
///
/// A request with a tenant also counts that tenant's units (`tenants`), and its
/// admission adds to them as to its role's; an admission without a tenant adds to
/// its role only.
pub fn decide_batch(
    requests: &[BatchRequest],
    counted: &HashMap<u32, Counted>,
    tenants: &HashMap<TenantOf, Counted>,
    db_active: i64,
) -> Vec<Decision> {
    let mut state = counted.clone();
    let mut tenant_state = tenants.clone();
    let mut db_active = db_active;
    let retained_for = |c: &Counted, ret: i64| {
        c.retained
            .iter()
            .find(|(r, _)| *r == ret)
            .map_or(0, |(_, n)| *n)
    };
    let bump = |c: &mut Counted, units: i64| {
        c.active += units;
        for (_, n) in c.retained.iter_mut() {
            *n += units;
        }
    };
    requests
        .iter()
        .map(|r| {
            if r.exempt {
                db_active += r.weight;
                return Decision::Admit;
            }
            let c = state.entry(r.role).or_default();
            let t = r
                .tenant
                .map(|t| tenant_state.entry((r.role, t)).or_default());
            let usage = Usage {
                active: c.active,
                retained: retained_for(c, r.retention_secs),
                db_active,
                ahead: 0,
                tenant_active: t.as_ref().map_or(0, |t| t.active),
                tenant_retained: t.as_ref().map_or(0, |t| retained_for(t, r.retention_secs)),
            };
            let limits = r.limits.for_tenant(r.tenant.is_some());
            let d = decide_weighted(limits, usage, r.weight, false);
            if d == Decision::Admit {
                bump(c, r.weight);
                if let Some(t) = t {
                    bump(t, r.weight);
                }
                db_active += r.weight;
            }
            d
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(role: u32, max_active: i64, max_retained: i64, retention_secs: i64) -> BatchRequest {
        BatchRequest {
            role,
            tenant: None,
            limits: Limits {
                max_active,
                max_retained,
                ..Limits::default()
            },
            retention_secs,
            exempt: false,
            weight: 1,
        }
    }

    fn treq(role: u32, tenant: u128, tenant_active: i64, role_active: i64) -> BatchRequest {
        BatchRequest {
            role,
            tenant: Some(tenant),
            limits: Limits {
                max_active: role_active,
                tenant_active,
                ..Limits::default()
            },
            retention_secs: 60,
            exempt: false,
            weight: 1,
        }
    }

    /// 0.5.0: two tenants of one role in one batch each fill their own limit, and
    /// together their role's; a start of the role itself counts against the role only.
    #[test]
    fn tenants_count_against_their_role_and_themselves() {
        let reqs = [
            treq(10, 1, 1, 3),
            treq(10, 1, 1, 3),
            treq(10, 2, 1, 3),
            req(10, 3, 0, 60),
            treq(10, 3, 1, 3),
        ];
        let ds = decide_batch(&reqs, &HashMap::new(), &HashMap::new(), 0);
        assert_eq!(ds[0], Decision::Admit);
        assert!(
            matches!(ds[1], Decision::Refuse(r) if r.kind == crate::core::RefusalKind::TenantActive)
        );
        assert_eq!(ds[2], Decision::Admit);
        assert_eq!(ds[3], Decision::Admit);
        // The role is full (3): tenant 3 is refused by its role's limit.
        assert!(matches!(ds[4], Decision::Refuse(r) if r.kind == crate::core::RefusalKind::Active));
        let n = tenant_needs(&reqs);
        assert_eq!(n[&(10, 1)].active_cap, Some(1));
        assert!(!n.contains_key(&(10, 0)));
    }

    fn admitted(ds: &[Decision]) -> usize {
        ds.iter().filter(|d| **d == Decision::Admit).count()
    }

    #[test]
    fn one_role_with_two_retentions_shares_its_last_slot() {
        let reqs = [req(10, 1, 0, 3600), req(10, 1, 0, 7200)];
        let counted = HashMap::from([(10, Counted::default())]);
        assert_eq!(
            admitted(&decide_batch(&reqs, &counted, &HashMap::new(), 0)),
            1
        );
    }

    #[test]
    fn retained_counts_of_every_retention_grow_with_each_admission() {
        let reqs = [req(10, 0, 2, 3600), req(10, 0, 2, 60), req(10, 0, 2, 3600)];
        let needs = needs(&reqs);
        assert_eq!(needs[&10].retentions, vec![3600, 60]);
        let counted = HashMap::from([(
            10,
            Counted {
                active: 0,
                retained: vec![(3600, 1), (60, 0)],
            },
        )]);
        // The first admission fills the 1h window (1 + 1 = 2); the 60 s window then has
        // 1 and admits; the 1h window is full.
        let ds = decide_batch(&reqs, &counted, &HashMap::new(), 0);
        assert_eq!(ds[0], Decision::Admit);
        assert_eq!(ds[1], Decision::Admit);
        assert!(matches!(ds[2], Decision::Refuse(_)));
    }

    #[test]
    fn needs_takes_the_highest_active_limit_and_skips_exempt_requests() {
        let mut su = req(10, 1, 1, 1);
        su.exempt = true;
        let n = needs(&[req(10, 2, 0, 1), req(10, 5, 0, 9), su]);
        assert_eq!(n[&10].active_cap, Some(5));
        assert!(n[&10].retentions.is_empty());
    }

    /// Two roles race the database's last slot in one batch: only the first gets it,
    /// and a superuser's ticket takes a slot of the cap without being refused.
    #[test]
    fn database_cap_spans_roles_and_counts_superusers() {
        let mut a = req(10, 5, 0, 1);
        a.limits.max_db = 3;
        let mut b = req(11, 5, 0, 1);
        b.limits.max_db = 3;
        let mut su = req(12, 0, 0, 1);
        su.exempt = true;
        assert_eq!(db_cap(&[a, b, su]), Some(3));
        assert_eq!(db_cap(&[req(10, 5, 0, 1), su]), None);
        let ds = decide_batch(&[a, b], &HashMap::new(), &HashMap::new(), 2);
        assert_eq!(ds[0], Decision::Admit);
        assert!(
            matches!(ds[1], Decision::Refuse(r) if r.kind == crate::core::RefusalKind::Database)
        );
        let ds = decide_batch(&[su, a], &HashMap::new(), &HashMap::new(), 2);
        assert_eq!(ds[0], Decision::Admit);
        assert!(matches!(ds[1], Decision::Refuse(r) if r.usage.db_active == 3));
    }

    proptest! {
        /// I1 against an independent model: replaying the decisions on a plain list
        /// of tickets, no admitted request ever takes its role past its own limits,
        /// active or retained, whatever mix of limits, retentions and weights (0.7.0:
        /// units in both counts) the batch carries.
        #[test]
        fn batch_never_admits_past_any_requests_limits(
            reqs in proptest::collection::vec((0u32..3, 0i64..4, 0i64..5, 0i64..3, 1i64..4), 0..24),
            start_active in proptest::collection::vec(0i64..4, 3),
        ) {
            let reqs: Vec<BatchRequest> = reqs.into_iter()
                .map(|(role, a, r, ret, weight)| BatchRequest { weight, ..req(role, a, r, ret * 100) })
                .collect();
            // Committed state: `start_active[role]` active tickets, nothing ended, so
            // every retention sees them as retained.
            let counted: HashMap<u32, Counted> = needs(&reqs).into_iter().map(|(role, n)| {
                let a = start_active[role as usize];
                (role, Counted {
                    active: n.active_cap.map_or(0, |cap| a.min(cap)),
                    retained: n.retentions.iter().map(|&ret| (ret, a)).collect(),
                })
            }).collect();
            let ds = decide_batch(&reqs, &counted, &HashMap::new(), 0);
            let mut held = start_active.clone();
            for (r, d) in reqs.iter().zip(&ds) {
                let h = held[r.role as usize];
                let fits = |limit: i64| limit == 0 || h + r.weight <= limit;
                let model = fits(r.limits.max_active) && fits(r.limits.max_retained);
                prop_assert_eq!(*d == Decision::Admit, model, "request {:?} with {} held", r, h);
                if *d == Decision::Admit {
                    held[r.role as usize] += r.weight;
                }
            }
        }

        /// I1 for tenants (0.5.0) and weights (0.7.0), against the same kind of model:
        /// each admission leaves its role within the role's limit and its tenant within
        /// the tenant's, in units, and a refusal happens only where its weight does
        /// not fit one of them.
        #[test]
        fn batch_never_admits_past_a_tenants_or_its_roles_limits(
            reqs in proptest::collection::vec((0u32..2, proptest::option::of(0u128..3), 0i64..4, 0i64..7, 1i64..4), 0..24),
            start_role in proptest::collection::vec(0i64..3, 2),
            start_tenant in proptest::collection::vec(0i64..2, 6),
        ) {
            let reqs: Vec<BatchRequest> = reqs.into_iter().map(|(role, tenant, ta, ra, weight)| {
                BatchRequest {
                    role,
                    tenant,
                    limits: Limits { max_active: ra, tenant_active: ta, ..Limits::default() },
                    retention_secs: 60,
                    exempt: false,
                    weight,
                }
            }).collect();
            let t_index = |role: u32, t: u128| (role as usize) * 3 + t as usize;
            // A role holds at least what its tenants hold.
            let mut role_held: Vec<i64> = (0..2u32)
                .map(|r| start_role[r as usize] + (0..3).map(|t| start_tenant[t_index(r, t)]).sum::<i64>())
                .collect();
            let mut tenant_held = start_tenant.clone();
            let counted: HashMap<u32, Counted> = (0..2u32)
                .map(|r| (r, Counted { active: role_held[r as usize], retained: vec![] }))
                .collect();
            let tenants: HashMap<TenantOf, Counted> = (0..2u32)
                .flat_map(|r| (0..3u128).map(move |t| (r, t)))
                .map(|(r, t)| ((r, t), Counted { active: start_tenant[t_index(r, t)], retained: vec![] }))
                .collect();
            let ds = decide_batch(&reqs, &counted, &tenants, 0);
            for (r, d) in reqs.iter().zip(&ds) {
                let rh = role_held[r.role as usize];
                let th = r.tenant.map_or(0, |t| tenant_held[t_index(r.role, t)]);
                let fits = |held: i64, limit: i64| limit == 0 || held + r.weight <= limit;
                let model = fits(rh, r.limits.max_active)
                    && (r.tenant.is_none() || fits(th, r.limits.tenant_active));
                prop_assert_eq!(*d == Decision::Admit, model, "request {:?}, role {} tenant {}", r, rh, th);
                if *d == Decision::Admit {
                    role_held[r.role as usize] += r.weight;
                    if let Some(t) = r.tenant {
                        tenant_held[t_index(r.role, t)] += r.weight;
                    }
                }
            }
        }
    }
}
