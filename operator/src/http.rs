//! The operator's HTTP listener: `/metrics` (the `OpenMetrics` text format), `/healthz` (the process answers)
//! and `/readyz` (the controller runs, or this replica stands by healthy for the leader Lease).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::{self, Metrics};

/// Where the process is in its life, as `/readyz` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ProcessState {
    /// Connecting, or not yet holding nor watching the Lease.
    Starting = 0,
    /// Another replica leads; this one watches the Lease to take over.
    StandingBy = 1,
    /// The controller runs.
    Running = 2,
    /// Shutting down (a signal, or the Lease was lost).
    Stopping = 3,
}

impl ProcessState {
    fn from_u8(value: u8) -> Self {
        match value {
            1 => Self::StandingBy,
            2 => Self::Running,
            3 => Self::Stopping,
            _ => Self::Starting,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::StandingBy => "standing by",
            Self::Running => "running",
            Self::Stopping => "stopping",
        }
    }

    /// A replica standing by is ready: it is healthy, and a Service may route to it (it serves
    /// `/metrics`); only one replica acts on runs at a time anyway.
    pub fn is_ready(self) -> bool {
        matches!(self, Self::StandingBy | Self::Running)
    }
}

/// The [`ProcessState`], shared between the runtime that sets it and the endpoint that reads it.
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<AtomicU8>);

impl Health {
    pub fn set(&self, state: ProcessState) {
        self.0.store(state as u8, Ordering::Release);
    }

    pub fn get(&self) -> ProcessState {
        ProcessState::from_u8(self.0.load(Ordering::Acquire))
    }
}

#[derive(Debug, Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Health,
}

/// The routes of the listener.
pub fn router(metrics: Arc<Metrics>, health: Health) -> Router {
    Router::new()
        .route("/metrics", get(serve_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(AppState { metrics, health })
}

async fn serve_metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        state.metrics.encode(),
    )
}

async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let process = state.health.get();
    let code = if process.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, format!("{}\n", process.as_str()))
}

/// Serves `router` on `listener` until `shutdown` resolves, then finishes the requests in flight.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::oneshot;

    use super::*;

    /// One HTTP/1.1 GET over a fresh connection: (status code, body).
    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("request");
        let mut response = String::new();
        stream
            .read_to_string(&mut response)
            .await
            .expect("response");
        let code = response
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {response:?}"));
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default();
        (code, body)
    }

    #[tokio::test]
    async fn the_listener_serves_health_readiness_and_metrics() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local address");
        let health = Health::default();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            listener,
            router(Arc::new(Metrics::default()), health.clone()),
            async {
                let _ = stopped.await;
            },
        ));

        assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_owned()));
        assert_eq!(get(addr, "/readyz").await, (503, "starting\n".to_owned()));
        health.set(ProcessState::StandingBy);
        assert_eq!(get(addr, "/readyz").await.0, 200);
        health.set(ProcessState::Running);
        assert_eq!(get(addr, "/readyz").await, (200, "running\n".to_owned()));
        let (code, body) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        assert!(
            body.contains("trajectory_operator_runs{phase=\"Running\"} 0"),
            "{body}"
        );
        assert_eq!(get(addr, "/nothing").await.0, 404);
        health.set(ProcessState::Stopping);
        assert_eq!(get(addr, "/readyz").await.0, 503);

        stop.send(()).expect("server still running");
        server.await.expect("server task").expect("server");
    }
}
