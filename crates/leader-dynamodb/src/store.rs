//! The table: how it is reached, and the checks of its settings (S15).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use aws_config::SdkConfig;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::retry::RetryConfig;
use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    TableDescription, TableStatus,
};
use leader_core::LockError;
use leader_core::backend::SettingsCheck;

use crate::error::{BACKEND, Context, map};
use crate::skew::ServerTime;

/// The table's partition key: a string attribute holding the election's name.
pub const KEY_ATTRIBUTE: &str = "name";

/// How long [`DynamoStoreBuilder::create_table`] waits for a table it created to become active.
const CREATE_WAIT: Duration = Duration::from_secs(60);

/// Builds a [`DynamoStore`]; see [`DynamoStore::from_url`] and [`DynamoStore::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct DynamoStoreBuilder {
    /// The table, or why the URL names none.
    table: Result<String, String>,
    create_table: bool,
    allow_global_table: bool,
    timeout: Duration,
    config: Option<SdkConfig>,
}

impl fmt::Debug for DynamoStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The SDK configuration holds credentials: only whether one was given is shown.
        f.debug_struct("DynamoStoreBuilder")
            .field("table", &self.table)
            .field("create_table", &self.create_table)
            .field("allow_global_table", &self.allow_global_table)
            .field("timeout", &self.timeout)
            .field("sdk_config", &self.config.is_some())
            .finish()
    }
}

impl DynamoStoreBuilder {
    pub(crate) fn new(table: Result<String, String>) -> Self {
        Self {
            table,
            create_table: false,
            allow_global_table: false,
            timeout: Duration::from_secs(5),
            config: None,
        }
    }

    /// Creates the table when it does not exist (on-demand capacity, the lock's key), before
    /// the first write. Off by default: a missing table is an error naming it, since a typo
    /// should not make a table of its own.
    pub fn create_table(mut self, create: bool) -> Self {
        self.create_table = create;
        self
    }

    /// Accepts a global table (one with replicas in other regions), with a warning at every
    /// check. Off by default, and best left off: replicas reconcile concurrent writes by last
    /// writer wins, so a conditional write holds in its own region only, and candidates in two
    /// regions can each lead. Only safe when every candidate writes in one region.
    pub fn allow_global_table(mut self, allow: bool) -> Self {
        self.allow_global_table = allow;
        self
    }

    /// The timeout of each request (default 5 s), connecting included; keep it below the
    /// elector's renew deadline. Requests are not retried inside the client: the elector
    /// retries at its retry period, with back-off.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Uses this AWS configuration (region, credentials, endpoint) instead of the one the
    /// environment gives ([`aws_config::load_defaults`]). Its retries and timeouts are replaced
    /// by the lock's; without an HTTP client of its own, the lock's (rustls on ring) is used.
    pub fn sdk_config(mut self, config: SdkConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// Reads the AWS configuration (unless given) and builds the client; nothing is sent yet.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] for a bad table name or URL, or when no region is
    /// configured.
    pub async fn build(self) -> Result<DynamoStore, LockError> {
        let bad = |message: String| LockError::Misconfigured {
            backend: BACKEND,
            message,
        };
        let table = self.table.map_err(bad)?;
        check_table_name(&table).map_err(|why| bad(format!("table {table:?}: {why}")))?;
        let config = match self.config {
            Some(config) => config,
            None => {
                aws_config::defaults(aws_config::BehaviorVersion::latest())
                    .http_client(http_client())
                    .load()
                    .await
            }
        };
        let Some(region) = config.region().map(ToString::to_string) else {
            return Err(bad(format!(
                "dynamodb:{table}: no AWS region is configured; set AWS_REGION (or a \
                 profile's region)"
            )));
        };
        let mut client = aws_sdk_dynamodb::config::Builder::from(&config)
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(self.timeout)
                    .operation_timeout(self.timeout)
                    .build(),
            );
        if config.http_client().is_none() {
            client = client.http_client(http_client());
        }
        // Signed by the server's time where the host's clock is off (S14).
        let time = ServerTime::new(config.time_source().unwrap_or_default());
        client = client.interceptor(time.learner()).time_source(time);
        let arn = format!("arn:aws:dynamodb:{region}:ACCOUNT_ID:table/{table}");
        Ok(DynamoStore {
            inner: Arc::new(Inner {
                client: Client::from_conf(client.build()),
                table,
                arn: std::sync::Mutex::new(arn),
                timeout: self.timeout,
                create_table: self.create_table,
                allow_global_table: self.allow_global_table,
                checked: AtomicBool::new(false),
                legacy: std::sync::Mutex::default(),
                term_check: SettingsCheck::default(),
            }),
        })
    }
}

/// The HTTPS client: hyper with rustls on ring (no aws-lc-rs), as every other client here.
fn http_client() -> aws_sdk_dynamodb::config::SharedHttpClient {
    use aws_smithy_http_client::tls;
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}

/// DynamoDB's rule for table names: 3 to 255 of `a-z A-Z 0-9 _ - .`.
pub(crate) fn check_table_name(table: &str) -> Result<(), String> {
    if !(3..=255).contains(&table.len()) {
        return Err("a table name has 3 to 255 characters".to_owned());
    }
    if !table
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err("a table name holds only letters, digits, _, - and .".to_owned());
    }
    Ok(())
}

/// A DynamoDB table holding leader election records, an item per election (its partition key
/// [`KEY_ATTRIBUTE`] is the election's name). Cheap to clone.
#[derive(Clone)]
pub struct DynamoStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) table: String,
    /// The table's ARN: with the account spelt out until `DescribeTable` told it.
    arn: std::sync::Mutex<String>,
    pub(crate) timeout: Duration,
    create_table: bool,
    allow_global_table: bool,
    /// Set once the table has passed [`DynamoStore::check_table`].
    checked: AtomicBool,
    /// The regions of the table's replication group as a global table of version 2017.11.29
    /// (none: not one), once `DescribeGlobalTable` said, or said it cannot tell for good.
    legacy: std::sync::Mutex<Option<Vec<String>>>,
    /// The check at each term's start.
    term_check: SettingsCheck,
}

impl fmt::Debug for DynamoStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoStore")
            .field("table", &self.inner.table)
            .finish_non_exhaustive()
    }
}

impl DynamoStore {
    /// A store on `table`, configured from the AWS environment (see
    /// [`from_url`](Self::from_url)).
    pub fn builder(table: impl Into<String>) -> DynamoStoreBuilder {
        DynamoStoreBuilder::new(Ok(table.into()))
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// The DynamoDB client (no retries, the lock's timeouts).
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    pub(crate) fn context(&self, what: String) -> Context {
        Context {
            what,
            arn: self
                .inner
                .arn
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            timeout: self.inner.timeout,
        }
    }

    /// Makes sure the table is one the lock can rely on, once per store (the lock runs it
    /// before its first write): see [`check_table_now`](Self::check_table_now).
    ///
    /// # Errors
    /// As [`check_table_now`](Self::check_table_now).
    pub async fn check_table(&self) -> Result<(), LockError> {
        if self.inner.checked.load(Ordering::Acquire) {
            return Ok(());
        }
        self.check_table_now().await
    }

    /// [`check_table_now`](Self::check_table_now) at a term's start: one check runs at a time
    /// and serves every term that waited for it, and a check that passed stands for a second,
    /// so that a member taking many shards at once asks once ([`SettingsCheck`]).
    pub(crate) async fn check_table_for_term(&self) -> Result<(), LockError> {
        self.inner.term_check.run(self.check_table_now()).await
    }

    /// Reads the table's description (`DescribeTable`) and checks it (S15): its key must be the
    /// lock's (a string partition key [`KEY_ATTRIBUTE`], no sort key; a table is never altered),
    /// it must be active, and it must have no replicas (a global table), unless allowed. A
    /// missing table is created when the builder asked for it. The lock runs it again at the
    /// start of every term, since replicas can be added to a running table.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] naming the setting; [`LockError::Forbidden`] naming the
    /// action to grant; outages.
    pub async fn check_table_now(&self) -> Result<(), LockError> {
        let table = self.describe_table().await?;
        let table = match table {
            Some(table) => table,
            None if self.inner.create_table => self.create().await?,
            None => {
                return Err(LockError::Misconfigured {
                    backend: BACKEND,
                    message: format!(
                        "dynamodb:{}: the table does not exist in this region; create it (a \
                         string partition key `{KEY_ATTRIBUTE}`, see deploy/dynamodb), or let \
                         the lock create it (`create_table=true` in the URL, or \
                         DynamoStoreBuilder::create_table)",
                        self.inner.table
                    ),
                });
            }
        };
        // A global table of version 2017.11.29 cannot become one once in use (its tables had
        // to be empty), so one answer per store is enough.
        let known = self
            .inner
            .legacy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let legacy = match known {
            Some(regions) => regions,
            None => self.legacy_replicas().await,
        };
        self.check_description(&table, &legacy)?;
        self.inner.checked.store(true, Ordering::Release);
        Ok(())
    }

    /// The regions of the table's replication group when it is a global table of version
    /// 2017.11.29, which `DescribeTable` does not show (`DescribeGlobalTable` does); none when
    /// it is not one, or when that cannot be told for good (a policy without
    /// `dynamodb:DescribeGlobalTable`, a server without the request: said in a warning). After
    /// an answer that may change (a timeout, throttling, a server error) none either, but the
    /// next check asks again.
    async fn legacy_replicas(&self) -> Vec<String> {
        let table = &self.inner.table;
        let answer = self
            .inner
            .client
            .describe_global_table()
            .global_table_name(table)
            .send()
            .await;
        let regions = match answer {
            Ok(answer) => answer
                .global_table_description()
                .map(|global| {
                    global
                        .replication_group()
                        .iter()
                        .filter_map(|replica| replica.region_name().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
            Err(err) if err.code() == Some("GlobalTableNotFoundException") => Vec::new(),
            Err(err) if answered_for_good(&err) => {
                tracing::warn!(
                    table = %table,
                    error = %DisplayErrorContext(&err),
                    "cannot tell whether the table is a global table of version 2017.11.29, \
                     which DescribeTable does not show (grant dynamodb:DescribeGlobalTable on \
                     its global-table ARN): candidates in two of its regions could each lead"
                );
                Vec::new()
            }
            Err(err) => {
                tracing::debug!(
                    table = %table,
                    error = %DisplayErrorContext(&err),
                    "DescribeGlobalTable failed; asked again at the next check"
                );
                return Vec::new();
            }
        };
        *self.inner.legacy.lock().unwrap_or_else(|p| p.into_inner()) = Some(regions.clone());
        regions
    }

    /// The table's description, or `None` when it does not exist.
    async fn describe_table(&self) -> Result<Option<TableDescription>, LockError> {
        let context = self.context(format!("dynamodb:{}", self.inner.table));
        let answer = self
            .inner
            .client
            .describe_table()
            .table_name(&self.inner.table)
            .send()
            .await;
        match answer {
            Ok(answer) => {
                let Some(table) = answer.table else {
                    return Err(LockError::other(
                        BACKEND,
                        format!("{}: DescribeTable answered without a table", context.what),
                    ));
                };
                if let Some(arn) = table.table_arn() {
                    *self.inner.arn.lock().unwrap_or_else(|p| p.into_inner()) = arn.to_owned();
                }
                Ok(Some(table))
            }
            Err(err) if err.code() == Some("ResourceNotFoundException") => Ok(None),
            Err(err) => Err(map(
                &context,
                "describe table",
                "dynamodb:DescribeTable",
                err,
            )),
        }
    }

    /// Creates the table (on-demand capacity) and waits until it is active.
    async fn create(&self) -> Result<TableDescription, LockError> {
        let table = &self.inner.table;
        let context = self.context(format!("dynamodb:{table}"));
        tracing::info!(table = %table, "creating the lock table");
        let key = KeySchemaElement::builder()
            .attribute_name(KEY_ATTRIBUTE)
            .key_type(KeyType::Hash)
            .build()
            .map_err(|err| LockError::other(BACKEND, err))?;
        let attribute = AttributeDefinition::builder()
            .attribute_name(KEY_ATTRIBUTE)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .map_err(|err| LockError::other(BACKEND, err))?;
        let created = self
            .inner
            .client
            .create_table()
            .table_name(table)
            .key_schema(key)
            .attribute_definitions(attribute)
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        match created {
            Ok(_) => {}
            // Another candidate created it at the same time.
            Err(err) if err.code() == Some("ResourceInUseException") => {}
            Err(err) => {
                return Err(map(&context, "create table", "dynamodb:CreateTable", err));
            }
        }
        let deadline = tokio::time::Instant::now() + CREATE_WAIT;
        loop {
            if let Some(table) = self.describe_table().await?
                && table.table_status() != Some(&TableStatus::Creating)
            {
                return Ok(table);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(LockError::unavailable(
                    BACKEND,
                    format!(
                        "dynamodb:{table}: the table created is not active after {CREATE_WAIT:?}"
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn check_description(
        &self,
        table: &TableDescription,
        legacy: &[String],
    ) -> Result<(), LockError> {
        let name = &self.inner.table;
        match check_description(table, legacy, self.inner.allow_global_table) {
            Ok(Some(warning)) => {
                tracing::warn!(table = %name, "{warning}");
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(Refusal::Misconfigured(message)) => Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!("dynamodb:{name}: {message}"),
            }),
            Err(Refusal::NotYet(message)) => Err(LockError::unavailable(
                BACKEND,
                format!("dynamodb:{name}: {message}"),
            )),
        }
    }
}

/// Whether a failed request was answered in a way that asking again will not change: the
/// server refused it for the caller (a 4xx other than throttling: no permission, an unknown
/// request), or the server does not serve it at all (a `501`). Not a timeout, a request that
/// did not reach the server, throttling or another server error.
fn answered_for_good<E>(
    err: &aws_sdk_dynamodb::error::SdkError<E, aws_sdk_dynamodb::config::http::HttpResponse>,
) -> bool
where
    E: ProvideErrorMetadata,
{
    use aws_sdk_dynamodb::error::SdkError;
    let status = match err {
        SdkError::ServiceError(failed) => failed.raw().status().as_u16(),
        _ => return false,
    };
    let throttled = err.code().is_some_and(crate::error::is_throttling);
    (400..500).contains(&status) && !throttled || status == 501
}

/// Why a table's description is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// For good, until someone changes the table or the lock's settings.
    Misconfigured(String),
    /// For now (a table being created).
    NotYet(String),
}

/// Checks a table's description, with the regions of its replication group if it is a global
/// table of version 2017.11.29 (`legacy`): `Ok(Some(warning))` for an allowed global table.
pub(crate) fn check_description(
    table: &TableDescription,
    legacy: &[String],
    allow_global_table: bool,
) -> Result<Option<String>, Refusal> {
    let keys: Vec<String> = table
        .key_schema()
        .iter()
        .map(|key| {
            let kind = table
                .attribute_definitions()
                .iter()
                .find(|a| a.attribute_name() == key.attribute_name())
                .map_or("?", |a| a.attribute_type().as_str());
            format!(
                "{} {} ({kind})",
                key.key_type().as_str(),
                key.attribute_name()
            )
        })
        .collect();
    let ours = format!("{} {KEY_ATTRIBUTE} (S)", KeyType::Hash.as_str());
    if keys != [ours] {
        return Err(Refusal::Misconfigured(format!(
            "the table's key is [{}], not the lock's (a string partition key `{KEY_ATTRIBUTE}` \
             and no sort key); the lock never alters a table: name another table, or create \
             one with that key",
            keys.join(", ")
        )));
    }
    match table.table_status() {
        None | Some(TableStatus::Active | TableStatus::Updating) => {}
        Some(TableStatus::Creating) => {
            return Err(Refusal::NotYet(
                "the table is still being created".to_owned(),
            ));
        }
        Some(status) => {
            return Err(Refusal::Misconfigured(format!(
                "the table is {}, not active",
                status.as_str()
            )));
        }
    }
    let mut replicas: Vec<&str> = table
        .replicas()
        .iter()
        .filter_map(|r| r.region_name())
        .collect();
    // A replication group of one region is a table alone.
    if legacy.len() > 1 {
        replicas.extend(legacy.iter().map(String::as_str));
    }
    if replicas.is_empty() && table.replicas().is_empty() {
        return Ok(None);
    }
    let why = format!(
        "the table is a global table (replicas in {}): replicas reconcile concurrent writes \
         by last writer wins, so a conditional write holds in one region only and candidates \
         in two regions can each lead",
        replicas.join(", ")
    );
    if allow_global_table {
        Ok(Some(format!(
            "{why}; allowed (allow_global_table): every candidate must write in one region"
        )))
    } else {
        Err(Refusal::Misconfigured(format!(
            "{why}; use a table without replicas, or allow it (allow_global_table=true) only \
             if every candidate writes in one region"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodb::types::ReplicaDescription;

    fn table(keys: &[(&str, KeyType, ScalarAttributeType)]) -> TableDescription {
        let mut table = TableDescription::builder().table_status(TableStatus::Active);
        for (name, kind, attribute) in keys {
            table = table
                .key_schema(
                    KeySchemaElement::builder()
                        .attribute_name(*name)
                        .key_type(kind.clone())
                        .build()
                        .expect("a key"),
                )
                .attribute_definitions(
                    AttributeDefinition::builder()
                        .attribute_name(*name)
                        .attribute_type(attribute.clone())
                        .build()
                        .expect("an attribute"),
                );
        }
        table.build()
    }

    #[test]
    fn only_the_locks_key_is_accepted() {
        let ours = table(&[(KEY_ATTRIBUTE, KeyType::Hash, ScalarAttributeType::S)]);
        assert_eq!(check_description(&ours, &[], false), Ok(None));
        for (keys, shown) in [
            (
                vec![("key", KeyType::Hash, ScalarAttributeType::S)],
                "HASH key (S)",
            ),
            (
                vec![(KEY_ATTRIBUTE, KeyType::Hash, ScalarAttributeType::N)],
                "HASH name (N)",
            ),
            (
                vec![
                    (KEY_ATTRIBUTE, KeyType::Hash, ScalarAttributeType::S),
                    ("sort", KeyType::Range, ScalarAttributeType::S),
                ],
                "RANGE sort (S)",
            ),
        ] {
            match check_description(&table(&keys), &[], false) {
                Err(Refusal::Misconfigured(message)) => {
                    assert!(message.contains(shown), "{message}");
                    assert!(message.contains("never alters"), "{message}");
                }
                other => panic!("{keys:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn global_tables_are_refused_unless_allowed() {
        let mut global = table(&[(KEY_ATTRIBUTE, KeyType::Hash, ScalarAttributeType::S)]);
        global.replicas = Some(vec![
            ReplicaDescription::builder()
                .region_name("eu-west-1")
                .build(),
            ReplicaDescription::builder()
                .region_name("us-east-1")
                .build(),
        ]);
        match check_description(&global, &[], false) {
            Err(Refusal::Misconfigured(message)) => {
                assert!(message.contains("global table"), "{message}");
                assert!(message.contains("eu-west-1, us-east-1"), "{message}");
                assert!(message.contains("allow_global_table=true"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let warning = check_description(&global, &[], true)
            .expect("allowed")
            .expect("a warning");
        assert!(warning.contains("last writer wins"), "{warning}");
    }

    #[test]
    fn a_table_being_deleted_is_refused() {
        let mut deleting = table(&[(KEY_ATTRIBUTE, KeyType::Hash, ScalarAttributeType::S)]);
        deleting.table_status = Some(TableStatus::Deleting);
        assert!(matches!(
            check_description(&deleting, &[], false),
            Err(Refusal::Misconfigured(_))
        ));
        deleting.table_status = Some(TableStatus::Creating);
        assert!(matches!(
            check_description(&deleting, &[], false),
            Err(Refusal::NotYet(_))
        ));
    }

    #[test]
    fn table_names_follow_dynamodbs_rule() {
        assert!(check_table_name("leader_locks-1.prod").is_ok());
        for bad in ["ab", "has space", "slash/", &"x".repeat(256)] {
            assert!(check_table_name(bad).is_err(), "{bad}");
        }
    }
}
