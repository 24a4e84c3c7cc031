//! Mapping of DynamoDB's errors onto the core's error kinds, naming the IAM action to grant.

use std::time::Duration;

use aws_credential_types::provider::error::CredentialsError;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use leader_core::LockError;

pub(crate) const BACKEND: &str = "dynamodb";

/// Where a request went, for messages: the lock (or table) and the table's ARN as far as it is
/// known, for the permission a denial names.
#[derive(Clone, Debug)]
pub(crate) struct Context {
    /// `dynamodb:TABLE/NAME` or `dynamodb:TABLE`.
    pub(crate) what: String,
    /// `arn:aws:dynamodb:REGION:ACCOUNT:table/TABLE`, with `ACCOUNT` spelt out when unknown.
    pub(crate) arn: String,
    /// The request's timeout.
    pub(crate) timeout: Duration,
}

/// The error codes DynamoDB answers a request it throttled with: retried at the elector's
/// retry period (with its back-off), never at once.
const THROTTLING: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "LimitExceededException",
];

/// Whether `code` is one of DynamoDB's throttling errors.
pub(crate) fn is_throttling(code: &str) -> bool {
    THROTTLING.contains(&code)
}

/// The failure of a credentials provider ([`CredentialsError`]) among the sources of an
/// error whose first source is `source`.
fn credentials_failure<'a>(
    mut source: Option<&'a (dyn std::error::Error + 'static)>,
) -> Option<&'a CredentialsError> {
    while let Some(cause) = source {
        if let Some(failure) = cause.downcast_ref::<CredentialsError>() {
            return Some(failure);
        }
        source = cause.source();
    }
    None
}

/// Whether a credentials provider's failure lasts until someone changes the configuration:
/// none were found anywhere, or what was found is invalid. A provider that timed out or failed
/// (an instance metadata service slow under load, a token service that throttles) may answer
/// the next time.
fn credentials_missing(failure: &CredentialsError) -> bool {
    matches!(
        failure,
        CredentialsError::CredentialsNotLoaded(_) | CredentialsError::InvalidConfiguration(_)
    )
}

/// [`LockError::Forbidden`] for credentials that could not be had, with `text`, the SDK's
/// account of it.
fn no_credentials(what: &str, text: &str) -> LockError {
    LockError::Forbidden {
        backend: BACKEND,
        message: format!(
            "{what}: no AWS credentials could be had (AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY, AWS_PROFILE, a web identity token, or the instance's or \
             container's role): {text}"
        ),
    }
}

/// Maps a failed request other than a lost condition (which the caller handles). `action` is
/// the IAM action the request needs (`dynamodb:GetItem`), for the message of a denial.
pub(crate) fn map<E, R>(
    context: &Context,
    operation: &'static str,
    action: &str,
    err: SdkError<E, R>,
) -> LockError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    let what = &context.what;
    // The credentials are had before a request is sent, so a failure to have them comes as
    // the request's: none anywhere, or invalid, is for good; a provider that timed out or
    // failed is an outage that says what failed.
    if matches!(err, SdkError::DispatchFailure(_))
        && let Some(failure) = credentials_failure(std::error::Error::source(&err))
    {
        let text = DisplayErrorContext(&err).to_string();
        if credentials_missing(failure) {
            return no_credentials(what, &text);
        }
        return LockError::unavailable(
            BACKEND,
            format!("{what}: the AWS credentials could not be had this time: {text}"),
        );
    }
    match &err {
        SdkError::TimeoutError(_) => {
            return LockError::Timeout {
                lock: what.clone(),
                operation,
                after: context.timeout,
            };
        }
        SdkError::DispatchFailure(failure) => {
            let kind = if failure.is_timeout() {
                return LockError::Timeout {
                    lock: what.clone(),
                    operation,
                    after: context.timeout,
                };
            } else if failure.is_io() {
                "could not reach DynamoDB"
            } else {
                "the request failed"
            };
            return LockError::unavailable(
                BACKEND,
                format!("{what}: {kind}: {}", DisplayErrorContext(&err)),
            );
        }
        SdkError::ConstructionFailure(_) => {
            let text = DisplayErrorContext(&err).to_string();
            if credentials_failure(std::error::Error::source(&err)).is_some()
                || text.contains("credentials")
                || text.contains("identity")
            {
                return no_credentials(what, &text);
            }
            return LockError::Misconfigured {
                backend: BACKEND,
                message: format!("{what}: {text}"),
            };
        }
        _ => {}
    }
    let code = err.code().unwrap_or_default().to_owned();
    let message = err.message().unwrap_or_default().to_owned();
    let arn = &context.arn;
    match code.as_str() {
        "AccessDeniedException" => LockError::Forbidden {
            backend: BACKEND,
            message: format!(
                "{what}: access denied: grant {action} on {arn} (deploy/dynamodb/policy.json \
                 lists every action the lock uses): {message}"
            ),
        },
        // Signed by a clock more than five minutes off: the next request is signed by the
        // server's time, which this answer's `Date` told (see `skew`).
        "InvalidSignatureException" if message.contains("Signature expired") => {
            LockError::unavailable(
                BACKEND,
                format!(
                    "{what}: this host's wall clock is more than five minutes off, so DynamoDB \
                     refused the request's signature; the next is signed by DynamoDB's time: \
                     {message}"
                ),
            )
        }
        "UnrecognizedClientException"
        | "InvalidSignatureException"
        | "ExpiredTokenException"
        | "MissingAuthenticationTokenException"
        | "IncompleteSignature" => LockError::Forbidden {
            backend: BACKEND,
            message: format!("{what}: DynamoDB refused the credentials ({code}): {message}"),
        },
        "ResourceNotFoundException" => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{what}: the table does not exist in this region; create it (see the \
                 leader-dynamodb README or deploy/dynamodb), or ask the lock to \
                 (`create_table=true`): {message}"
            ),
        },
        "ValidationException" => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{what}: DynamoDB refused the request ({message}); is the table's key the \
                 lock's (a string partition key `name`)?"
            ),
        },
        code if is_throttling(code) => LockError::unavailable(
            BACKEND,
            format!(
                "{what}: throttled ({code}), retried at the retry period: raise the table's \
                 capacity or use on-demand: {message}"
            ),
        ),
        "" => LockError::unavailable(BACKEND, format!("{what}: {}", DisplayErrorContext(&err))),
        _ => LockError::unavailable(BACKEND, format!("{what}: {code}: {message}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodb::operation::get_item::GetItemError;

    fn context() -> Context {
        Context {
            what: "dynamodb:locks/app".to_owned(),
            arn: "arn:aws:dynamodb:eu-west-1:ACCOUNT:table/locks".to_owned(),
            timeout: Duration::from_secs(5),
        }
    }

    fn service_error(code: &str) -> SdkError<GetItemError, ()> {
        let meta = aws_sdk_dynamodb::error::ErrorMetadata::builder()
            .code(code)
            .message("a message")
            .build();
        SdkError::service_error(GetItemError::generic(meta), ())
    }

    #[test]
    fn a_denial_names_the_action_and_the_table() {
        let mapped = map(
            &context(),
            "get",
            "dynamodb:GetItem",
            service_error("AccessDeniedException"),
        );
        let text = mapped.to_string();
        assert!(matches!(mapped, LockError::Forbidden { .. }), "{mapped:?}");
        assert!(text.contains("dynamodb:GetItem"), "{text}");
        assert!(text.contains("table/locks"), "{text}");
    }

    #[test]
    fn throttling_is_an_outage_and_a_missing_table_a_misconfiguration() {
        for code in THROTTLING {
            let mapped = map(&context(), "get", "dynamodb:GetItem", service_error(code));
            assert!(
                matches!(mapped, LockError::Unavailable { .. }),
                "{mapped:?}"
            );
            assert!(mapped.to_string().contains("throttled"), "{mapped}");
        }
        let missing = service_error("ResourceNotFoundException");
        let mapped = map(&context(), "get", "dynamodb:GetItem", missing);
        assert!(
            matches!(mapped, LockError::Misconfigured { .. }),
            "{mapped:?}"
        );
        assert!(mapped.to_string().contains("create_table=true"), "{mapped}");
    }
}
