//! The wall clock requests are signed with. DynamoDB refuses a request signed more than five
//! minutes from its own time (`InvalidSignatureException`, "Signature expired"), and the SDK
//! signs with the host's clock as it is: a host whose clock stepped an hour would fail every
//! request, its leader would lose its term, and it could never lead again until someone set
//! its clock (against S14: a wall clock's step never changes who leads). Every answer's `Date`
//! says the server's time; where the host's clock is off by a minute or more, requests are
//! signed by the server's time from then on, as other AWS SDKs correct a clock's skew. One
//! request fails at most: the one whose answer told the skew.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use aws_sdk_dynamodb::config::interceptors::BeforeDeserializationInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::primitives::{DateTime, DateTimeFormat};
use aws_smithy_async::time::{SharedTimeSource, TimeSource};

/// Below this, a difference between the host's clock and the server's is the `Date` header's
/// whole seconds and the answer's time on the way, not a skew.
const SKEW: Duration = Duration::from_secs(60);

/// The host's clock (`local`, as the SDK's configuration has it), corrected by the skew the
/// server's answers told, in milliseconds (the server's time less the host's).
#[derive(Debug, Clone)]
pub(crate) struct ServerTime {
    local: SharedTimeSource,
    skew_ms: Arc<AtomicI64>,
}

impl ServerTime {
    pub(crate) fn new(local: SharedTimeSource) -> Self {
        Self {
            local,
            skew_ms: Arc::default(),
        }
    }

    /// The interceptor that learns the skew from every answer.
    pub(crate) fn learner(&self) -> LearnSkew {
        LearnSkew(self.clone())
    }

    /// Learns from an answer sent at `server` (its `Date`), read now by the host's clock.
    fn learn(&self, server: SystemTime) {
        let local = self.local.now();
        let skew = match server.duration_since(local) {
            Ok(ahead) => i64::try_from(ahead.as_millis()).unwrap_or(i64::MAX),
            Err(behind) => i64::try_from(behind.duration().as_millis()).map_or(i64::MIN, |ms| -ms),
        };
        let kept = if skew.unsigned_abs() >= SKEW.as_millis() as u64 {
            skew
        } else {
            0
        };
        if self.skew_ms.swap(kept, Ordering::AcqRel) != kept && kept != 0 {
            tracing::warn!(
                skew_seconds = kept / 1000,
                "this host's wall clock is off from DynamoDB's; requests are signed by DynamoDB's time"
            );
        }
    }
}

impl TimeSource for ServerTime {
    fn now(&self) -> SystemTime {
        let local = self.local.now();
        let skew = self.skew_ms.load(Ordering::Acquire);
        let by = Duration::from_millis(skew.unsigned_abs());
        if skew >= 0 {
            local.checked_add(by).unwrap_or(local)
        } else {
            local.checked_sub(by).unwrap_or(local)
        }
    }
}

/// Reads the `Date` of every answer, refused or not, into a [`ServerTime`].
#[derive(Debug)]
pub(crate) struct LearnSkew(ServerTime);

impl Intercept for LearnSkew {
    fn name(&self) -> &'static str {
        "LearnSkew"
    }

    fn read_after_transmit(
        &self,
        context: &BeforeDeserializationInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let date = context
            .response()
            .headers()
            .get("date")
            .and_then(|date| DateTime::from_str(date, DateTimeFormat::HttpDate).ok())
            .and_then(|date| SystemTime::try_from(date).ok());
        if let Some(date) = date {
            self.0.learn(date);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed(SystemTime);

    impl TimeSource for Fixed {
        fn now(&self) -> SystemTime {
            self.0
        }
    }

    /// A skew of a minute or more is corrected, either way; less is left alone.
    #[test]
    fn a_skew_of_a_minute_or_more_is_corrected() {
        let host = SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000);
        let time = ServerTime::new(SharedTimeSource::new(Fixed(host)));
        assert_eq!(time.now(), host);
        for server in [
            host + Duration::from_secs(3600),
            host - Duration::from_secs(3600),
            host + Duration::from_secs(60),
        ] {
            time.learn(server);
            assert_eq!(time.now(), server);
        }
        time.learn(host + Duration::from_secs(59));
        assert_eq!(time.now(), host, "within a minute: the host's own");
    }
}
