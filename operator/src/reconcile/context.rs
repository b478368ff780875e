//! What every reconcile shares: the client, the settings, the Event recorder, the metrics, and the
//! little the controller remembers of each run between reconciles.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kube::runtime::events::Recorder;
use kube::{Client, ResourceExt};

use super::children::MANAGER;
use super::error::Stage;
use super::observe::ObserveCache;
use crate::api::TrajectoryRun;
use crate::metrics::Metrics;
use crate::settings::Settings;

/// Shared state of the reconcilers.
#[derive(Clone)]
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    /// Publishes an Event on the run at every phase change.
    pub recorder: Recorder,
    /// Reconcile counters and durations; runs by phase from the controller's cache.
    pub metrics: Arc<Metrics>,
    /// What observe read that cannot change, kept for the runs' next reconciles.
    pub observe_cache: Arc<ObserveCache>,
    memory: Arc<Mutex<Memory>>,
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

impl Context {
    pub fn new(client: Client, settings: Settings) -> Self {
        let recorder = Recorder::new(client.clone(), MANAGER.into());
        Self {
            client,
            settings,
            recorder,
            metrics: Arc::new(Metrics::new(&Stage::ALL.map(Stage::as_str))),
            observe_cache: Arc::default(),
            memory: Arc::default(),
        }
    }

    fn memory(&self) -> MutexGuard<'_, Memory> {
        // The map holds plain data: a panic elsewhere cannot leave it half-updated.
        self.memory.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long ago the status of `run` was last written by this process.
    pub fn since_status_written(&self, run: &TrajectoryRun) -> Option<Duration> {
        self.memory()
            .status_written
            .get(&key(run))
            .map(Instant::elapsed)
    }

    /// Notes that the status of `run` was written now.
    pub fn status_written(&self, run: &TrajectoryRun) {
        let interval = self.settings.pacing.status_interval;
        let mut memory = self.memory();
        memory
            .status_written
            .retain(|_, at| at.elapsed() < interval);
        memory.status_written.insert(key(run), Instant::now());
    }

    /// Counts a failed reconcile of `run`; returns the failures in a row.
    pub fn failed(&self, run: &TrajectoryRun) -> u32 {
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

    /// Forgets the failures of `run`: its next failure waits the first backoff again.
    pub fn succeeded(&self, run: &TrajectoryRun) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn failures_count_per_run_and_a_success_resets_them() {
        // A client that is never used: the memory is all this test touches.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let ctx = Context::new(Client::try_from(config).unwrap(), Settings::default());
        let run = |uid: &str| TrajectoryRun::test().uid(uid).build();
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
