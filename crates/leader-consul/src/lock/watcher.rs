//! The change stream's reader: blocking queries on the record key, and what of an entry wakes
//! the followers.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use leader_core::{LeaderElectionRecord, LockError};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::error::BACKEND;
use crate::store::ConsulStore;

/// A reader of the record key with blocking queries, for the change stream.
pub(super) struct Watcher {
    pub(super) store: ConsulStore,
    pub(super) path: String,
    pub(super) context: String,
}

impl Watcher {
    /// Reads the key: the entry, if any, and the index to block on next.
    pub(super) async fn read(
        &self,
        query: &[(&str, String)],
        extra: Duration,
    ) -> Result<(Option<(Option<String>, Vec<u8>)>, u64), LockError> {
        let answer = self
            .store
            .send(&self.context, Method::GET, &self.path, query, None, extra)
            .await?;
        match answer.code {
            StatusCode::NOT_FOUND => Ok((None, answer.index)),
            StatusCode::OK => {
                let entries: Value = serde_json::from_str(&answer.body).map_err(|err| {
                    LockError::invalid_record(
                        BACKEND,
                        format!("{}: an answer that is not JSON: {err}", self.context),
                    )
                })?;
                let entry = &entries[0];
                let value = entry["Value"]
                    .as_str()
                    .and_then(|v| BASE64.decode(v).ok())
                    .unwrap_or_default();
                let session = entry["Session"]
                    .as_str()
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned);
                Ok((Some((session, value)), answer.index))
            }
            _ => Err(self.store.refused(&self.context, &answer)),
        }
    }
}

/// What followers wake for: the key's existence, its lock, its holder and a handover request.
#[derive(PartialEq, Eq)]
pub(super) struct Wake {
    pub(super) present: bool,
    pub(super) session: Option<String>,
    pub(super) holder: Option<String>,
    pub(super) handover_to: Option<String>,
}

impl Wake {
    pub(super) fn of(entry: Option<&(Option<String>, Vec<u8>)>) -> Self {
        let record =
            entry.and_then(|(_, value)| serde_json::from_slice::<LeaderElectionRecord>(value).ok());
        Self {
            present: entry.is_some(),
            session: entry.and_then(|(session, _)| session.clone()),
            holder: record.as_ref().map(|r| r.holder_identity.clone()),
            handover_to: record.and_then(|r| r.handover_to().map(str::to_owned)),
        }
    }
}
