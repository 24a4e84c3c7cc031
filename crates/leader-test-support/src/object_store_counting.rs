//! An `object_store` wrapper that counts the requests a lock makes, by kind and answer, and can
//! play a store that ignores preconditions, or keeps them only in part (as some S3-compatible
//! servers do).
//!
//! With retries off (as the object storage lock sets them), each `put_opts` and `get_opts` of a
//! small object is one HTTP request, so these counts are the store's request counts.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures_util::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// Counts requests to the store it wraps.
#[derive(Debug)]
pub struct Counting {
    inner: Arc<dyn ObjectStore>,
    counts: Mutex<BTreeMap<String, usize>>,
    preconditions: Preconditions,
}

/// Which preconditions of a write the store keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Preconditions {
    /// All of them.
    Kept,
    /// None: every write is unconditional.
    Ignored,
    /// `If-Match` on an object that exists, and nothing else: an update of an absent object
    /// writes it, and a create (`If-None-Match: *`) overwrites one that exists, as MinIO from
    /// 2023-02 to RELEASE.2024-05-07 does.
    OnExistingObjects,
}

impl fmt::Display for Counting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Counting({})", self.inner)
    }
}

impl Counting {
    /// Counts the requests to `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            counts: Mutex::default(),
            preconditions: Preconditions::Kept,
        })
    }

    /// Writes every object unconditionally, whatever the request's precondition: a broken
    /// store, which the lock must refuse.
    pub fn ignoring_preconditions(inner: Arc<dyn ObjectStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            counts: Mutex::default(),
            preconditions: Preconditions::Ignored,
        })
    }

    /// Keeps `If-Match` on objects that exist, and no other precondition: a store the lock
    /// must refuse, though a check of an object that exists would pass.
    pub fn checking_preconditions_only_on_existing_objects(
        inner: Arc<dyn ObjectStore>,
    ) -> Arc<Self> {
        Arc::new(Self {
            inner,
            counts: Mutex::default(),
            preconditions: Preconditions::OnExistingObjects,
        })
    }

    /// Requests so far, by kind: `GET 200`, `GET 304`, `GET 404`, `PUT create 200`,
    /// `PUT update 412`, ...
    pub fn counts(&self) -> BTreeMap<String, usize> {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// All requests so far.
    pub fn total(&self) -> usize {
        self.counts().values().sum()
    }

    fn count(&self, kind: String) {
        *self
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(kind)
            .or_default() += 1;
    }
}

fn answer<T>(result: &Result<T>) -> &'static str {
    use object_store::Error as E;
    match result {
        Ok(_) => "200",
        Err(E::NotModified { .. }) => "304",
        Err(E::NotFound { .. }) => "404",
        Err(E::Precondition { .. } | E::AlreadyExists { .. }) => "412",
        Err(E::PermissionDenied { .. }) => "403",
        Err(_) => "error",
    }
}

#[async_trait]
impl ObjectStore for Counting {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        mut opts: PutOptions,
    ) -> Result<PutResult> {
        let mode = match opts.mode {
            PutMode::Overwrite => "overwrite",
            PutMode::Create => "create",
            PutMode::Update(_) => "update",
        };
        let unconditional = match (self.preconditions, &opts.mode) {
            (Preconditions::Kept, _) => false,
            (Preconditions::Ignored, _) | (Preconditions::OnExistingObjects, PutMode::Create) => {
                true
            }
            (Preconditions::OnExistingObjects, _) => {
                object_store::ObjectStoreExt::head(&*self.inner, location)
                    .await
                    .is_err()
            }
        };
        if unconditional {
            opts.mode = PutMode::Overwrite;
        }
        let result = self.inner.put_opts(location, payload, opts).await;
        self.count(format!("PUT {mode} {}", answer(&result)));
        result
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.count("multipart".to_owned());
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let method = if options.head { "HEAD" } else { "GET" };
        let result = self.inner.get_opts(location, options).await;
        self.count(format!("{method} {}", answer(&result)));
        result
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.count("DELETE".to_owned());
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.count("LIST".to_owned());
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.count("LIST".to_owned());
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.count("COPY".to_owned());
        self.inner.copy_opts(from, to, options).await
    }
}
