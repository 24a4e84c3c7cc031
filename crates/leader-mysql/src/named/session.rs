//! The lock's own session: its statements, and whether its connection (with the user-level
//! lock) is gone.

use super::*;

/// The lock's own session.
#[derive(Debug)]
pub(super) struct Session {
    pub(super) conn: Conn,
    /// The fencing term whose user-level lock this session holds; `None` when it holds none.
    pub(super) term: Option<u64>,
    /// The connection failed: the session is gone, and its user-level lock with it.
    pub(super) lost: bool,
}

impl Session {
    pub(super) async fn first<T: FromRow + Send + 'static>(
        &mut self,
        context: &str,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<Option<T>, LockError> {
        let result = self.conn.exec_first(sql, params).await;
        self.check(context, result, map)
    }

    /// Runs a statement that calls `GET_LOCK`: as [`first`](Self::first), with a server that
    /// refuses `GET_LOCK` reported as misconfigured.
    pub(super) async fn get_lock(
        &mut self,
        context: &str,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<Option<Option<i64>>, LockError> {
        let result = self.conn.exec_first(sql, params).await;
        self.check(context, result, map_get_lock)
    }

    /// Runs a write and returns how many rows it changed.
    pub(super) async fn write(
        &mut self,
        context: &str,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<u64, LockError> {
        let result = self.conn.exec_drop(sql, params).await;
        self.check(context, result, map)?;
        Ok(self.conn.affected_rows())
    }

    fn check<T>(
        &mut self,
        context: &str,
        result: Result<T, mysql_async::Error>,
        map: fn(&str, mysql_async::Error) -> LockError,
    ) -> Result<T, LockError> {
        result.map_err(|err| {
            if connection_lost(&err) {
                self.lost = true;
                self.term = None;
            }
            map(context, err)
        })
    }
}

/// Whether `err` means the session is gone (and the server let go of its user-level locks).
pub(super) fn connection_lost(err: &mysql_async::Error) -> bool {
    match err {
        mysql_async::Error::Server(server) => {
            // Server shutdown, connection killed, idle connection closed by MySQL 8.
            matches!(server.code, 1053 | 1927 | 4031)
        }
        _ => true,
    }
}
