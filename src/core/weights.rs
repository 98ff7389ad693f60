//! Weighted tickets (0.7.0): the texts of the errors that only weights raise (their
//! variants are in errors.rs; a weight's check is core::ticket::check_weight). A
//! ticket of weight n counts n units against every limit that applies to it (its
//! tenant's and its role's, active and retained, and the database's).

use super::decision::RefusalKind;
use super::refusals::{holder, set_by};

/// What a start that can never fit names (see decision::never_fits).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeverFits {
    pub kind: RefusalKind,
    pub weight: i64,
    pub limit: i64,
    /// Whose limit it is, named as a refusal names it (core::refusals::holder).
    pub role: String,
    pub tenant: Option<String>,
    pub database: String,
    /// Where the limit comes from: the setting, or quota.set_tenant_limits().
    pub tenant_limit_set: bool,
}

impl NeverFits {
    pub fn message(&self) -> String {
        format!(
            "a start of weight {} can never fit the limit of {} {} units {} for {}",
            self.weight,
            self.limit,
            self.what(),
            set_by(self.kind, self.tenant_limit_set),
            holder(
                self.kind,
                &self.role,
                self.tenant.as_deref(),
                &self.database
            )
        )
    }

    /// "active" or "retained", as the limit counts.
    fn what(&self) -> &'static str {
        if self.kind.is_active() {
            "active"
        } else {
            "retained"
        }
    }

    pub fn hint(&self) -> String {
        let raise = match self.kind {
            RefusalKind::TenantActive | RefusalKind::TenantRetained if self.tenant_limit_set => {
                "raise the tenant's own limit with quota.set_tenant_limits()"
            }
            _ => "ask a superuser to raise the limit",
        };
        // A retained limit is a budget per window: the pieces of split work share it.
        let spread = if self.kind.is_active() {
            ","
        } else {
            ", spread over more than quota.retention,"
        };
        format!(
            "Waiting does not help: even with nothing else {}, {} units are more than the limit. Split the work into starts of at most {} units{spread} or {raise}.",
            self.what(),
            self.weight,
            self.limit
        )
    }
}

/// The DETAIL sentence a refusal of a weighted start adds.
pub fn refusal_detail(weight: i64) -> Option<String> {
    (weight > 1).then(|| {
        format!(
            "This start weighs {weight} units; the counts are units, a ticket counting its weight."
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::decision::MAX_WEIGHT;

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
        // Retained limits count units too: checked in decide's order.
        let retained = Limits {
            max_retained: 8,
            tenant_retained: 6,
            ..limits
        };
        assert_eq!(
            never_fits(retained, 5, false),
            Some(RefusalKind::TenantActive)
        );
        let retained = Limits {
            tenant_active: 0,
            ..retained
        };
        assert_eq!(
            never_fits(retained, 7, false),
            Some(RefusalKind::TenantRetained)
        );
        let role_only = Limits {
            tenant_retained: 0,
            ..retained
        };
        assert_eq!(never_fits(role_only, 9, false), Some(RefusalKind::Retained));
        assert_eq!(never_fits(role_only, 8, false), Some(RefusalKind::Database));
    }
}
