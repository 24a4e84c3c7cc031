//! A `tower` layer that lets requests through only while this replica leads (feature `tower`).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Request, Response, StatusCode};
use leader_core::{ElectorStatus, LeaderElector, LeaderState, LeaderView};
use tokio::sync::watch;
use tower::{Layer, Service};

/// A [`tower::Layer`] that lets requests through only while this replica leads, for the
/// endpoints only the leader may answer (a webhook, an admin API, a queue consumer's HTTP
/// side). Other replicas answer `503 Service Unavailable` with `Retry-After` and the
/// [`LeaderView`] as JSON, which names the leader (`"leader"`, or `null` while nobody leads).
///
/// - A request let through carries the term's [`Leadership`](leader_core::Leadership) in its
///   extensions (axum: `Extension<Leadership>`), for the fencing token of its writes.
/// - It runs only while the term lasts: when the term ends (a step-down, a handover, a renew
///   deadline missed), the request's future is dropped at once and the client gets the 503, as
///   [`Leadership::run`](leader_core::Leadership::run) does. Its clone of the leadership counts
///   as the term's work, so the elector releases the lease only once it is gone (S6): no
///   request admitted by the old leader runs beside the next leader's.
/// - A client that got a 503 may retry after `Retry-After` (the elector's retry period, in
///   whole seconds, unless [`retry_after`](Self::retry_after) says otherwise), through a load
///   balancer that sends it to any replica, or to the leader the body names.
///
/// With axum, `route_layer` puts it on the routes that need it:
///
/// ```
/// # use std::time::Duration;
/// use axum::{Extension, Router, routing::post};
/// use leader::{LeaderElector, LeaderOnlyLayer, Leadership, MemoryLock};
///
/// # fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let identity = leader::default_identity(); // the pod name, else host name and process id
/// let elector = LeaderElector::builder(MemoryLock::new("webhooks", &identity)).build()?;
/// let app: Router = Router::new()
///     .route("/hook", post(|Extension(term): Extension<Leadership>| async move {
///         format!("handled under fencing token {}", term.fencing_token())
///     }))
///     .route_layer(LeaderOnlyLayer::new(&elector));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct LeaderOnlyLayer {
    state: watch::Receiver<LeaderState>,
    status: ElectorStatus,
    retry_after: HeaderValue,
}

impl fmt::Debug for LeaderOnlyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderOnlyLayer")
            .field("leading", &self.state.borrow().is_leading())
            .field("retry_after", &self.retry_after)
            .finish_non_exhaustive()
    }
}

impl LeaderOnlyLayer {
    /// A layer that follows `elector`'s leadership; build it before running the elector.
    pub fn new(elector: &LeaderElector) -> Self {
        Self {
            state: elector.subscribe(),
            status: elector.status(),
            retry_after: whole_seconds(elector.config().lease.retry_period),
        }
    }

    /// The `Retry-After` of a 503, rounded up to whole seconds (RFC 9110 gives it in seconds),
    /// at least one (default: the elector's retry period).
    #[must_use]
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = whole_seconds(after);
        self
    }

    /// The 503 a request gets when this replica does not lead.
    fn unavailable<B: From<String>>(&self) -> Response<B> {
        unavailable(&self.status.view(), self.retry_after.clone())
    }
}

fn whole_seconds(after: Duration) -> HeaderValue {
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    HeaderValue::from(seconds.max(1))
}

fn unavailable<B: From<String>>(view: &LeaderView, retry_after: HeaderValue) -> Response<B> {
    let body = serde_json::to_string(view).unwrap_or_default();
    let mut response = Response::new(B::from(body));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, retry_after);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

impl<S> Layer<S> for LeaderOnlyLayer {
    type Service = LeaderOnly<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LeaderOnly {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`LeaderOnlyLayer`] wraps around `S`.
#[derive(Clone)]
pub struct LeaderOnly<S> {
    inner: S,
    layer: LeaderOnlyLayer,
}

impl<S> fmt::Debug for LeaderOnly<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderOnly")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for LeaderOnly<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: From<String> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        // A counted clone: the elector waits for it before releasing (S6).
        let leadership = self.layer.state.borrow().leadership().cloned();
        let Some(leadership) = leadership else {
            let response = self.layer.unavailable();
            return Box::pin(std::future::ready(Ok(response)));
        };
        let mut inner = take_ready(&mut self.inner);
        request.extensions_mut().insert(leadership.clone());
        let answer = inner.call(request);
        let layer = self.layer.clone();
        Box::pin(async move {
            match leadership.run(answer).await {
                Ok(answered) => answered,
                Err(_lost) => Ok(layer.unavailable()),
            }
        })
    }
}

/// The service that was polled ready, to take the request; a clone stays for the next one
/// (tower's `poll_ready` contract: the service polled is the one called).
pub(crate) fn take_ready<S: Clone>(inner: &mut S) -> S {
    let ready = inner.clone();
    std::mem::replace(inner, ready)
}
