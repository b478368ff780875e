//! The controller: watch runs and the Jobs they own, and reconcile each run through
//! observe → desired state → apply → status.
//!
//! Errors are one enum with a variant per stage. Permanent ones (a spec the operator cannot act
//! on, or children the API server refuses) are written into the run's status as `Stalled` and
//! `Failed` conditions with an Event, and wait for a change of the run; transient ones (API server
//! errors, conflicts, timeouts) are requeued with a per-run exponential [`Backoff`] that resets on
//! the next success.
//!
//! Status writes are paced ([`Pacing::status_interval`]): a change of phase, condition or attempt is
//! written at once, a change of progress alone at most once per interval per run, and the reconcile
//! that holds one back requeues itself for the rest of the interval, so the last count is written.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{debug, info, instrument, warn};

use crate::api::{ConditionType, Phase, TrajectoryRun, TrajectoryRunStatus};
use crate::desired::{DesiredError, MANAGER, Reason, Settings, labels, set_condition};
use crate::metrics::Metrics;
use crate::state::{StatusWrite, desired_state, status_write};
use crate::{apply, observe};

/// Exponential backoff of the requeues after transient errors of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failure.
    pub first: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_millis(500),
            max: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// The requeue delay after `failures` consecutive failures (the first is 1): `first`, doubled at
    /// every further failure, at most `max`.
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.first
            .checked_mul(1 << doublings)
            .map_or(self.max, |delay| delay.min(self.max))
    }
}

/// How often the controller writes and retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// The least time between two status writes of one run that change only its progress.
    pub status_interval: Duration,
    /// Requeues after transient errors.
    pub retry: Backoff,
}

impl Default for Pacing {
    fn default() -> Self {
        Self {
            status_interval: Duration::from_secs(3),
            retry: Backoff::default(),
        }
    }
}

/// What the controller remembers of each run between reconciles: when it last wrote the status, and
/// how many reconciles in a row failed. Lost on restart, which only makes the first write and
/// retry prompt. Entries that no longer matter are dropped as new ones are made, so runs deleted
/// long ago take no memory.
#[derive(Debug, Default)]
struct Memory {
    status_written: HashMap<String, Instant>,
    failures: HashMap<String, (u32, Instant)>,
}

/// The key of a run in [`Memory`]: its uid (a run re-created under the same name starts afresh).
fn key(run: &TrajectoryRun) -> String {
    run.uid()
        .unwrap_or_else(|| format!("{}/{}", run.namespace().unwrap_or_default(), run.name_any()))
}

/// Shared state of the reconcilers.
#[derive(Clone)]
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    /// Publishes an Event on the run at every phase change.
    pub recorder: Recorder,
    /// Reconcile counters and durations; runs by phase from the controller's cache.
    pub metrics: Arc<Metrics>,
    memory: Arc<Mutex<Memory>>,
}

impl Context {
    pub fn new(client: Client, settings: Settings) -> Self {
        let recorder = Recorder::new(client.clone(), MANAGER.into());
        Self {
            client,
            settings,
            recorder,
            metrics: Arc::default(),
            memory: Arc::default(),
        }
    }

    fn memory(&self) -> std::sync::MutexGuard<'_, Memory> {
        // The map holds plain data: a panic elsewhere cannot leave it half-updated.
        self.memory
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long ago the status of `run` was last written by this process.
    fn since_status_written(&self, run: &TrajectoryRun) -> Option<Duration> {
        self.memory()
            .status_written
            .get(&key(run))
            .map(Instant::elapsed)
    }

    fn status_written(&self, run: &TrajectoryRun) {
        let interval = self.settings.pacing.status_interval;
        let mut memory = self.memory();
        memory
            .status_written
            .retain(|_, at| at.elapsed() < interval);
        memory.status_written.insert(key(run), Instant::now());
    }

    /// Counts a failed reconcile of `run`; returns the failures in a row.
    fn failed(&self, run: &TrajectoryRun) -> u32 {
        let forget = self.settings.pacing.retry.max * 2;
        let mut memory = self.memory();
        memory.failures.retain(|_, (_, at)| at.elapsed() < forget);
        let entry = memory
            .failures
            .entry(key(run))
            .or_insert((0, Instant::now()));
        *entry = (entry.0.saturating_add(1), Instant::now());
        entry.0
    }

    fn succeeded(&self, run: &TrajectoryRun) {
        self.memory().failures.remove(&key(run));
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
            | Self::Status { source, .. } => is_refused(source),
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

/// True when the API server refused a request as wrong in itself (400 Bad Request, 422 Invalid, and
/// other 4xx), which sending it again cannot change. Not so for 401/403 (credentials and RBAC get
/// fixed without touching the run), 404 (a namespace or CRD on its way), 408, 409 (a stale copy)
/// and 429 (throttling).
fn is_refused(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status)
        if (400..500).contains(&status.code)
            && ![401, 403, 404, 408, 409, 429].contains(&status.code))
}

fn now() -> Time {
    Time(Timestamp::now())
}

/// Reconciles one run; a success resets its [`Backoff`].
#[instrument(skip_all, fields(run = %run.name_any(), namespace = run.namespace().unwrap_or_default()))]
pub async fn reconcile(run: Arc<TrajectoryRun>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Boxed: the reconcile future is large (clippy::large_futures).
    let result = Box::pin(reconcile_run(&run, &ctx)).await;
    if result.is_ok() {
        ctx.succeeded(&run);
    }
    result
}

async fn reconcile_run(run: &TrajectoryRun, ctx: &Context) -> Result<Action, Error> {
    let name = run.name_any();
    // Being deleted (a foreground cascade, or another party's finalizer holds it): the garbage
    // collector is removing the children, and applying them again would undo its work.
    if run.metadata.deletion_timestamp.is_some() {
        debug!(run = %name, "being deleted; leaving its children to the garbage collector");
        return Ok(Action::await_change());
    }
    let observed = observe::observe(&ctx.client, run)
        .await
        .map_err(|source| Error::Observe {
            run: name.clone(),
            source,
        })?;
    let desired = match desired_state(run, &observed, &ctx.settings, &now()) {
        Ok(desired) => desired,
        Err(source) => {
            let error = Error::Desired { run: name, source };
            if error.is_permanent() {
                stall(ctx, run, &error).await?;
            }
            return Err(error);
        }
    };
    if let Err(source) = apply::apply(&ctx.client, run, &observed, &desired).await {
        let error = Error::Apply { run: name, source };
        if error.is_permanent() {
            stall(ctx, run, &error).await?;
        }
        return Err(error);
    }
    let interval = ctx.settings.pacing.status_interval;
    let since = ctx.since_status_written(run);
    match status_write(run.status.as_ref(), &desired.status, since, interval) {
        // Children are watched; nothing needs a timer.
        StatusWrite::Unchanged => Ok(Action::await_change()),
        StatusWrite::After(wait) => {
            debug!(
                progress = desired.status.progress.as_deref(),
                wait_ms = wait.as_millis(),
                "progress written soon"
            );
            Ok(Action::requeue(wait))
        }
        StatusWrite::Now => {
            write_status(ctx, run, &desired.status).await?;
            Ok(Action::await_change())
        }
    }
}

/// Writes `status`, then announces a phase change with an Event. Writing first keeps a write that
/// fails (a conflict on a stale copy of the run) from announcing the change twice.
async fn write_status(
    ctx: &Context,
    run: &TrajectoryRun,
    status: &TrajectoryRunStatus,
) -> Result<(), Error> {
    let wrote = apply::update_status(&ctx.client, run, status)
        .await
        .map_err(|source| Error::Status {
            run: run.name_any(),
            source,
        })?;
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
    if let Some(phase) = status.phase.filter(|phase| Some(*phase) != before) {
        let message = status
            .conditions
            .iter()
            .find(|c| c.type_ == ConditionType::Failed.as_str() && c.status == "True")
            .or_else(|| {
                status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == ConditionType::Progressing.as_str())
            })
            .map(|c| c.message.clone());
        publish(ctx, run, phase, message).await;
    }
    Ok(())
}

/// Records a permanent error in the run's status: `Stalled` and `Failed` with reason `InvalidSpec`
/// and the error's message (for a child the API server refused, its message names the field).
async fn stall(ctx: &Context, run: &TrajectoryRun, error: &Error) -> Result<(), Error> {
    let mut status = run.status.clone().unwrap_or_default();
    let generation = run.metadata.generation;
    let message = match error {
        Error::Desired { source, .. } => source.to_string(),
        Error::Apply {
            source: kube::Error::Api(status),
            ..
        } => format!(
            "the API server refused a child of the run: {}",
            status.message
        ),
        other => other.to_string(),
    };
    let now = now();
    status.observed_generation = generation;
    status.phase = Some(Phase::Failed);
    for (type_, value) in [
        (ConditionType::Stalled, true),
        (ConditionType::Failed, true),
        (ConditionType::Progressing, false),
        (ConditionType::Reconciling, false),
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
    write_status(ctx, run, &status).await
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

/// Transient errors are retried after the run's [`Backoff`]; permanent ones wait for the run to
/// change (its status already says why, see [`stall`]).
// The signature is the one `Controller::run` calls.
#[allow(clippy::needless_pass_by_value)]
pub fn error_policy(run: Arc<TrajectoryRun>, error: &Error, ctx: Arc<Context>) -> Action {
    if error.is_permanent() {
        warn!(stage = error.label(), %error, "permanent reconcile error; waiting for a change of the run");
        Action::await_change()
    } else {
        let failures = ctx.failed(&run);
        let delay = ctx.settings.pacing.retry.delay(failures);
        warn!(
            stage = error.label(),
            %error,
            failures,
            retry_in_ms = delay.as_millis(),
            "transient reconcile error; retrying"
        );
        Action::requeue(delay)
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
            (400, true),
            (422, true),
            // RBAC and credentials get fixed without a change of the run.
            (401, false),
            (403, false),
            (404, false),
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

    #[test]
    fn backoff_doubles_from_the_first_delay_up_to_the_cap() {
        let backoff = Backoff {
            first: Duration::from_millis(500),
            max: Duration::from_secs(60),
        };
        let delays: Vec<u64> = (1..=10)
            .map(|failures| u64::try_from(backoff.delay(failures).as_millis()).unwrap())
            .collect();
        assert_eq!(
            delays,
            [
                500, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000, 60_000
            ]
        );
        // No failure yet counts as the first; absurd counts neither overflow nor exceed the cap.
        assert_eq!(backoff.delay(0), Duration::from_millis(500));
        assert_eq!(backoff.delay(u32::MAX), Duration::from_secs(60));
        let huge = Backoff {
            first: Duration::from_secs(u64::MAX / 2),
            max: Duration::MAX,
        };
        assert_eq!(huge.delay(40), Duration::MAX);
    }

    #[tokio::test]
    async fn failures_count_per_run_and_a_success_resets_them() {
        // A client that is never used: the memory is all this test touches.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let ctx = Context::new(Client::try_from(config).unwrap(), Settings::default());
        let run = |uid: &str| {
            let mut run = TrajectoryRun::new(
                "r",
                serde_json::from_value(serde_json::json!({
                    "dataset": {"path": "d.jsonl"},
                    "model": {"baseUrl": "http://m/v1", "name": "m"},
                }))
                .unwrap(),
            );
            run.metadata.uid = Some(uid.into());
            run
        };
        let (a, b) = (run("a"), run("b"));
        assert_eq!((ctx.failed(&a), ctx.failed(&a), ctx.failed(&a)), (1, 2, 3));
        assert_eq!(ctx.failed(&b), 1, "another run has its own count");
        ctx.succeeded(&a);
        assert_eq!(ctx.failed(&a), 1, "a success starts the count again");

        assert_eq!(ctx.since_status_written(&a), None);
        ctx.status_written(&a);
        assert!(ctx.since_status_written(&a).unwrap() < Duration::from_secs(1));
        assert_eq!(ctx.since_status_written(&b), None);
    }
}
