//! Whether the server can run the `GET_LOCK` lock at all: not with Galera replication on, which
//! is found once, when the lock is opened, rather than at every attempt.

use leader_core::LockError;
use mysql_async::prelude::Queryable;

use super::NamedLock;
use crate::error::{BACKEND, USE_THE_TABLE_LOCK};

/// Reads `wsrep_on`: a row on MariaDB and Percona XtraDB Cluster (`ON` while Galera replicates),
/// none on MySQL. The global value is the one the server's `GET_LOCK` refusal follows.
const WSREP_ON: &str = "SHOW GLOBAL VARIABLES WHERE Variable_name = 'wsrep_on'";

impl NamedLock {
    /// Refuses a server with Galera replication on ([`LockError::Misconfigured`], one line),
    /// where the lock would be refused at every attempt, or hold `GET_LOCK` on one node only.
    pub(crate) async fn check_server(&self) -> Result<(), LockError> {
        let context = self.context();
        let mut conn = self.store.conn().await?;
        let row = conn.query_first(WSREP_ON).await;
        let row: Option<(String, String)> = self.store.answered(conn, row, &context).await?;
        refuse_galera(&context, row.as_ref().map(|(_, value)| value.as_str()))
    }
}

/// [`LockError::Misconfigured`] when `wsrep_on`, as `SHOW VARIABLES` answers it (`None`: the
/// server has no such variable), says Galera replication is on.
pub(super) fn refuse_galera(context: &str, wsrep_on: Option<&str>) -> Result<(), LockError> {
    let on = wsrep_on.is_some_and(|value| value.eq_ignore_ascii_case("ON") || value == "1");
    if !on {
        return Ok(());
    }
    Err(LockError::Misconfigured {
        backend: BACKEND,
        message: format!(
            "{context}: wsrep_on=ON (Galera): the GET_LOCK lock needs wsrep_on=OFF, since a Galera node refuses GET_LOCK or takes it for itself alone; {USE_THE_TABLE_LOCK}"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No Galera cluster runs here: these are the answers `SHOW GLOBAL VARIABLES` gives on a
    /// Galera node (`ON`), on MariaDB without it (`OFF`) and on MySQL (no row).
    #[test]
    fn galera_is_refused_and_other_servers_are_not() {
        let context = "mysql://app:***@db/app table leader_election election \"jobs\"";
        let err = refuse_galera(context, Some("ON")).expect_err("Galera");
        crate::error::assert_galera_refusal(
            &err,
            &["wsrep_on=ON", "wsrep_on=OFF", "election \"jobs\""],
        );
        assert!(refuse_galera(context, Some("on")).is_err());
        assert!(refuse_galera(context, Some("1")).is_err());
        assert!(refuse_galera(context, Some("OFF")).is_ok());
        assert!(refuse_galera(context, Some("0")).is_ok());
        assert!(refuse_galera(context, None).is_ok(), "MySQL");
    }
}
