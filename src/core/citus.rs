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

#[cfg(test)]
mod tests {
    use super::*;

    const CALL: &str = "quota.try_start(tenant => …)";

    fn at(table: Option<&str>, nodes: &str, here: bool) -> Option<Placement> {
        Some(Placement {
            table: table.map(str::to_string),
            nodes: nodes.to_string(),
            here,
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
