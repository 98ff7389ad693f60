// `#[pg_test]` tests. Each runs inside a transaction that is rolled back at the end,
// so commit, rollback and multi-session behaviour live in tests/pg_regress and
// tests/isolation instead. The ledger writer commits on its own, so tickets started
// here stay in the test database's ledger; each test uses a role of its own.

use pgrx::prelude::*;

fn as_tenant(role: &str, max_active: i32) {
    Spi::run(&format!("CREATE ROLE {role}")).unwrap();
    Spi::run(&format!("SET LOCAL quota.max_active_per_role = {max_active}")).unwrap();
    Spi::run(&format!("SET LOCAL ROLE {role}")).unwrap();
}

fn start() -> Option<pgrx::Uuid> {
    Spi::get_one("SELECT quota.start()").unwrap()
}

#[pg_test]
fn start_returns_a_ticket_that_finish_ends_once() {
    as_tenant("pgt_once", 5);
    let t = start().expect("a ticket");
    let first: Option<bool> = Spi::get_one_with_args("SELECT quota.finish($1)", &[t.into()]).unwrap();
    let second: Option<bool> = Spi::get_one_with_args("SELECT quota.finish($1)", &[t.into()]).unwrap();
    assert_eq!(first, Some(true));
    assert_eq!(second, Some(false), "finish is idempotent: no double release");
}

#[pg_test]
fn i1_try_start_returns_null_at_the_limit() {
    as_tenant("pgt_limit", 2);
    assert!(start().is_some());
    assert!(start().is_some());
    let third: Option<pgrx::Uuid> = Spi::get_one("SELECT quota.try_start()").unwrap();
    assert_eq!(third, None);
}

#[pg_test(error = "role \"pgt_refused\" has 1 active ticket, the limit set by quota.max_active_per_role")]
fn i8_start_refuses_at_the_limit() {
    as_tenant("pgt_refused", 1);
    start();
    start();
}

#[pg_test]
fn i7_superuser_is_never_refused() {
    Spi::run("SET LOCAL quota.max_active_per_role = 1").unwrap();
    for _ in 0..3 {
        assert!(start().is_some());
    }
}

/// I2: finish is transactional, so the slot frees only when the finishing
/// transaction commits; before that the writer still counts the ticket as active.
#[pg_test]
fn i2_uncommitted_finish_does_not_free_the_slot() {
    as_tenant("pgt_frees", 1);
    let t = start().unwrap();
    Spi::get_one_with_args::<bool>("SELECT quota.finish($1, 'failed')", &[t.into()]).unwrap();
    let again: Option<pgrx::Uuid> = Spi::get_one("SELECT quota.try_start()").unwrap();
    assert_eq!(again, None);
}

#[pg_test]
fn label_of_200_characters_is_accepted() {
    let t: Option<pgrx::Uuid> = Spi::get_one("SELECT quota.start(repeat('é', 200))").unwrap();
    assert!(t.is_some());
}

#[pg_test(error = "label is too long")]
fn label_of_201_characters_is_22001() {
    Spi::run("SELECT quota.start(repeat('x', 201))").unwrap();
}

#[pg_test(error = "ticket must not be null")]
fn null_ticket_is_22004() {
    Spi::run("SELECT quota.finish(NULL)").unwrap();
}

#[pg_test(error = "outcome must not be null")]
fn null_outcome_is_22004() {
    Spi::run("SELECT quota.finish(quota.start(), NULL)").unwrap();
}

#[pg_test(error = "invalid outcome \"done\"")]
fn unknown_outcome_is_22023() {
    Spi::run("SELECT quota.finish(quota.start(), 'done')").unwrap();
}

#[pg_test(error = "ticket 00000000-0000-0000-0000-000000000000 does not exist")]
fn unknown_ticket_is_22023() {
    Spi::run("SELECT quota.finish('00000000-0000-0000-0000-000000000000')").unwrap();
}

#[pg_test]
fn ledger_records_role_label_and_outcome() {
    as_tenant("pgt_record", 5);
    let t = Spi::get_one::<pgrx::Uuid>("SELECT quota.start('nightly export')").unwrap().unwrap();
    Spi::get_one_with_args::<bool>("SELECT quota.finish($1, 'cancelled')", &[t.into()]).unwrap();
    Spi::run("RESET ROLE").unwrap();
    let row: (Option<String>, Option<String>, Option<bool>) = Spi::get_three_with_args(
        "SELECT label, outcome, role = 'pgt_record'::regrole::oid FROM quota.ledger WHERE id = $1",
        &[t.into()],
    )
    .unwrap();
    assert_eq!(row, (Some("nightly export".into()), Some("cancelled".into()), Some(true)));
}

/// 0.6.x: ticket ids take their random bits from a batch fetched at once; every draw
/// is fresh, across refills (none repeats, none is the zeroed buffer).
#[pg_test]
fn ticket_ids_draw_fresh_random_bytes() {
    let n = 3 * crate::ledger::write::RANDOM_BATCH + 5;
    let draws: Vec<[u8; 8]> = (0..n).map(|_| crate::ledger::write::random_bytes()).collect();
    let distinct: std::collections::HashSet<_> = draws.iter().collect();
    assert_eq!(distinct.len(), n, "a draw repeated");
    assert!(!draws.contains(&[0u8; 8]), "a draw was the zeroed buffer");
}

/// 0.6.x: a Reader skips its read lock on a relation this transaction holds in
/// RowExclusiveLock; the look into the lock table must see exactly that mode there.
#[pg_test]
fn relation_lock_held_sees_this_transactions_row_exclusive_lock() {
    let oid = |name: &str| -> pg_sys::Oid {
        Spi::get_one(&format!("SELECT '{name}'::regclass::oid")).unwrap().unwrap()
    };
    let (active, history) = (oid("quota.active"), oid("quota.history"));
    let held = |rel| crate::compat::relation_lock_held(rel, pg_sys::RowExclusiveLock);
    assert!(!held(active) && !held(history), "nothing locked yet");
    Spi::run("LOCK TABLE quota.active IN ROW EXCLUSIVE MODE").unwrap();
    Spi::run("LOCK TABLE quota.history IN ACCESS SHARE MODE").unwrap();
    assert!(held(active), "the row exclusive lock on quota.active");
    assert!(!held(history), "an access share lock is not a row exclusive one");
}
