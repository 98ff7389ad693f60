//! Weighted tickets (0.7.0): the check of a start's weight, and the texts of the errors
//! that only weights raise (their variants are in errors.rs). A ticket of weight n
//! counts n units against every active limit that applies to it (its tenant's, its
//! role's, the database's); its retained limits count it once, as every ticket.

use super::decision::{RefusalKind, MAX_WEIGHT};
use super::errors::QuotaError;

/// Checks a start's `weight`: NULL raises 22004, a weight below 1 or above MAX_WEIGHT
/// 22023.
pub fn check_weight(weight: Option<i32>) -> Result<i64, QuotaError> {
    let w = i64::from(weight.ok_or(QuotaError::NullArgument("weight"))?);
    if (1..=MAX_WEIGHT).contains(&w) {
        Ok(w)
    } else {
        Err(QuotaError::InvalidWeight { value: w })
    }
}

/// What a start that can never fit names (see decision::never_fits).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeverFits {
    pub kind: RefusalKind,
    pub weight: i64,
    pub limit: i64,
    /// "role \"app\"", "tenant \"acme\" of role \"app\"" or "database \"jobs\"".
    pub who: String,
    /// Where the limit comes from: the setting, or quota.set_tenant_limits().
    pub tenant_limit_set: bool,
}

impl NeverFits {
    fn source(&self) -> &'static str {
        match self.kind {
            RefusalKind::TenantActive if self.tenant_limit_set => {
                "set for the tenant by quota.set_tenant_limits"
            }
            RefusalKind::TenantActive => "set by quota.max_active_per_tenant",
            RefusalKind::Database => "set by quota.max_active_per_database",
            _ => "set by quota.max_active_per_role",
        }
    }

    pub fn message(&self) -> String {
        format!(
            "a start of weight {} can never fit the limit of {} active units {} for {}",
            self.weight,
            self.limit,
            self.source(),
            self.who
        )
    }

    pub fn hint(&self) -> String {
        let raise = match self.kind {
            RefusalKind::TenantActive if self.tenant_limit_set => {
                "raise the tenant's own limit with quota.set_tenant_limits()"
            }
            _ => "ask a superuser to raise the limit",
        };
        format!(
            "Waiting does not help: even with nothing else active, {} units are more than the limit. Split the work into starts of at most {} units, or {raise}.",
            self.weight, self.limit
        )
    }
}

/// The DETAIL sentence a refusal of a weighted start adds.
pub fn refusal_detail(weight: i64) -> Option<String> {
    (weight > 1).then(|| {
        format!("This start weighs {weight} units; active counts are units, a ticket counting its weight.")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::errors::Sqlstate;

    #[test]
    fn a_weight_is_1_to_a_million() {
        assert_eq!(check_weight(Some(1)), Ok(1));
        assert_eq!(check_weight(Some(1_000_000)), Ok(1_000_000));
        for bad in [0, -1, 1_000_001, i32::MIN, i32::MAX] {
            let e = check_weight(Some(bad)).unwrap_err();
            assert_eq!(e.sqlstate(), Sqlstate::InvalidParameterValue, "{bad}");
            assert_eq!(e.to_string(), format!("invalid weight {bad}"));
        }
        let e = check_weight(None).unwrap_err();
        assert_eq!(e.sqlstate(), Sqlstate::NullValueNotAllowed);
        assert_eq!(e.to_string(), "weight must not be null");
    }

    #[test]
    fn a_start_that_never_fits_says_why_and_what_to_do() {
        let e = QuotaError::WeightNeverFits(NeverFits {
            kind: RefusalKind::TenantActive,
            weight: 8,
            limit: 5,
            who: "tenant \"acme\" of role \"app\"".into(),
            tenant_limit_set: true,
        });
        assert_eq!(e.sqlstate(), Sqlstate::ConfigurationLimitExceeded);
        assert_eq!(
            e.to_string(),
            "a start of weight 8 can never fit the limit of 5 active units set for the tenant by quota.set_tenant_limits for tenant \"acme\" of role \"app\""
        );
        let hint = e.hint().unwrap();
        assert!(hint.starts_with("Waiting does not help"), "{hint}");
        assert!(hint.contains("at most 5 units"), "{hint}");
        assert!(hint.contains("quota.set_tenant_limits()"), "{hint}");
        let role = QuotaError::WeightNeverFits(NeverFits {
            kind: RefusalKind::Database,
            weight: 3,
            limit: 2,
            who: "database \"jobs\"".into(),
            tenant_limit_set: false,
        });
        assert!(role
            .to_string()
            .contains("set by quota.max_active_per_database"));
        assert!(role.hint().unwrap().contains("ask a superuser"));
    }

    #[test]
    fn a_weighted_refusal_counts_units() {
        use crate::core::decision::{decide_weighted, Decision, Limits, Usage};
        let limits = Limits {
            max_active: 10,
            ..Limits::default()
        };
        let usage = Usage {
            active: 8,
            ..Usage::default()
        };
        assert_eq!(decide_weighted(limits, usage, 2, false), Decision::Admit);
        let Decision::Refuse(r) = decide_weighted(limits, usage, 3, false) else {
            panic!("8 + 3 > 10 admitted");
        };
        assert_eq!(
            r.usage.active, 8,
            "the counts as counted, without the start"
        );
        let e = QuotaError::Refused {
            role: "app".into(),
            tenant: None,
            database: "jobs".into(),
            refusal: r,
            next_ageout: None,
            default_retained_for: None,
            tenant_limit_set: false,
        };
        assert_eq!(
            e.to_string(),
            "role \"app\" has 8 active units: a start of weight 3 does not fit the limit of 10 set by quota.max_active_per_role"
        );
        assert!(e.detail().unwrap().ends_with(
            "This start weighs 3 units; active counts are units, a ticket counting its weight."
        ));
        assert_eq!(decide_weighted(limits, usage, 3, true), Decision::Admit);
    }

    #[test]
    fn a_weight_above_a_limit_never_fits() {
        use crate::core::decision::{never_fits, Limits};
        let limits = Limits {
            max_active: 10,
            tenant_active: 4,
            max_db: 6,
            ..Limits::default()
        };
        assert_eq!(never_fits(limits, 4, false), None);
        assert_eq!(
            never_fits(limits, 5, false),
            Some(RefusalKind::TenantActive)
        );
        assert_eq!(never_fits(limits, 5, true), None);
        let no_tenant = Limits {
            tenant_active: 0,
            ..limits
        };
        assert_eq!(never_fits(no_tenant, 7, false), Some(RefusalKind::Database));
        assert_eq!(never_fits(no_tenant, 11, false), Some(RefusalKind::Active));
        assert_eq!(never_fits(Limits::default(), MAX_WEIGHT, false), None);
    }

    #[test]
    fn a_repeat_with_another_weight_is_refused() {
        let e = QuotaError::WeightMismatch {
            ticket: "t".into(),
            held: 3,
            asked: 5,
        };
        assert_eq!(e.sqlstate(), Sqlstate::InvalidParameterValue);
        assert_eq!(
            e.to_string(),
            "idempotency key names ticket t, of weight 3, not 5"
        );
        assert!(e.hint().is_some());
    }
}
