//! The controller: watch runs and the Jobs they own, and run the [`reconcile`] pipeline on each
//! change of a run or one of its Jobs.
//!
//! Errors come back typed by stage ([`Error`]). Permanent ones (a spec the operator cannot act on,
//! or children the API server refuses) were already written into the run's status as `Stalled` and
//! `Failed` with an Event, and wait for a change of the run; transient ones (API server errors,
//! conflicts, timeouts) are requeued with a per-run exponential [`Backoff`](crate::settings::Backoff)
//! that resets on the next success.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::batch::v1::Job;
use kube::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use tracing::warn;

use crate::api::TrajectoryRun;
use crate::reconcile::children::{MANAGER, labels};
use crate::reconcile::{Context, Error, reconcile};

/// Transient errors are retried after the run's backoff; permanent ones wait for the run to
/// change (its status already says why).
// The signature is the one `Controller::run` calls.
#[allow(clippy::needless_pass_by_value)]
pub fn error_policy(run: Arc<TrajectoryRun>, error: &Error, ctx: Arc<Context>) -> Action {
    if error.is_permanent() {
        warn!(stage = error.stage().as_str(), %error, "permanent reconcile error; waiting for a change of the run");
        Action::await_change()
    } else {
        let failures = ctx.failed(&run);
        let delay = ctx.settings.pacing.retry.delay(failures);
        warn!(
            stage = error.stage().as_str(),
            %error,
            failures,
            retry_in_ms = delay.as_millis(),
            "transient reconcile error; retrying"
        );
        Action::requeue(delay)
    }
}

/// How long the controller may take to drain after a shutdown request: reconciles in flight finish
/// in well under a second, and a pod's default termination grace is 30 s.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// Runs the controller over every namespace (or the one of `settings.watch_namespace`) until
/// `shutdown` resolves, and its reconciles in flight finish (at most [`DRAIN_LIMIT`] later).
pub async fn run(ctx: Context, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let (runs, jobs): (Api<TrajectoryRun>, Api<Job>) = match &ctx.settings.watch_namespace {
        Some(namespace) => (
            Api::namespaced(ctx.client.clone(), namespace),
            Api::namespaced(ctx.client.clone(), namespace),
        ),
        None => (Api::all(ctx.client.clone()), Api::all(ctx.client.clone())),
    };
    let managed = format!("{}={MANAGER}", labels::MANAGED_BY);
    let controller = Controller::new(runs, watcher::Config::default())
        .owns(jobs, watcher::Config::default().labels(&managed));
    ctx.metrics.count_runs_in(controller.store());
    let shutdown = shutdown.shared();
    let drained = controller
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile, error_policy, Arc::new(ctx))
        .for_each(|result| async move {
            if let Err(error) = result {
                warn!(%error, "reconcile failed");
            }
        });
    // A controller asked to stop before its first list of runs arrived never drains: kube-runtime
    // holds reconciles until its cache is ready, and the shutdown has ended the watch that fills
    // it. Without a limit, a SIGTERM or a lost Lease right at startup would leave the process up.
    tokio::select! {
        () = drained => {}
        () = async {
            shutdown.await;
            tokio::time::sleep(DRAIN_LIMIT).await;
        } => warn!(limit = ?DRAIN_LIMIT, "the controller did not drain in time; stopping it"),
    }
}
