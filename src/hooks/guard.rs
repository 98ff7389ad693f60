//! Layer 5, the paths (part of hooks/): what DDL may do to pg_quota's own tables,
//! quota.active, quota.history and quota.summary (0.6.0; quota.ledger and
//! quota.summary before) (I9).
//!
//! pg_quota writes these tables below SQL (heap.rs), where no trigger fires. Two kinds
//! of DDL would silently break the accounting, so the hooks (mod.rs) route them here:
//!
//! - **A trigger of someone else's.** A row trigger on the ledger sees only the writes
//!   made through SQL, never pg_quota's. A tool that copies a table through such a
//!   trigger (pg_repack: copy, then replay what its trigger logged, then swap) loses
//!   every ticket committed during the copy; an audit or replication trigger misses
//!   them; a foreign key to the ledger (whose checks are triggers) is never checked
//!   when the writer purges. So CREATE TRIGGER on pg_quota's tables is refused, outside
//!   pg_quota's own extension scripts. Each table also carries a disabled trigger that
//!   does nothing, named `repack_trigger`: pg_repack takes a table with a trigger of that
//!   name for the leftover of an interrupted run and skips it, with a warning, before it
//!   copies anything, and goes on with the other tables of a `-d` or `--all` run.
//!   pg_quota's own triggers cannot be dropped or renamed.
//! - **A change to the triggers pg_quota relies on.** After SQL-level writes to the
//!   ledger, the statement triggers ledger_written and ledger_truncated empty the
//!   summary, which also resets every scope counter (scopes.rs: a counter is valid only
//!   for the summary's relfilenode). While a DBA has them disabled, writes go unseen, so
//!   the summary and any counter built before may be stale afterwards. So any
//!   ALTER TABLE that touches the state of one of pg_quota's data triggers empties the
//!   summary in the same transaction: whatever happened while they were off is counted
//!   afresh from the ledger. And because they must fire under
//!   session_replication_role = replica too, a trigger that is enabled but not ENABLE
//!   ALWAYS (ENABLE TRIGGER ALL, as `pg_restore --disable-triggers` runs it, leaves
//!   ENABLE) is set back to ENABLE ALWAYS, with a NOTICE. A disabled one stays
//!   disabled, with a WARNING that says what that costs.

use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::core::QuotaError;
use crate::error::raise;

/// pg_quota's data triggers, by table: the counters and the summary rely on them.
/// quota.ledger is a table before 0.6.0, quota.active and quota.history from 0.6.0;
/// a schema has one or the other. 0.7.0: quota.tenant_overrides' trigger, which tells
/// every session's cache of the tenants' own limits of a change.
const DATA_TRIGGERS: [(&str, &str); 8] = [
    ("ledger", "ledger_written"),
    ("ledger", "ledger_truncated"),
    ("active", "ledger_written"),
    ("active", "ledger_truncated"),
    ("history", "ledger_written"),
    ("history", "ledger_truncated"),
    ("summary", "summary_written"),
    ("tenant_overrides", "tenant_overrides_written"),
];

/// 0.6.0: the trigger that sends a superuser's writes through the view quota.ledger to
/// the table each row belongs in.
const ROUTE: (&str, &str) = ("ledger", "ledger_route");

/// The placeholder that keeps pg_repack off each table (see above).
const PLACEHOLDER: &str = "repack_trigger";

/// Whether `name` is one of the triggers pg_quota creates on `table`.
fn is_own_trigger(table: &str, name: &str) -> bool {
    name == PLACEHOLDER || DATA_TRIGGERS.contains(&(table, name)) || (table, name) == ROUTE
}

/// Whether the running command sets up pg_quota's tables as they are meant to be, so
/// that none of the rules here apply: one of pg_quota's own extension scripts (CREATE
/// EXTENSION pg_quota, ALTER EXTENSION pg_quota UPDATE), or pg_upgrade, whose
/// --binary-upgrade restore creates an extension's objects one by one, its triggers
/// included, outside any script.
fn setting_up() -> bool {
    // SAFETY: plain reads of backend state, and a catalog lookup.
    unsafe {
        pg_sys::IsBinaryUpgrade
            || (pg_sys::creating_extension && {
                let name = pg_sys::get_extension_name(pg_sys::CurrentExtensionObject);
                !name.is_null() && CStr::from_ptr(name) == c"pg_quota"
            })
    }
}

/// Which of pg_quota's tables `relid` is ("ledger", "active", "history", "summary" or,
/// from 0.7.0, "tenant_overrides"),
/// if it is one: a relation of that name in schema `quota` that belongs to extension
/// pg_quota (0.6.0: "ledger" is the view over the two others).
pub fn our_table(relid: pg_sys::Oid) -> Option<&'static str> {
    if relid == pg_sys::InvalidOid {
        return None;
    }
    // SAFETY: syscache and pg_depend lookups; each returns NULL or InvalidOid when the
    // object is missing.
    unsafe {
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        if ns == pg_sys::InvalidOid || pg_sys::get_rel_namespace(relid) != ns {
            return None;
        }
        let name = pg_sys::get_rel_name(relid);
        if name.is_null() {
            return None;
        }
        let table = match CStr::from_ptr(name).to_bytes() {
            b"ledger" => "ledger",
            b"active" => "active",
            b"history" => "history",
            b"summary" => "summary",
            b"tenant_overrides" => "tenant_overrides",
            _ => return None,
        };
        let ext = pg_sys::get_extension_oid(c"pg_quota".as_ptr(), true);
        (ext != pg_sys::InvalidOid
            && pg_sys::getExtensionOfObject(pg_sys::RelationRelationId, relid) == ext)
            .then_some(table)
    }
}

/// The catalog row with OID `oid` in catalog `catalog` (found through its OID index
/// `index`, the OID being column 1), handed to `read`. SnapshotSelf, as sepgsql reads
/// objects in its hooks: in a post-create or post-alter hook the row may have been
/// written by the current command, before any CommandCounterIncrement.
fn catalog_row<T>(
    catalog: pg_sys::Oid,
    index: u32,
    oid: pg_sys::Oid,
    read: impl FnOnce(pg_sys::HeapTuple, pg_sys::TupleDesc) -> T,
) -> Option<T> {
    // SAFETY: an index scan of a catalog by OID; `read` sees the tuple while the scan
    // is open.
    unsafe {
        let rel = pg_sys::table_open(catalog, pg_sys::AccessShareLock as i32);
        let mut key: pg_sys::ScanKeyData = std::mem::zeroed();
        pg_sys::ScanKeyInit(
            &mut key,
            1,
            pg_sys::BTEqualStrategyNumber as u16,
            pg_sys::Oid::from(pg_sys::F_OIDEQ),
            oid.into(),
        );
        let scan = pg_sys::systable_beginscan(
            rel,
            pg_sys::Oid::from(index),
            true,
            std::ptr::addr_of_mut!(pg_sys::SnapshotSelfData),
            1,
            &mut key,
        );
        let tup = pg_sys::systable_getnext(scan);
        let found = (!tup.is_null()).then(|| read(tup, (*rel).rd_att));
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as i32);
        found
    }
}

/// The table and name of trigger `trigoid`.
fn trigger_of(trigoid: pg_sys::Oid) -> Option<(pg_sys::Oid, String)> {
    catalog_row(
        pg_sys::TriggerRelationId,
        pg_sys::TriggerOidIndexId,
        trigoid,
        // SAFETY: a pg_trigger tuple.
        |tup, _| unsafe { table_and_name(tup) },
    )
}

/// The table and name of the trigger in `tup`.
///
/// # Safety
/// `tup` is a pg_trigger tuple, whose fixed part is FormData_pg_trigger.
unsafe fn table_and_name(tup: pg_sys::HeapTuple) -> (pg_sys::Oid, String) {
    // SAFETY: the caller's pg_trigger tuple.
    unsafe {
        let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_trigger>(tup);
        (
            (*form).tgrelid,
            // Not name_data_to_str, which panics on a name that is not UTF-8.
            crate::catalog::name_text((*form).tgname.data.as_ptr()),
        )
    }
}

/// The name of extension `extoid`.
fn extension_name(extoid: pg_sys::Oid) -> Option<String> {
    catalog_row(
        pg_sys::ExtensionRelationId,
        pg_sys::ExtensionOidIndexId,
        extoid,
        // SAFETY: a pg_extension tuple, whose fixed part is FormData_pg_extension.
        |tup, _| unsafe {
            let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_extension>(tup);
            crate::catalog::name_text((*form).extname.data.as_ptr())
        },
    )
}

/// An extension was created (OAT_POST_CREATE): for pg_quota, checks the schema it is
/// about to install into. The hook runs once PostgreSQL has decided to install (so
/// not for CREATE EXTENSION IF NOT EXISTS of an installed one), for CREATE EXTENSION …
/// CASCADE of an extension that requires pg_quota too, and before the script runs.
pub fn extension_created(extoid: pg_sys::Oid) {
    // SAFETY: a plain read of a backend flag.
    if unsafe { pg_sys::IsBinaryUpgrade } {
        return;
    }
    if extension_name(extoid).as_deref() == Some("pg_quota") {
        check_install_schema();
    }
}

// Single-threaded backend state: the lowest subtransaction nesting level at which a
// command of the current transaction changed the state of one of pg_quota's data
// triggers and `after_utility` has not acted on it yet (0: none), and whether
// `after_utility` is acting on it now.
static mut CHANGED_AT: i32 = 0;
static mut FIXING: bool = false;
/// Whether a change noted in CHANGED_AT was to a trigger of the ledger's tables or the
/// summary's, which makes the summary stale (0.7.0: quota.tenant_overrides' trigger
/// does not).
static mut SUMMARY_STALE: bool = false;

/// A trigger was created (object_access_hook, OAT_POST_CREATE): refused on pg_quota's
/// tables, unless by pg_quota's own scripts; a quota.finish_job() trigger anywhere is
/// checked as its firing would check it (0.6.0, job_trigger.rs). Under pg_upgrade
/// (binary upgrade), which recreates the old cluster's triggers, nothing is refused,
/// but a job trigger still gets its dependency on its column: pg_depend is not carried
/// over, and without it the new cluster would let DROP COLUMN through.
pub fn trigger_created(trigoid: pg_sys::Oid) {
    // SAFETY: a plain read of a backend flag.
    let binary_upgrade = unsafe { pg_sys::IsBinaryUpgrade };
    if setting_up() && !binary_upgrade {
        return;
    }
    // One read of the new trigger's row: its table and name, and what a
    // quota.finish_job() trigger needs checked.
    let Some(((rel, name), job)) = catalog_row(
        pg_sys::TriggerRelationId,
        pg_sys::TriggerOidIndexId,
        trigoid,
        // SAFETY: a pg_trigger tuple and pg_trigger's descriptor.
        |tup, desc| unsafe { (table_and_name(tup), job_trigger_of(tup, desc)) },
    ) else {
        return;
    };
    if binary_upgrade && job.is_none() {
        return;
    }
    if let Some(table) = our_table(rel).filter(|_| !binary_upgrade) {
        raise(QuotaError::TriggerRefused {
            table: format!("quota.{table}"),
            trigger: name,
        });
    }
    if let Some(job) = job {
        let args: Vec<&[u8]> = job.args.split(|&b| b == 0).take(job.nargs).collect();
        match crate::job_trigger::check_created(job.func, &name, job.tgtype, rel, &args) {
            // The old cluster had it: carried over as it was, without the dependency.
            Err(_) if binary_upgrade => {}
            Err(e) => raise(e),
            // The trigger depends on the column it reads, as on the columns of its WHEN
            // clause: DROP COLUMN is refused (or, with CASCADE, drops the trigger), and so
            // is ALTER COLUMN ... TYPE, so that a dump restores the trigger and a new
            // partition gets it. CREATE OR REPLACE TRIGGER removed the old version's
            // dependencies before this hook runs.
            Ok(attnum) => {
                let trigger = pg_sys::ObjectAddress {
                    classId: pg_sys::TriggerRelationId,
                    objectId: trigoid,
                    objectSubId: 0,
                };
                let column = pg_sys::ObjectAddress {
                    classId: pg_sys::RelationRelationId,
                    objectId: rel,
                    objectSubId: attnum,
                };
                // SAFETY: a pg_depend row between two objects that exist.
                unsafe {
                    pg_sys::recordDependencyOn(
                        &trigger,
                        &column,
                        pg_sys::DependencyType::DEPENDENCY_NORMAL,
                    )
                };
            }
        }
    }
}

/// What pg_trigger holds of a quota.finish_job() or quota.claim_job() trigger, besides
/// its table and name.
struct JobTriggerRow {
    func: crate::core::JobFn,
    tgtype: i16,
    nargs: usize,
    /// tgargs: the arguments, each followed by a NUL.
    args: Vec<u8>,
}

/// The trigger in `tup` if its function is pg_quota's quota.finish_job() or
/// quota.claim_job().
///
/// # Safety
/// `tup` is a pg_trigger tuple and `desc` pg_trigger's descriptor.
unsafe fn job_trigger_of(tup: pg_sys::HeapTuple, desc: pg_sys::TupleDesc) -> Option<JobTriggerRow> {
    // SAFETY: the caller's pg_trigger tuple; syscache and pg_depend lookups.
    unsafe {
        let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_trigger>(tup);
        let func = (*form).tgfoid;
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        let ext = pg_sys::get_extension_oid(c"pg_quota".as_ptr(), true);
        let fname = pg_sys::get_func_name(func);
        let job_fn = if fname.is_null() {
            None
        } else if CStr::from_ptr(fname) == c"finish_job" {
            Some(crate::core::JobFn::Finish)
        } else if CStr::from_ptr(fname) == c"claim_job" {
            Some(crate::core::JobFn::Claim)
        } else {
            None
        };
        if ns == pg_sys::InvalidOid
            || ext == pg_sys::InvalidOid
            || job_fn.is_none()
            || pg_sys::get_func_namespace(func) != ns
            || pg_sys::getExtensionOfObject(pg_sys::ProcedureRelationId, func) != ext
        {
            return None;
        }
        let mut isnull = false;
        let args = pg_sys::heap_getattr(
            tup,
            pg_sys::Anum_pg_trigger_tgargs as i32,
            desc,
            &mut isnull,
        );
        let args = if isnull {
            Vec::new()
        } else {
            let bytea = pg_sys::pg_detoast_datum_packed(args.cast_mut_ptr());
            pgrx::varlena::varlena_to_byte_slice(bytea).to_vec()
        };
        Some(JobTriggerRow {
            func: job_fn?,
            tgtype: (*form).tgtype,
            nargs: (*form).tgnargs as usize,
            args,
        })
    }
}

/// A trigger was altered (OAT_POST_ALTER: enabled, disabled, or renamed): remembers
/// that one of pg_quota's data triggers changed, for `after_utility`.
pub fn trigger_altered(trigoid: pg_sys::Oid) {
    // SAFETY: single-threaded backend state.
    if setting_up() || unsafe { FIXING } {
        return;
    }
    if let Some((rel, name)) = trigger_of(trigoid) {
        if let Some(table) = our_table(rel) {
            if DATA_TRIGGERS.contains(&(table, name.as_str())) {
                // SAFETY: single-threaded backend state, and a plain read of
                // transaction state.
                unsafe {
                    let level = pg_sys::GetCurrentTransactionNestLevel();
                    if CHANGED_AT == 0 || level < CHANGED_AT {
                        CHANGED_AT = level;
                    }
                    SUMMARY_STALE |= table != "tenant_overrides";
                }
            }
        }
    }
}

/// At the end of a (sub)transaction: a change noted in one that aborts did not happen
/// (a failed ALTER TABLE, a rolled-back savepoint, a caught error). `level` is the
/// nesting level that ends; a top-level abort is level 1.
pub fn at_abort(level: i32) {
    // SAFETY: single-threaded backend state.
    unsafe {
        if CHANGED_AT >= level {
            CHANGED_AT = 0;
            SUMMARY_STALE = false;
        }
        FIXING = false;
    }
}

/// The relation a qualified or unqualified name list (`[schema,] table`) names, if any.
///
/// # Safety
/// `names` is a List of String nodes.
unsafe fn relation_of(names: *mut pg_sys::List) -> pg_sys::Oid {
    // SAFETY: per the contract above.
    unsafe { relid_of(pg_sys::makeRangeVarFromNameList(names)) }
}

/// The relation `rv` names, if any (InvalidOid if none); no lock is taken.
///
/// # Safety
/// `rv` is a RangeVar.
unsafe fn relid_of(rv: *mut pg_sys::RangeVar) -> pg_sys::Oid {
    // SAFETY: per the contract above; missing_ok.
    unsafe {
        pg_sys::RangeVarGetRelidExtended(
            rv,
            pg_sys::NoLock as i32,
            pg_sys::RVROption::RVR_MISSING_OK,
            None,
            std::ptr::null_mut(),
        )
    }
}

/// Refuses DROP TRIGGER and ALTER TRIGGER … RENAME of pg_quota's own triggers, before
/// the command runs. DROP TABLE and DROP EXTENSION drop them along with the table,
/// which is fine. 0.6.0: refuses COPY FROM into the view quota.ledger under
/// session_replication_role = replica (its trigger would not fire).
///
/// # Safety
/// `node` is a parse tree node.
pub unsafe fn before_utility(node: *mut pg_sys::Node) {
    // SAFETY: each cast follows its node tag check.
    unsafe {
        if setting_up() {
            return;
        }
        let mut targets: Vec<(pg_sys::Oid, String, &'static str)> = Vec::new();
        if pgrx::is_a(node, pg_sys::NodeTag::T_CopyStmt) {
            // 0.6.0: COPY FROM into the view quota.ledger goes through its INSTEAD OF
            // trigger, which does not fire under session_replication_role = replica:
            // every row would be dropped, with COPY reporting them all.
            let stmt = node as *mut pg_sys::CopyStmt;
            if (*stmt).is_from
                && !(*stmt).relation.is_null()
                && pg_sys::SessionReplicationRole == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
            {
                let rel = relid_of((*stmt).relation);
                if our_table(rel) == Some("ledger")
                    && pg_sys::get_rel_relkind(rel) == pg_sys::RELKIND_VIEW as std::ffi::c_char
                {
                    raise(QuotaError::LedgerCopyUnderReplica);
                }
            }
            return;
        }
        if pgrx::is_a(node, pg_sys::NodeTag::T_DropStmt) {
            let stmt = node as *mut pg_sys::DropStmt;
            if (*stmt).removeType != pg_sys::ObjectType::OBJECT_TRIGGER || (*stmt).objects.is_null()
            {
                return;
            }
            let objects = (*stmt).objects;
            for i in 0..(*objects).length as usize {
                // [schema,] table, trigger: the trigger's name comes last.
                let names =
                    pg_sys::list_copy((*(*objects).elements.add(i)).ptr_value as *mut pg_sys::List);
                let n = (*names).length as usize;
                if n < 2 {
                    continue;
                }
                let last = (*(*names).elements.add(n - 1)).ptr_value as *mut pg_sys::String;
                let trigger = crate::catalog::name_text((*last).sval);
                let table = pg_sys::list_truncate(names, (n - 1) as i32);
                targets.push((relation_of(table), trigger, "drop"));
            }
        } else if pgrx::is_a(node, pg_sys::NodeTag::T_RenameStmt) {
            let stmt = node as *mut pg_sys::RenameStmt;
            if (*stmt).renameType != pg_sys::ObjectType::OBJECT_TRIGGER
                || (*stmt).relation.is_null()
                || (*stmt).subname.is_null()
            {
                return;
            }
            let rel = relid_of((*stmt).relation);
            let trigger = crate::catalog::name_text((*stmt).subname);
            targets.push((rel, trigger, "rename"));
        }
        for (rel, trigger, action) in targets {
            if let Some(table) = our_table(rel) {
                if is_own_trigger(table, &trigger) {
                    raise(QuotaError::TriggerRequired {
                        table: format!("quota.{table}"),
                        trigger,
                        action,
                    });
                }
            }
        }
    }
}

/// As CREATE EXTENSION pg_quota begins: if the schema "quota" already exists, CREATE
/// EXTENSION would install into it. Its owner could then rename it, put look-alike
/// tables in its place, and so bypass every limit. Install only into a schema that a
/// superuser owns, that only superusers may create objects in, and that holds nothing
/// yet. (0.3.0 and earlier checked this in a DO block of the install script, whose
/// whole text PostgreSQL then printed as the error's CONTEXT.) A schema that this very
/// command created is empty and a superuser's: it passes.
fn check_install_schema() {
    let owner = Spi::get_two::<String, bool>(
        "SELECT pg_catalog.quote_ident(r.rolname)::pg_catalog.text, r.rolsuper
           FROM pg_catalog.pg_namespace n
           JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) n.nspowner
          WHERE n.nspname OPERATOR(pg_catalog.=) 'quota'",
    );
    let Ok((Some(owner), Some(superuser))) = owner else {
        return; // no such schema: CREATE EXTENSION creates it
    };
    if !superuser {
        raise(QuotaError::SchemaNotOurs { owner });
    }
    let creators = Spi::get_one::<String>(
        "SELECT pg_catalog.string_agg(CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                           ELSE pg_catalog.quote_ident(r.rolname)::pg_catalog.text END,
                                      ', ')
           FROM pg_catalog.pg_namespace n,
                LATERAL pg_catalog.aclexplode(n.nspacl) a
                LEFT JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) a.grantee
          WHERE n.nspname OPERATOR(pg_catalog.=) 'quota'
            AND a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
            AND NOT coalesce(r.rolsuper, false)",
    );
    if let Ok(Some(creators)) = creators {
        raise(QuotaError::SchemaOpen { creators });
    }
    let objects = Spi::get_one::<i64>(
        "SELECT (SELECT pg_catalog.count(*) FROM pg_catalog.pg_class c
                  WHERE c.relnamespace OPERATOR(pg_catalog.=) 'quota'::pg_catalog.regnamespace)
              OPERATOR(pg_catalog.+)
                (SELECT pg_catalog.count(*) FROM pg_catalog.pg_proc p
                  WHERE p.pronamespace OPERATOR(pg_catalog.=) 'quota'::pg_catalog.regnamespace)
              OPERATOR(pg_catalog.+)
                (SELECT pg_catalog.count(*) FROM pg_catalog.pg_type t
                  WHERE t.typnamespace OPERATOR(pg_catalog.=) 'quota'::pg_catalog.regnamespace)",
    );
    if objects.ok().flatten().unwrap_or(0) > 0 {
        raise(QuotaError::SchemaNotEmpty);
    }
}

/// After a utility command: if a command changed the state of one of pg_quota's data
/// triggers, empties the summary and sets enabled triggers back to ENABLE ALWAYS, in
/// the command's own transaction (see the top of this file). Guarded by the caller.
pub fn after_utility() {
    // SAFETY: single-threaded backend state, and plain reads of transaction state:
    // nothing is done outside a transaction, or in one that failed (a ROLLBACK TO that
    // psql's ON_ERROR_ROLLBACK sends ends up here too, after the abort forgot the
    // change).
    unsafe {
        if CHANGED_AT == 0
            || FIXING
            || !pg_sys::IsTransactionState()
            || pg_sys::IsAbortedTransactionBlockState()
        {
            return;
        }
        CHANGED_AT = 0;
    }
    // FIXING keeps the ALTER TABLEs below from noting changes of their own, and goes
    // back to false however this ends: an ERROR here unwinds through the guard, and the
    // (sub)transaction's abort would not clear it if an exception block caught it.
    struct Fixing;
    impl Fixing {
        fn start() -> Fixing {
            // SAFETY: single-threaded backend state.
            unsafe { FIXING = true };
            Fixing
        }
    }
    impl Drop for Fixing {
        fn drop(&mut self) {
            // SAFETY: single-threaded backend state.
            unsafe { FIXING = false };
        }
    }
    let _fixing = Fixing::start();
    // SAFETY: makes the command's catalog changes visible to the queries below, as
    // between two statements of a transaction.
    unsafe { pg_sys::CommandCounterIncrement() };
    let mut promoted = Vec::new();
    let mut disabled = Vec::new();
    let mut overrides_disabled = false;
    for (table, trigger) in DATA_TRIGGERS {
        let state = Spi::get_one::<String>(&format!(
            "SELECT t.tgenabled::pg_catalog.text
               FROM pg_catalog.pg_trigger t
              WHERE t.tgrelid OPERATOR(pg_catalog.=) pg_catalog.to_regclass('quota.{table}')
                AND t.tgname OPERATOR(pg_catalog.=) '{trigger}'"
        ));
        match state.ok().flatten().as_deref() {
            Some("A") => {}
            Some("D") if table == "tenant_overrides" => overrides_disabled = true,
            Some("D") => disabled.push(format!("{trigger} on quota.{table}")),
            Some(_) => {
                Spi::run(&format!(
                    "ALTER TABLE quota.{table} ENABLE ALWAYS TRIGGER {trigger}"
                ))
                .unwrap_or_else(|e| pgrx::error!("pg_quota: {e}"));
                promoted.push(format!("{trigger} on quota.{table}"));
            }
            // Missing (dropped before 0.3.1 refused that): nothing to keep.
            None => {}
        }
    }
    // SAFETY: single-threaded backend state.
    if unsafe { std::mem::take(&mut *std::ptr::addr_of_mut!(SUMMARY_STALE)) } {
        Spi::run("TRUNCATE quota.summary").unwrap_or_else(|e| pgrx::error!("pg_quota: {e}"));
    }
    if !promoted.is_empty() {
        let msg = crate::core::errors::triggers_promoted(&promoted);
        pgrx::notice!("{msg}");
    }
    if overrides_disabled {
        let (msg, detail, hint) = crate::core::errors::overrides_trigger_disabled();
        pgrx::pg_sys::panic::ErrorReport::new(PgSqlErrorCode::ERRCODE_WARNING, msg, "pg_quota")
            .set_detail(detail)
            .set_hint(hint)
            .report(PgLogLevel::WARNING);
    }
    if !disabled.is_empty() {
        let (msg, detail, hint) = crate::core::errors::triggers_disabled(&disabled);
        pgrx::pg_sys::panic::ErrorReport::new(PgSqlErrorCode::ERRCODE_WARNING, msg, "pg_quota")
            .set_detail(detail)
            .set_hint(hint)
            .report(PgLogLevel::WARNING);
    }
    // SAFETY: single-threaded backend state: the ALTER TABLEs above noted nothing.
    unsafe { CHANGED_AT = 0 };
}
