//! Unit tests of errors.rs: each message, DETAIL, HINT and SQLSTATE as the contract
//! words them.
use super::*;
use crate::core::decision::{Limits, Usage};

fn refusal(kind: RefusalKind) -> Refusal {
    Refusal {
        kind,
        usage: Usage {
            active: 3,
            retained: 7,
            db_active: 9,
            ..Usage::default()
        },
        limits: Limits {
            max_active: 3,
            max_retained: 0,
            max_db: 9,
            ..Limits::default()
        },
        weight: 1,
    }
}

/// A refusal of `role` in database "app", of no tenant, with no age-out time and a
/// retained limit that something set.
fn refused(role: &str, refusal: Refusal) -> QuotaError {
    QuotaError::Refused {
        role: role.into(),
        tenant: None,
        database: "app".into(),
        refusal,
        next_ageout: None,
        age_out: crate::core::lease::AgeOut::Oldest,
        default_retained_for: None,
        tenant_limit_set: false,
    }
}

#[test]
fn refusal_names_role_count_and_guc() {
    let e = refused("alice", refusal(RefusalKind::Active));
    assert_eq!(e.sqlstate().code(), "53400");
    let msg = e.to_string();
    assert!(msg.contains("\"alice\""), "{msg}");
    assert!(msg.contains("3 active"), "{msg}");
    assert!(msg.contains("quota.max_active_per_role"), "{msg}");
    assert_eq!(
        e.detail().unwrap(),
        "Active tickets: 3 of 3. Retained tickets: 7 of unlimited."
    );
    assert!(e.hint().unwrap().contains("quota.finish()"));
}

#[test]
fn refusal_of_one_ticket_is_singular() {
    let mut r = refusal(RefusalKind::Active);
    r.usage.active = 1;
    let e = refused("carol", r);
    assert!(e.to_string().contains("has 1 active ticket,"), "{e}");
}

#[test]
fn retained_refusal_hint_says_when_capacity_returns() {
    let e = QuotaError::Refused {
        role: "bob".into(),
        tenant: None,
        database: "app".into(),
        refusal: refusal(RefusalKind::Retained),
        next_ageout: Some("2026-12-01 10:00:00+00".into()),
        age_out: crate::core::lease::AgeOut::Oldest,
        default_retained_for: None,
        tenant_limit_set: false,
    };
    assert!(e.to_string().contains("quota.max_retained_per_role"));
    assert!(e.hint().unwrap().contains("2026-12-01 10:00:00+00"));
}

#[test]
fn database_cap_refusal_names_database_count_and_guc() {
    let e = refused("dave", refusal(RefusalKind::Database));
    assert_eq!(e.sqlstate().code(), "53400");
    assert_eq!(
        e.to_string(),
        "database \"app\" has 9 active tickets, the limit set by quota.max_active_per_database"
    );
    assert_eq!(
        e.detail().unwrap(),
        "Active tickets in the database, all roles together: 9 of 9. Active tickets of this role: 3."
    );
    assert!(e.hint().unwrap().contains("quota.max_active_per_database"));
}

#[test]
fn refusal_counting_waiters_says_so() {
    let mut r = refusal(RefusalKind::Active);
    r.usage.active = 2;
    r.usage.ahead = 1;
    let e = refused("erin", r);
    assert_eq!(
        e.to_string(),
        "role \"erin\" has 2 active tickets and 1 earlier start waiting for capacity, which fill the limit of 3 set by quota.max_active_per_role"
    );
    // The counts are tickets only: "2 of 3", not the tickets plus the line ("3 of 3"),
    // which a reader would take for tickets.
    assert_eq!(
        e.detail().unwrap(),
        "Active tickets: 2 of 3. Retained tickets: 7 of unlimited. 1 earlier start() is still waiting for capacity and goes first."
    );
    r.usage.ahead = 2;
    let e = refused("erin", r);
    assert!(e
        .detail()
        .unwrap()
        .ends_with("2 earlier starts are still waiting for capacity and go first."));
}

/// A session with a lower limit than the one that admitted the tickets (sessions
/// of one role may differ, SET ROLE keeps the login role's settings) sees more
/// tickets than its limit: the texts say so rather than "2 of 1".
#[test]
fn refusal_over_the_limit_reads_true() {
    let mut r = refusal(RefusalKind::Active);
    r.usage.active = 5;
    let e = refused("frank", r);
    assert_eq!(
        e.to_string(),
        "role \"frank\" has 5 active tickets, more than the limit of 3 set by quota.max_active_per_role"
    );
    assert_eq!(
        e.detail().unwrap(),
        "Active tickets: 5, over the limit of 3. Retained tickets: 7 of unlimited."
    );
}

#[test]
fn trigger_texts_name_the_triggers() {
    let one = vec!["ledger_written on quota.ledger".to_string()];
    assert_eq!(
        triggers_promoted(&one),
        "pg_quota set trigger ledger_written on quota.ledger back to ENABLE ALWAYS, so that it fires whatever session_replication_role says"
    );
    let two = vec![
        one[0].clone(),
        "ledger_truncated on quota.ledger".to_string(),
    ];
    assert!(triggers_promoted(&two)
        .starts_with("pg_quota set triggers ledger_written on quota.ledger, ledger_truncated"));
    let (msg, detail, hint) = triggers_disabled(&two);
    assert_eq!(
        msg,
        "pg_quota's triggers ledger_written on quota.ledger, ledger_truncated on quota.ledger are disabled"
    );
    assert!(detail.ends_with('.') && hint.ends_with('.'));
    let e = QuotaError::TriggerRequired {
        table: "quota.ledger".into(),
        trigger: "ledger_written".into(),
        action: "drop",
    };
    assert_eq!(e.sqlstate().code(), "2BP01");
    assert_eq!(
        e.to_string(),
        "cannot drop trigger \"ledger_written\" on table \"quota.ledger\" because extension pg_quota requires it"
    );
    let e = QuotaError::TriggerRefused {
        table: "quota.ledger".into(),
        trigger: "repack_trigger".into(),
    };
    assert_eq!(e.sqlstate().code(), "0A000");
    assert!(e.hint().unwrap().contains("Reclaiming space"));
}

#[test]
fn messages_are_lowercase_postgres_style() {
    let all = [
        QuotaError::KeyHeldUncommitted,
        QuotaError::LabelTooLong {
            chars: 201,
            max: 200,
        },
        QuotaError::KeyTooLong {
            chars: 201,
            max: 200,
        },
        QuotaError::InvalidInterval {
            what: "lease",
            value: "-1 days".into(),
        },
        QuotaError::TicketEnded {
            ticket: "x".into(),
            expired: true,
        },
        QuotaError::NeedsUpdate {
            feature: "quota.max_active_per_database",
            needs: "0.2.0",
        },
        QuotaError::NullArgument("ticket"),
        QuotaError::InvalidOutcome("done".into()),
        QuotaError::UnknownTicket("x".into()),
        QuotaError::ForeignTicket {
            ticket: "x".into(),
            action: "finish",
        },
        QuotaError::NotPreloaded,
        QuotaError::NoWorkerSlot { waited_ms: 10_000 },
        QuotaError::WriterGone,
        QuotaError::CommitUnconfirmed,
        QuotaError::WriterDidNotStart { db: "app".into() },
        QuotaError::LockTimeout {
            relation: "quota.ledger".into(),
            seconds: 5,
        },
        QuotaError::ExtensionLockTimeout { seconds: 5 },
        QuotaError::NotExtensionMember {
            relation: "quota.ledger".into(),
        },
        QuotaError::BadShape {
            relation: "quota.ledger".into(),
            why: "Column 2 is text".into(),
        },
        QuotaError::UnsupportedIndex {
            table: "quota.ledger".into(),
            index: "u".into(),
            what: "a unique index",
        },
        QuotaError::TriggerRefused {
            table: "quota.ledger".into(),
            trigger: "t".into(),
        },
        QuotaError::TriggerRequired {
            table: "quota.ledger".into(),
            trigger: "t".into(),
            action: "rename",
        },
        QuotaError::SchemaNotOurs {
            owner: "mallory".into(),
        },
        QuotaError::SchemaOpen {
            creators: "PUBLIC".into(),
        },
        QuotaError::SchemaNotEmpty,
    ];
    for e in all {
        let m = e.to_string();
        let first = m.chars().next().unwrap();
        assert!(!first.is_uppercase(), "{m}");
        assert!(!m.ends_with('.'), "{m}");
        if let Some(h) = e.hint() {
            assert!(h.ends_with('.'), "{h}");
        }
    }
}

#[test]
fn a_default_retained_limit_says_so_and_how_to_turn_it_off() {
    let refused = |default_retained_for: Option<String>, next: Option<&str>| {
        QuotaError::Refused {
            role: "tn".into(),
            tenant: None,
            database: "app".into(),
            refusal: Refusal {
                kind: RefusalKind::Retained,
                usage: Usage {
                    active: 16,
                    retained: 10_000,
                    ..Usage::default()
                },
                limits: Limits {
                    max_active: 0,
                    max_retained: 10_000,
                    ..Limits::default()
                },
                weight: 1,
            },
            next_ageout: next.map(str::to_string),
            age_out: crate::core::lease::AgeOut::Oldest,
            default_retained_for,
            tenant_limit_set: false,
        }
        .hint()
        .unwrap()
    };
    let hint = refused(Some("tn".into()), Some("2026-12-11 10:00:00+00"));
    assert!(
        hint.starts_with("Capacity returns at 2026-12-11 10:00:00+00"),
        "{hint}"
    );
    assert!(
        hint.contains("quota.max_retained_per_role is at its default of 10000"),
        "{hint}"
    );
    assert!(
        hint.contains("ALTER ROLE tn SET quota.max_retained_per_role = 0"),
        "{hint}"
    );
    let hint = refused(Some("\"Tn\"".into()), None);
    assert!(
        hint.starts_with("Every retained ticket is still active"),
        "{hint}"
    );
    assert!(hint.contains("ALTER ROLE \"Tn\" SET"), "{hint}");
    // A limit someone set: the hint of 0.5.x.
    let hint = refused(None, None);
    assert!(!hint.contains("default"), "{hint}");
    assert!(hint.contains("raise quota.max_retained_per_role"), "{hint}");
}

#[test]
fn sqlstates_match_the_contract() {
    assert_eq!(
        QuotaError::LabelTooLong {
            chars: 300,
            max: 200
        }
        .sqlstate()
        .code(),
        "22001"
    );
    assert_eq!(
        QuotaError::NullArgument("ticket").sqlstate().code(),
        "22004"
    );
    assert_eq!(
        QuotaError::UnknownTicket("x".into()).sqlstate().code(),
        "22023"
    );
    assert_eq!(
        QuotaError::InvalidOutcome("x".into()).sqlstate().code(),
        "22023"
    );
    let foreign = QuotaError::ForeignTicket {
        ticket: "x".into(),
        action: "finish",
    };
    assert_eq!(foreign.sqlstate().code(), "42501");
    assert_eq!(
        QuotaError::LockTimeout {
            relation: "quota.ledger".into(),
            seconds: 5
        }
        .sqlstate()
        .code(),
        "55P03"
    );
    let ext = QuotaError::ExtensionLockTimeout { seconds: 5 };
    assert_eq!(ext.sqlstate().code(), "55P03");
    assert_eq!(
        ext.to_string(),
        "could not obtain lock on extension \"pg_quota\""
    );
    assert!(ext.detail().unwrap().contains("DROP EXTENSION pg_quota"));
    let held = QuotaError::KeyHeldUncommitted;
    assert_eq!(held.sqlstate().code(), "55000");
    assert!(held.hint().unwrap().contains("transactional => true"));
}

/// MAKE_SQLSTATE of PostgreSQL's errcodes.h: six bits a character, first in the
/// lowest bits.
fn packed(code: &str) -> i32 {
    code.bytes()
        .enumerate()
        .map(|(i, c)| (i32::from(c - b'0') & 0x3F) << (6 * i))
        .sum()
}

#[test]
fn a_relayed_writer_error_keeps_its_sqlstate() {
    for code in ["23514", "0A000", "55P03", "XX000", "40001"] {
        let e = QuotaError::WriterFailed {
            code: packed(code),
            message: "new row violates check constraint \"c\"".into(),
        };
        assert_eq!(e.sqlstate().code(), code);
        assert!(e
            .to_string()
            .starts_with("pg_quota ledger writer failed: new row"));
        assert_eq!(
            e.hint().as_deref(),
            Some("No charge was recorded for this call.")
        );
    }
}

/// Holding a ticket's uuid must not reveal which role owns it (item 9 of 0.1.1).
#[test]
fn foreign_ticket_refusal_does_not_name_the_owner() {
    let e = QuotaError::ForeignTicket {
        ticket: "0192".into(),
        action: "renew",
    };
    assert_eq!(e.to_string(), "permission denied to renew ticket 0192");
    let all = format!("{e} {:?} {:?}", e.detail(), e.hint());
    assert_eq!(e.detail().unwrap(), "The ticket belongs to another role.");
    assert!(!all.contains("role \""), "{all}");
}

#[test]
fn ledger_copy_under_replica_is_refused_with_a_way_out() {
    let e = QuotaError::LedgerCopyUnderReplica;
    assert_eq!(e.sqlstate().code(), "55000");
    assert_eq!(
        e.to_string(),
        "cannot copy into the view quota.ledger while session_replication_role is replica"
    );
    let hint = e.hint().expect("a hint");
    assert!(hint.contains("--disable-triggers"), "{hint}");
    assert!(
        hint.contains("quota.active") && hint.contains("quota.history"),
        "{hint}"
    );
}

#[test]
fn a_refusal_at_a_tenants_own_limit_names_set_tenant_limits() {
    let at = |kind: RefusalKind, set: bool, next: Option<&str>| QuotaError::Refused {
        role: "app".into(),
        tenant: Some("acme".into()),
        database: "app".into(),
        refusal: Refusal {
            kind,
            usage: Usage {
                active: 2,
                tenant_active: 2,
                tenant_retained: 5,
                ..Usage::default()
            },
            limits: Limits {
                tenant_active: 2,
                tenant_retained: 5,
                ..Limits::default()
            },
            weight: 1,
        },
        next_ageout: next.map(str::to_string),
        age_out: crate::core::lease::AgeOut::Oldest,
        default_retained_for: None,
        tenant_limit_set: set,
    };
    let e = at(RefusalKind::TenantActive, true, None);
    assert_eq!(e.sqlstate().code(), "53400");
    assert_eq!(
        e.to_string(),
        "tenant \"acme\" of role \"app\" has 2 active tickets, the limit set for the tenant by quota.set_tenant_limits"
    );
    assert!(
        e.hint().unwrap().contains("quota.set_tenant_limits()"),
        "{e:?}"
    );
    let e = at(
        RefusalKind::TenantRetained,
        true,
        Some("2026-12-07 10:00:00+00"),
    );
    assert!(
        e.to_string()
            .ends_with("the limit set for the tenant by quota.set_tenant_limits"),
        "{e}"
    );
    let h = e.hint().unwrap();
    assert!(
        h.contains("2026-12-07 10:00:00+00") && h.contains("quota.set_tenant_limits()"),
        "{h}"
    );
    assert!(at(RefusalKind::TenantRetained, true, None)
        .hint()
        .unwrap()
        .contains("quota.set_tenant_limits()"));
    // The role's setting where nothing set the tenant's own.
    let e = at(RefusalKind::TenantActive, false, None);
    assert!(
        e.to_string()
            .ends_with("the limit set by quota.max_active_per_tenant"),
        "{e}"
    );
    assert!(!e.hint().unwrap().contains("set_tenant_limits"));
    // A tenant's own limit never renames the role's limits.
    let mut r = at(RefusalKind::Active, true, None);
    if let QuotaError::Refused { refusal, .. } = &mut r {
        refusal.limits.max_active = 2;
    }
    assert!(r.to_string().contains("quota.max_active_per_role"), "{r}");
}

#[test]
fn set_tenant_limits_errors_have_their_sqlstates() {
    let e = QuotaError::InvalidLimit {
        what: "max_active",
        value: -1,
    };
    assert_eq!(e.sqlstate().code(), "22023");
    assert_eq!(e.to_string(), "invalid max_active -1");
    assert!(e.hint().is_some());
    assert_eq!(QuotaError::UnknownRole(4242).sqlstate().code(), "42704");
    assert_eq!(
        QuotaError::UnknownRole(4242).to_string(),
        "role with OID 4242 does not exist"
    );
    let e = QuotaError::ForeignTenantLimits {
        role: "billing".into(),
    };
    assert_eq!(e.sqlstate().code(), "42501");
    assert_eq!(
        e.to_string(),
        "permission denied to set the limits of tenants of role \"billing\""
    );
    assert!(e.hint().unwrap().contains("member"));
    let e = QuotaError::TenantLimitsBusy { seconds: 5 };
    assert_eq!(e.sqlstate().code(), "55P03");
    assert!(e.detail().unwrap().contains("still open"));
}

#[test]
fn the_tenant_limits_table_has_its_own_trigger_texts() {
    let refused = QuotaError::TriggerRefused {
        table: "quota.tenant_overrides".into(),
        trigger: "audit".into(),
    };
    assert!(refused.detail().unwrap().contains("set_tenant_limits()"));
    assert!(!refused.detail().unwrap().contains("below SQL"));
    assert!(refused.hint().unwrap().contains("quota.tenant_limits"));
    let drop = QuotaError::TriggerRequired {
        table: "quota.tenant_overrides".into(),
        trigger: "tenant_overrides_written".into(),
        action: "drop",
    };
    assert_eq!(drop.sqlstate().code(), "2BP01");
    assert!(!drop.hint().unwrap().contains("counts from the ledger"));
    let ledger = QuotaError::TriggerRefused {
        table: "quota.active".into(),
        trigger: "audit".into(),
    };
    assert!(ledger.detail().unwrap().contains("below SQL"));
}

#[test]
fn a_start_that_never_fits_says_why_and_what_to_do() {
    let e = QuotaError::WeightNeverFits(crate::core::weights::NeverFits {
        kind: RefusalKind::TenantActive,
        weight: 8,
        limit: 5,
        role: "app".into(),
        tenant: Some("acme".into()),
        database: "jobs".into(),
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
    let role = QuotaError::WeightNeverFits(crate::core::weights::NeverFits {
        kind: RefusalKind::Database,
        weight: 3,
        limit: 2,
        role: "app".into(),
        tenant: None,
        database: "jobs".into(),
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
        age_out: crate::core::lease::AgeOut::Oldest,
        default_retained_for: None,
        tenant_limit_set: false,
    };
    assert_eq!(
        e.to_string(),
        "role \"app\" has 8 active units: a start of weight 3 does not fit the limit of 10 set by quota.max_active_per_role"
    );
    assert!(e.detail().unwrap().ends_with(
        "This start weighs 3 units; the counts are units, a ticket counting its weight."
    ));
    assert_eq!(decide_weighted(limits, usage, 3, true), Decision::Admit);
}

#[test]
fn a_weighted_start_is_refused_at_a_retained_limit_by_units() {
    use crate::core::decision::{decide_weighted, Decision, RefusalKind};
    let limits = Limits {
        max_retained: 10,
        tenant_retained: 6,
        ..Limits::default()
    };
    let usage = Usage {
        retained: 7,
        tenant_retained: 3,
        ..Usage::default()
    };
    assert_eq!(decide_weighted(limits, usage, 3, false), Decision::Admit);
    let Decision::Refuse(r) = decide_weighted(limits, usage, 4, false) else {
        panic!("3 + 4 > 6 admitted");
    };
    assert_eq!(r.kind, RefusalKind::TenantRetained);
    let role_only = Limits {
        tenant_retained: 0,
        ..limits
    };
    let Decision::Refuse(r) = decide_weighted(role_only, usage, 4, false) else {
        panic!("7 + 4 > 10 admitted");
    };
    let e = QuotaError::Refused {
        role: "app".into(),
        tenant: None,
        database: "jobs".into(),
        refusal: r,
        next_ageout: None,
        age_out: crate::core::lease::AgeOut::Oldest,
        default_retained_for: None,
        tenant_limit_set: false,
    };
    assert_eq!(
        e.to_string(),
        "role \"app\" has 7 retained units: a start of weight 4 does not fit the limit of 10 set by quota.max_retained_per_role"
    );
    let never = crate::core::weights::NeverFits {
        kind: RefusalKind::Retained,
        weight: 12,
        limit: 10,
        role: "app".into(),
        tenant: None,
        database: "jobs".into(),
        tenant_limit_set: false,
    };
    assert_eq!(
        never.message(),
        "a start of weight 12 can never fit the limit of 10 retained units set by quota.max_retained_per_role for role \"app\""
    );
    assert_eq!(
        never.hint(),
        "Waiting does not help: even with nothing else retained, 12 units are more than the limit. Split the work into starts of at most 10 units, spread over more than quota.retention, or ask a superuser to raise the limit."
    );
}

#[test]
fn a_weighted_retained_refusal_says_when_enough_units_age_out() {
    use crate::core::decision::{Refusal, RefusalKind};
    use crate::core::lease::AgeOut;
    let refused = |kind, weight, how, next: Option<&str>| QuotaError::Refused {
        role: "app".into(),
        tenant: Some("acme".into()),
        database: "jobs".into(),
        refusal: Refusal {
            kind,
            usage: Usage::default(),
            limits: Limits {
                max_retained: 10,
                tenant_retained: 10,
                ..Limits::default()
            },
            weight,
        },
        next_ageout: next.map(str::to_string),
        age_out: how,
        default_retained_for: None,
        tenant_limit_set: false,
    };
    let hint = |kind, weight, how, next| refused(kind, weight, how, next).hint().unwrap();
    // Weight 1 at its limit: as before 0.7.0.
    assert_eq!(
        hint(RefusalKind::Retained, 1, AgeOut::Oldest, Some("T")),
        "Capacity returns at T, when the oldest retained ticket ages out; a superuser can raise quota.max_retained_per_role or shorten quota.retention."
    );
    assert_eq!(
        hint(RefusalKind::TenantRetained, 1, AgeOut::NoneEnded, None),
        "Every retained ticket of the tenant is still active: tickets age out quota.retention after they finish. A superuser can raise quota.max_retained_per_tenant for its role."
    );
    // Weight 1 where several must age out (a limit lowered below the count).
    assert_eq!(
        hint(RefusalKind::Retained, 1, AgeOut::Enough, Some("T")),
        "Capacity for this start returns at T, when enough of the retained units have aged out; a superuser can raise quota.max_retained_per_role or shorten quota.retention."
    );
    // A heavier start needs enough units to age out, which may never happen alone.
    assert_eq!(
        hint(RefusalKind::Retained, 5, AgeOut::Oldest, Some("T")),
        "Capacity for a start of weight 5 returns at T, when enough of the retained units have aged out; a superuser can raise quota.max_retained_per_role or shorten quota.retention."
    );
    assert_eq!(
        hint(RefusalKind::TenantRetained, 5, AgeOut::TooFew, None),
        "Aging out frees too few of the tenant's retained units for a start of weight 5: more tickets of the tenant must finish first, and tickets age out quota.retention after they finish. A superuser can raise quota.max_retained_per_tenant for its role."
    );
    assert_eq!(
        hint(RefusalKind::Retained, 1, AgeOut::TooFew, None),
        "Aging out frees too few of the retained units for this start: more tickets must finish first, and tickets age out quota.retention after they finish. A superuser can raise quota.max_retained_per_role."
    );
    assert_eq!(
        hint(RefusalKind::Retained, 2, AgeOut::Beyond, None),
        "Capacity for a start of weight 2 returns as more than 10000 of the retained tickets age out, quota.retention after they end. A superuser can raise quota.max_retained_per_role."
    );
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
