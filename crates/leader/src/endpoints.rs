//! A `tower` layer that answers who leads and the probes, in front of any service (feature
//! `tower`).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use leader_core::{ElectorStatus, HealthCheck, LeaderElector};
use tower::{Layer, Service};

/// The tolerance of the liveness and readiness checks [`LeaderEndpointsLayer::new`] uses: a
/// leader whose last renewal is older than a lease plus this is stuck (`/healthz` fails), a
/// replica the store has not answered for a lease plus this could not take over (`/readyz`
/// fails). 5 s, as `leader run --serve`; with the default lease of 15 s a probe fails after
/// 20 s, client-go's usual `HealthzAdaptor` timeout. Probe every 10 s and restart after 3
/// failures, so that one slow store round-trip restarts nothing.
pub const DEFAULT_HEALTH_TOLERANCE: Duration = Duration::from_secs(5);

/// A [`tower::Layer`] that answers the endpoints every replicated service needs, as
/// `leader run --serve` does, and passes every other request to the service it wraps:
///
/// - `GET /leader`: the [`LeaderView`](leader_core::LeaderView) as JSON (who leads, since
///   when, the fencing token), **200 on the leader and 503 elsewhere**, so that a load
///   balancer's health check on `/leader` routes to the leader;
/// - `GET /readyz`: 200 `ok` unless this replica could not take over
///   ([`HealthCheck::ready`]: the store has not answered for a lease, or another process leads
///   with its identity), then 503 with the reason; with
///   [`ready_only_while_leading`](Self::ready_only_while_leading), 503 also on a follower;
/// - `GET /healthz`: 200 `ok` unless this replica believes it leads although its last renewal
///   is older than its lease ([`HealthCheck::check`]: its loop is stuck; restart it), then 503.
///
/// The paths are the application's choice: the layer answers them before the service it
/// wraps, so an application that has a `/healthz` of its own moves the layer's
/// ([`health_path`](Self::health_path)) or turns it off (`None`), and likewise for the others.
///
/// The service's response body must be buildable from a `String` (`ResBody: From<String>`):
/// axum's `Body`, `String`, and `http_body_util::Full<Bytes>` are; tonic's `Body` is not, so
/// a gRPC server serves these endpoints on an HTTP router of its own (axum, say) beside it.
///
/// With axum, one line on the router (its routes and its fallback):
///
/// ```
/// use axum::{Router, routing::get};
/// use leader::{LeaderElector, LeaderEndpointsLayer, MemoryLock};
///
/// # fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let elector = LeaderElector::builder(MemoryLock::new("reports", &leader::default_identity()))
///     .name("reports")
///     .build()?;
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(LeaderEndpointsLayer::new(&elector));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct LeaderEndpointsLayer {
    status: ElectorStatus,
    health: HealthCheck,
    ready_only_while_leading: bool,
    leader_path: Option<String>,
    ready_path: Option<String>,
    health_path: Option<String>,
}

impl fmt::Debug for LeaderEndpointsLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderEndpointsLayer")
            .field("ready_only_while_leading", &self.ready_only_while_leading)
            .field("leader_path", &self.leader_path)
            .field("ready_path", &self.ready_path)
            .field("health_path", &self.health_path)
            .finish_non_exhaustive()
    }
}

impl LeaderEndpointsLayer {
    /// The endpoints of `elector`, its checks with [`DEFAULT_HEALTH_TOLERANCE`].
    pub fn new(elector: &LeaderElector) -> Self {
        Self::with_health(elector, elector.health_check(DEFAULT_HEALTH_TOLERANCE))
    }

    /// The endpoints of `elector`, its checks as `health` makes them (another tolerance).
    pub fn with_health(elector: &LeaderElector, health: HealthCheck) -> Self {
        Self {
            status: elector.status(),
            health,
            ready_only_while_leading: false,
            leader_path: Some("/leader".to_owned()),
            ready_path: Some("/readyz".to_owned()),
            health_path: Some("/healthz".to_owned()),
        }
    }

    /// Where who leads is served (default `/leader`); `None`: nowhere, the request goes to the
    /// wrapped service.
    #[must_use]
    pub fn leader_path(mut self, path: Option<&str>) -> Self {
        self.leader_path = path.map(str::to_owned);
        self
    }

    /// Where readiness is served (default `/readyz`); `None`: nowhere.
    #[must_use]
    pub fn ready_path(mut self, path: Option<&str>) -> Self {
        self.ready_path = path.map(str::to_owned);
        self
    }

    /// Where liveness is served (default `/healthz`); `None`: nowhere, for an application
    /// whose own `/healthz` must stay its own.
    #[must_use]
    pub fn health_path(mut self, path: Option<&str>) -> Self {
        self.health_path = path.map(str::to_owned);
        self
    }

    /// `/readyz` fails on a replica that does not lead (default `false`): for a Service whose
    /// readiness gates the leader's traffic. A rolling update waits for readiness, so under a
    /// Deployment prefer a leader-only Service by label, and keep this off.
    #[must_use]
    pub fn ready_only_while_leading(mut self, only: bool) -> Self {
        self.ready_only_while_leading = only;
        self
    }

    /// The answer to a request for `path` with `method`, if it is one of the endpoints.
    fn answer<B: From<String>>(&self, method: &Method, path: &str) -> Option<Response<B>> {
        if method != Method::GET && method != Method::HEAD {
            return None;
        }
        let is = |served: &Option<String>| served.as_deref() == Some(path);
        let (code, content_type, body) = if is(&self.leader_path) {
            let view = self.status.view();
            let code = if view.leading {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let json = serde_json::to_string(&view).unwrap_or_default();
            (code, "application/json", json)
        } else if is(&self.ready_path) {
            let (code, text) = self.ready();
            (code, "text/plain; charset=utf-8", text)
        } else if is(&self.health_path) {
            let (code, text) = outcome(self.health.check());
            (code, "text/plain; charset=utf-8", text)
        } else {
            return None;
        };
        let mut response = Response::new(B::from(body));
        *response.status_mut() = code;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        Some(response)
    }

    fn ready(&self) -> (StatusCode, String) {
        if let Err(err) = self.health.ready() {
            return outcome(Err(err));
        }
        if self.ready_only_while_leading {
            let view = self.status.view();
            if !view.leading {
                let leader = view.leader.as_deref().unwrap_or("nobody");
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not leading (ready only while leading); the leader: {leader}"),
                );
            }
        }
        (StatusCode::OK, "ok".to_owned())
    }
}

/// 200 `ok`, or 503 with the reason.
fn outcome<E: fmt::Display>(result: Result<(), E>) -> (StatusCode, String) {
    match result {
        Ok(()) => (StatusCode::OK, "ok".to_owned()),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, err.to_string()),
    }
}

impl<S> Layer<S> for LeaderEndpointsLayer {
    type Service = LeaderEndpoints<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LeaderEndpoints {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`LeaderEndpointsLayer`] wraps around `S`.
#[derive(Clone)]
pub struct LeaderEndpoints<S> {
    inner: S,
    layer: LeaderEndpointsLayer,
}

impl<S> fmt::Debug for LeaderEndpoints<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderEndpoints")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for LeaderEndpoints<S>
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

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if let Some(response) = self.layer.answer(request.method(), request.uri().path()) {
            return Box::pin(std::future::ready(Ok(response)));
        }
        Box::pin(crate::leader_only::take_ready(&mut self.inner).call(request))
    }
}
