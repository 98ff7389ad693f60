//! Which value of a `quota.*` setting applies to a charge: the policy of the role that
//! is charged, not of the session's login (0.5.0).
//!
//! PostgreSQL applies `ALTER ROLE … SET` values once, at login, for the session's user:
//! after `SET ROLE b` (as pooled workers, PostgREST and Supabase do per request) the
//! session still runs with the login role's values. pg_quota resolves each setting for
//! the charged role instead, in PostgreSQL's own order of precedence:
//!
//! 1. a value set in the session (`SET`, `SET LOCAL`, a function's `SET` clause, the
//!    connection's options): a superuser's, or a delegated role's, explicit choice for
//!    this session, which wins for every role the session charges;
//! 2. `ALTER ROLE b IN DATABASE d SET`;
//! 3. `ALTER ROLE b SET`;
//! 4. `ALTER DATABASE d SET` (and `ALTER ROLE ALL IN DATABASE d SET`);
//! 5. `ALTER ROLE ALL SET`;
//! 6. the server's value: postgresql.conf, `ALTER SYSTEM`, the command line, or the
//!    default.
//!
//! The catalog is read for every charge (through a cache that any invalidation empties),
//! so an `ALTER ROLE … SET` applies to the next `start()`, also in sessions that were
//! open before it.

/// The values one setting has in each layer that can apply to a charge.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layers<T: Copy> {
    /// Set in the session (PGC_S_CLIENT and above).
    pub session: Option<T>,
    /// pg_db_role_setting (database, role).
    pub database_role: Option<T>,
    /// pg_db_role_setting (0, role).
    pub role: Option<T>,
    /// pg_db_role_setting (database, 0).
    pub database: Option<T>,
    /// pg_db_role_setting (0, 0).
    pub all_roles: Option<T>,
    /// The server's value.
    pub server: T,
}

impl<T: Copy> Layers<T> {
    /// The value that applies: the first layer that has one, in the order above.
    pub fn resolve(&self) -> T {
        self.configured().unwrap_or(self.server)
    }

    /// The value of the first layer above the server's that has one.
    pub fn configured(&self) -> Option<T> {
        self.session
            .or(self.database_role)
            .or(self.role)
            .or(self.database)
            .or(self.all_roles)
    }
}

/// The value of `name` in one `setconfig` entry of pg_db_role_setting (`name=value`),
/// if the entry is for that setting. GUC names compare case-insensitively, and
/// PostgreSQL stores them as they were written in `ALTER ROLE … SET`.
pub fn entry_value<'a>(entry: &'a [u8], name: &str) -> Option<&'a [u8]> {
    let eq = entry.iter().position(|&b| b == b'=')?;
    entry[..eq]
        .eq_ignore_ascii_case(name.as_bytes())
        .then(|| &entry[eq + 1..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(
        session: Option<i64>,
        database_role: Option<i64>,
        role: Option<i64>,
        database: Option<i64>,
        all_roles: Option<i64>,
    ) -> Layers<i64> {
        Layers {
            session,
            database_role,
            role,
            database,
            all_roles,
            server: 100,
        }
    }

    #[test]
    fn postgresql_order_of_precedence() {
        assert_eq!(layers(None, None, None, None, None).resolve(), 100);
        assert_eq!(layers(None, None, None, None, Some(5)).resolve(), 5);
        assert_eq!(layers(None, None, None, Some(4), Some(5)).resolve(), 4);
        assert_eq!(layers(None, None, Some(3), Some(4), Some(5)).resolve(), 3);
        assert_eq!(
            layers(None, Some(2), Some(3), Some(4), Some(5)).resolve(),
            2
        );
        assert_eq!(
            layers(Some(1), Some(2), Some(3), Some(4), Some(5)).resolve(),
            1
        );
    }

    #[test]
    fn a_session_value_wins_for_every_role() {
        assert_eq!(layers(Some(0), Some(2), None, None, None).resolve(), 0);
    }

    #[test]
    fn entries_match_their_setting_only() {
        let e = b"quota.max_active_per_role=7";
        assert_eq!(entry_value(e, "quota.max_active_per_role"), Some(&b"7"[..]));
        assert_eq!(
            entry_value(b"QUOTA.Max_Active_Per_Role=7", "quota.max_active_per_role"),
            Some(&b"7"[..])
        );
        assert_eq!(entry_value(e, "quota.max_active_per_tenant"), None);
        assert_eq!(
            entry_value(
                b"quota.max_active_per_role_x=7",
                "quota.max_active_per_role"
            ),
            None
        );
        assert_eq!(entry_value(b"no equals sign", "no equals sign"), None);
    }
}
