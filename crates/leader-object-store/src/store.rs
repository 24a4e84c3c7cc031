//! The bucket: which store, how it is reached, and the key prefix.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use leader_core::LockError;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    ClientConfigKey, ObjectStore, PutMode, PutOptions, PutPayload, RetryConfig, UpdateVersion,
};

use crate::error::{BACKEND, Kind, Op, chain, is_missing_bucket, map, scrub};

/// The key prefix when none is given: records live at `leader/NAME`.
pub const DEFAULT_PREFIX: &str = "leader/";

/// What the objects that [`BucketStore::check_conditional_writes`] tries to replace are named
/// with under the prefix, each followed by `-` and a random number: none is ever written by a
/// store that keeps preconditions.
pub const PROBE_NAME: &str = ".leader-conditional-write-check";

/// Where the store comes from.
enum Source {
    /// `s3://`, `gs://`, `az://`, `memory://`: built here from the URL and the environment.
    Url(url::Url),
    /// A URL that does not parse, with the reason, reported by `build`.
    Invalid(String),
    /// A store the caller built, with a name for messages.
    Store {
        store: Arc<dyn ObjectStore>,
        name: String,
    },
}

/// Builds a [`BucketStore`]; see [`BucketStore::from_url`] and [`BucketStore::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct BucketStoreBuilder {
    source: Source,
    options: Vec<(String, String)>,
    prefix: Option<String>,
    timeout: Duration,
}

impl fmt::Debug for BucketStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::Url(url) => describe_url(url),
            Source::Invalid(why) => why.clone(),
            Source::Store { name, .. } => name.clone(),
        };
        // Option values may be credentials: only their keys are shown.
        let keys: Vec<&str> = self.options.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("BucketStoreBuilder")
            .field("source", &source)
            .field("options", &keys)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// `scheme://bucket/path` without credentials or query.
fn describe_url(url: &url::Url) -> String {
    format!(
        "{}://{}{}",
        url.scheme(),
        url.host_str().unwrap_or_default(),
        url.path()
    )
}

impl BucketStoreBuilder {
    /// Sets one of `object_store`'s configuration keys for the store (`aws_region`,
    /// `aws_endpoint`, `google_service_account`, `azure_storage_account_name`, `allow_http`,
    /// ...), over what the environment says. Values are never shown.
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.push((key.into(), value.into()));
        self
    }

    /// The prefix of the records' keys: election `NAME` is the object `PREFIX` + `NAME`. By
    /// default the URL's path (`s3://bucket/locks/` → `locks/`), or [`DEFAULT_PREFIX`].
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    /// The timeout of each request (default 5 s); keep it below the elector's renew deadline.
    /// Requests are not retried inside the client: the elector retries at its retry period.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Checks the settings and builds the client; nothing is sent yet.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] for a URL that is not `s3://`, `gs://`, `az://` (or
    /// `azure://`) or `memory://`; for a store without conditional writes (`file://`, an
    /// `http://` store, S3 with `conditional_put` disabled); for an unknown option or a
    /// configuration `object_store` refuses (a missing bucket name, say).
    pub fn build(self) -> Result<BucketStore, LockError> {
        let bad = |message: String| LockError::Misconfigured {
            backend: BACKEND,
            message,
        };
        let (store, kind, name, bucket, path_prefix): (Arc<dyn ObjectStore>, _, _, _, _) =
            match self.source {
                Source::Store { store, name } => {
                    let kind = Kind::of(store.as_ref());
                    (store, kind, name, String::new(), None)
                }
                Source::Invalid(why) => return Err(bad(why)),
                Source::Url(url) => {
                    let described = describe_url(&url);
                    let bucket = url.host_str().unwrap_or_default().to_owned();
                    let path = url.path().trim_start_matches('/').to_owned();
                    let built = build_from_url(&url, &self.options, self.timeout)
                        .map_err(|message| bad(format!("{described}: {message}")))?;
                    let name = format!("{}://{bucket}", url.scheme());
                    (built.0, built.1, name, bucket, Some(path))
                }
            };
        let prefix = self
            .prefix
            .or(path_prefix.filter(|p| !p.is_empty()))
            .unwrap_or_else(|| DEFAULT_PREFIX.to_owned());
        if prefix.starts_with('/') || prefix.contains("//") {
            return Err(bad(format!(
                "the key prefix {prefix:?} must not start with / or hold an empty segment"
            )));
        }
        Ok(BucketStore {
            inner: Arc::new(Inner {
                store,
                kind,
                name,
                bucket,
                prefix,
                checked: tokio::sync::OnceCell::new(),
            }),
        })
    }
}

/// Installs ring as rustls' process-wide crypto provider, unless the program installed one:
/// for an application that has no provider of its own, at the start of `main`.
///
/// The `object_store` this crate re-exports makes its HTTP clients with rustls and the
/// process's provider (this crate brings ring, not aws-lc-rs). Which provider a process uses
/// is the application's choice, so the lock never installs one itself: an application that
/// installs aws-lc-rs later would find ring there and fail. [`BucketStore::from_url`] refuses
/// to build without one, saying so; an `object_store` client built without one panics.
pub fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may have installed one in between: either is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Whether the process has the rustls crypto provider that `object_store`'s HTTP clients need.
fn check_crypto_provider() -> Result<(), String> {
    if rustls::crypto::CryptoProvider::get_default().is_some() {
        return Ok(());
    }
    Err(
        "no rustls crypto provider is installed in this process, and object storage's HTTP \
         client needs one: install one at the start of main \
         (rustls::crypto::ring::default_provider().install_default(), or aws-lc-rs's), or \
         call leader_object_store::ensure_crypto_provider() to install ring"
            .to_owned(),
    )
}

/// What a store URL must be, before anything reads the environment: a scheme with conditional
/// writes, a bucket, and neither credentials nor options (object_store reads those from the
/// environment).
pub(crate) fn check_url(url: &url::Url) -> Result<(), String> {
    match url.scheme() {
        "file" => {
            return Err(
                "object_store's local file system has no conditional update, so it \
                 cannot hold a lock safely; use the file lock (file:///DIR, leader_core::FileLock)"
                    .to_owned(),
            );
        }
        "http" | "https" => {
            return Err(
                "plain HTTP/WebDAV stores have no conditional update, so they cannot hold a \
                 lock safely; use s3:// with AWS_ENDPOINT for an S3-compatible server"
                    .to_owned(),
            );
        }
        "s3" | "s3a" | "gs" | "az" | "azure" | "memory" => {}
        other => {
            return Err(format!(
                "unknown scheme {other:?}; use s3://, gs://, az:// or memory://"
            ));
        }
    }
    if url.host_str().is_none_or(str::is_empty) && url.scheme() != "memory" {
        return Err("the URL needs a bucket (or container): SCHEME://BUCKET/PREFIX".to_owned());
    }
    if !url.username().is_empty() || url.password().is_some() || url.query().is_some() {
        return Err(
            "the URL must hold no credentials or options; object_store reads them from the \
             environment (AWS_*, GOOGLE_*, AZURE_*), or give them with .option()"
                .to_owned(),
        );
    }
    Ok(())
}

/// Builds the store a URL names, from the environment and `options`.
fn build_from_url(
    url: &url::Url,
    options: &[(String, String)],
    timeout: Duration,
) -> Result<(Arc<dyn ObjectStore>, Kind), String> {
    // No retries inside the client: a conditional write retried after a lost answer fails its
    // own precondition, and retries would outlast the elector's deadlines. The elector retries.
    let retry = RetryConfig {
        max_retries: 0,
        retry_timeout: timeout,
        ..RetryConfig::default()
    };
    let timeout = humanize(timeout);
    let unknown = |key: &str, err: object_store::Error| format!("option {key:?}: {err}");
    check_url(url)?;
    match url.scheme() {
        "s3" | "s3a" => {
            let mut builder = AmazonS3Builder::from_env()
                .with_url(url.as_str())
                .with_retry(retry)
                .with_config(
                    AmazonS3ConfigKey::Client(ClientConfigKey::Timeout),
                    &timeout,
                )
                .with_config(
                    AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                    &timeout,
                );
            for (key, value) in options {
                let parsed: AmazonS3ConfigKey = key.parse().map_err(|e| unknown(key, e))?;
                builder = builder.with_config(parsed, value);
            }
            if builder
                .get_config_value(&AmazonS3ConfigKey::ConditionalPut)
                .is_some_and(|v| v.trim() == "disabled")
            {
                return Err(
                    "conditional puts are disabled (AWS_CONDITIONAL_PUT=disabled), and \
                     the lock never writes without them; leave conditional_put at its default \
                     (etag)"
                        .to_owned(),
                );
            }
            // The last check, so that what is wrong with the URL is said first.
            check_crypto_provider()?;
            let store = builder.build().map_err(|e| scrub(&chain(&e)))?;
            Ok((Arc::new(store), Kind::S3))
        }
        "gs" => {
            let mut builder = GoogleCloudStorageBuilder::from_env()
                .with_url(url.as_str())
                .with_retry(retry)
                .with_config(GoogleConfigKey::Client(ClientConfigKey::Timeout), &timeout)
                .with_config(
                    GoogleConfigKey::Client(ClientConfigKey::ConnectTimeout),
                    &timeout,
                );
            for (key, value) in options {
                let parsed: GoogleConfigKey = key.parse().map_err(|e| unknown(key, e))?;
                builder = builder.with_config(parsed, value);
            }
            // The last check, so that what is wrong with the URL is said first.
            check_crypto_provider()?;
            let store = builder.build().map_err(|e| scrub(&chain(&e)))?;
            Ok((Arc::new(store), Kind::Gcs))
        }
        "az" | "azure" => {
            let mut builder = MicrosoftAzureBuilder::from_env()
                .with_url(url.as_str())
                .with_retry(retry)
                .with_config(AzureConfigKey::Client(ClientConfigKey::Timeout), &timeout)
                .with_config(
                    AzureConfigKey::Client(ClientConfigKey::ConnectTimeout),
                    &timeout,
                );
            for (key, value) in options {
                let parsed: AzureConfigKey = key.parse().map_err(|e| unknown(key, e))?;
                builder = builder.with_config(parsed, value);
            }
            // The last check, so that what is wrong with the URL is said first.
            check_crypto_provider()?;
            let store = builder.build().map_err(|e| scrub(&chain(&e)))?;
            Ok((Arc::new(store), Kind::Azure))
        }
        "memory" => {
            if !options.is_empty() {
                return Err("memory:// takes no options".to_owned());
            }
            Ok((Arc::new(InMemory::new()), Kind::Memory))
        }
        other => Err(format!("unknown scheme {other:?}")),
    }
}

/// `5s`, `250ms`: a duration as object_store's configuration parses it.
fn humanize(duration: Duration) -> String {
    format!("{}ms", duration.as_millis().max(1))
}

/// A bucket (or container) holding leader election records, one object per election, through
/// [`object_store`]: Amazon S3 and S3-compatible stores with conditional writes, Google Cloud
/// Storage, Azure Blob Storage, or a store the caller built. Cheap to clone.
#[derive(Clone)]
pub struct BucketStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) kind: Kind,
    /// The store for messages: `s3://bucket`, or the caller's name.
    pub(crate) name: String,
    pub(crate) bucket: String,
    pub(crate) prefix: String,
    /// Set once the store has shown that it keeps preconditions.
    /// The check's answer once the store answered it: a pass, or a refusal.
    checked: tokio::sync::OnceCell<Result<(), String>>,
}

impl fmt::Debug for BucketStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BucketStore")
            .field("store", &self.inner.name)
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

impl BucketStore {
    /// A store from a URL: `s3://BUCKET/PREFIX`, `gs://BUCKET/PREFIX`,
    /// `az://CONTAINER/PREFIX` (or `azure://`), or `memory://` (in this process only, for
    /// tests). Credentials, region and endpoint come from the environment as `object_store`
    /// reads them (`AWS_ACCESS_KEY_ID`, `AWS_REGION`, `AWS_ENDPOINT`, `AWS_ALLOW_HTTP`,
    /// `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_ACCOUNT_NAME`, ...) or from
    /// [`option`](BucketStoreBuilder::option).
    pub fn from_url(url: &str) -> BucketStoreBuilder {
        let parsed = leader_core::backend::check_user_info(url)
            .map_err(|err| err.message)
            .and_then(|()| url::Url::parse(url).map_err(|err| format!("not a URL ({err})")));
        let source = match parsed {
            Ok(parsed) => Source::Url(parsed),
            Err(why) => Source::Invalid(format!(
                "{}: {why}; use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX \
                 or memory://",
                leader_core::redact_url(url)
            )),
        };
        BucketStoreBuilder {
            source,
            options: Vec::new(),
            prefix: None,
            timeout: Duration::from_secs(5),
        }
    }

    /// A store on an `object_store` client the caller built (its own credentials, retries,
    /// HTTP client; install a rustls crypto provider before building it, see
    /// [`ensure_crypto_provider`]), named `name` in
    /// messages. Turn its retries off (`RetryConfig { max_retries: 0, .. }`) and keep its
    /// timeout below the elector's renew deadline, as [`BucketStore::from_url`] does. A store that ignores preconditions is refused
    /// by [`check_conditional_writes`](Self::check_conditional_writes), which runs before the
    /// first write.
    pub fn builder(store: Arc<dyn ObjectStore>, name: impl Into<String>) -> BucketStoreBuilder {
        BucketStoreBuilder {
            source: Source::Store {
                store,
                name: name.into(),
            },
            options: Vec::new(),
            prefix: None,
            timeout: Duration::from_secs(5),
        }
    }

    /// The key prefix of the records.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The `object_store` client.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner.store
    }

    /// Makes sure the store keeps preconditions before anything relies on them: it asks to
    /// replace an object under the prefix that no one wrote ([`PROBE_NAME`] and a random
    /// number) only if it has an ETag that no object has. A store that keeps preconditions
    /// refuses (412, or 404 as the object is absent) and writes nothing; one that ignores them
    /// writes the object, and is refused. The object is a new one at every store: a store that
    /// checks preconditions only on objects that exist (MinIO before RELEASE.2025-09-06, which
    /// also took `If-None-Match: *` for an overwrite before RELEASE.2024-05-07) would pass a
    /// check of an object an earlier check wrote. One request, once per store (every lock runs
    /// it before its first write); a refusal stands for the store's life too, so a broken
    /// store gets one object at most.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] when the store ignores preconditions or has none; the
    /// store's own errors otherwise (unreachable, access denied: the check needs the
    /// permission to write under the prefix, as the lock does), which are asked again.
    pub async fn check_conditional_writes(&self) -> Result<(), LockError> {
        let answer = self
            .inner
            .checked
            .get_or_try_init(|| async {
                match self.probe().await {
                    Ok(()) => Ok(Ok(())),
                    Err(LockError::Misconfigured { message, .. }) => Ok(Err(message)),
                    Err(err) => Err(err),
                }
            })
            .await?;
        answer.clone().map_err(|message| LockError::Misconfigured {
            backend: BACKEND,
            message,
        })
    }

    async fn probe(&self) -> Result<(), LockError> {
        let key = format!(
            "{}{PROBE_NAME}-{:016x}",
            self.inner.prefix,
            fastrand::u64(..)
        );
        let path = Path::from(key.as_str());
        let options = PutOptions {
            mode: PutMode::Update(UpdateVersion {
                e_tag: Some("\"leader-no-such-etag\"".to_owned()),
                // Not 0: Cloud Storage reads generation 0 as "only if absent".
                version: Some("1".to_owned()),
            }),
            ..PutOptions::default()
        };
        let context = format!("{} object {key}", self.inner.name);
        let refuse = |why: &str| LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: {why}; the lock needs a store that keeps If-Match and If-None-Match \
                 on writes (S3, Google Cloud Storage, Azure Blob Storage, MinIO, R2, ...)"
            ),
        };
        match self
            .inner
            .store
            .put_opts(&path, PutPayload::from_static(b"probe"), options)
            .await
        {
            Err(
                err @ (object_store::Error::Precondition { .. }
                | object_store::Error::NotFound { .. }),
            ) if !is_missing_bucket(&err) => Ok(()),
            Ok(_) => {
                tracing::error!(store = %self.inner.name, %key, "the store ignored a precondition");
                Err(refuse(
                    "the store wrote an object although its precondition (If-Match) failed",
                ))
            }
            Err(
                err @ (object_store::Error::NotImplemented { .. }
                | object_store::Error::NotSupported { .. }),
            ) => Err(refuse(&format!(
                "the store has no conditional update: {}",
                scrub(&chain(&err))
            ))),
            Err(err) => Err(map(
                &context,
                self.inner.kind,
                &self.resource(),
                Op::Write,
                err,
            )),
        }
    }

    /// `bucket/prefix`, for the permissions a 403 names.
    pub(crate) fn resource(&self) -> String {
        if self.inner.bucket.is_empty() {
            self.inner.prefix.clone()
        } else {
            format!("{}/{}", self.inner.bucket, self.inner.prefix)
        }
    }
}
