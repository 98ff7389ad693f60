//! The one SQL statement pg_quota runs, the writer's purge of expired tickets, and the
//! little SPI layer under it. Everything else reads and writes the tables directly:
//! see counts.rs and heap.rs.
//!
//! Every query is schema-qualified down to its functions and operators (I5), so that
//! objects on the search_path, `pg_temp` included, change nothing.

use std::ffi::CStr;

use pgrx::pg_sys;

/// Writer only: drops the role's tickets that ended before the cutoff `$2`.
pub const PURGE: &CStr = c"
WITH d AS (DELETE FROM quota.ledger l
            WHERE l.role OPERATOR(pg_catalog.=) $1 AND l.ended_at OPERATOR(pg_catalog.<) $2
           RETURNING 1)
UPDATE quota.summary s SET tickets = s.tickets OPERATOR(pg_catalog.-) (SELECT pg_catalog.count(*) FROM d)
 WHERE s.role OPERATOR(pg_catalog.=) $1";

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

    /// Runs the statement the ordinary way: in the writer, a READ COMMITTED
    /// transaction that takes a fresh snapshot per statement and sees its own rows.
    pub fn run(&self, args: &mut [pg_sys::Datum], nulls: &[bool]) -> u64 {
        let plan = self.plan();
        let nulls = null_flags(nulls);
        // SAFETY: inside SPI_connect; arrays match the plan's argument count.
        let rc =
            unsafe { pg_sys::SPI_execute_plan(plan, args.as_mut_ptr(), nulls.as_ptr(), false, 0) };
        check(rc);
        // SAFETY: set by the execution above.
        unsafe { pg_sys::SPI_processed }
    }
}

fn null_flags(nulls: &[bool]) -> Vec<std::ffi::c_char> {
    nulls
        .iter()
        .map(|&n| if n { b'n' as _ } else { b' ' as _ })
        .collect()
}

fn check(rc: i32) {
    if rc < 0 {
        pgrx::error!("pg_quota: SPI execution failed with code {rc}");
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
