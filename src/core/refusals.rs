//! The primary message of a refusal at a limit (I8), and the counts its DETAIL gives:
//! errors.rs words the rest of each error around them. A weighted start's refusal
//! (0.7.0) says its weight.

use super::decision::{Refusal, RefusalKind};

/// Whose limit one of `kind` is: the role's, its tenant's, or the database's.
pub(super) fn holder(
    kind: RefusalKind,
    role: &str,
    tenant: Option<&str>,
    database: &str,
) -> String {
    match kind {
        RefusalKind::Database => format!("database \"{database}\""),
        RefusalKind::TenantActive | RefusalKind::TenantRetained => format!(
            "tenant \"{}\" of role \"{role}\"",
            tenant.unwrap_or_default()
        ),
        _ => format!("role \"{role}\""),
    }
}

/// Where a limit of `kind` comes from: "set by" its setting, or (0.7.0) "set for the
/// tenant by quota.set_tenant_limits" where the tenant has its own.
pub(super) fn set_by(kind: RefusalKind, tenant_limit_set: bool) -> String {
    if tenant_limit_set && kind.is_tenant() {
        return "set for the tenant by quota.set_tenant_limits".to_string();
    }
    let guc = match kind {
        RefusalKind::Active => "quota.max_active_per_role",
        RefusalKind::Retained => "quota.max_retained_per_role",
        RefusalKind::Database => "quota.max_active_per_database",
        RefusalKind::TenantActive => "quota.max_active_per_tenant",
        RefusalKind::TenantRetained => "quota.max_retained_per_tenant",
    };
    format!("set by {guc}")
}

fn tickets(n: i64) -> &'static str {
    if n == 1 {
        "ticket"
    } else {
        "tickets"
    }
}

pub(super) fn refusal_message(
    role: &str,
    tenant: Option<&str>,
    database: &str,
    r: &Refusal,
    tenant_limit_set: bool,
) -> String {
    let n = match r.kind {
        RefusalKind::Active => r.usage.active,
        RefusalKind::Retained => r.usage.retained,
        RefusalKind::Database => r.usage.db_active,
        RefusalKind::TenantActive => r.usage.tenant_active,
        RefusalKind::TenantRetained => r.usage.tenant_retained,
    };
    let what = if r.kind.is_active() {
        "active"
    } else {
        "retained"
    };
    let limit = r.limits.of(r.kind);
    let set_by = set_by(r.kind, tenant_limit_set);
    let who = holder(r.kind, role, tenant, database);
    // 0.7.0: a weighted start refused at a limit, which may be below it.
    if r.weight > 1 {
        let ahead = match r.usage.ahead {
            0 => String::new(),
            1 => " and 1 earlier start waiting for capacity".to_string(),
            a => format!(" and {a} earlier starts waiting for capacity"),
        };
        return format!(
            "{who} has {n} {what} units{ahead}: a start of weight {} does not fit the limit of {limit} {set_by}",
            r.weight
        );
    }
    // A scope can hold more than a session's limit: sessions of one role may run with
    // different limits, and a superuser may have written tickets by hand. Below the
    // limit, the refusal is the doing of earlier starts still waiting in line, which
    // take the next free slots; they are not tickets, so they are named apart.
    let tail = if n > limit {
        format!("more than the limit of {limit} {set_by}")
    } else if n == limit || r.usage.ahead == 0 {
        format!("the limit {set_by}")
    } else {
        let a = r.usage.ahead;
        format!(
            "and {a} earlier {} waiting for capacity, which fill the limit of {limit} {set_by}",
            if a == 1 { "start" } else { "starts" }
        )
    };
    let sep = if n < limit && r.usage.ahead > 0 {
        " "
    } else {
        ", "
    };
    format!("{who} has {n} {what} {}{sep}{tail}", tickets(n))
}

/// "3 of 5", "3 of unlimited", or, for a count above its limit, "3, over the limit of 2".
pub(super) fn count_of(n: i64, limit: i64) -> String {
    if limit > 0 && n > limit {
        format!("{n}, over the limit of {limit}")
    } else {
        format!("{n} of {}", limit_text(limit))
    }
}

fn limit_text(limit: i64) -> String {
    if limit == 0 {
        "unlimited".to_string()
    } else {
        limit.to_string()
    }
}
