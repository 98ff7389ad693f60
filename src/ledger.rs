//! The queries pg_quota runs against its ledger, and the little SPI layer under them.
//!
//! Every query is schema-qualified down to its functions and operators (I5), so that
//! objects a tenant creates on the search_path, `pg_temp` included, change nothing.
//! Callers read with `GetLatestSnapshot()` rather than their transaction snapshot (I3):
//! pgrx's `Spi` helpers would read the transaction snapshot under REPEATABLE READ.

use std::ffi::CStr;

use pgrx::pg_sys;

/// Writer only: records a batch of admitted tickets (ids `$1`, roles `$2`, labels
/// `$3`, all started at `$4`) and adds them to their roles' summary rows, in one
/// statement.
pub const INSERT: &CStr = c"
WITH t AS (
  INSERT INTO quota.ledger (id, role, label, started_at)
  SELECT u.id, u.role, u.label, $4
    FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($2), pg_catalog.unnest($3)) AS u (id, role, label))
INSERT INTO quota.summary AS s (role, tickets)
SELECT u.role, pg_catalog.count(*) FROM pg_catalog.unnest($2) AS u (role) GROUP BY u.role
ON CONFLICT (role) DO UPDATE SET tickets = s.tickets OPERATOR(pg_catalog.+) excluded.tickets";

/// Writer only: drops the role's tickets that ended before the cutoff `$2`.
pub const PURGE: &CStr = c"
WITH d AS (DELETE FROM quota.ledger l
            WHERE l.role OPERATOR(pg_catalog.=) $1 AND l.ended_at OPERATOR(pg_catalog.<) $2
           RETURNING 1)
UPDATE quota.summary s SET tickets = s.tickets OPERATOR(pg_catalog.-) (SELECT pg_catalog.count(*) FROM d)
 WHERE s.role OPERATOR(pg_catalog.=) $1";

/// The owner and state of one ticket.
pub const TICKET: &CStr = c"
SELECT l.role, l.ended_at IS NOT NULL FROM quota.ledger l WHERE l.id OPERATOR(pg_catalog.=) $1";

/// Ends ticket `$1` of role `$4`, unless it has ended already.
pub const FINISH: &CStr = c"
UPDATE quota.ledger l SET ended_at = $2, outcome = $3
 WHERE l.id OPERATOR(pg_catalog.=) $1 AND l.ended_at IS NULL AND l.role OPERATOR(pg_catalog.=) $4";

/// A prepared statement, kept for the life of the backend. Plans are per process,
/// and backends are single-threaded, so a plain static cell is enough. PostgreSQL's
/// plan cache revalidates a kept plan after DDL, such as DROP and CREATE EXTENSION.
pub struct Stmt {
    sql: &'static CStr,
    argtypes: &'static [pg_sys::Oid],
    plan: std::cell::Cell<pg_sys::SPIPlanPtr>,
}

// SAFETY: a PostgreSQL backend runs one thread; pgrx checks it on every FFI call.
unsafe impl Sync for Stmt {}

impl Stmt {
    pub const fn new(sql: &'static CStr, argtypes: &'static [pg_sys::Oid]) -> Stmt {
        Stmt {
            sql,
            argtypes,
            plan: std::cell::Cell::new(std::ptr::null_mut()),
        }
    }

    fn plan(&self) -> pg_sys::SPIPlanPtr {
        if self.plan.get().is_null() {
            // SAFETY: inside SPI_connect (see `connect`); argtypes outlives the call.
            unsafe {
                let plan = pg_sys::SPI_prepare(
                    self.sql.as_ptr(),
                    self.argtypes.len() as i32,
                    self.argtypes.as_ptr() as *mut pg_sys::Oid,
                );
                if plan.is_null() {
                    let code = pg_sys::SPI_result;
                    pgrx::error!("pg_quota: SPI_prepare failed: {code}");
                }
                pg_sys::SPI_keepplan(plan);
                self.plan.set(plan);
            }
        }
        self.plan.get()
    }

    /// Runs the statement with the latest committed snapshot, whatever the isolation
    /// level of the calling transaction. Returns the number of rows processed.
    pub fn run_latest(&self, args: &mut [pg_sys::Datum], nulls: &[bool], read_only: bool) -> u64 {
        let plan = self.plan();
        let nulls = null_flags(nulls);
        // SAFETY: inside SPI_connect; GetLatestSnapshot returns a static snapshot that
        // SPI_execute_snapshot copies when it pushes it. No crosscheck snapshot: the
        // point is to act on rows committed after our transaction snapshot.
        let rc = unsafe {
            pg_sys::SPI_execute_snapshot(
                plan,
                args.as_mut_ptr(),
                nulls.as_ptr(),
                pg_sys::GetLatestSnapshot(),
                std::ptr::null_mut(),
                read_only,
                false,
                0,
            )
        };
        check(rc);
        // SAFETY: set by the execution above.
        unsafe { pg_sys::SPI_processed }
    }

    /// Runs the statement the ordinary way: in the writer, a READ COMMITTED
    /// transaction that takes a fresh snapshot per statement and sees its own rows.
    pub fn run(&self, args: &mut [pg_sys::Datum], nulls: &[bool]) -> u64 {
        let plan = self.plan();
        let nulls = null_flags(nulls);
        // SAFETY: inside SPI_connect; arrays match the plan's argument count.
        let rc = unsafe { pg_sys::SPI_execute_plan(plan, args.as_mut_ptr(), nulls.as_ptr(), false, 0) };
        check(rc);
        // SAFETY: set by the execution above.
        unsafe { pg_sys::SPI_processed }
    }
}

fn null_flags(nulls: &[bool]) -> Vec<std::ffi::c_char> {
    nulls.iter().map(|&n| if n { b'n' as _ } else { b' ' as _ }).collect()
}

fn check(rc: i32) {
    if rc < 0 {
        pgrx::error!("pg_quota: SPI execution failed with code {rc}");
    }
}

/// Column `col` (1-based) of row `row` of the last result, or None if NULL.
pub fn value(row: usize, col: i32) -> Option<pg_sys::Datum> {
    // SAFETY: called after a successful SELECT inside SPI; row < SPI_processed.
    unsafe {
        let tt = pg_sys::SPI_tuptable;
        assert!(!tt.is_null() && (row as u64) < pg_sys::SPI_processed);
        let mut isnull = false;
        let d = pg_sys::SPI_getbinval(*(*tt).vals.add(row), (*tt).tupdesc, col, &mut isnull);
        (!isnull).then_some(d)
    }
}

/// Runs `f` between SPI_connect and SPI_finish.
pub fn connect<R>(f: impl FnOnce() -> R) -> R {
    struct Finish;
    impl Drop for Finish {
        fn drop(&mut self) {
            // SAFETY: matches the SPI_connect below. During an unwind after an ERROR,
            // SPI_finish may fail; abort cleans SPI up in that case, so ignore it.
            if !std::thread::panicking() {
                unsafe { pg_sys::SPI_finish() };
            }
        }
    }
    // SAFETY: plain SPI entry; errors raise.
    unsafe { pg_sys::SPI_connect() };
    let _finish = Finish;
    f()
}

/// Runs `f` as `owner`, the owner of the ledger, the way PostgreSQL runs maintenance
/// as a table owner: a local user id change plus a security-restricted operation.
/// `current_user` at the call site has already been read by then; it is restored on
/// return, on unwind, and by transaction abort in any case.
pub fn as_owner<R>(owner: pg_sys::Oid, f: impl FnOnce() -> R) -> R {
    struct Restore(pg_sys::Oid, i32);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: restores the values saved below.
            unsafe { pg_sys::SetUserIdAndSecContext(self.0, self.1) };
        }
    }
    let mut uid = pg_sys::InvalidOid;
    let mut ctx = 0;
    // SAFETY: plain getters and setters of backend-local state.
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut uid, &mut ctx);
        pg_sys::SetUserIdAndSecContext(
            owner,
            ctx | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32 | pg_sys::SECURITY_RESTRICTED_OPERATION as i32,
        );
    }
    let _restore = Restore(uid, ctx);
    f()
}

/// The owner of `quota.ledger`, who holds the only privileges on it.
pub fn owner() -> pg_sys::Oid {
    // SAFETY: syscache and relcache lookups; missing objects raise ERROR.
    unsafe {
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), false);
        let relid = pg_sys::get_relname_relid(c"ledger".as_ptr(), ns);
        if relid == pg_sys::InvalidOid {
            pgrx::ereport!(
                ERROR,
                pgrx::PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
                "relation \"quota.ledger\" does not exist",
                "Reinstall the extension with DROP EXTENSION pg_quota and CREATE EXTENSION pg_quota."
            );
        }
        let rel = pg_sys::relation_open(relid, pg_sys::AccessShareLock as i32);
        let owner = (*(*rel).rd_rel).relowner;
        pg_sys::relation_close(rel, pg_sys::NoLock as i32);
        owner
    }
}
