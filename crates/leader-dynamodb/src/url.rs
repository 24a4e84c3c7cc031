//! `dynamodb://TABLE` lock URLs.

use leader_core::{LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait};

use crate::store::{DynamoStore, DynamoStoreBuilder, check_table_name};

/// A DynamoDB lock URL: `dynamodb://TABLE`, with the parameters `create_table=true` (create
/// the table when it is missing) and `allow_global_table=true` (accept a table with replicas,
/// with a warning). Region, endpoint and credentials come from the AWS environment; the URL
/// holds none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockUrl {
    table: String,
    create_table: bool,
    allow_global_table: bool,
}

impl LockUrl {
    /// Parses the URL.
    ///
    /// # Errors
    /// Another scheme, credentials in the URL, a path, a bad table name, or an unknown or
    /// malformed parameter.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: &str| UrlError::new(lock, message);
        leader_core::backend::check_user_info(lock)?;
        let rest = lock
            .strip_prefix("dynamodb://")
            .ok_or_else(|| invalid("not a DynamoDB URL; use dynamodb://TABLE"))?;
        let (table, query) = rest.split_once('?').unwrap_or((rest, ""));
        let table = table.strip_suffix('/').unwrap_or(table);
        if table.contains('@') {
            return Err(invalid(
                "the URL holds no credentials: they come from the AWS environment \
                 (AWS_ACCESS_KEY_ID, AWS_PROFILE, a role)",
            ));
        }
        if table.contains('/') {
            return Err(invalid(
                "a DynamoDB URL names a table and nothing more: dynamodb://TABLE (an item per \
                 election, named after it)",
            ));
        }
        check_table_name(table).map_err(|why| invalid(&why))?;
        let mut url = Self {
            table: table.to_owned(),
            create_table: false,
            allow_global_table: false,
        };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let field = match key {
                "create_table" => &mut url.create_table,
                "allow_global_table" => &mut url.allow_global_table,
                _ => {
                    return Err(invalid(&format!(
                        "unknown parameter {key:?}; the parameters are create_table and \
                         allow_global_table (region, endpoint and credentials come from the AWS \
                         environment)"
                    )));
                }
            };
            *field = match value {
                "true" => true,
                "false" => false,
                _ => {
                    return Err(invalid(&format!("{key} is true or false, not {value:?}")));
                }
            };
        }
        Ok(url)
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// The table the URL names.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// A builder of the store the URL names, with its parameters.
    pub fn builder(&self) -> DynamoStoreBuilder {
        DynamoStore::builder(&self.table)
            .create_table(self.create_table)
            .allow_global_table(self.allow_global_table)
    }

    /// The store, configured from the AWS environment, with its table checked (see
    /// [`DynamoStore::check_table`]): a table refused is an error here, before anything runs;
    /// one that cannot be reached now is checked again before the first write.
    async fn checked_store(&self) -> Result<DynamoStore, LockError> {
        let store = self.builder().build().await?;
        match store.check_table().await {
            Err(err @ (LockError::Misconfigured { .. } | LockError::Forbidden { .. })) => {
                return Err(err);
            }
            Err(err) => {
                tracing::warn!(error = %err, "could not check the DynamoDB table yet");
            }
            Ok(()) => {}
        }
        Ok(store)
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        format!("dynamodb:{}", self.table)
    }

    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        Ok(Box::new(self.checked_store().await?.lock(name, identity)))
    }

    /// An item per record in the table, read with `BatchGetItem` and renewed with
    /// `TransactWriteItems`.
    async fn open_set(&self, _name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        Ok(Box::new(self.checked_store().await?.lock_set(identity)))
    }
}

impl DynamoStore {
    /// A store from a URL, `dynamodb://TABLE`, with the parameters `create_table=true` and
    /// `allow_global_table=true` ([`DynamoStoreBuilder::create_table`],
    /// [`DynamoStoreBuilder::allow_global_table`]). Region, endpoint and credentials come from
    /// the AWS environment, as every AWS SDK reads it (`AWS_REGION`, `AWS_ENDPOINT_URL` or
    /// `AWS_ENDPOINT_URL_DYNAMODB`, `AWS_ACCESS_KEY_ID`, `AWS_PROFILE`, a web identity, the
    /// container's or instance's role); the URL holds none of them.
    pub fn from_url(url: &str) -> DynamoStoreBuilder {
        match LockUrl::parse(url) {
            Ok(parsed) => parsed.builder(),
            Err(err) => DynamoStoreBuilder::new(Err(err.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_and_its_parameters() {
        let url = LockUrl::parse("dynamodb://leader_locks").expect("parses");
        assert_eq!(url.table(), "leader_locks");
        assert!(!url.create_table && !url.allow_global_table);
        let url =
            LockUrl::parse("dynamodb://Locks.prod/?create_table=true&allow_global_table=true")
                .expect("parses");
        assert_eq!(url.table(), "Locks.prod");
        assert!(url.create_table && url.allow_global_table);
    }

    #[test]
    fn bad_urls_are_refused_without_showing_secrets() {
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                ("dynamodb://AKID:secret@locks", "no credentials"),
                ("dynamodb://locks/app", "names a table and nothing more"),
                ("dynamodb://x", "3 to 255"),
                ("dynamodb://bad table", "letters, digits"),
                ("dynamodb://locks?region=eu-west-1", "unknown parameter"),
                ("dynamodb://locks?create_table=yes", "true or false"),
                ("s3://locks", "dynamodb://TABLE"),
            ],
        );
    }
}
