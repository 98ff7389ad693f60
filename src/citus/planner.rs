//! A start without a tenant, kept from Citus' function delegation (which would route
//! it on its NULL tenant and crash the server).

use pgrx::pg_sys;

use super::metadata::citus_loaded;

/// The argument position of `tenant` in every start function that has one (0-based):
/// start(label, lease, idempotency_key, wait, tenant, …) and start(weight, lease,
/// label, wait, tenant, …) alike.
const TENANT_ARG: i32 = 4;

/// Keeps a start whose tenant is NULL from Citus' function delegation. Where
/// pg_quota's start functions are distributed by `tenant`, Citus 14 routes
/// `SELECT quota.start(…)` on the value of that argument, and a NULL there (a start
/// without a tenant: the default) crashes the server in its shard lookup. Citus
/// decides on the query as standard_planner leaves it (SQL functions inlined,
/// defaults filled in, parameters substituted, a WHERE true folded away, subqueries
/// pulled up): called at the top level's UPPERREL_FINAL, when the Query has that
/// form, this judges it by Citus' own rules (`delegated_call`), and where the call is
/// a start with a NULL tenant gives the Query a WHERE true again, which Citus never
/// delegates and the planner no longer reads. The start runs where the client is, as
/// a start without a tenant always does.
///
/// # Safety
/// `root` is the planner's, at UPPERREL_FINAL.
pub unsafe fn keep_tenantless_start_local(root: *mut pg_sys::PlannerInfo) {
    if !citus_loaded() {
        return;
    }
    // SAFETY: the caller's.
    unsafe {
        if (*root).query_level != 1 || (*root).parse.is_null() {
            return;
        }
        let q = (*root).parse;
        if delegated_call(q).is_some_and(|call| is_start(call) && tenant_is_null(call)) {
            (*(*q).jointree).quals = pg_sys::lappend(
                std::ptr::null_mut(),
                pg_sys::makeBoolConst(true, false).cast(),
            )
            .cast();
        }
    }
}

/// The call Citus' TryToDelegateFunctionCall would delegate in a planned query: a
/// SELECT with no WHERE, nothing in FROM but one function or an empty result, and a
/// function call alone in the target list or in FROM (not both).
///
/// # Safety
/// `q` is a Query as standard_planner left it.
unsafe fn delegated_call(q: *mut pg_sys::Query) -> Option<*mut pg_sys::FuncExpr> {
    // SAFETY: the caller's; tags are checked before casts.
    unsafe {
        let q = &*q;
        if q.commandType != pg_sys::CmdType::CMD_SELECT
            || q.jointree.is_null()
            || !(*q.jointree).quals.is_null()
        {
            return None;
        }
        let func_of = |e: *mut pg_sys::Node| {
            (!e.is_null() && (*e).type_ == pg_sys::NodeTag::T_FuncExpr)
                .then(|| e.cast::<pg_sys::FuncExpr>())
        };
        let from = pgrx::PgList::<pg_sys::Node>::from_pg((*q.jointree).fromlist);
        let from_call = match from.len() {
            0 => None,
            1 => {
                let r = from.get_ptr(0)?;
                if (*r).type_ != pg_sys::NodeTag::T_RangeTblRef {
                    return None;
                }
                let rtes = pgrx::PgList::<pg_sys::RangeTblEntry>::from_pg(q.rtable);
                let rte = rtes.get_ptr((*r.cast::<pg_sys::RangeTblRef>()).rtindex as usize - 1)?;
                match (*rte).rtekind {
                    pg_sys::RTEKind::RTE_RESULT => None,
                    pg_sys::RTEKind::RTE_FUNCTION => {
                        let fns =
                            pgrx::PgList::<pg_sys::RangeTblFunction>::from_pg((*rte).functions);
                        if fns.len() != 1 {
                            return None;
                        }
                        func_of((*fns.get_ptr(0)?).funcexpr)
                    }
                    _ => return None,
                }
            }
            _ => return None,
        };
        let targets = pgrx::PgList::<pg_sys::TargetEntry>::from_pg(q.targetList);
        let target_call = if targets.len() == 1 {
            func_of((*targets.get_ptr(0)?).expr.cast())
        } else {
            None
        };
        match (target_call, from_call) {
            (Some(_), Some(_)) => None,
            (t, f) => t.or(f),
        }
    }
}

/// Whether `func` calls one of pg_quota's start functions.
///
/// # Safety
/// `func` is a FuncExpr.
unsafe fn is_start(func: *mut pg_sys::FuncExpr) -> bool {
    // SAFETY: the caller's.
    unsafe {
        func_is(
            (*func).funcid,
            &[(c"quota", c"start"), (c"quota", c"try_start")],
        )
    }
}

/// Whether function `funcid` is one of `names` (schema, name); false where it is gone.
pub(super) fn func_is(funcid: pg_sys::Oid, names: &[(&std::ffi::CStr, &std::ffi::CStr)]) -> bool {
    // SAFETY: syscache lookups, NULL where the function or its schema is gone; the
    // names are NUL-terminated and palloc'd in the current context.
    // Each is freed here: the function manager asks this (runs::is_operation) in
    // whatever memory context its caller is in.
    unsafe {
        let name_ptr = pg_sys::get_func_name(funcid);
        if name_ptr.is_null() {
            return false;
        }
        let name = std::ffi::CStr::from_ptr(name_ptr);
        let mut found = false;
        if names.iter().any(|(_, n)| *n == name) {
            let schema_ptr = pg_sys::get_namespace_name(pg_sys::get_func_namespace(funcid));
            if !schema_ptr.is_null() {
                let schema = std::ffi::CStr::from_ptr(schema_ptr);
                found = names.iter().any(|(sc, n)| *n == name && *sc == schema);
                pg_sys::pfree(schema_ptr.cast());
            }
        }
        pg_sys::pfree(name_ptr.cast());
        found
    }
}

/// Whether the planned call's tenant (its arguments positional and complete, as the
/// planner leaves them) is a NULL constant, what Citus would route on and crash.
///
/// # Safety
/// `func` is a planned FuncExpr of a start function.
unsafe fn tenant_is_null(func: *mut pg_sys::FuncExpr) -> bool {
    // SAFETY: the caller's; tags are checked before casts.
    unsafe {
        let args = pgrx::PgList::<pg_sys::Node>::from_pg((*func).args);
        let Some(mut arg) = args.get_ptr(TENANT_ARG as usize) else {
            return false;
        };
        while (*arg).type_ == pg_sys::NodeTag::T_RelabelType {
            arg = (*arg.cast::<pg_sys::RelabelType>())
                .arg
                .cast::<pg_sys::Node>();
        }
        (*arg).type_ == pg_sys::NodeTag::T_Const && (*arg.cast::<pg_sys::Const>()).constisnull
    }
}
