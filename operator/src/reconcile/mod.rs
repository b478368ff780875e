//! The reconcile pipeline of one `TrajectoryRun`, one stage per module:
//!
//! ```text
//!  observe ──► validate ──► decide ──► build ──► apply ──► status
//!  (reads)     (spec, once)  (pure)     (pure)    (SSA)     (pure, then one paced write)
//!     │            │                                │          │
//!     └────────────┴──── Error: permanent → the run stalls (Failed/Stalled, an Event);
//!                                transient → retried with the run's backoff
//! ```
//!
//! - [`observe`]: the run's Jobs, their plan `ConfigMap`s and the summaries of finished pods.
//! - [`validate`]: the spec checked once into a [`ValidatedRun`](validate::ValidatedRun) that the
//!   builders take; a spec that breaks its own rules is refused as a decision, one the operator
//!   cannot build children from is an error.
//! - [`decide`]: which children the run should have and where it stands (plan → attempts →
//!   merge), as a [`Decision`](decide::Decision); no client, no errors.
//! - [`build`]: the `ConfigMap`s and Jobs of the decision, one file per object.
//! - [`apply`]: server-side apply of new children, a merge patch of the live-tunable fields of
//!   existing ones, and the status write.
//! - [`status`]: the status vocabulary (reasons, condition sets, Events) and write pacing.
//!
//! [`children`] names and labels every child; [`queue`] reads the Kueue Workloads of a queued
//! run's Jobs (observe reads them, decide says which to stop or start, apply patches them);
//! [`context`] is what every reconcile shares;
//! [`error`] says which stage failed and whether retrying can help.

mod api_error;
pub mod apply;
pub mod build;
pub mod children;
pub mod context;
pub mod decide;
pub mod error;
pub mod observe;
pub mod queue;
pub mod status;
pub mod validate;

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use tracing::{debug, info, instrument, warn};

use self::build::Children;
pub use self::context::Context;
use self::decide::{Child, Decision, Tasks};
pub use self::error::{Error, Stage};
use self::observe::Observed;
use self::status::StatusWrite;
use self::validate::{Invalid, Validation};
use crate::api::{Phase, TrajectoryRun, TrajectoryRunStatus};
use crate::settings::Settings;

/// Reconciles one run, measured: its duration and result are recorded in the metrics, and a
/// success resets the run's backoff.
#[instrument(skip_all, fields(run = %run.name_any(), namespace = run.namespace().unwrap_or_default()))]
pub async fn reconcile(run: Arc<TrajectoryRun>, ctx: Arc<Context>) -> Result<Action, Error> {
    let mut measure = ctx.metrics.measure_reconcile();
    let result = reconcile_run(&run, &ctx).await;
    match &result {
        Ok(_) => ctx.succeeded(&run),
        Err(error) => measure.failed(error.stage().as_str(), error.class()),
    }
    result
}

async fn reconcile_run(run: &TrajectoryRun, ctx: &Context) -> Result<Action, Error> {
    // Being deleted (a foreground cascade, or another party's finalizer holds it): the garbage
    // collector is removing the children, and applying them again would undo its work.
    if run.metadata.deletion_timestamp.is_some() {
        debug!("being deleted; leaving its children to the garbage collector");
        return Ok(Action::await_change());
    }
    // Boxed: the pipeline's future is large (clippy::large_futures).
    let result = Box::pin(pipeline(run, ctx)).await;
    if let Err(error) = &result
        && error.stalls()
    {
        stall(ctx, run, error).await?;
    }
    result
}

/// observe → (validate → decide → build → status: [`desired_state`]) → apply → write.
async fn pipeline(run: &TrajectoryRun, ctx: &Context) -> Result<Action, Error> {
    // Boxed too: the observed plan summary and run plans make it large (clippy::large_futures).
    let observed = Box::pin(observe::observe(&ctx.client, run, &ctx.observe_cache))
        .await
        .map_err(Error::observe(run))?;
    let desired =
        desired_state(run, &observed, &ctx.settings, &now()).map_err(Error::validate(run))?;
    let namespace = run.namespace().unwrap_or_default();
    // Deletions first: a Job whose pods cannot pull is gone before the one recording its rows
    // is created, so that no more Jobs run at once than the window allows.
    apply::delete(&ctx.client, &namespace, &desired.delete)
        .await
        .map_err(Error::apply(run))?;
    apply::apply(&ctx.client, &namespace, &observed, &desired.children)
        .await
        .map_err(Error::apply(run))?;
    if let Some(queue) = &observed.queue {
        apply::activate(&ctx.client, &namespace, queue.version, &desired.activate)
            .await
            .map_err(Error::apply(run))?;
    }
    let action = write_paced(ctx, run, &desired.status, desired.record_now).await?;
    if action != Action::await_change() {
        return Ok(action);
    }
    // Pods are not watched: a pull that fails shows in a pod's status alone, so a run with image
    // Jobs running looks again after a while. Nor are Kueue's Workloads: a Job waiting in its
    // queue changes only once admitted.
    Ok(if desired.watch_queue {
        Action::requeue(QUEUE_CHECK_INTERVAL)
    } else if desired.watch_pulls {
        Action::requeue(PULL_CHECK_INTERVAL)
    } else {
        action
    })
}

/// How often a run whose rows' images are being pulled looks at its pods.
const PULL_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// How often a queued run whose Jobs are not all admitted looks at their Workloads.
const QUEUE_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Everything the run should have now: its children and its status.
#[derive(Debug, Clone, Default)]
pub struct Desired {
    pub children: Children,
    /// Jobs to delete, with their pods and plan `ConfigMap`s.
    pub delete: Vec<String>,
    /// Jobs of rows naming an image run: their pods are looked at again after a while.
    pub watch_pulls: bool,
    /// Kueue Workloads whose `spec.active` to set (a queued run stopped or resumed), by name.
    pub activate: Vec<(String, bool)>,
    /// A queued Job is not running yet: its Workload is looked at again after a while.
    pub watch_queue: bool,
    /// Write the status now, progress alone or not ([`Decision::record_now`]).
    pub record_now: bool,
    pub status: TrajectoryRunStatus,
}

/// The pure middle of the pipeline: validate, decide, build, and the status the decision shows.
/// A run that fails validation reaches no builder: it has no [`ValidatedRun`](validate::ValidatedRun).
pub fn desired_state(
    run: &TrajectoryRun,
    observed: &Observed,
    settings: &Settings,
    now: &Time,
) -> Result<Desired, Invalid> {
    let (decision, children) = match validate::validate(run)? {
        Validation::Valid(valid) => {
            let decision = decide::decide(&valid, observed);
            let children = build::children(&valid, settings, &decision.children);
            (decision, children)
        }
        Validation::Refused(message) => (Decision::refused(message), Children::default()),
    };
    Ok(Desired {
        children,
        delete: decision.delete.clone(),
        activate: decision.admissions.activate.clone(),
        watch_queue: decision.admissions.recheck,
        record_now: decision.record_now,
        watch_pulls: decision.children.iter().any(|child| {
            matches!(child, Child::Generation(shard) if matches!(shard.tasks, Tasks::Image(_)))
        }),
        status: status::desired(run, &decision.outcome, &decision.tally, now),
    })
}

/// Writes `desired` now, later (requeued for the rest of the interval) or not at all.
async fn write_paced(
    ctx: &Context,
    run: &TrajectoryRun,
    desired: &TrajectoryRunStatus,
    record_now: bool,
) -> Result<Action, Error> {
    let interval = ctx.settings.pacing.status_interval;
    let since = ctx.since_status_written(run);
    let write = match status::status_write(run.status.as_ref(), desired, since, interval) {
        StatusWrite::After(_) if record_now => StatusWrite::Now,
        write => write,
    };
    match write {
        // Children are watched; nothing needs a timer.
        StatusWrite::Unchanged => Ok(Action::await_change()),
        StatusWrite::After(wait) => {
            debug!(
                progress = desired.progress.as_deref(),
                wait_ms = wait.as_millis(),
                "progress written soon"
            );
            Ok(Action::requeue(wait))
        }
        StatusWrite::Now => {
            write_status(ctx, run, desired).await?;
            Ok(Action::await_change())
        }
    }
}

/// Records a permanent error in the run's status (see [`status::stalled`]).
async fn stall(ctx: &Context, run: &TrajectoryRun, error: &Error) -> Result<(), Error> {
    let message = error.stall_message();
    warn!(error = %message, "the run cannot proceed until it changes");
    write_status(ctx, run, &status::stalled(run, &message, &now())).await
}

/// Writes `status`, then announces a phase change with an Event. Writing first keeps a write that
/// fails (a conflict on a stale copy of the run) from announcing the change twice. A lost Event is
/// logged, not retried: the status holds the same facts.
async fn write_status(
    ctx: &Context,
    run: &TrajectoryRun,
    status: &TrajectoryRunStatus,
) -> Result<(), Error> {
    let wrote = apply::update_status(&ctx.client, run, status)
        .await
        .map_err(Error::status(run))?;
    if !wrote {
        return Ok(());
    }
    ctx.status_written(run);
    info!(
        phase = status.phase.map(Phase::as_str),
        progress = status.progress.as_deref(),
        "status updated"
    );
    let before = run.status.as_ref().and_then(|status| status.phase);
    let events = [
        status::transition_event(before, status),
        status::sandbox_event(run.status.as_ref(), status),
        status::image_event(run.status.as_ref(), status),
    ];
    for event in events.into_iter().flatten() {
        if let Err(error) = ctx.recorder.publish(&event, &run.object_ref(&())).await {
            warn!(%error, "publishing an Event failed");
        }
    }
    Ok(())
}

fn now() -> Time {
    Time(Timestamp::now())
}

#[cfg(test)]
mod tests;
