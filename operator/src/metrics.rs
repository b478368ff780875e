//! Prometheus metrics of the operator, served in the `OpenMetrics` text format on `/metrics` by [`crate::http`].
//!
//! Counters and the duration histogram are recorded around every reconcile by the guard that
//! [`Metrics::measure_reconcile`] returns; the reconciler names the stage and class of a failure.
//! This module knows nothing of the reconciler: the stages come in as labels. The gauges of runs by phase and of batches are computed from the
//! controller's cache of runs at every scrape rather than kept up to date by the reconciler: a
//! deleted run is never reconciled again, so only the cache knows that it is gone.
//!
//! API requests are counted by verb and resource in the client itself ([`counted_client`]): what
//! the operator costs the API server, writes per run included.

use std::sync::{Arc, LazyLock, OnceLock};
use std::time::{Duration, Instant};

use kube::runtime::reflector::Store;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::api::{Phase, TrajectoryRun};

/// Every phase, so each one has a series (zero included) from the first scrape on.
const PHASES: [Phase; 6] = [
    Phase::Pending,
    Phase::Planning,
    Phase::Running,
    Phase::Merging,
    Phase::Succeeded,
    Phase::Failed,
];

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    /// `success` or `error`.
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    /// The stage that failed (the reconciler's names: `observe`, `validate`, `apply`, `status`).
    stage: &'static str,
    /// `permanent` (waits for a change of the run) or `transient` (retried).
    class: &'static str,
}

/// Whether a failed reconcile waits for a change of the run or is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    Permanent,
    Transient,
}

impl ErrorClass {
    pub const ALL: [Self; 2] = [Self::Permanent, Self::Transient];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Permanent => "permanent",
            Self::Transient => "transient",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    /// The Kubernetes verb: `get`, `list`, `watch`, `create`, `patch`, `update`, `delete`, ...
    verb: &'static str,
    /// The resource and subresource: `jobs`, `trajectoryruns/status`, `events`, ...
    resource: String,
}

/// Requests of every [`counted_client`] of the process (a process has one client; the counter is
/// global so that the client can be built before the [`Metrics`] that report it).
static API_REQUESTS: LazyLock<Family<RequestLabels, Counter>> = LazyLock::new(Family::default);

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: &'static str,
}

/// The operator's metrics and the registry that encodes them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ResultLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    duration: Histogram,
    runs: Family<PhaseLabels, Gauge>,
    batches: Gauge,
    batches_done: Gauge,
    verified: Gauge,
    passed: Gauge,
    leader: Gauge,
    /// The controller's cache of runs, once the controller has started.
    runs_cache: OnceLock<Store<TrajectoryRun>>,
}

impl Default for Metrics {
    /// Metrics whose error series appear as errors happen.
    fn default() -> Self {
        Self::new(&[])
    }
}

impl Metrics {
    /// Metrics with a zero series of reconcile errors for each of `stages` and each class from the
    /// first scrape on, so that `rate()` and alerts see zeros, not gaps.
    pub fn new(stages: &[&'static str]) -> Self {
        let mut registry = Registry::with_prefix("trajectory_operator");
        let reconciles = Family::<ResultLabels, Counter>::default();
        registry.register(
            "reconciles",
            "Reconciles of TrajectoryRuns, by result",
            reconciles.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "reconcile_errors",
            "Failed reconciles, by stage and by class (permanent or transient)",
            errors.clone(),
        );
        // 5 ms to about 20 s: a reconcile is a few API calls, slow ones are the API server's.
        let duration = Histogram::new(exponential_buckets(0.005, 2.0, 13));
        registry.register_with_unit(
            "reconcile_duration",
            "Duration of a reconcile",
            Unit::Seconds,
            duration.clone(),
        );
        let runs = Family::<PhaseLabels, Gauge>::default();
        registry.register("runs", "TrajectoryRuns, by phase", runs.clone());
        let batches = Gauge::default();
        registry.register(
            "batches",
            "Batches of all TrajectoryRuns that have been planned",
            batches.clone(),
        );
        let batches_done = Gauge::default();
        registry.register(
            "batches_done",
            "Finished batches of all TrajectoryRuns",
            batches_done.clone(),
        );
        let verified = Gauge::default();
        registry.register(
            "verified_records",
            "Records of merged TrajectoryRuns whose row's verifier ran",
            verified.clone(),
        );
        let passed = Gauge::default();
        registry.register(
            "passed_records",
            "Records of merged TrajectoryRuns whose row's verifier passed",
            passed.clone(),
        );
        registry.register(
            "api_requests",
            "Requests to the Kubernetes API server, by verb and resource",
            API_REQUESTS.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease (or runs without leader election)",
            leader.clone(),
        );
        // Every series from the first scrape on, so `rate()` and alerts see zeros, not gaps.
        for result in ["success", "error"] {
            drop(reconciles.get_or_create(&ResultLabels { result }));
        }
        for &stage in stages {
            for class in ErrorClass::ALL {
                drop(errors.get_or_create(&ErrorLabels {
                    stage,
                    class: class.as_str(),
                }));
            }
        }
        Self {
            registry,
            reconciles,
            errors,
            duration,
            runs,
            batches,
            batches_done,
            verified,
            passed,
            leader,
            runs_cache: OnceLock::new(),
        }
    }

    /// Starts measuring a reconcile: the guard records its duration and result when dropped, a
    /// success unless [`ReconcileMeasure::failed`] said otherwise.
    pub fn measure_reconcile(&self) -> ReconcileMeasure<'_> {
        ReconcileMeasure {
            metrics: self,
            start: Instant::now(),
            failure: None,
        }
    }

    /// Records one reconcile's result and duration.
    fn record(&self, failure: Option<(&'static str, ErrorClass)>, elapsed: Duration) {
        self.duration.observe(elapsed.as_secs_f64());
        let result = match failure {
            None => "success",
            Some((stage, class)) => {
                self.errors
                    .get_or_create(&ErrorLabels {
                        stage,
                        class: class.as_str(),
                    })
                    .inc();
                "error"
            }
        };
        self.reconciles
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// Gives the gauges of runs and batches the controller's cache to count from. Only the first
    /// cache counts: one process runs one controller.
    pub fn count_runs_in(&self, store: Store<TrajectoryRun>) {
        let _ = self.runs_cache.set(store);
    }

    /// Sets whether this replica leads.
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// Refreshes the gauges from the runs and encodes every metric in the `OpenMetrics` text format.
    pub fn encode(&self) -> String {
        let runs: Vec<Arc<TrajectoryRun>> =
            self.runs_cache.get().map(Store::state).unwrap_or_default();
        self.refresh(&runs);
        let mut text = String::new();
        // Writing into a String cannot fail.
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("encoding into a String");
        text
    }

    fn refresh(&self, runs: &[Arc<TrajectoryRun>]) {
        let (mut batches, mut done) = (0_i64, 0_i64);
        let (mut verified, mut passed) = (0_i64, 0_i64);
        let mut by_phase = [0_i64; PHASES.len()];
        for run in runs {
            let status = run.status.as_ref();
            // A run the operator has not written a status for yet is waiting to start.
            let phase = status.and_then(|s| s.phase).unwrap_or(Phase::Pending);
            if let Some(i) = PHASES.iter().position(|p| *p == phase) {
                by_phase[i] += 1;
            }
            if let Some(counts) = status.and_then(|s| s.batches.as_ref()) {
                batches += i64::from(counts.total);
                done += i64::from(finished_batches(counts));
            }
            if let Some(verification) = status.and_then(|s| s.verification.as_ref()) {
                verified += i64::try_from(verification.verified).unwrap_or(i64::MAX);
                passed += i64::try_from(verification.passed).unwrap_or(i64::MAX);
            }
        }
        for (phase, count) in PHASES.iter().zip(by_phase) {
            self.runs
                .get_or_create(&PhaseLabels {
                    phase: phase.as_str(),
                })
                .set(count);
        }
        self.batches.set(batches);
        self.batches_done.set(done);
        self.verified.set(verified);
        self.passed.set(passed);
    }
}

/// The finished batches of a run's status: its count, or, in a status written before there was
/// one, its ranges counted (the status is the operator's own writing; unreadable ranges count
/// nothing).
fn finished_batches(counts: &crate::api::BatchCounts) -> u32 {
    if counts.completed_count > 0 || counts.pending_list.is_some() {
        return counts.completed_count;
    }
    trajectory_worker::contract::parse_ranges(&counts.completed)
        .map_or(0, |ids| u32::try_from(ids.len()).unwrap_or(u32::MAX))
}

/// A client for `config` whose requests are counted in `trajectory_operator_api_requests_total`.
/// Counted as sent by the operator: kube's own retries of a failed request are not counted again.
pub fn counted_client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    let layer = tower::util::MapRequestLayer::new(|request: http::Request<kube::client::Body>| {
        let (verb, resource) = verb_and_resource(request.method(), request.uri());
        API_REQUESTS
            .get_or_create(&RequestLabels { verb, resource })
            .inc();
        request
    });
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&layer)
        .build())
}

/// The Kubernetes verb and the `resource[/subresource]` of a request to the API server, e.g.
/// `PATCH /apis/batch/v1/namespaces/ns/jobs/j/status` → `("patch", "jobs/status")`.
fn verb_and_resource(method: &http::Method, uri: &http::Uri) -> (&'static str, String) {
    let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
    // `/api/v1/...` or `/apis/<group>/<version>/...`; anything else (`/version`) is its own path.
    let rest = match segments.first() {
        Some(&"api") => segments.get(2..),
        Some(&"apis") => segments.get(3..),
        _ => None,
    }
    .unwrap_or_default();
    let rest = match rest {
        ["namespaces", _, resource @ ..] if !resource.is_empty() => resource,
        other => other,
    };
    let (resource, named) = match rest {
        [] => (uri.path().to_owned(), false),
        [resource] => ((*resource).to_owned(), false),
        [resource, _name] => ((*resource).to_owned(), true),
        [resource, _name, subresource, ..] => (format!("{resource}/{subresource}"), true),
    };
    let watch = uri
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    let verb = match *method {
        http::Method::GET if watch => "watch",
        http::Method::GET if named => "get",
        http::Method::GET => "list",
        http::Method::POST => "create",
        http::Method::PATCH => "patch",
        http::Method::PUT => "update",
        http::Method::DELETE if named => "delete",
        http::Method::DELETE => "deletecollection",
        _ => "other",
    };
    (verb, resource)
}

/// Measures one reconcile (see [`Metrics::measure_reconcile`]).
#[derive(Debug)]
pub struct ReconcileMeasure<'a> {
    metrics: &'a Metrics,
    start: Instant,
    failure: Option<(&'static str, ErrorClass)>,
}

impl ReconcileMeasure<'_> {
    /// The reconcile failed in `stage`.
    pub fn failed(&mut self, stage: &'static str, class: ErrorClass) {
        self.failure = Some((stage, class));
    }
}

impl Drop for ReconcileMeasure<'_> {
    fn drop(&mut self) {
        self.metrics.record(self.failure, self.start.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn run_with_status(name: &str, status: &serde_json::Value) -> Arc<TrajectoryRun> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "trajectories.dev/v1alpha1",
                "kind": "TrajectoryRun",
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {
                    "dataset": {"path": "d.jsonl"},
                    "model": {"baseUrl": "http://m/v1", "name": "m"},
                    "storage": {"volume": {"emptyDir": {}}},
                },
                "status": status,
            }))
            .expect("a valid run"),
        )
    }

    #[test]
    fn the_registry_encodes_every_metric_name() {
        let metrics = Metrics::new(&["observe", "status"]);
        drop(metrics.measure_reconcile());
        let text = metrics.encode();
        for name in [
            "# TYPE trajectory_operator_reconciles counter",
            "# TYPE trajectory_operator_reconcile_errors counter",
            "# TYPE trajectory_operator_reconcile_duration_seconds histogram",
            "# TYPE trajectory_operator_runs gauge",
            "# TYPE trajectory_operator_batches gauge",
            "# TYPE trajectory_operator_batches_done gauge",
            "# TYPE trajectory_operator_leader gauge",
            "trajectory_operator_reconciles_total{result=\"success\"} 1",
            "trajectory_operator_reconcile_duration_seconds_count 1",
            "trajectory_operator_runs{phase=\"Running\"} 0",
            "trajectory_operator_reconcile_errors_total{stage=\"status\",class=\"permanent\"} 0",
        ] {
            assert!(text.contains(name), "no `{name}` in:\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn errors_are_counted_by_stage_and_class() {
        let metrics = Metrics::default();
        for (stage, class) in [
            ("apply", ErrorClass::Transient),
            ("validate", ErrorClass::Permanent),
        ] {
            metrics.measure_reconcile().failed(stage, class);
        }
        let text = metrics.encode();
        for line in [
            "trajectory_operator_reconciles_total{result=\"error\"} 2",
            "trajectory_operator_reconcile_errors_total{stage=\"apply\",class=\"transient\"} 1",
            "trajectory_operator_reconcile_errors_total{stage=\"validate\",class=\"permanent\"} 1",
        ] {
            assert!(text.contains(line), "no `{line}` in:\n{text}");
        }
    }

    #[test]
    fn runs_are_counted_by_phase_and_batches_from_their_status() {
        let metrics = Metrics::default();
        let runs = [
            run_with_status("new", &json!({})),
            run_with_status(
                "working",
                &json!({"phase": "Running", "batches": {"total": 10, "completed": "0-3,7", "failed": "5"}}),
            ),
            run_with_status(
                "done",
                &json!({"phase": "Succeeded", "batches": {"total": 2, "completed": "0-1", "completedCount": 2},
                        "verification": {"verified": 8, "passed": 3}}),
            ),
            run_with_status(
                "resumed",
                &json!({"phase": "Running", "batches": {"total": 1000, "completedCount": 400, "pendingList": {"path": "plan/pending-1.ranges", "batches": 600}}}),
            ),
        ];
        metrics.refresh(&runs);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &metrics.registry).expect("encode");
        for line in [
            "trajectory_operator_runs{phase=\"Pending\"} 1",
            "trajectory_operator_runs{phase=\"Running\"} 2",
            "trajectory_operator_runs{phase=\"Succeeded\"} 1",
            "trajectory_operator_runs{phase=\"Failed\"} 0",
            "trajectory_operator_batches 1012",
            "trajectory_operator_batches_done 407",
            "trajectory_operator_verified_records 8",
            "trajectory_operator_passed_records 3",
        ] {
            assert!(text.contains(line), "no `{line}` in:\n{text}");
        }
    }

    #[test]
    fn requests_are_labelled_with_their_verb_and_resource() {
        let cases = [
            (
                "GET",
                "/apis/batch/v1/namespaces/ns/jobs?labelSelector=a%3Db",
                ("list", "jobs"),
            ),
            (
                "GET",
                "/apis/batch/v1/jobs?watch=true&resourceVersion=5",
                ("watch", "jobs"),
            ),
            (
                "GET",
                "/api/v1/namespaces/ns/configmaps/r-gen-1",
                ("get", "configmaps"),
            ),
            (
                "PATCH",
                "/apis/batch/v1/namespaces/ns/jobs/r-plan?fieldManager=m",
                ("patch", "jobs"),
            ),
            (
                "PATCH",
                "/apis/trajectories.dev/v1alpha1/namespaces/ns/trajectoryruns/r/status",
                ("patch", "trajectoryruns/status"),
            ),
            (
                "POST",
                "/apis/events.k8s.io/v1/namespaces/ns/events",
                ("create", "events"),
            ),
            (
                "PUT",
                "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l",
                ("update", "leases"),
            ),
            ("GET", "/api/v1/namespaces/ns", ("get", "namespaces")),
            (
                "DELETE",
                "/api/v1/namespaces/ns/pods",
                ("deletecollection", "pods"),
            ),
            ("GET", "/version", ("list", "/version")),
        ];
        for (method, uri, (verb, resource)) in cases {
            let method: http::Method = method.parse().unwrap();
            let uri: http::Uri = uri.parse().unwrap();
            assert_eq!(
                verb_and_resource(&method, &uri),
                (verb, resource.to_owned()),
                "{method} {uri}"
            );
        }
    }
}
