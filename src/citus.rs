//! Layer 4, beside scopes/ (whose lock tags it uses): what this node's Citus metadata says of a tenant (0.7.1), for
//! core::citus::admit_here; what a shard move would leave behind on this node; and a
//! start without a tenant kept from Citus' delegation. Nothing is read where Citus
//! is not loaded in this server; where it is not installed in the database, a start
//! for a tenant costs one catalog probe more. Otherwise what was read is remembered
//! per backend until Citus invalidates it: a start reads Citus' metadata only the
//! first time its backend meets the tenant (its shard, through fmgr) or the shard
//! (its nodes, a kept plan).

use pgrx::pg_sys;

use crate::catalog::{name_text, AsRole};
use crate::core::citus::{Declared, Placed, Placement, Remembered};
use crate::core::QuotaError;
use crate::ledger::scan::text_datum;

/// The colocation of pg_quota's start functions: the table Citus places them with
/// (the first of their colocation group) and its owner, how many colocation groups
/// they are in, and whether each is distributed by its tenant argument. Only
/// start() and try_start() count: set_tenant_limits() follows (USER_GUIDE "Citus").
const DECLARED: &std::ffi::CStr = c"
SELECT r.logicalrelid::pg_catalog.oid, k.relowner, c.groups, c.by_tenant,
       pg_catalog.to_regprocedure('pg_catalog.get_shard_id_for_distribution_column(pg_catalog.regclass,pg_catalog.\"any\")')::pg_catalog.oid
  FROM (SELECT pg_catalog.min(o.colocationid) AS colocationid,
               pg_catalog.count(DISTINCT o.colocationid) AS groups,
               pg_catalog.bool_and(o.distribution_argument_index = 4) AS by_tenant
          FROM pg_catalog.pg_dist_object o
          JOIN pg_catalog.pg_proc f ON f.oid = o.objid
         WHERE o.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
           AND o.colocationid IS NOT NULL AND o.colocationid <> 0
           AND f.pronamespace = $1 AND f.proname IN ('start', 'try_start')
        HAVING pg_catalog.count(*) > 0) c
  LEFT JOIN LATERAL (SELECT d.logicalrelid FROM pg_catalog.pg_dist_partition d
                      WHERE d.colocationid = c.colocationid
                      ORDER BY d.logicalrelid LIMIT 1) r ON true
  LEFT JOIN pg_catalog.pg_class k ON k.oid = r.logicalrelid";

/// The nodes that hold shard $2 of table $1, and whether this one does.
const PLACED: &std::ffi::CStr = c"
SELECT $1::pg_catalog.regclass::pg_catalog.text,
       coalesce(pg_catalog.bool_or(p.groupid = (SELECT l.groupid FROM pg_catalog.pg_dist_local_group l)), false),
       coalesce(pg_catalog.string_agg(n.nodename || ':' || n.nodeport, ', ' ORDER BY n.nodeid), '')
  FROM pg_catalog.pg_dist_placement p
  LEFT JOIN pg_catalog.pg_dist_node n ON n.groupid = p.groupid AND n.noderole = 'primary'
 WHERE p.shardid = $2";

/// The slots of the plans kept for the backend's life (SPI_keepplan): the plan cache
/// replans them when a catalog they read changes.
const DECLARED_PLAN: usize = 0;
const PLACED_PLAN: usize = 1;

/// Bumped by each relcache invalidation of a relation in WATCHED (Citus sends one
/// for the table whose shards, placements or distribution change, and for
/// pg_dist_object, pg_dist_node, pg_dist_local_group and pg_dist_colocation on any
/// change of theirs), of every relation (a reset of the invalidation queue), or of any
/// relation while Citus' metadata is being read (READING: the table read may not be
/// watched yet), and by any change of pg_proc (DECLARED picks the start functions by
/// name: a distributed function renamed to quota.start changes no catalog of Citus'):
/// what placement() remembers (core::citus::Remembered) is then read again. Dropping
/// Citus drops its catalogs, which invalidates them too. READING is a flag: a read
/// nested in a read (a domain check of the distribution column that starts a ticket)
/// ends it early, and an ERROR in a read leaves it set to the next read; either only
/// makes the memory forget more.
static mut GENERATION: u64 = 1;
/// The table the start functions are colocated with, then Citus' catalogs.
static mut WATCHED: [pg_sys::Oid; 1 + CATALOGS.len()] = [pg_sys::InvalidOid; 1 + CATALOGS.len()];
static mut READING: bool = false;
static mut REGISTERED: bool = false;
const CATALOGS: [&std::ffi::CStr; 7] = [
    c"pg_dist_object",
    c"pg_dist_partition",
    c"pg_dist_shard",
    c"pg_dist_placement",
    c"pg_dist_node",
    c"pg_dist_local_group",
    c"pg_dist_colocation",
];

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn proc_changed(_arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    // SAFETY: single-threaded backend state.
    unsafe { GENERATION += 1 };
}

/// This module's crate::inval::Handler.
unsafe fn relcache_changed(relid: pg_sys::Oid) {
    // SAFETY: single-threaded backend state, read by value.
    unsafe {
        let watched = std::ptr::addr_of!(WATCHED).read();
        if READING || relid == pg_sys::InvalidOid || watched.contains(&relid) {
            GENERATION += 1;
        }
    }
}

/// The generation now, with every invalidation committed so far taken in (as a lock
/// acquisition takes them in): what is remembered from this generation is what
/// Citus' metadata says as committed now.
fn generation() -> u64 {
    // SAFETY: single-threaded backend state; the handler is registered once per
    // backend; AcceptInvalidationMessages has nothing to do in the common case.
    unsafe {
        if !REGISTERED {
            crate::inval::on_relcache(relcache_changed);
            pg_sys::CacheRegisterSyscacheCallback(
                pg_sys::SysCacheIdentifier::PROCOID as i32,
                Some(proc_changed),
                pg_sys::Datum::from(0),
            );
            REGISTERED = true;
        }
        pg_sys::AcceptInvalidationMessages();
        GENERATION
    }
}

/// Runs `read` (a read of Citus' metadata) with every relcache invalidation that
/// comes in meanwhile counted; its value, and the generation as it is then (without
/// taking invalidations in): where that moved during the read, what it read is used
/// but not kept.
fn reading<T>(read: impl FnOnce() -> T) -> (T, u64) {
    // SAFETY: single-threaded backend state. An ERROR inside leaves READING set,
    // which only makes the memo forget more, until the next read resets it.
    unsafe { READING = true };
    let value = read();
    // SAFETY: as above.
    unsafe {
        READING = false;
        (value, GENERATION)
    }
}

thread_local! {
    /// DECLARED by schema quota's OID; a tenant's shard; a shard's placement.
    static DECLARED_SEEN: std::cell::RefCell<Remembered<u32, Declared>> =
        std::cell::RefCell::new(Remembered::new(4));
    static SHARD_SEEN: std::cell::RefCell<Remembered<Vec<u8>, i64>> =
        std::cell::RefCell::new(Remembered::new(4_096));
    static PLACED_SEEN: std::cell::RefCell<Remembered<i64, Placed>> =
        std::cell::RefCell::new(Remembered::new(16_384));
}

/// Where `tenant` lives, if pg_quota's start functions are distributed by tenant in
/// this database; None where they are not (or Citus is not here). Citus' metadata is
/// read as committed now, as Citus itself reads it to route a call, not as of the
/// transaction's snapshot: a REPEATABLE READ transaction sees a move or a new
/// distribution as soon as Citus does. What was read is remembered for the backend
/// until Citus' metadata changes (GENERATION), so a start reads it once per tenant.
pub fn placement(tenant: &[u8]) -> Result<Option<Placement>, QuotaError> {
    if !citus_loaded() {
        return Ok(None);
    }
    // SAFETY: schema quota's OID, InvalidOid if it is gone (then nothing matches).
    let ns = u32::from(unsafe { pg_sys::get_namespace_oid(c"quota".as_ptr(), true) });
    let seen = generation();
    let declared = match DECLARED_SEEN.with_borrow_mut(|m| m.get(seen, &ns)) {
        Some(d) => d,
        None => {
            // SAFETY: a catalog probe of pg_extension, inside the caller's transaction.
            // Not remembered where Citus is not installed: nothing would say when it is.
            if unsafe { pg_sys::get_extension_oid(c"citus".as_ptr(), true) } == pg_sys::InvalidOid {
                return Ok(None);
            }
            let (d, now) = reading(|| {
                let mut watched = [pg_sys::InvalidOid; 1 + CATALOGS.len()];
                // SAFETY: syscache lookups of Citus' catalogs; SPI inside the caller's
                // transaction (an ERROR unwinds through it, and the transaction's abort
                // cleans SPI up); then single-threaded backend state, written at once.
                unsafe {
                    for (w, name) in watched[1..].iter_mut().zip(CATALOGS) {
                        *w = pg_sys::get_relname_relid(
                            name.as_ptr(),
                            pg_sys::PG_CATALOG_NAMESPACE.into(),
                        );
                    }
                    let d = read_declared_now(ns.into());
                    if let Declared::With { table, .. } = d {
                        watched[0] = table.into();
                    }
                    std::ptr::addr_of_mut!(WATCHED).write(watched);
                    d
                }
            });
            DECLARED_SEEN.with_borrow_mut(|m| m.keep(seen, now, ns, d));
            d
        }
    };
    let (table, owner, shard_fn) = match declared {
        Declared::No => return Ok(None),
        Declared::Misdeclared { groups } => return Err(QuotaError::CitusMisdeclared { groups }),
        // A table dropped since its colocation was read has no owner: as no table.
        Declared::NoTable => {
            return Ok(Some(Placement {
                table: None,
                nodes: String::new(),
                here: false,
                shard: None,
            }))
        }
        Declared::With {
            table,
            owner,
            shard_fn,
        } => (
            pg_sys::Oid::from(table),
            pg_sys::Oid::from(owner),
            pg_sys::Oid::from(shard_fn),
        ),
    };
    let shard = match SHARD_SEEN.with_borrow_mut(|m| m.get(seen, tenant)) {
        Some(shard) => shard,
        None => {
            // SAFETY: a call of Citus' function with an argument of its types.
            let (shard, now) = reading(|| unsafe { shard_of(shard_fn, table, owner, tenant) });
            SHARD_SEEN.with_borrow_mut(|m| m.keep(seen, now, tenant.to_vec(), shard));
            shard
        }
    };
    // Held until `release` (a writer-committed start's charge has committed) or the
    // transaction's end: a move of the shard off this node refuses to go meanwhile
    // (shard_leaving), so that no charge is left behind; and a start that comes during
    // a move waits for it (LOCK_WAIT at most), then reads where the shard is after it:
    // the move's invalidations are sent before its locks are given back.
    // SAFETY: a plain read of backend state.
    let db = unsafe { pg_sys::MyDatabaseId };
    crate::ledger::locks::lock_tag_bounded(
        crate::scopes::shard_lock_tag(db, shard),
        pg_sys::ShareLock,
        |seconds| QuotaError::ShardBusy { shard, seconds },
    );
    let locked = generation();
    let placed = match PLACED_SEEN.with_borrow_mut(|m| m.get(locked, &shard)) {
        Some(p) => p,
        None => {
            // SAFETY: SPI inside the caller's transaction, as above.
            let (placed, now) = reading(|| unsafe {
                connect();
                query(
                    pg_sys::GetUserId(),
                    Some(PLACED_PLAN),
                    PLACED,
                    &[
                        (pg_sys::OIDOID, pg_sys::Datum::from(table)),
                        (pg_sys::INT8OID, pg_sys::Datum::from(shard)),
                    ],
                );
                let placed = Placed {
                    table: column_text(1).unwrap_or_else(|| u32::from(table).to_string()),
                    here: column_bool(2),
                    nodes: column_text(3).unwrap_or_default(),
                };
                pg_sys::SPI_finish();
                placed
            });
            PLACED_SEEN.with_borrow_mut(|m| m.keep(locked, now, shard, placed.clone()));
            placed
        }
    };
    Ok(Some(Placement {
        table: Some(placed.table),
        here: placed.here,
        nodes: placed.nodes,
        shard: Some(shard),
    }))
}

/// DECLARED as it reads now.
///
/// # Safety
/// Inside a transaction; `ns` is schema quota's OID (or InvalidOid).
unsafe fn read_declared_now(ns: pg_sys::Oid) -> Declared {
    // SAFETY: the caller's.
    unsafe {
        connect();
        let d = match read_declared(ns) {
            None => Declared::No,
            Some(groups) if groups != 1 || !column_bool(4) => Declared::Misdeclared { groups },
            Some(_) => match (column_oid(1), column_oid(2)) {
                (Some(table), Some(owner)) => Declared::With {
                    table: table.into(),
                    owner: owner.into(),
                    shard_fn: column_oid(5).map_or(0, u32::from),
                },
                _ => Declared::NoTable,
            },
        };
        pg_sys::SPI_finish();
        d
    }
}

/// The tenant's shard of `table`: Citus' get_shard_id_for_distribution_column()
/// (`func`), called through fmgr rather than SPI (it answers from Citus' own
/// metadata cache), as the table's owner: it wants SELECT on the table, which a role
/// that only starts tickets need not have; with search_path pinned (AsRole), since
/// it converts the tenant with the distribution column's input function, which a
/// domain's check may run.
///
/// # Safety
/// Inside a transaction; `func` is that function's OID, `table` a distributed table,
/// `owner` its owner. An ERROR unwinds through it; the abort restores the user.
unsafe fn shard_of(
    func: pg_sys::Oid,
    table: pg_sys::Oid,
    owner: pg_sys::Oid,
    tenant: &[u8],
) -> i64 {
    if func == pg_sys::InvalidOid {
        pgrx::error!(
            "pg_quota: Citus' get_shard_id_for_distribution_column(regclass, \"any\") is missing"
        );
    }
    let value = text_datum(tenant);
    // SAFETY: the caller's. The function reads its second argument's type from the
    // call's expression (get_fn_expr_argtype), so the FmgrInfo carries one: a FuncExpr
    // of a regclass and a text constant, in the current memory context.
    unsafe {
        let mut flinfo: pg_sys::FmgrInfo = std::mem::zeroed();
        pg_sys::fmgr_info(func, &mut flinfo);
        let mut args = pg_sys::lappend(
            std::ptr::null_mut(),
            pg_sys::makeConst(
                pg_sys::REGCLASSOID,
                -1,
                pg_sys::InvalidOid,
                4,
                pg_sys::Datum::from(table),
                false,
                true,
            )
            .cast(),
        );
        args = pg_sys::lappend(
            args,
            pg_sys::makeConst(
                pg_sys::TEXTOID,
                -1,
                pg_sys::DEFAULT_COLLATION_OID.into(),
                -1,
                value,
                false,
                false,
            )
            .cast(),
        );
        flinfo.fn_expr = pg_sys::makeFuncExpr(
            func,
            pg_sys::INT8OID,
            args,
            pg_sys::InvalidOid,
            pg_sys::DEFAULT_COLLATION_OID.into(),
            pg_sys::CoercionForm::COERCE_EXPLICIT_CALL,
        )
        .cast();
        let _owner = AsRole::enter(owner);
        let shard = pg_sys::FunctionCall2Coll(
            &mut flinfo,
            pg_sys::InvalidOid,
            pg_sys::Datum::from(table),
            value,
        );
        shard.value() as i64
    }
}

/// Reads DECLARED (its row left in SPI_tuptable): the number of colocation groups of
/// pg_quota's distributed start functions, None where none is distributed. With the
/// caller's own privileges: Citus' metadata is readable by all.
///
/// # Safety
/// Connected to SPI; `ns` is schema quota's OID (or InvalidOid).
unsafe fn read_declared(ns: pg_sys::Oid) -> Option<i64> {
    // SAFETY: the caller's.
    unsafe {
        let found = query(
            pg_sys::GetUserId(),
            Some(DECLARED_PLAN),
            DECLARED,
            &[(pg_sys::OIDOID, pg_sys::Datum::from(ns))],
        );
        (found == 1).then(|| column(3).map_or(0, |d| d.value() as i64))
    }
}

/// Says once per session, as a WARNING, that the role's own active limit and the
/// database cap count per node (core::citus::per_node_warning), where either is
/// chosen: the role limit's default (100, which no setting chose) is not named.
pub fn warn_per_node(policy: &crate::policy::Policy) {
    // Backends are single-threaded: a plain flag of this one's.
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if WARNED.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    if let Some(w) = crate::core::citus::per_node_warning(
        if policy.active_is_default {
            0
        } else {
            policy.limits.max_active
        },
        policy.limits.max_db,
    ) {
        WARNED.store(true, std::sync::atomic::Ordering::Relaxed);
        pgrx::warning!("{w}");
    }
}

/// Gives back the shard lock `placement` took for a start, once the start's charge
/// is committed (a writer-committed start): a move that comes later sees the charge.
/// A transactional start keeps it to its transaction's end, when its charge commits.
pub fn release(placement: &Option<Placement>) {
    if let Some(shard) = placement.as_ref().and_then(|p| p.shard) {
        // SAFETY: a plain read of backend state, and the release of a lock this
        // transaction holds (LockRelease warns, harmlessly, where it does not).
        unsafe {
            let mut tag = crate::scopes::shard_lock_tag(pg_sys::MyDatabaseId, shard);
            pg_sys::LockRelease(&mut tag, pg_sys::ShareLock as i32, false);
        }
    }
}

/// # Safety
/// Inside a transaction.
unsafe fn connect() {
    // SAFETY: the caller's.
    if unsafe { pg_sys::SPI_connect() } != pg_sys::SPI_OK_CONNECT as i32 {
        pgrx::error!("pg_quota: SPI_connect failed");
    }
}

/// Runs `sql` read-only as `role`, with search_path pinned (catalog::AsRole: an
/// operator of the caller's schemas must not stand in for pg_catalog's), with `args`
/// under the latest snapshot; the number of rows (at most one is kept). With a slot,
/// its plan is prepared once and kept.
///
/// # Safety
/// Connected to SPI; the datums are valid for their types; a slot always names the
/// same `sql` and argument types.
unsafe fn query(
    role: pg_sys::Oid,
    slot: Option<usize>,
    sql: &std::ffi::CStr,
    args: &[(pg_sys::Oid, pg_sys::Datum)],
) -> u64 {
    // Backends are single-threaded: this one's kept plans.
    static mut KEPT: [pg_sys::SPIPlanPtr; 2] = [std::ptr::null_mut(); 2];
    let mut types: Vec<pg_sys::Oid> = args.iter().map(|a| a.0).collect();
    let mut values: Vec<pg_sys::Datum> = args.iter().map(|a| a.1).collect();
    let _as_role = AsRole::enter(role);
    // SAFETY: the caller's; an error raises ERROR, and the return codes are checked.
    // KEPT is this backend's alone.
    unsafe {
        let kept = slot.map(|i| &mut *std::ptr::addr_of_mut!(KEPT[i]));
        let plan = match kept {
            Some(p) if !p.is_null() => *p,
            _ => {
                let plan = pg_sys::SPI_prepare(sql.as_ptr(), args.len() as i32, types.as_mut_ptr());
                if plan.is_null() {
                    let code = std::ptr::addr_of!(pg_sys::SPI_result).read();
                    pgrx::error!("pg_quota: reading Citus' metadata failed: {code}");
                }
                if let Some(p) = kept {
                    if pg_sys::SPI_keepplan(plan) == 0 {
                        *p = plan;
                    }
                }
                plan
            }
        };
        let rc = pg_sys::SPI_execute_snapshot(
            plan,
            values.as_mut_ptr(),
            std::ptr::null(),
            pg_sys::GetLatestSnapshot(),
            std::ptr::null_mut(),
            true,
            false,
            1,
        );
        if rc != pg_sys::SPI_OK_SELECT as i32 {
            pgrx::error!("pg_quota: reading Citus' metadata failed: {rc}");
        }
        pg_sys::SPI_processed
    }
}

/// # Safety
/// After `query` returned a row; `n` is a column of it.
unsafe fn column(n: i32) -> Option<pg_sys::Datum> {
    let mut null = false;
    // SAFETY: the caller's.
    let d = unsafe {
        let t = pg_sys::SPI_tuptable;
        if t.is_null() || (*t).numvals == 0 {
            return None;
        }
        pg_sys::SPI_getbinval(*(*t).vals, (*t).tupdesc, n, &mut null)
    };
    (!null).then_some(d)
}

/// # Safety
/// As `column`; the column is an oid.
unsafe fn column_oid(n: i32) -> Option<pg_sys::Oid> {
    // SAFETY: the caller's.
    unsafe { column(n) }.map(|d| pg_sys::Oid::from(d.value() as u32))
}

/// # Safety
/// As `column`; the column is a bool.
unsafe fn column_bool(n: i32) -> bool {
    // SAFETY: the caller's.
    unsafe { column(n) }.is_some_and(|d| d.value() != 0)
}

/// # Safety
/// As `column`.
unsafe fn column_text(n: i32) -> Option<String> {
    // SAFETY: the caller's; SPI_getvalue is the column's output text, palloc'd in
    // the server encoding, NULL for a NULL.
    unsafe {
        let t = pg_sys::SPI_tuptable;
        if t.is_null() || (*t).numvals == 0 {
            return None;
        }
        let p = pg_sys::SPI_getvalue(*(*t).vals, (*t).tupdesc, n);
        (!p.is_null()).then(|| name_text(p))
    }
}

/// The shard, source group and target group of Citus' own
/// `SELECT citus_internal.update_placement_metadata(shard, source, target)`, which a
/// shard move (citus_move_shard_placement, the rebalancer) sends to every node with
/// metadata in its transaction, as it is about to run: a planned statement whose
/// plan is a Result of that one call, run by a superuser (Citus' own connections;
/// pg_quota names tenants in its refusal, and a role that may not run the function
/// must not take pg_quota's lock by preparing a call of it). None for anything else
/// (told apart by its shape alone, before any catalog lookup).
///
/// # Safety
/// `stmt` is the PlannedStmt the executor is starting.
pub unsafe fn placement_update(stmt: *const pg_sys::PlannedStmt) -> Option<(i64, i32, i32)> {
    if !citus_loaded() {
        return None;
    }
    // SAFETY: the caller's; every node is checked for its tag before it is cast.
    unsafe {
        let plan = (*stmt).planTree;
        if (*stmt).commandType != pg_sys::CmdType::CMD_SELECT
            || plan.is_null()
            || (*plan).type_ != pg_sys::NodeTag::T_Result
            || !(*plan).lefttree.is_null()
            || !pg_sys::superuser_arg(pg_sys::GetUserId())
        {
            return None;
        }
        let targets = pgrx::PgList::<pg_sys::TargetEntry>::from_pg((*plan).targetlist);
        if targets.len() != 1 {
            return None;
        }
        let expr = (*targets.get_ptr(0)?).expr;
        if expr.is_null() || (*expr).type_ != pg_sys::NodeTag::T_FuncExpr {
            return None;
        }
        let func = expr.cast::<pg_sys::FuncExpr>();
        let args = pgrx::PgList::<pg_sys::Node>::from_pg((*func).args);
        if args.len() != 3 {
            return None;
        }
        // Before Citus 12 (and from an older node during a rolling upgrade):
        // pg_catalog.citus_internal_update_placement_metadata.
        if !func_is(
            (*func).funcid,
            &[
                (c"citus_internal", c"update_placement_metadata"),
                (c"pg_catalog", c"citus_internal_update_placement_metadata"),
            ],
        ) {
            return None;
        }
        // Citus writes the shard as a plain number, an int4 constant under an implicit
        // cast to int8, which the planner has folded.
        let mut consts = [(pg_sys::InvalidOid, pg_sys::Datum::from(0)); 3];
        for (i, c) in consts.iter_mut().enumerate() {
            let arg = args.get_ptr(i)?;
            if (*arg).type_ != pg_sys::NodeTag::T_Const {
                return None;
            }
            let arg = arg.cast::<pg_sys::Const>();
            if (*arg).constisnull {
                return None;
            }
            *c = ((*arg).consttype, (*arg).constvalue);
        }
        if consts[0].0 != pg_sys::INT8OID
            || consts[1].0 != pg_sys::INT4OID
            || consts[2].0 != pg_sys::INT4OID
        {
            return None;
        }
        Some((
            consts[0].1.value() as i64,
            consts[1].1.value() as i32,
            consts[2].1.value() as i32,
        ))
    }
}

/// This node's group.
const LOCAL_GROUP: &std::ffi::CStr = c"SELECT l.groupid FROM pg_catalog.pg_dist_local_group l";

/// The tenants with active tickets and with their own limits here. Read as the
/// bootstrap superuser (pg_quota's tables are not the move's user's to read), with
/// search_path pinned, by a query that calls no code but PostgreSQL's own.
const HELD_HERE: &str = "SELECT {active}, {own}";
const ACTIVE_HERE: &str = "(SELECT pg_catalog.array_agg(DISTINCT a.tenant) FROM quota.active a
   WHERE a.tenant IS NOT NULL
     AND (a.lease_until IS NULL OR a.lease_until OPERATOR(pg_catalog.>) pg_catalog.now()))";
const OWN_HERE: &str = "(SELECT pg_catalog.array_agg(o.tenant) FROM quota.tenant_overrides o)";

/// Of the tenants in $2 and in $3, those whose shard of table $1 is $4, as the table's
/// owner (see PLACED), each list joined with a unit separator, sorted.
const OF_SHARD: &std::ffi::CStr = c"
SELECT (SELECT pg_catalog.string_agg(t, E'\\x1f' ORDER BY t) FROM pg_catalog.unnest($2) t
         WHERE pg_catalog.get_shard_id_for_distribution_column($1, t) OPERATOR(pg_catalog.=) $4),
       (SELECT pg_catalog.string_agg(t, E'\\x1f' ORDER BY t) FROM pg_catalog.unnest($3) t
         WHERE pg_catalog.get_shard_id_for_distribution_column($1, t) OPERATOR(pg_catalog.=) $4)";

/// Refuses (core::citus::shard_may_leave) Citus' move of `shard` off this node, the
/// source group `source`, where a tenant of the shard holds active tickets or its own
/// limits here. Nothing is read unless pg_quota's starts are distributed by tenant.
pub fn shard_leaving(shard: i64, source: i32) -> Result<(), QuotaError> {
    // SAFETY: schema quota's OID, InvalidOid if it is gone; then catalog probes.
    let (ns, has_active, has_own) = unsafe {
        let ns = pg_sys::get_namespace_oid(c"quota".as_ptr(), true);
        if ns == pg_sys::InvalidOid {
            return Ok(());
        }
        (
            ns,
            pg_sys::get_relname_relid(c"active".as_ptr(), ns) != pg_sys::InvalidOid,
            pg_sys::get_relname_relid(c"tenant_overrides".as_ptr(), ns) != pg_sys::InvalidOid,
        )
    };
    let held = std::ffi::CString::new(
        HELD_HERE
            .replace(
                "{active}",
                if has_active {
                    ACTIVE_HERE
                } else {
                    "NULL::pg_catalog.text[]"
                },
            )
            .replace(
                "{own}",
                if has_own {
                    OWN_HERE
                } else {
                    "NULL::pg_catalog.text[]"
                },
            ),
    )
    .expect("no NUL in the query");
    // SAFETY: SPI inside the move's transaction; an ERROR unwinds through it and the
    // abort cleans SPI up. The arrays read by the first query stay in SPI's memory
    // until SPI_finish, after the second.
    unsafe {
        connect();
        let found = read_declared(ns).is_some();
        let (true, Some(table), Some(owner)) = (found, column_oid(1), column_oid(2)) else {
            pg_sys::SPI_finish();
            return Ok(());
        };
        query(pg_sys::GetUserId(), None, LOCAL_GROUP, &[]);
        if column(1).map(|d| d.value() as i32) != Some(source) {
            pg_sys::SPI_finish();
            return Ok(()); // not the node the shard leaves
        }
        // Hold off new starts for the shard's tenants here to the move's end; where a
        // start holds the lock (a transactional charge not committed yet, a start that
        // waits for capacity), refuse now rather than wait: its transaction may next
        // write to the shard, which the move blocks, and the two would deadlock.
        let mut tag = crate::scopes::shard_lock_tag(pg_sys::MyDatabaseId, shard);
        if pg_sys::LockAcquire(&mut tag, pg_sys::ExclusiveLock as i32, false, true)
            == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
        {
            pg_sys::SPI_finish();
            return Err(QuotaError::ShardMoveBusy { shard });
        }
        query(pg_sys::BOOTSTRAP_SUPERUSERID.into(), None, &held, &[]);
        let (active, own) = (column(1), column(2));
        if active.is_none() && own.is_none() {
            pg_sys::SPI_finish();
            return Ok(());
        }
        // SAFETY: an empty text[] in the current (SPI's) memory context.
        let empty = || pg_sys::Datum::from(pg_sys::construct_empty_array(pg_sys::TEXTOID));
        query(
            owner,
            None,
            OF_SHARD,
            &[
                (pg_sys::OIDOID, pg_sys::Datum::from(table)),
                (pg_sys::TEXTARRAYOID, active.unwrap_or_else(empty)),
                (pg_sys::TEXTARRAYOID, own.unwrap_or_else(empty)),
                (pg_sys::INT8OID, pg_sys::Datum::from(shard)),
            ],
        );
        let split = |s: Option<String>| -> Vec<String> {
            s.map(|s| s.split('\u{1f}').map(str::to_string).collect())
                .unwrap_or_default()
        };
        let (active, own) = (split(column_text(1)), split(column_text(2)));
        pg_sys::SPI_finish();
        crate::core::citus::shard_may_leave(shard, active, own)
            .map_err(QuotaError::ShardMoveRefused)
    }
}

/// Whether Citus is loaded in this server (its GUCs are defined only then). Fixed
/// for the server's life: shared_preload_libraries.
fn citus_loaded() -> bool {
    // Backends are single-threaded; 0 unknown, 1 no, 2 yes.
    static LOADED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
    match LOADED.load(std::sync::atomic::Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            // SAFETY: a GUC lookup; NULL where Citus never defined it.
            let loaded = unsafe {
                !pg_sys::GetConfigOption(c"citus.shard_count".as_ptr(), true, false).is_null()
            };
            LOADED.store(
                if loaded { 2 } else { 1 },
                std::sync::atomic::Ordering::Relaxed,
            );
            loaded
        }
    }
}

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
fn func_is(funcid: pg_sys::Oid, names: &[(&std::ffi::CStr, &std::ffi::CStr)]) -> bool {
    // SAFETY: syscache lookups, NULL where the function or its schema is gone; the
    // names are NUL-terminated and palloc'd in the current context.
    unsafe {
        let name = pg_sys::get_func_name(funcid);
        if name.is_null() {
            return false;
        }
        let name = std::ffi::CStr::from_ptr(name);
        if !names.iter().any(|(_, n)| *n == name) {
            return false;
        }
        let schema = pg_sys::get_namespace_name(pg_sys::get_func_namespace(funcid));
        if schema.is_null() {
            return false;
        }
        let schema = std::ffi::CStr::from_ptr(schema);
        names.iter().any(|(sc, n)| *n == name && *sc == schema)
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
