//! Mapping of `object_store` errors onto the core's error kinds.

use leader_core::LockError;

pub(crate) const BACKEND: &str = "object-store";

/// The kind of store, for the permission a 403 asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    S3,
    Gcs,
    Azure,
    Memory,
    /// A store the caller built: the permission is named generically.
    Other,
}

/// What the request was doing, for the permission a 403 asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Write,
}

impl Kind {
    /// The kind of a store built elsewhere, from how object_store names it (`AmazonS3(bucket)`,
    /// `GoogleCloudStorage(bucket)`, `MicrosoftAzure { .. }`, `InMemory`), so that a 403 names
    /// the right permission; [`Kind::Other`] for any other store or a wrapper.
    pub(crate) fn of(store: &dyn object_store::ObjectStore) -> Self {
        let name = store.to_string();
        if name.starts_with("AmazonS3") {
            Self::S3
        } else if name.starts_with("GoogleCloudStorage") {
            Self::Gcs
        } else if name.starts_with("MicrosoftAzure") {
            Self::Azure
        } else if name.starts_with("InMemory") {
            Self::Memory
        } else {
            Self::Other
        }
    }

    /// The permission `op` needs on `resource` (`bucket/prefix`).
    pub(crate) fn permission(self, op: Op, resource: &str) -> String {
        match (self, op) {
            (Self::S3, Op::Read) => {
                let bucket = resource.split('/').next().unwrap_or_default();
                format!(
                    "the credentials need s3:GetObject on arn:aws:s3:::{resource}*, and \
                     s3:ListBucket on arn:aws:s3:::{bucket} (without it S3 answers 403 for an \
                     object that does not exist yet)"
                )
            }
            (Self::S3, Op::Write) => format!(
                "the credentials need s3:PutObject (and s3:GetObject) on arn:aws:s3:::{resource}*"
            ),
            (Self::Gcs, Op::Read) => {
                format!("the service account needs storage.objects.get on gs://{resource}*")
            }
            (Self::Gcs, Op::Write) => format!(
                "the service account needs storage.objects.create and storage.objects.delete \
                 (Cloud Storage asks for both to replace an object) on gs://{resource}*"
            ),
            (Self::Azure, Op::Read) => format!(
                "the identity needs Microsoft.Storage/storageAccounts/blobServices/containers/blobs/read on {resource}*"
            ),
            (Self::Azure, Op::Write) => format!(
                "the identity needs Microsoft.Storage/storageAccounts/blobServices/containers/blobs/write (and read) on {resource}*"
            ),
            (Self::Memory | Self::Other, Op::Read) => format!("read access to {resource}*"),
            (Self::Memory | Self::Other, Op::Write) => format!("write access to {resource}*"),
        }
    }
}

/// Maps an error that is not one the caller handles itself (absent object, lost precondition).
///
/// `context` names the store and the key. The error's own text names the request's URL, whose
/// query (where Azure puts a SAS token) is cut off.
pub(crate) fn map(
    context: &str,
    kind: Kind,
    resource: &str,
    op: Op,
    err: object_store::Error,
) -> LockError {
    use object_store::Error as E;
    let text = scrub(&chain(&err));
    match err {
        E::PermissionDenied { .. } => LockError::Forbidden {
            backend: BACKEND,
            message: format!(
                "{context}: access denied; {}",
                kind.permission(op, resource)
            ),
        },
        E::Unauthenticated { .. } => LockError::Forbidden {
            backend: BACKEND,
            message: format!("{context}: the store refused the credentials: {text}"),
        },
        E::NotImplemented { .. } | E::NotSupported { .. } => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: the store has no conditional writes, which the lock needs: {text}"
            ),
        },
        // The store's whole answer (an XML body, object_store's wording for the 404 it turned
        // into a precondition failure) says no more than this.
        _ if names_missing_bucket(&text) => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: the bucket does not exist; create it, or fix the bucket in the URL"
            ),
        },
        _ if let Some(code) = blob_refusal(&text) => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: the store refuses to write the object ({code}): a lease on the blob \
                 that the lock did not take (break it), or an immutability policy or legal hold \
                 on it"
            ),
        },
        E::InvalidPath { .. } | E::UnknownConfigurationKey { .. } => LockError::Misconfigured {
            backend: BACKEND,
            message: format!("{context}: {text}"),
        },
        _ => LockError::unavailable(BACKEND, format!("{context}: {text}")),
    }
}

/// Azure's codes for a write refused for the blob's state, never for a lost race: a lease on
/// the blob (the lock takes none: another tool or a person took it), or an immutability
/// policy or legal hold. They come as `409` and `412`, as lost preconditions do, and taken for
/// those, every write would be a conflict, and no one would ever lead, with nothing said.
const BLOB_REFUSALS: [&str; 5] = [
    "LeaseIdMissing",
    "LeaseIdMismatchWithBlobOperation",
    "LeaseLost",
    "BlobImmutableDueToPolicy",
    "BlobImmutableDueToLegalHold",
];

/// The code of a write refused for the blob's state ([`BLOB_REFUSALS`]) that `text` names.
fn blob_refusal(text: &str) -> Option<&'static str> {
    BLOB_REFUSALS
        .into_iter()
        .find(|code| text.contains(&format!("<Code>{code}</Code>")))
}

/// Whether `err`, a write's answer of the kind a lost precondition gets (`409`, `412`, a
/// `404` on `If-Match`), is one: not a missing bucket, nor a blob whose state refuses every
/// write ([`BLOB_REFUSALS`]).
pub(crate) fn is_lost_precondition(err: &object_store::Error) -> bool {
    let text = chain(err);
    !names_missing_bucket(&text) && blob_refusal(&text).is_none()
}

/// Whether an error (a 404, or a lost precondition that was a 404) says the bucket itself is
/// missing (S3 `NoSuchBucket`, Azure `ContainerNotFound`, Cloud Storage's message), not the
/// object.
pub(crate) fn names_missing_bucket(text: &str) -> bool {
    ["NoSuchBucket", "ContainerNotFound", "bucket does not exist"]
        .iter()
        .any(|code| text.contains(code))
}

/// Whether `err` is a missing bucket.
pub(crate) fn is_missing_bucket(err: &object_store::Error) -> bool {
    names_missing_bucket(&chain(err))
}

/// An error's text with its sources, as one line.
pub(crate) fn chain(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !message.contains(&cause_text) {
            message.push_str(": ");
            message.push_str(&cause_text);
        }
        source = cause.source();
    }
    message
}

/// `text` with what may carry a credential taken out: the query of every URL (where a SAS
/// token or a presigned signature travels) and every element of the store's XML error
/// answers but their `Code` and `Message` ([`error_documents_reduced`]).
pub(crate) fn scrub(text: &str) -> String {
    error_documents_reduced(&queries_cut(text))
}

/// `text` with each XML error answer in it (S3's and Azure's `<Error>...</Error>`) reduced to
/// its `Code` and `Message`. The other elements echo the request's credentials: S3 an expired
/// or invalid session token (`Token-0`), a signature it did not match (`SignatureProvided`,
/// `StringToSign`, `CanonicalRequest`); Azure the signature it did not match
/// (`AuthenticationErrorDetail`). An answer cut short loses all that follows its start.
fn error_documents_reduced(text: &str) -> String {
    const START: &str = "<Error";
    const END: &str = "</Error>";
    let element = |document: &str, name: &str| {
        let open = format!("<{name}>");
        let start = document.find(&open)? + open.len();
        let len = document[start..].find(&format!("</{name}>"))?;
        Some(document[start..start + len].to_owned())
    };
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    // `<Error>`, or `<Error` with attributes (a namespace), not `<ErrorCode>` and the like.
    let next = |rest: &str| {
        rest.match_indices(START)
            .map(|(at, _)| at)
            .find(|&at| matches!(rest[at + START.len()..].chars().next(), Some('>' | ' ')))
    };
    while let Some(start) = next(rest) {
        out.push_str(&rest[..start]);
        let document = &rest[start..];
        let (document, after) = match document.find(END) {
            Some(end) => document.split_at(end + END.len()),
            None => (document, ""),
        };
        let code = element(document, "Code").unwrap_or_default();
        let message = element(document, "Message").unwrap_or_default();
        out.push_str(&format!(
            "<Error><Code>{code}</Code><Message>{message}</Message>"
        ));
        out.push_str(if after.is_empty() && !document.ends_with(END) {
            "(the rest of the answer left out)"
        } else {
            "(other elements left out)</Error>"
        });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// `text` with the query of every URL in it cut off.
fn queries_cut(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("://") {
        let (before, after) = rest.split_at(start);
        out.push_str(before);
        let end = after
            .find(|c: char| c.is_whitespace() || c == '"' || c == '\'' || c == ',')
            .unwrap_or(after.len());
        let url = &after[..end];
        match url.find('?') {
            Some(query) => {
                out.push_str(&url[..query]);
                out.push_str("?(redacted)");
            }
            None => out.push_str(url),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_of_urls_are_cut_off() {
        let text = "Error performing PUT https://acct.blob.core.windows.net/c/k?sv=2022&sig=SECRET in 1s, \
                    then GET http://127.0.0.1:9/b/k done";
        let scrubbed = scrub(text);
        assert!(!scrubbed.contains("SECRET"), "{scrubbed}");
        assert!(scrubbed.contains("https://acct.blob.core.windows.net/c/k?(redacted) in 1s"));
        assert!(scrubbed.contains("http://127.0.0.1:9/b/k done"));
    }

    /// An error answer keeps its code and message, and loses what echoes a credential.
    #[test]
    fn error_answers_keep_their_code_and_message_only() {
        let text = "Error performing PUT http://127.0.0.1:9/b/k in 1ms - Server returned \
            non-2xx status code: 400 Bad Request: <?xml version=\"1.0\"?><Error>\
            <Code>ExpiredToken</Code><Message>The provided token has expired.</Message>\
            <Token-0>SECRET-TOKEN</Token-0><RequestId>R</RequestId></Error> then <Error \
            xmlns=\"x\"><Code>SignatureDoesNotMatch</Code><StringToSign>SECRET-SIGNED</StringToSign>";
        let scrubbed = scrub(text);
        assert!(!scrubbed.contains("SECRET"), "{scrubbed}");
        for kept in [
            "400 Bad Request",
            "<Code>ExpiredToken</Code><Message>The provided token has expired.</Message>",
            " then <Error><Code>SignatureDoesNotMatch</Code>",
        ] {
            assert!(scrubbed.contains(kept), "{kept}: {scrubbed}");
        }
        assert!(names_missing_bucket(&scrub(
            "<Error><Code>NoSuchBucket</Code><BucketName>b</BucketName></Error>"
        )));
    }

    #[test]
    fn stores_built_elsewhere_are_recognised() {
        crate::ensure_crypto_provider();
        let s3 = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name("b")
            .with_region("us-east-1")
            .build()
            .expect("an S3 client");
        assert_eq!(Kind::of(&s3), Kind::S3);
        assert_eq!(
            Kind::of(&object_store::memory::InMemory::new()),
            Kind::Memory
        );
    }

    #[test]
    fn a_403_names_the_permission() {
        let err = object_store::Error::PermissionDenied {
            path: "leader/app".into(),
            source: "AccessDenied".into(),
        };
        let mapped = map("s3://b/leader/app", Kind::S3, "b/leader/", Op::Write, err);
        let text = mapped.to_string();
        assert!(matches!(mapped, LockError::Forbidden { .. }), "{mapped:?}");
        assert!(text.contains("s3:PutObject"), "{text}");
        assert!(text.contains("arn:aws:s3:::b/leader/*"), "{text}");
    }
}
