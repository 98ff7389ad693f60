//! Layer 5, the paths: hooks into PostgreSQL's DDL, so that DBA operations keep working
//! while pg_quota is in use (I9). guard.rs holds what DDL may do to pg_quota's own
//! tables. And, on a Citus node (0.7.1, citus/planner.rs), a planner hook that keeps a start
//! without a tenant from Citus' delegation, an executor hook that checks Citus'
//! shard moves off the node and splits, and a function-manager hook that sees those
//! operations run on the node that holds the shard itself (a coordinator with shards).
//!
//! - A ledger writer is a session connected to its database. It must leave before
//!   commands that need the database to themselves: DROP DATABASE, CREATE DATABASE
//!   … TEMPLATE, ALTER DATABASE … RENAME TO and … SET TABLESPACE. Those wait only five
//!   seconds for other sessions (CountOtherDBBackends), and an idle writer stays
//!   longer than that. A writer also leaves on DROP EXTENSION pg_quota.
//! - DROP ROLE: once the dropping transaction commits, every writer purges the
//!   dropped role's tickets, so they count for nobody else (a role created later with
//!   the same OID, or whatever role has that OID after a restore elsewhere), and its
//!   quota.stats rows go into their databases' totals. DROP DATABASE removes the
//!   database's quota.stats and quota.writer_stats rows when it commits.

mod guard;

use std::sync::atomic::Ordering;

use pgrx::pg_sys;
use pgrx::prelude::*;

static mut PREV_OBJECT_ACCESS_HOOK: pg_sys::object_access_hook_type = None;
static mut PREV_PROCESS_UTILITY_HOOK: pg_sys::ProcessUtility_hook_type = None;
static mut PREV_EXECUTOR_END_HOOK: pg_sys::ExecutorEnd_hook_type = None;
static mut PREV_CREATE_UPPER_PATHS_HOOK: pg_sys::create_upper_paths_hook_type = None;
static mut PREV_NEEDS_FMGR_HOOK: pg_sys::needs_fmgr_hook_type = None;
static mut PREV_FMGR_HOOK: pg_sys::fmgr_hook_type = None;
// Single-threaded backend state: the roles this transaction dropped, with the
// subtransaction nesting level that dropped them, and the databases it dropped.
static mut DROPPED_ROLES: Vec<(pg_sys::Oid, i32)> = Vec::new();
static mut DROPPED_DATABASES: Vec<pg_sys::Oid> = Vec::new();
static mut XACT_CALLBACK_REGISTERED: bool = false;

pub fn init() {
    // SAFETY: _PG_init runs once in the postmaster before any hook can fire.
    unsafe {
        PREV_OBJECT_ACCESS_HOOK = pg_sys::object_access_hook;
        pg_sys::object_access_hook = Some(object_access);
        PREV_PROCESS_UTILITY_HOOK = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(process_utility);
        PREV_EXECUTOR_END_HOOK = pg_sys::ExecutorEnd_hook;
        pg_sys::ExecutorEnd_hook = Some(executor_end);
        PREV_CREATE_UPPER_PATHS_HOOK = pg_sys::create_upper_paths_hook;
        pg_sys::create_upper_paths_hook = Some(create_upper_paths);
        PREV_NEEDS_FMGR_HOOK = pg_sys::needs_fmgr_hook;
        pg_sys::needs_fmgr_hook = Some(needs_fmgr);
        PREV_FMGR_HOOK = pg_sys::fmgr_hook;
        pg_sys::fmgr_hook = Some(fmgr);
    }
}

/// Whether the function manager must tell `fmgr` of calls of `fn_oid`: Citus' shard
/// moves and splits (citus/runs.rs), where Citus is loaded, and what an earlier hook
/// asks for. Asked at each lookup of a function that is not built in; answered from
/// a memo per backend.
#[pg_guard]
unsafe extern "C-unwind" fn needs_fmgr(fn_oid: pg_sys::Oid) -> bool {
    // SAFETY: an earlier hook's own contract; then a memo and syscache lookups.
    unsafe {
        if let Some(prev) = PREV_NEEDS_FMGR_HOOK {
            if prev(fn_oid) {
                return true;
            }
        }
    }
    crate::citus::is_operation(fn_oid)
}

/// Once a call of Citus' shard move or split has returned on this node (the
/// coordinator, which may hold shards itself, and whose metadata Citus changes
/// without a command the executor hook below could see), in its statement: pg_quota
/// checks what the operation took from this node (citus/runs.rs), after an earlier
/// hook's FHET_END, so that its START and END pair whatever pg_quota raises. The
/// calls of other functions an earlier hook asked for are only passed on.
#[pg_guard]
unsafe extern "C-unwind" fn fmgr(
    event: pg_sys::FmgrHookEventType::Type,
    flinfo: *mut pg_sys::FmgrInfo,
    private: *mut pg_sys::Datum,
) {
    // SAFETY: we pass the call on unchanged, then read the FmgrInfo's OID. FHET_ABORT
    // comes inside PostgreSQL's error handling, and is only passed on.
    unsafe {
        if let Some(prev) = PREV_FMGR_HOOK {
            prev(event, flinfo, private);
        }
        if event == pg_sys::FmgrHookEventType::FHET_END
            && crate::citus::is_operation((*flinfo).fn_oid)
        {
            crate::error::boundary(crate::citus::operation_ended);
        }
    }
}

/// While PostgreSQL plans a query, once its final form is known (the top level's
/// UPPERREL_FINAL): a start whose tenant is NULL in that form is kept from Citus'
/// function delegation, which would crash on it and which decides on that same form
/// after standard_planner returns (citus/planner.rs). Every other query is left as it is.
#[pg_guard]
unsafe extern "C-unwind" fn create_upper_paths(
    root: *mut pg_sys::PlannerInfo,
    stage: pg_sys::UpperRelationKind::Type,
    input_rel: *mut pg_sys::RelOptInfo,
    output_rel: *mut pg_sys::RelOptInfo,
    extra: *mut std::ffi::c_void,
) {
    // SAFETY: we pass the call on unchanged; the planner's root is ours to read, and
    // its Query's jointree quals are no longer read by the planner at this stage.
    unsafe {
        if let Some(prev) = PREV_CREATE_UPPER_PATHS_HOOK {
            prev(root, stage, input_rel, output_rel, extra);
        }
        if stage == pg_sys::UpperRelationKind::UPPERREL_FINAL {
            crate::citus::keep_tenantless_start_local(root);
        }
    }
}

/// Citus moves a shard by sending every node with metadata, in the move's
/// transaction, `SELECT citus_internal.update_placement_metadata(shard, source,
/// target)`. On the node the shard leaves, pg_quota refuses it, once it has run (so
/// Citus' own checks let its user change Citus' metadata), where a tenant of the shard
/// holds tickets or its own limits here, which the move would leave behind
/// (citus/moves.rs; USER_GUIDE "Citus"), so that the move fails whole. A split sends
/// `SELECT citus_internal.delete_shard_metadata(shard)` likewise: once it has run,
/// pg_quota takes its lock on the shard and checks, as the split's transaction commits
/// here, that no tenant holding tickets or its own limits here was placed on another
/// node (citus/splits.rs). Each is acted on only when its one row came back: a call
/// that was only planned, prepared, declared in a cursor not fetched, or filtered
/// away did nothing, and takes no lock. Every other statement is told apart by its
/// plan's shape alone.
///
/// At ExecutorEnd, before the executor's own end, rather than after ExecutorFinish:
/// a hook that wraps PostgreSQL's ExecutorFinish would carry every error of the
/// statement's AFTER triggers across pgrx's guard, which drops their CONTEXT lines.
/// Nothing of the statement's own runs in ExecutorEnd.
#[pg_guard]
unsafe extern "C-unwind" fn executor_end(query_desc: *mut pg_sys::QueryDesc) {
    // SAFETY: we only read the plan, the executor's row count and catalogs, then pass
    // the call on unchanged. An ERROR of ours ends the transaction; the portal's
    // cleanup has let go of the QueryDesc, and the abort frees the executor's state.
    unsafe {
        let estate = (*query_desc).estate;
        if !estate.is_null() && (*estate).es_processed > 0 {
            let stmt = (*query_desc).plannedstmt;
            if let Some((shard, source, _target)) = crate::citus::placement_update(stmt) {
                crate::error::boundary(|| crate::citus::shard_leaving(shard, source));
            } else if let Some(shard) = crate::citus::shard_deletion(stmt) {
                crate::error::boundary(|| crate::citus::shard_splitting(shard));
            }
        }
        match PREV_EXECUTOR_END_HOOK {
            Some(prev) => prev(query_desc),
            None => pg_sys::standard_ExecutorEnd(query_desc),
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn object_access(
    access: pg_sys::ObjectAccessType::Type,
    class_id: pg_sys::Oid,
    object_id: pg_sys::Oid,
    sub_id: i32,
    arg: *mut std::ffi::c_void,
) {
    // SAFETY: we pass the call on unchanged, then only read catalogs.
    unsafe {
        if let Some(prev) = PREV_OBJECT_ACCESS_HOOK {
            prev(access, class_id, object_id, sub_id, arg);
        }
        if class_id == pg_sys::TriggerRelationId {
            // CREATE TRIGGER on pg_quota's tables is refused; a change to its own
            // triggers' state is acted on after the command (see guard.rs). Inside
            // error::boundary, so that the refusal names the trigger in the server
            // encoding.
            crate::error::boundary(|| {
                if access == pg_sys::ObjectAccessType::OAT_POST_CREATE {
                    guard::trigger_created(object_id);
                } else if access == pg_sys::ObjectAccessType::OAT_POST_ALTER {
                    ensure_callbacks();
                    guard::trigger_altered(object_id);
                }
                Ok(())
            });
            return;
        }
        if access == pg_sys::ObjectAccessType::OAT_POST_CREATE
            && class_id == pg_sys::ExtensionRelationId
        {
            // Its refusals name roles: in the server encoding (error.rs).
            crate::error::boundary(|| {
                guard::extension_created(object_id);
                Ok(())
            });
            return;
        }
        if access == pg_sys::ObjectAccessType::OAT_POST_ALTER
            && class_id == pg_sys::ExtensionRelationId
        {
            // ALTER EXTENSION pg_quota ADD/DROP/UPDATE changes which relations belong to
            // pg_quota without touching the relations, so no relcache invalidation
            // would tell backends (and writers) to look them up again. Send one at
            // commit; it is as rare as ALTER EXTENSION.
            let name = pg_sys::get_extension_name(object_id);
            if !name.is_null() && std::ffi::CStr::from_ptr(name) == c"pg_quota" {
                pg_sys::CacheInvalidateRelcacheAll();
            }
            return;
        }
        if access != pg_sys::ObjectAccessType::OAT_DROP {
            return;
        }
        // dropdb() runs this hook before it terminates (WITH (FORCE)) and counts the
        // sessions still connected. The writer must be gone by then, not merely asked
        // to leave: FORCE terminates sessions with the dropping user's rights, and a
        // database owner who is not a superuser has none over a background worker.
        if class_id == pg_sys::DatabaseRelationId {
            crate::workers::stop(object_id);
            crate::scopes::forget(object_id, None);
            note_dropped(None, Some(object_id));
        } else if class_id == pg_sys::ExtensionRelationId {
            let name = pg_sys::get_extension_name(object_id);
            if !name.is_null() && std::ffi::CStr::from_ptr(name) == c"pg_quota" {
                crate::workers::request_exit(crate::shmem::my_db(), true);
                crate::scopes::forget(crate::shmem::my_db(), None);
            }
        } else if class_id == pg_sys::AuthIdRelationId {
            note_dropped(Some(object_id), None);
        }
    }
}

/// Remembers that this transaction dropped a role or a database; the writers and
/// quota.stats hear of it when the transaction commits, not before: until then the
/// role still exists for them.
fn note_dropped(role: Option<pg_sys::Oid>, db: Option<pg_sys::Oid>) {
    ensure_callbacks();
    // SAFETY: single-threaded backend state.
    unsafe {
        let level = pg_sys::GetCurrentTransactionNestLevel();
        if let Some(r) = role {
            (*std::ptr::addr_of_mut!(DROPPED_ROLES)).push((r, level));
        }
        if let Some(d) = db {
            (*std::ptr::addr_of_mut!(DROPPED_DATABASES)).push(d);
        }
    }
}

/// Registers this module's transaction callbacks, once per backend.
fn ensure_callbacks() {
    // SAFETY: single-threaded backend state; the callbacks are registered once.
    unsafe {
        if !XACT_CALLBACK_REGISTERED {
            pg_sys::RegisterXactCallback(Some(xact_event), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(subxact_event), std::ptr::null_mut());
            XACT_CALLBACK_REGISTERED = true;
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn xact_event(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    if event == pg_sys::XactEvent::XACT_EVENT_ABORT {
        guard::at_abort(1);
    }
    // SAFETY: single-threaded backend state; the shared counter is atomic.
    unsafe {
        let roles = &mut *std::ptr::addr_of_mut!(DROPPED_ROLES);
        let dbs = &mut *std::ptr::addr_of_mut!(DROPPED_DATABASES);
        if roles.is_empty() && dbs.is_empty() {
            return;
        }
        match event {
            // PREPARE too: COMMIT PREPARED may run in another session, and a purge
            // that finds the role still there does nothing.
            pg_sys::XactEvent::XACT_EVENT_COMMIT | pg_sys::XactEvent::XACT_EVENT_PREPARE => {
                if crate::shmem::available() {
                    if !roles.is_empty() {
                        crate::workers::roles_dropped().fetch_add(1, Ordering::AcqRel);
                        crate::workers::wake_all();
                    }
                    // quota.stats: a dropped role's counts go to its databases' totals
                    // (a later role with its OID starts from nothing); a dropped
                    // database's go altogether. Not for a prepared transaction, which
                    // may still roll back.
                    if event == pg_sys::XactEvent::XACT_EVENT_COMMIT {
                        for &(role, _) in roles.iter() {
                            crate::stats::reset(Some(role));
                        }
                        for &db in dbs.iter() {
                            crate::stats::forget_database(db);
                        }
                    }
                }
                roles.clear();
                dbs.clear();
            }
            pg_sys::XactEvent::XACT_EVENT_ABORT => {
                roles.clear();
                dbs.clear();
            }
            _ => {}
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn subxact_event(
    event: pg_sys::SubXactEvent::Type,
    _my_subid: pg_sys::SubTransactionId,
    _parent_subid: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    if event == pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB {
        // SAFETY: a plain read of transaction state.
        guard::at_abort(unsafe { pg_sys::GetCurrentTransactionNestLevel() });
    }
    // SAFETY: single-threaded backend state.
    unsafe {
        // A DROP ROLE in a rolled-back savepoint did not happen.
        crate::xact::at_subxact_end(&mut *std::ptr::addr_of_mut!(DROPPED_ROLES), event);
    }
}

/// The database a utility command needs to have to itself, if any, and only if the
/// current user may run the command on it: otherwise PostgreSQL refuses the command
/// anyway, and any role could make any database's writer leave over and over.
///
/// # Safety
/// `node` is a parse tree node.
unsafe fn database_needed_alone(node: *mut pg_sys::Node) -> Option<pg_sys::Oid> {
    // SAFETY: each cast follows the node tag check; catalog lookups only.
    unsafe {
        let (name, clone): (*const std::ffi::c_char, bool) =
            if pgrx::is_a(node, pg_sys::NodeTag::T_CreatedbStmt) {
                let stmt = node as *mut pg_sys::CreatedbStmt;
                // TEMPLATE DEFAULT has no argument: template1, as createdb() reads it.
                let name = match option(&(*stmt).options, c"template") {
                    Some(d) if !(*d).arg.is_null() => pg_sys::defGetString(d),
                    _ => c"template1".as_ptr(),
                };
                (name, true)
            } else if pgrx::is_a(node, pg_sys::NodeTag::T_RenameStmt) {
                let stmt = node as *mut pg_sys::RenameStmt;
                if (*stmt).renameType != pg_sys::ObjectType::OBJECT_DATABASE {
                    return None;
                }
                ((*stmt).subname, false)
            } else if pgrx::is_a(node, pg_sys::NodeTag::T_AlterDatabaseStmt) {
                let stmt = node as *mut pg_sys::AlterDatabaseStmt;
                option(&(*stmt).options, c"tablespace")?;
                ((*stmt).dbname, false)
            } else {
                return None;
            };
        if name.is_null() {
            return None;
        }
        let db = pg_sys::get_database_oid(name, true);
        if db == pg_sys::InvalidOid {
            return None;
        }
        let owner = crate::compat::database_ownercheck(db);
        // The checks createdb(), RenameDatabase() and movedb() make first.
        let allowed = if clone {
            pg_sys::have_createdb_privilege() && (owner || is_template(db))
        } else {
            owner
        };
        allowed.then_some(db)
    }
}

/// Whether database `db` is marked as a template (`datistemplate`).
fn is_template(db: pg_sys::Oid) -> bool {
    // SAFETY: a syscache lookup; the tuple is released before we return, and its
    // fixed-size part is FormData_pg_database.
    unsafe {
        let tup =
            pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::DATABASEOID as i32, db.into());
        if tup.is_null() {
            return false;
        }
        let data = (*tup).t_data;
        let form =
            (data as *const u8).add((*data).t_hoff as usize) as *const pg_sys::FormData_pg_database;
        let t = (*form).datistemplate;
        pg_sys::ReleaseSysCache(tup);
        t
    }
}

/// The DefElem named `name` in a statement's option list.
///
/// # Safety
/// `options` is NIL or a List of DefElem.
unsafe fn option(
    options: &*mut pg_sys::List,
    name: &std::ffi::CStr,
) -> Option<*mut pg_sys::DefElem> {
    // SAFETY: per the contract above.
    unsafe {
        let list = *options;
        if list.is_null() {
            return None;
        }
        (0..(*list).length as usize)
            .map(|i| (*(*list).elements.add(i)).ptr_value as *mut pg_sys::DefElem)
            .find(|&d| std::ffi::CStr::from_ptr((*d).defname) == name)
    }
}

/// Asks the writer to leave if the command needs its database to itself. Guarded: an
/// ERROR in here becomes an ordinary PostgreSQL error.
#[pg_guard]
unsafe extern "C-unwind" fn before_utility(pstmt: *mut pg_sys::PlannedStmt) {
    // SAFETY: we only read the parse tree.
    unsafe {
        let node = (*pstmt).utilityStmt;
        if let Some(db) = database_needed_alone(node) {
            crate::workers::request_exit(db, false);
        }
        // Its refusals name triggers and roles in the server encoding (error.rs).
        crate::error::boundary(|| {
            guard::before_utility(node);
            Ok(())
        });
    }
}

/// After a utility command that succeeded: see guard::after_utility. Guarded, as
/// `before_utility`.
#[pg_guard]
unsafe extern "C-unwind" fn after_utility() {
    guard::after_utility();
}

unsafe extern "C-unwind" {
    /// Declared here without pgrx's FFI guard, unlike pg_sys::standard_ProcessUtility:
    /// see `process_utility`.
    #[link_name = "standard_ProcessUtility"]
    fn standard_process_utility(
        pstmt: *mut pg_sys::PlannedStmt,
        query_string: *const std::ffi::c_char,
        read_only_tree: bool,
        context: pg_sys::ProcessUtilityContext::Type,
        params: pg_sys::ParamListInfo,
        query_env: *mut pg_sys::QueryEnvironment,
        dest: *mut pg_sys::DestReceiver,
        qc: *mut pg_sys::QueryCompletion,
    );
}

/// The ProcessUtility hook. It is deliberately not a `#[pg_guard]` function and calls
/// the next hook through an unguarded declaration: pgrx would catch every ERROR of
/// every utility command and raise it again without its cursor position and error
/// fields. An ERROR from the command longjmps straight through this frame instead,
/// which is sound because the frame holds nothing that needs dropping (a "plain old
/// frame" in the C-unwind ABI). The Rust work happens in the guarded `before_utility`.
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn process_utility(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    query_env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: the arguments are passed on unchanged; see above for the ERROR path.
    unsafe {
        before_utility(pstmt);
        match PREV_PROCESS_UTILITY_HOOK {
            Some(prev) => prev(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
            None => standard_process_utility(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
        }
        after_utility();
    }
}
