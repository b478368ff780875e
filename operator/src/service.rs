//! The process around the controller: the HTTP listener, leader election, and shutdown.
//!
//! ```text
//!  start HTTP (/healthz ok, /readyz 503 "starting")
//!   └─► [leader election] stand by (/readyz 200) ──► Lease acquired
//!        └─► controller runs (/readyz 200 "running") ──► SIGTERM / Lease lost
//!             └─► controller drains (graceful shutdown) ─► Lease released ─► HTTP stops
//! ```
//!
//! A lost Lease ends the process with [`Exit::LostLease`], which `main` turns into a non-zero
//! exit: the Deployment restarts the pod, which stands by again. Continuing to reconcile without
//! the Lease could race the new leader.

use std::future::Future;
use std::sync::Arc;

use kube::Client;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use crate::controller;
use crate::http::{self, Health, ProcessState};
use crate::leader::{Election, LeaderError, LeaseConfig};
use crate::reconcile::Context;
use crate::settings::Settings;

/// How the process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Asked to stop (a signal); the controller drained and the Lease was released.
    Stopped,
    /// Another replica holds the Lease now; this one stopped its controller.
    LostLease,
}

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("leader election: {0}")]
    Leader(#[from] LeaderError),
    #[error("HTTP listener: {0}")]
    Http(#[source] std::io::Error),
}

/// Runs the operator until `shutdown` resolves or the Lease is lost: serves HTTP on `listener`,
/// competes for `lease` (none: this replica always leads), and runs the controller while leading.
pub async fn run(
    client: Client,
    settings: Settings,
    listener: TcpListener,
    lease: Option<LeaseConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Exit, ServiceError> {
    let ctx = Context::new(client.clone(), settings);
    let metrics = ctx.metrics.clone();
    let health = Health::default();
    // Everything that must stop watches this one flag.
    let (stop, stopping) = watch::channel(false);
    let stop = Arc::new(stop);

    let server = tokio::spawn(http::serve(
        listener,
        http::router(metrics.clone(), health.clone()),
        stopped(stopping.clone()),
    ));
    let signal = tokio::spawn({
        let stop = stop.clone();
        async move {
            shutdown.await;
            info!("shutting down");
            stop.send_replace(true);
        }
    });

    let mut election = None;
    let mut lost_lease = None;
    if let Some(lease) = lease {
        let mut started = Election::start(client, lease).await?;
        health.set(ProcessState::StandingBy);
        info!(
            lease = %started.config().name,
            namespace = %started.config().namespace,
            identity = %started.config().identity,
            "standing by for the leader Lease"
        );
        tokio::select! {
            acquired = started.acquired() => acquired?,
            () = stopped(stopping.clone()) => {
                health.set(ProcessState::Stopping);
                started.step_down().await?;
                return finish(server, signal, &stop, Exit::Stopped).await;
            }
        }
        info!("leading");
        lost_lease = Some(tokio::spawn({
            let lost = started.lost();
            let stop = stop.clone();
            async move {
                lost.await;
                warn!("lost the leader Lease; stopping the controller");
                stop.send_replace(true);
            }
        }));
        election = Some(started);
    }

    metrics.set_leader(true);
    health.set(ProcessState::Running);
    controller::run(ctx, stopped_sync(stopping.clone())).await;
    health.set(ProcessState::Stopping);
    metrics.set_leader(false);

    let mut exit = Exit::Stopped;
    if let Some(election) = election {
        if !election.is_leader() {
            exit = Exit::LostLease;
        }
        // The watcher of the Lease holds a receiver of its state: it must end before the
        // manager can.
        if let Some(task) = lost_lease {
            task.abort();
            let _ = task.await;
        }
        if let Err(error) = election.step_down().await {
            warn!(%error, "releasing the leader Lease failed; it expires by itself");
        }
    }
    finish(server, signal, &stop, exit).await
}

/// Stops the HTTP listener and waits for it.
async fn finish(
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    signal: tokio::task::JoinHandle<()>,
    stop: &watch::Sender<bool>,
    exit: Exit,
) -> Result<Exit, ServiceError> {
    stop.send_replace(true);
    signal.abort();
    match server.await {
        Ok(Ok(())) | Err(_) => Ok(exit),
        Ok(Err(error)) => Err(ServiceError::Http(error)),
    }
}

/// Resolves once the stop flag is set (or its sender is gone).
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// [`stopped`] as a `Sync` future, which the controller's graceful shutdown asks for.
fn stopped_sync(stopping: watch::Receiver<bool>) -> impl Future<Output = ()> + Send + Sync {
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        stopped(stopping).await;
        let _ = tx.send(());
    });
    async move {
        let _ = rx.await;
    }
}

/// Resolves on SIGTERM (what Kubernetes sends a pod) or Ctrl-C.
pub async fn termination_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(error) => {
                warn!(%error, "cannot handle SIGTERM; only Ctrl-C stops gracefully");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
