//! Where a tenant may be admitted on a Citus cluster (0.7.1), and what a start made
//! elsewhere is told.
//!
//! pg_quota keeps a ledger per node. On a cluster whose tables are distributed by
//! tenant, the DBA declares that tenants are too by distributing pg_quota's start
//! functions by their `tenant` argument, colocated with such a table
//! (`create_distributed_function(…, '$5', colocate_with := 'jobs')`, USER_GUIDE
//! "Citus"). From then on a tenant's tickets are counted on the node that holds the
//! tenant's shard of that table, and only there: Citus runs a call made alone in its
//! statement on that node, and a start that reaches any other node (a call inside a
//! transaction block without force_delegation, in a PL/pgSQL expression, in an
//! INSERT … SELECT) is refused, rather than admitted by a ledger that does not see the
//! tenant's other tickets.

/// What the node's Citus metadata says of a tenant, once starts are distributed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The table the start functions are colocated with (regclass text); None where
    /// their colocation group has no table any more.
    pub table: Option<String>,
    /// The nodes that hold the tenant's shard ("host:port", ", "-separated); empty
    /// where none does.
    pub nodes: String,
    /// Whether this node holds it.
    pub here: bool,
    /// The shard, where the table has one for the tenant.
    pub shard: Option<i64>,
}

/// A start refused on a node that does not hold its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Elsewhere {
    pub tenant: String,
    pub placement: Placement,
    /// The call refused, for the hint: "quota.try_start(tenant => …)".
    pub call: &'static str,
}

/// Whether a start for `tenant` may be admitted here: always where the start functions
/// are not distributed (`None`), else only on a node that holds the tenant's shard.
/// `call` names the call refused, for the hint.
pub fn admit_here(
    tenant: &str,
    placement: Option<Placement>,
    call: &'static str,
) -> Result<(), Box<Elsewhere>> {
    match placement {
        Some(p) if !p.here => Err(Box::new(Elsewhere {
            tenant: tenant.to_string(),
            placement: p,
            call,
        })),
        _ => Ok(()),
    }
}

/// The WARNING a start distributed by tenant gets (once per session) where the role
/// has an active limit of its own or the database a cap: those count the tickets of
/// the node that admits, and a role's tenants are admitted on every node, so on a
/// cluster of n nodes that hold tenants a role can run up to n times its limit. None
/// where neither is set (0 is no limit). The retained limit counts per node as well,
/// but it bounds each node's ledger, which is what it is for: it is not named.
pub fn per_node_warning(max_active: i64, max_db: i64) -> Option<String> {
    let set: Vec<String> = [
        ("quota.max_active_per_role", max_active),
        ("quota.max_active_per_database", max_db),
    ]
    .iter()
    .filter(|(_, v)| *v > 0)
    .map(|(name, v)| format!("{name} = {v}"))
    .collect();
    if set.is_empty() {
        return None;
    }
    Some(format!(
        "{} count{} per node on this Citus cluster: starts distributed by tenant are admitted on their tenant's node, so a role's tickets on all nodes together can exceed {}",
        set.join(", "),
        if set.len() == 1 { "s" } else { "" },
        if set.len() == 1 { "it" } else { "them" }
    ))
}

/// The message of a start refused because pg_quota's start functions are distributed
/// in `groups` colocation groups (1: by another argument than the tenant).
pub fn misdeclared_message(groups: i64) -> String {
    if groups > 1 {
        format!("pg_quota's start functions are distributed in {groups} colocation groups, not one: no node can count all of a tenant's tickets")
    } else {
        "pg_quota's start functions are distributed by another argument than tenant: no node can count all of a tenant's tickets".to_string()
    }
}

/// The DETAIL of a start that waited `seconds` for a move or a split of its tenant's
/// shard.
pub fn shard_busy_detail(seconds: i64) -> String {
    format!("pg_quota waited {seconds} s for a move or a split of the shard on this node, which holds it until its transaction ends on this node (a two-phase commit still pending included).")
}

/// What Citus does to a shard that pg_quota may refuse on the node that holds it: a
/// move off the node (the placement's metadata update), or a split (the old shard's
/// metadata deleted, its tenants' new shards placed by the split).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardChange {
    Move,
    Split,
}

impl ShardChange {
    /// The refusal's message while a start for a tenant of the shard is in progress.
    pub fn busy_message(self, shard: i64) -> String {
        match self {
            ShardChange::Move => format!("pg_quota cannot let shard {shard} leave this node now: a start for one of its tenants is in progress here"),
            ShardChange::Split => format!("pg_quota cannot let shard {shard} be split now: a start for one of its tenants is in progress here"),
        }
    }

    pub fn busy_hint(self) -> String {
        let verb = match self {
            ShardChange::Move => "Move",
            ShardChange::Split => "Split",
        };
        let noun = match self {
            ShardChange::Move => "move",
            ShardChange::Split => "split",
        };
        format!("{verb} the shard again once the transactions that started tickets for its tenants on this node have ended: the {noun} does not wait for them, so that it cannot deadlock with them.")
    }
}

pub const MISDECLARED_HINT: &str = "Distribute quota.start() and quota.try_start(), every overload called, by their tenant argument ('$5') and colocated with one table: create_distributed_function(…, '$5', colocate_with := …).";

impl std::fmt::Display for Elsewhere {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.placement;
        match (&p.table, p.nodes.is_empty()) {
            (Some(_), false) => write!(
                f,
                "tenant \"{}\" is held by node {}, not by this one",
                self.tenant, p.nodes
            ),
            (Some(table), true) => write!(
                f,
                "tenant \"{}\" has no node that holds its shard of table {table}",
                self.tenant
            ),
            (None, _) => write!(
                f,
                "tenant \"{}\" cannot be placed: pg_quota's start functions are colocated with no table",
                self.tenant
            ),
        }
    }
}

impl Elsewhere {
    pub fn detail(&self) -> String {
        let with = match &self.placement.table {
            Some(t) => format!("colocated with table {t}"),
            None => "in a colocation group whose tables are gone".to_string(),
        };
        format!(
            "pg_quota's start functions are distributed by tenant, {with}: a tenant's tickets are counted on the node that holds its shard, and only there, so that its limits hold across the cluster."
        )
    }

    pub fn hint(&self) -> String {
        if self.placement.table.is_none() {
            return "Distribute quota.start() and quota.try_start() again with create_distributed_function(…, '$5', colocate_with := …) naming a table distributed by tenant.".to_string();
        }
        format!(
            "Call it alone in its statement, as SELECT {}, which Citus runs on that node where the function is distributed by tenant like the start functions; inside a transaction block, distribute it with force_delegation := true and pass the tenant as a constant.",
            self.call
        )
    }
}

/// A shard move that pg_quota refuses on the node the shard leaves (0.7.1): a tenant
/// of the shard holds active tickets here, or has its own limits here. Both stay in
/// this node's ledger, which a move does not carry: the node the shard goes to would
/// admit the tenant as if it had no tickets, and without its own limits. A split
/// likewise, for the tenants whose new shard it places on another node: the lists are
/// then of those tenants alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveRefused {
    pub change: ShardChange,
    pub shard: i64,
    /// Tenants of the shard with active tickets here.
    pub active: Vec<String>,
    /// Tenants of the shard with their own limits here.
    pub own_limits: Vec<String>,
}

/// Refuses the move of `shard` off this node (or its split that places them on
/// another) where its tenants hold anything here.
pub fn shard_may_leave(
    change: ShardChange,
    shard: i64,
    active: Vec<String>,
    own_limits: Vec<String>,
) -> Result<(), Box<MoveRefused>> {
    if active.is_empty() && own_limits.is_empty() {
        return Ok(());
    }
    Err(Box::new(MoveRefused {
        change,
        shard,
        active,
        own_limits,
    }))
}

/// "tenant \"t1\" holds active tickets here", "tenants \"t1\", \"t2\" hold …": at most
/// five names, then how many more; `verbs` for one tenant and for several.
fn clause(tenants: &[String], verbs: (&str, &str), what: &str) -> String {
    let shown: Vec<String> = tenants.iter().take(5).map(|t| format!("\"{t}\"")).collect();
    let names = match tenants.len() {
        n if n > 5 => format!("{} and {} more", shown.join(", "), n - 5),
        _ => shown.join(", "),
    };
    let (s, verb) = if tenants.len() == 1 {
        ("", verbs.0)
    } else {
        ("s", verbs.1)
    };
    format!("tenant{s} {names} {verb} {what} here")
}

impl std::fmt::Display for MoveRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.change {
            ShardChange::Move => write!(
                f,
                "pg_quota cannot let shard {} leave this node: ",
                self.shard
            )?,
            ShardChange::Split => write!(
                f,
                "pg_quota cannot let the split of shard {} place tenants on another node: ",
                self.shard
            )?,
        }
        let mut parts = Vec::new();
        if !self.active.is_empty() {
            parts.push(clause(&self.active, ("holds", "hold"), "active tickets"));
        }
        if !self.own_limits.is_empty() {
            parts.push(clause(
                &self.own_limits,
                ("has its", "have their"),
                "own limits",
            ));
        }
        write!(f, "{}", parts.join("; "))
    }
}

impl MoveRefused {
    pub fn detail(&self) -> String {
        match self.change {
            ShardChange::Move => "pg_quota counts a tenant's tickets, and keeps its own limits, on the node that holds its shard; a shard move does not carry them, so the node it goes to would admit the tenant as if it had none.",
            ShardChange::Split => "pg_quota counts a tenant's tickets, and keeps its own limits, on the node that holds its shard; a split that places the tenant's new shard on another node does not carry them, so that node would admit the tenant as if it had none.",
        }
        .to_string()
    }

    pub fn hint(&self) -> String {
        match self.change {
            ShardChange::Move => "Move the shard once its tenants' tickets have ended (finished, or their leases run out); clear their own limits with quota.set_tenant_limits(tenant) and set them again after the move.",
            ShardChange::Split => "Split so that these tenants' new shards stay on this node (isolate_tenant_to_new_shard keeps a tenant on its node), or once their tickets have ended (finished, or their leases run out) and their own limits are cleared with quota.set_tenant_limits(tenant).",
        }
        .to_string()
    }
}

/// A backend's memory of what Citus' metadata said, so that a start reads that
/// metadata once per backend rather than three queries each time (issue 35's cost).
/// Valid for one generation: the pgrx layer counts the relcache invalidations that
/// Citus sends for every change of the tables, shards, placements, nodes and
/// distributed functions it reads, and a generation other than the one the memory
/// was filled in empties it. A value read while an invalidation came in (the
/// generation moved during the read) is used for that start, not kept. At most
/// `cap` keys: full, it starts again empty.
#[derive(Debug)]
pub struct Remembered<K, V> {
    generation: u64,
    map: std::collections::HashMap<K, V>,
    cap: usize,
}

impl<K: std::hash::Hash + Eq, V: Clone> Remembered<K, V> {
    pub fn new(cap: usize) -> Self {
        Self {
            generation: 0,
            map: std::collections::HashMap::new(),
            cap,
        }
    }

    /// What is remembered for `key`, if it was read in `generation`.
    pub fn get<Q>(&mut self, generation: u64, key: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.turn(generation);
        self.map.get(key).cloned()
    }

    /// Remembers `value`, read from `read_in` on, where the generation is still
    /// `read_in` now.
    pub fn keep(&mut self, read_in: u64, now: u64, key: K, value: V) {
        if read_in != now {
            return;
        }
        self.turn(now);
        if self.map.len() >= self.cap && !self.map.contains_key(&key) {
            self.map.clear();
        }
        self.map.insert(key, value);
    }

    fn turn(&mut self, generation: u64) {
        if self.generation != generation {
            self.map.clear();
            self.generation = generation;
        }
    }
}

/// What DECLARED says of pg_quota's start functions, as a backend remembers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declared {
    /// Not distributed (or Citus not installed): tenants are admitted anywhere.
    No,
    /// Distributed across `groups` colocation groups, or by another argument.
    Misdeclared { groups: i64 },
    /// Colocated with a group that has no table any more.
    NoTable,
    /// Colocated with `table` (an OID), owned by `owner`; `shard_fn` is Citus'
    /// get_shard_id_for_distribution_column() (0 where it is missing).
    With {
        table: u32,
        owner: u32,
        shard_fn: u32,
    },
}

/// Where a shard is, as a backend remembers it: the table's name, whether this node
/// holds the shard, and the nodes that do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub table: String,
    pub here: bool,
    pub nodes: String,
}

#[cfg(test)]
mod tests {
    #[test]
    fn remembered_values_last_one_generation() {
        let mut m: Remembered<Vec<u8>, i64> = Remembered::new(4);
        assert_eq!(m.get(1, b"t1".as_slice()), None);
        m.keep(1, 1, b"t1".to_vec(), 7);
        assert_eq!(m.get(1, b"t1".as_slice()), Some(7));
        // An invalidation came: everything read before it is forgotten.
        assert_eq!(m.get(2, b"t1".as_slice()), None);
        assert_eq!(m.get(1, b"t1".as_slice()), None);
    }

    #[test]
    fn a_value_read_across_an_invalidation_is_not_kept() {
        let mut m: Remembered<i64, bool> = Remembered::new(4);
        m.keep(3, 4, 10, true);
        assert_eq!(m.get(4, &10), None);
        assert_eq!(m.get(3, &10), None);
    }

    #[test]
    fn remembered_values_are_bounded() {
        let mut m: Remembered<i64, i64> = Remembered::new(3);
        for k in 0..3 {
            m.keep(1, 1, k, k);
        }
        assert_eq!(m.get(1, &2), Some(2));
        m.keep(1, 1, 2, 20); // a key already there does not empty it
        assert_eq!(m.get(1, &0), Some(0));
        m.keep(1, 1, 3, 3); // full: starts again with the new key alone
        assert_eq!((m.get(1, &0), m.get(1, &3)), (None, Some(3)));
    }

    use super::*;

    const CALL: &str = "quota.try_start(tenant => …)";

    fn at(table: Option<&str>, nodes: &str, here: bool) -> Option<Placement> {
        Some(Placement {
            table: table.map(str::to_string),
            nodes: nodes.to_string(),
            here,
            shard: Some(7),
        })
    }

    #[test]
    fn tenant_admitted_only_where_its_shard_lives() {
        assert!(
            admit_here("t1", None, CALL).is_ok(),
            "not distributed: every node"
        );
        assert!(admit_here("t1", at(Some("jobs"), "w1:5432", true), CALL).is_ok());
        let e = admit_here("t1", at(Some("jobs"), "w2:5432", false), CALL).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tenant \"t1\" is held by node w2:5432, not by this one"
        );
        assert!(e.detail().contains("colocated with table jobs"));
        assert!(e
            .hint()
            .contains("SELECT quota.try_start(tenant => …), which"));
        assert!(e.hint().contains("force_delegation"));
    }

    #[test]
    fn role_limits_on_a_cluster_are_said_to_be_per_node() {
        assert_eq!(per_node_warning(0, 0), None);
        assert_eq!(
            per_node_warning(10, 0).unwrap(),
            "quota.max_active_per_role = 10 counts per node on this Citus cluster: starts distributed by tenant are admitted on their tenant's node, so a role's tickets on all nodes together can exceed it"
        );
        let w = per_node_warning(10, 30).unwrap();
        assert!(w.starts_with(
            "quota.max_active_per_role = 10, quota.max_active_per_database = 30 count per node"
        ));
        assert!(w.ends_with("exceed them"));
    }

    #[test]
    fn shard_with_tenants_holding_tickets_may_not_leave() {
        assert!(shard_may_leave(ShardChange::Move, 7, vec![], vec![]).is_ok());
        let e = shard_may_leave(ShardChange::Move, 7, vec!["t1".into()], vec![]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "pg_quota cannot let shard 7 leave this node: tenant \"t1\" holds active tickets here"
        );
        let many: Vec<String> = (1..=7).map(|i| format!("t{i}")).collect();
        let e = shard_may_leave(ShardChange::Move, 7, many, vec!["p".into()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "pg_quota cannot let shard 7 leave this node: tenants \"t1\", \"t2\", \"t3\", \"t4\", \"t5\" and 2 more hold active tickets here; tenant \"p\" has its own limits here"
        );
        assert!(e.hint().contains("quota.set_tenant_limits(tenant)"));
    }

    #[test]
    fn split_placing_tenants_elsewhere_is_refused() {
        assert!(shard_may_leave(ShardChange::Split, 7, vec![], vec![]).is_ok());
        let e = shard_may_leave(ShardChange::Split, 7, vec!["t1".into()], vec!["t1".into()])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "pg_quota cannot let the split of shard 7 place tenants on another node: tenant \"t1\" holds active tickets here; tenant \"t1\" has its own limits here"
        );
        assert!(e
            .detail()
            .contains("a split that places the tenant's new shard"));
        assert!(e.hint().contains("isolate_tenant_to_new_shard"));
        assert!(ShardChange::Split
            .busy_message(7)
            .starts_with("pg_quota cannot let shard 7 be split now"));
        assert!(ShardChange::Split
            .busy_hint()
            .starts_with("Split the shard again"));
    }

    #[test]
    fn start_functions_distributed_apart_are_refused() {
        assert!(misdeclared_message(2).contains("in 2 colocation groups, not one"));
        assert!(misdeclared_message(1).contains("by another argument than tenant"));
        assert!(MISDECLARED_HINT.contains("'$5'"));
    }

    #[test]
    fn shard_lock_waits_say_what_holds_them() {
        assert!(shard_busy_detail(5)
            .starts_with("pg_quota waited 5 s for a move or a split of the shard"));
        assert!(ShardChange::Move.busy_hint().contains("cannot deadlock"));
        assert!(ShardChange::Move
            .busy_message(7)
            .starts_with("pg_quota cannot let shard 7 leave this node now"));
    }

    #[test]
    fn tenant_without_node_or_table_is_refused() {
        let e = admit_here("t1", at(Some("jobs"), "", false), CALL).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tenant \"t1\" has no node that holds its shard of table jobs"
        );
        let e = admit_here("t1", at(None, "", false), CALL).unwrap_err();
        assert!(e.to_string().contains("colocated with no table"));
        assert!(e.hint().contains("create_distributed_function"));
    }
}
