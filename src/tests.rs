//! `#[pg_test]` tests: each runs inside a transaction that is rolled back, so
//! commit, rollback and multi-session behaviour live in tests/pg_regress and
//! tests/isolation instead.
