//! The controller: watch runs and the Jobs they own, and reconcile each run through
//! observe → desired state → apply → status.
//!
//! Errors are one enum with a variant per stage. Permanent ones (a spec the operator cannot act
//! on) are written into the run's status as a `Stalled` condition and wait for a change of the run;
//! transient ones (API server errors, conflicts, timeouts) are requeued soon by [`error_policy`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{info, instrument, warn};

use crate::api::{ConditionType, Phase, TrajectoryRun};
use crate::desired::{DesiredError, MANAGER, Reason, Settings, labels, set_condition};
use crate::metrics::Metrics;
use crate::state::desired_state;
use crate::{apply, observe};

/// Shared state of the reconcilers.
#[derive(Clone)]
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    /// Publishes an Event on the run at every phase change.
    pub recorder: Recorder,
    /// Reconcile counters and durations; runs by phase from the controller's cache.
    pub metrics: Arc<Metrics>,
}

impl Context {
    pub fn new(client: Client, settings: Settings) -> Self {
        let recorder = Recorder::new(client.clone(), MANAGER.into());
        Self {
            client,
            settings,
            recorder,
            metrics: Arc::default(),
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `kube::Client` has no Debug; the settings say all there is to say.
        f.debug_struct("Context")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// Why a reconcile failed, by stage.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("observing the children of {run}: {source}")]
    Observe {
        run: String,
        #[source]
        source: kube::Error,
    },
    #[error("deciding the desired state of {run}: {source}")]
    Desired {
        run: String,
        #[source]
        source: DesiredError,
    },
    #[error("applying the children of {run}: {source}")]
    Apply {
        run: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status of {run}: {source}")]
    Status {
        run: String,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// True when only a change of the run can fix it.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::Desired { source, .. } => source.is_permanent(),
            Self::Observe { source, .. }
            | Self::Apply { source, .. }
            | Self::Status { source, .. } => {
                // 4xx other than conflicts and throttling: the request itself is wrong.
                matches!(source, kube::Error::Api(status)
                    if (400..500).contains(&status.code) && ![409, 429].contains(&status.code))
            }
        }
    }

    /// A short label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Observe { .. } => "observe",
            Self::Desired { .. } => "desired",
            Self::Apply { .. } => "apply",
            Self::Status { .. } => "status",
        }
    }
}

fn now() -> Time {
    Time(Timestamp::now())
}

/// Reconciles one run.
#[instrument(skip_all, fields(run = %run.name_any(), namespace = run.namespace().unwrap_or_default()))]
pub async fn reconcile(run: Arc<TrajectoryRun>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = run.name_any();
    let observed = observe::observe(&ctx.client, &run)
        .await
        .map_err(|source| Error::Observe {
            run: name.clone(),
            source,
        })?;
    let desired = match desired_state(&run, &observed, &ctx.settings, &now()) {
        Ok(desired) => desired,
        Err(source) if source.is_permanent() => {
            stall(&ctx, &run, &source).await?;
            return Ok(Action::await_change());
        }
        Err(source) => return Err(Error::Desired { run: name, source }),
    };
    apply::apply(&ctx.client, &run, &observed, &desired)
        .await
        .map_err(|source| Error::Apply {
            run: name.clone(),
            source,
        })?;
    let wrote = apply::update_status(&ctx.client, &run, &desired.status)
        .await
        .map_err(|source| Error::Status {
            run: name.clone(),
            source,
        })?;
    let before = run.status.as_ref().and_then(|status| status.phase);
    if let Some(phase) = desired.status.phase.filter(|phase| Some(*phase) != before) {
        let message = desired
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == ConditionType::Failed.as_str() && c.status == "True")
            .or_else(|| {
                desired
                    .status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == ConditionType::Progressing.as_str())
            })
            .map(|c| c.message.clone());
        publish(&ctx, &run, phase, message).await;
    }
    if wrote {
        info!(
            phase = desired.status.phase.map(Phase::as_str),
            progress = desired.status.progress.as_deref(),
            "status updated"
        );
    }
    // Children are watched; nothing needs a timer.
    Ok(Action::await_change())
}

/// Records a permanent error in the run's status: `Stalled` and `Failed` with the error's reason.
async fn stall(ctx: &Context, run: &TrajectoryRun, error: &DesiredError) -> Result<(), Error> {
    let mut status = run.status.clone().unwrap_or_default();
    let generation = run.metadata.generation;
    let message = error.to_string();
    let now = now();
    status.observed_generation = generation;
    status.phase = Some(Phase::Failed);
    for (type_, value) in [
        (ConditionType::Stalled, true),
        (ConditionType::Failed, true),
        (ConditionType::Progressing, false),
        (ConditionType::Ready, false),
    ] {
        set_condition(
            &mut status.conditions,
            type_,
            value,
            Reason::InvalidSpec,
            &message,
            generation,
            &now,
        );
    }
    warn!(error = %message, "the run cannot proceed until it changes");
    if run.status.as_ref().and_then(|s| s.phase) != Some(Phase::Failed) {
        publish(ctx, run, Phase::Failed, Some(message.clone())).await;
    }
    apply::update_status(&ctx.client, run, &status)
        .await
        .map(|_| ())
        .map_err(|source| Error::Status {
            run: run.name_any(),
            source,
        })
}

/// Publishes a phase change as an Event on the run. A lost Event is logged, not retried: the
/// status holds the same facts.
async fn publish(ctx: &Context, run: &TrajectoryRun, phase: Phase, note: Option<String>) {
    let event = Event {
        type_: if phase == Phase::Failed {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: phase.as_str().to_owned(),
        // Events cap notes at 1 kB.
        note: note.map(|note| note.chars().take(1000).collect()),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &run.object_ref(&())).await {
        warn!(%error, "publishing an Event failed");
    }
}

/// Transient errors are retried soon; permanent ones wait for the run to change.
pub fn error_policy(_run: Arc<TrajectoryRun>, error: &Error, _ctx: Arc<Context>) -> Action {
    if error.is_permanent() {
        warn!(stage = error.label(), %error, "permanent reconcile error");
        Action::await_change()
    } else {
        warn!(stage = error.label(), %error, "transient reconcile error; retrying");
        Action::requeue(Duration::from_secs(5))
    }
}

/// Runs the controller over every namespace (or the one of `settings.watch_namespace`) until
/// `shutdown` resolves.
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
    controller
        .graceful_shutdown_on(shutdown)
        .run(
            crate::metrics::measured_reconcile,
            error_policy,
            Arc::new(ctx),
        )
        .for_each(|result| async move {
            if let Err(error) = result {
                warn!(%error, "reconcile failed");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use kube::core::Status;

    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            Status::failure("refused", "Refused")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn errors_are_permanent_only_when_retrying_cannot_help() {
        let apply = |code| Error::Apply {
            run: "r".into(),
            source: api_error(code),
        };
        let cases = [
            (422, true),
            (403, true),
            (409, false),
            (429, false),
            (500, false),
            (503, false),
        ];
        for (code, permanent) in cases {
            assert_eq!(apply(code).is_permanent(), permanent, "HTTP {code}");
        }
        let desired = |source| Error::Desired {
            run: "r".into(),
            source,
        };
        assert!(desired(DesiredError::MissingVolume).is_permanent());
        assert!(!desired(DesiredError::NotStored).is_permanent());
        assert_eq!(apply(500).label(), "apply");
    }
}
