//! Observe: read what exists of a run's children (reads only). Jobs are found by the run label and
//! kept only when the run is their controller (a run re-created under the same name does not adopt
//! its predecessor's Jobs), and only those of the latest round (the earlier rounds' children are
//! history); summaries come from the termination message of a succeeded pod.
//!
//! Each generation Job's `completedIndexes` / `failedIndexes` are mapped back to batch ids through
//! the attempt's pending list here ([`attempt_batches`], pure), so that what decide reads is
//! already in batch ids; a Job whose indexes cannot be read is a permanent error.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use serde::de::DeserializeOwned;
use trajectory_worker::contract::{
    self, BatchSummary, BuildReport, ImageGroup, ImagePage, LandlockStatus, MergeSummary,
    PlanSummary, RunPlan, WorkerFailure, exit, paths,
};

mod cache;
mod generation_pods;

pub use self::cache::ObserveCache;
use self::cache::RunEntry;
pub use self::generation_pods::{PullReport, pull_failure};
use super::children::{
    BUILD_CONTAINER, CONTAINER, Component, annotations, image_index_name, labels,
};
use super::queue::{self, ObservedQueue};
use crate::api::TrajectoryRun;

/// What the controller read about a run's children.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The latest round any child belongs to (1 before there is any); the fields below are its.
    pub round: u32,
    pub plan_job: Option<Job>,
    /// The plan pod's termination message, once the plan Job completed.
    pub plan_summary: Option<PlanSummary>,
    /// The completed plan Job has no pod left (its node went): its summary is lost, not missing.
    pub plan_pod_gone: bool,
    /// Attempts in ascending order.
    pub attempts: Vec<ObservedAttempt>,
    pub merge_job: Option<Job>,
    pub merge_summary: Option<MergeSummary>,
    /// What the failed plan pod reported, once the plan Job failed.
    pub plan_failure: Option<WorkerFailure>,
    /// What the failed merge pod reported, once the merge Job failed.
    pub merge_failure: Option<WorkerFailure>,
    /// Whether Landlock confined the commands, from the first generation pod that finished; read
    /// only while the run's status does not show it yet.
    pub landlock: Option<LandlockStatus>,
    /// The Job reporting the pages of the round's plan's image index, when it has one.
    pub image_pages_job: Option<Job>,
    /// The pages its succeeded pods reported, once it completed.
    pub image_pages: Vec<ImagePage>,
    /// The Job building the round's plan's images, when it builds some.
    pub build_job: Option<Job>,
    /// What its succeeded pods reported, once it completed and until the operator kept the
    /// groups they resolved.
    pub build_reports: Vec<BuildReport>,
    /// The complete build Job has no pod left: reports missing were lost, not never written.
    pub build_pods_gone: bool,
    /// The image groups of the round's plan, as the operator keeps them in its `ConfigMap`
    /// ([`super::children::image_index_name`]) once it read them.
    pub image_index: Option<Vec<ImageGroup>>,
    /// The running generation Jobs of rows naming an image whose image cannot be pulled (by Job
    /// name): why, as the node said, once it counts as unavailable
    /// ([`trajectory_worker::spec::SandboxSpec::image_unavailable_after_seconds`]).
    pub unpullable: BTreeMap<String, String>,
    /// What the succeeded pods of the image Jobs there are waited for their image.
    pub pull_reports: Vec<PullReport>,
    /// The round's Jobs pulling images ahead (`spec.sandbox.prefetch`).
    pub prefetch_jobs: Vec<Job>,
    /// The nodes their succeeded pods pulled on, by the piece (shard) whose image they pulled.
    pub prefetched: BTreeMap<u32, String>,
    /// The highest `spec.model.budget.maxCost` a pod of the latest attempt stopped at, having
    /// found it spent (read only while the run has a budget).
    pub budget_exhausted_at: Option<f64>,
    /// The most any batch pod of the latest attempt said the run had spent as it ended (finished,
    /// or stopped at the budget), in USD (read only while the run has prices).
    pub run_spent: Option<f64>,
    /// The Kueue Workloads of the round's Jobs, for a run that names a queue; `None` without a
    /// queue or when the cluster serves no Workload API.
    pub queue: Option<ObservedQueue>,
}

impl Default for Observed {
    /// A run without children: in its first round.
    fn default() -> Self {
        Self {
            round: 1,
            plan_job: None,
            plan_summary: None,
            plan_pod_gone: false,
            attempts: Vec::new(),
            merge_job: None,
            merge_summary: None,
            plan_failure: None,
            merge_failure: None,
            landlock: None,
            image_pages_job: None,
            image_pages: Vec::new(),
            build_job: None,
            build_reports: Vec::new(),
            build_pods_gone: false,
            image_index: None,
            unpullable: BTreeMap::new(),
            pull_reports: Vec::new(),
            prefetch_jobs: Vec::new(),
            prefetched: BTreeMap::new(),
            budget_exhausted_at: None,
            run_spent: None,
            queue: None,
        }
    }
}

impl Observed {
    /// Every Job of the round: plan, image pages, generation attempts, merge.
    pub fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.plan_job
            .iter()
            .chain(self.image_pages_job.iter())
            .chain(self.build_job.iter())
            .chain(self.attempts.iter().map(|attempt| &attempt.job))
            .chain(self.prefetch_jobs.iter())
            .chain(self.merge_job.iter())
    }
}

/// One generation attempt as observed: its Job, the batch each index works, and the batches it
/// finished and gave up on so far.
#[derive(Debug, Clone)]
pub struct ObservedAttempt {
    pub attempt: u32,
    /// Which of the attempt's Jobs (0 unless the attempt has more batches than one Job holds).
    pub shard: u32,
    pub job: Job,
    /// What each index works: batch ids, or slots of `pending_list`.
    pub pending: Vec<u32>,
    /// The plan's pending list on storage, when the ids are slots of it.
    pub pending_list: Option<String>,
    pub batches: AttemptBatches,
    /// What a failed pod of the Job reported, once the Job failed (the one that stopped on a
    /// configuration error first).
    pub failure: Option<WorkerFailure>,
    /// The image its rows name, for a Job of rows that name one.
    pub image: Option<String>,
    /// Set on the Job recording those rows as unavailable: why the image could not be pulled
    /// (or built).
    pub unavailable: Option<String>,
    /// Set on the Job recording those rows as unavailable because their image could not be
    /// built.
    pub build_failed: bool,
}

/// Batches an attempt finished and gave up on, as batch ids (or slots, with a pending list).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptBatches {
    pub completed: BTreeSet<u32>,
    pub failed: BTreeSet<u32>,
}

/// How a child Job ended, from its conditions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    Running,
    Complete,
    /// Failed, with the Job condition's reason (`PodFailurePolicy`, `MaxFailedIndexesExceeded`,
    /// `BackoffLimitExceeded`, ...) and message.
    Failed {
        reason: String,
        message: String,
    },
}

impl JobState {
    pub fn of(job: &Job) -> Self {
        let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
        let holds = |type_: &str| {
            conditions
                .into_iter()
                .flatten()
                .find(|c| c.type_ == type_ && c.status == "True")
        };
        if let Some(failed) = holds("Failed") {
            Self::Failed {
                reason: failed.reason.clone().unwrap_or_default(),
                message: failed.message.clone().unwrap_or_default(),
            }
        } else if holds("Complete").is_some() {
            Self::Complete
        } else {
            Self::Running
        }
    }
}

/// Why the children of a run could not be observed.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("Job {job} reports unreadable indexes {text:?}: {reason}")]
    BadIndexes {
        job: String,
        text: String,
        reason: String,
    },
    #[error("the plan ConfigMap {map} lists unreadable batch ranges: {reason}")]
    UnreadablePlan { map: String, reason: String },
    #[error("Job {job} reports index {index}, but its attempt has {pending} pending batches")]
    IndexOutOfRange {
        job: String,
        index: u32,
        pending: usize,
    },
}

impl ObserveError {
    /// The API errors are the API server's to judge; a Job whose indexes make no sense against its
    /// pending list stays so until the Job changes, which is watched.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::Api(error) => super::api_error::is_refused(error),
            Self::BadIndexes { .. }
            | Self::UnreadablePlan { .. }
            | Self::IndexOutOfRange { .. } => true,
        }
    }

    /// A short label for logs and tests.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Api(_) => "Api",
            Self::BadIndexes { .. } => "BadIndexes",
            Self::UnreadablePlan { .. } => "UnreadablePlan",
            Self::IndexOutOfRange { .. } => "IndexOutOfRange",
        }
    }
}

/// Reads the children of `run`, what cannot have changed since it was read taken from `cache`.
pub async fn observe(
    client: &Client,
    run: &TrajectoryRun,
    cache: &ObserveCache,
) -> Result<Observed, ObserveError> {
    let namespace = run.namespace().unwrap_or_default();
    let name = run.name_any();
    let uid = run.uid();
    let kept = cache.take(uid.as_deref());
    let mut seen = RunEntry::default();
    let jobs: Api<Job> = Api::namespaced(client.clone(), &namespace);
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);

    let selector = format!("{}={name}", labels::RUN);
    let owned = jobs
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .into_iter()
        .filter(|job| {
            job.owner_references()
                .iter()
                .any(|owner| owner.controller == Some(true) && Some(&owner.uid) == uid.as_ref())
        });
    let (round, latest) = latest_round(owned);

    let mut observed = Observed {
        round,
        ..Observed::default()
    };
    for job in latest {
        let labels = job.labels();
        match labels.get(labels::COMPONENT).map(String::as_str) {
            Some(component) if component == Component::Plan { round }.label() => {
                observed.plan_job = Some(job);
            }
            Some(component) if component == Component::Merge { round }.label() => {
                observed.merge_job = Some(job);
            }
            Some(component) if component == Component::ImagePages { round }.label() => {
                observed.image_pages_job = Some(job);
            }
            Some(component) if component == Component::Build { round }.label() => {
                observed.build_job = Some(job);
            }
            Some(component) if component == Component::Prefetch { round, shard: 0 }.label() => {
                observed.prefetch_jobs.push(job);
            }
            _ => {
                let Some(attempt) = labels.get(labels::ATTEMPT).and_then(|a| a.parse().ok()) else {
                    continue;
                };
                let (pending, list) = pending_list(&maps, &job, (&kept, &mut seen)).await?;
                let mut observed_attempt = ObservedAttempt::new(attempt, job, pending)?;
                observed_attempt.pending_list = list;
                observed_attempt.failure = failure_if_failed(&pods, &observed_attempt.job).await?;
                observed.attempts.push(observed_attempt);
            }
        }
    }
    observed
        .attempts
        .sort_by_key(|attempt| (attempt.attempt, attempt.shard));
    if let Some(job) = observed
        .plan_job
        .as_ref()
        .filter(|j| JobState::of(j) == JobState::Complete)
    {
        observed.plan_summary = summary(&pods, &job.name_any()).await?;
        if observed.plan_summary.is_none() {
            let selector = format!("batch.kubernetes.io/job-name={}", job.name_any());
            let left = pods.list(&ListParams::default().labels(&selector)).await?;
            observed.plan_pod_gone = left.items.is_empty();
        }
    }
    if let Some(job) = observed
        .merge_job
        .as_ref()
        .filter(|j| JobState::of(j) == JobState::Complete)
    {
        observed.merge_summary = summary(&pods, &job.name_any()).await?;
    }
    let landlock_shown = run.status.as_ref().is_some_and(|s| s.sandbox.is_some());
    if !landlock_shown {
        observed.landlock = first_landlock_status(&pods, &observed.attempts).await?;
    }
    if let Some(job) = &observed.plan_job {
        observed.plan_failure = failure_if_failed(&pods, job).await?;
    }
    if let Some(job) = &observed.merge_job {
        observed.merge_failure = failure_if_failed(&pods, job).await?;
    }
    observed.image_index = image_index(&maps, &name, round, (&kept, &mut seen)).await?;
    read_image_reports(&pods, &mut observed).await?;
    generation_pods::read(&pods, run, &mut observed).await?;
    (observed.budget_exhausted_at, observed.run_spent) =
        spending_reports(&pods, run, &observed.attempts).await?;
    if run.spec.run.queue_name.is_some() {
        let uids: Vec<String> = observed.jobs().filter_map(ResourceExt::uid).collect();
        observed.queue = queue::observe(client, &namespace, &uids).await?;
    }
    cache.put(uid.as_deref(), seen);
    Ok(observed)
}

/// What the pods of the round's image pages Job and build Job reported, once they completed and
/// until the operator keeps what they said.
async fn read_image_reports(pods: &Api<Pod>, observed: &mut Observed) -> Result<(), kube::Error> {
    let complete = |job: &&Job| JobState::of(job) == JobState::Complete;
    if let Some(job) = observed.image_pages_job.as_ref().filter(complete)
        && observed.image_index.is_none()
    {
        observed.image_pages = image_pages(pods, job).await?;
    }
    let unresolved = |groups: &Vec<ImageGroup>| groups.iter().any(|group| group.build.is_some());
    if let Some(job) = observed.build_job.as_ref().filter(complete)
        && observed.image_index.as_ref().is_none_or(unresolved)
    {
        (observed.build_reports, observed.build_pods_gone) = build_reports(pods, job).await?;
    }
    Ok(())
}

/// What the succeeded pods of the build Job `job` reported, one report a line of the build list,
/// and whether the Job has no pod left (the node that ran them went).
async fn build_reports(
    pods: &Api<Pod>,
    job: &Job,
) -> Result<(Vec<BuildReport>, bool), kube::Error> {
    let (count, messages) =
        pod_messages(pods, &job.name_any(), Some("Succeeded"), BUILD_CONTAINER).await?;
    let mut reports: Vec<BuildReport> = messages
        .iter()
        .filter_map(|message| serde_json::from_str(message).ok())
        .collect();
    reports.sort_by_key(|report| report.build);
    reports.dedup_by_key(|report| report.build);
    Ok((reports, count == 0))
}

/// The pages the succeeded pods of the image pages Job `job` reported, in page order.
async fn image_pages(pods: &Api<Pod>, job: &Job) -> Result<Vec<ImagePage>, kube::Error> {
    let mut pages: Vec<ImagePage> = termination_messages(pods, &job.name_any(), Some("Succeeded"))
        .await?
        .iter()
        .filter_map(|message| serde_json::from_str(message).ok())
        .collect();
    pages.sort_by_key(|page| page.page);
    pages.dedup_by_key(|page| page.page);
    Ok(pages)
}

/// What the pods of the latest attempt's Jobs reported of the run's spending: the highest budget
/// a failed one stopped at, and the most a finished one (or one stopped at the budget) said the
/// run had spent (nothing is read for a run without prices or a budget).
async fn spending_reports(
    pods: &Api<Pod>,
    run: &TrajectoryRun,
    attempts: &[ObservedAttempt],
) -> Result<(Option<f64>, Option<f64>), kube::Error> {
    let model = &run.spec.run.model;
    let latest = attempts.iter().map(|attempt| attempt.attempt).max();
    let (Some(latest), true) = (latest, model.pricing.is_some() || model.budget.is_some()) else {
        return Ok((None, None));
    };
    let highest = |high: Option<f64>, value: f64| Some(high.map_or(value, |high| high.max(value)));
    let (mut exhausted_at, mut spent) = (None, None);
    for attempt in attempts.iter().filter(|attempt| attempt.attempt == latest) {
        for message in termination_messages(pods, &attempt.job.name_any(), None).await? {
            if let Ok(summary) = serde_json::from_str::<BatchSummary>(&message) {
                if let Some(run_spent) = summary.run_spent.and_then(|text| text.parse().ok()) {
                    spent = highest(spent, run_spent);
                }
            } else if let Ok(failure) = serde_json::from_str::<WorkerFailure>(&message)
                && failure.exit_code == exit::BUDGET_EXHAUSTED
                && let Some(budget) = failure.budget
            {
                exhausted_at = highest(exhausted_at, budget);
                if let Some(run_spent) = failure.run_spent.and_then(|text| text.parse().ok()) {
                    spent = highest(spent, run_spent);
                }
            }
        }
    }
    Ok((exhausted_at, spent))
}

/// The image groups the operator keeps for run `run`'s `round`: as `kept` when they were read
/// before, else from their `ConfigMap`; into `seen` once there.
async fn image_index(
    maps: &Api<ConfigMap>,
    run: &str,
    round: u32,
    (kept, seen): (&RunEntry, &mut RunEntry),
) -> Result<Option<Vec<ImageGroup>>, ObserveError> {
    // Kept groups whose builds are not resolved yet are read again: the operator resolves them
    // in the `ConfigMap` once the build Job reported.
    let resolved = |groups: &&Vec<ImageGroup>| groups.iter().all(|group| group.build.is_none());
    let groups = match kept.image_index(round).filter(resolved) {
        Some(groups) => Some(groups.clone()),
        None => read_image_index(maps, &image_index_name(run, round)).await?,
    };
    if let Some(groups) = &groups {
        seen.keep_image_index(round, groups.clone());
    }
    Ok(groups)
}

/// The image groups in `ConfigMap` `name`, one JSON [`ImageGroup`] a line.
async fn read_image_index(
    maps: &Api<ConfigMap>,
    name: &str,
) -> Result<Option<Vec<ImageGroup>>, ObserveError> {
    let Some(text) = maps
        .get_opt(name)
        .await?
        .and_then(|map| map.data?.remove(IMAGE_INDEX_KEY))
    else {
        return Ok(None);
    };
    text.lines()
        .map(serde_json::from_str)
        .collect::<Result<Vec<ImageGroup>, _>>()
        .map(Some)
        .map_err(|err| ObserveError::UnreadablePlan {
            map: name.to_owned(),
            reason: err.to_string(),
        })
}

/// The key of the image index `ConfigMap` holding the groups.
pub const IMAGE_INDEX_KEY: &str = "groups.jsonl";

/// Whether Landlock confined the commands, as the summary of a succeeded generation pod says: one
/// pod list, for the first Job with a succeeded index (the kernel and the runtime's profile are
/// the nodes', so one pod tells for the pool).
async fn first_landlock_status(
    pods: &Api<Pod>,
    attempts: &[ObservedAttempt],
) -> Result<Option<LandlockStatus>, kube::Error> {
    let succeeded = |attempt: &&ObservedAttempt| {
        attempt
            .job
            .status
            .as_ref()
            .and_then(|status| status.succeeded)
            .is_some_and(|succeeded| succeeded > 0)
    };
    let Some(attempt) = attempts.iter().find(succeeded) else {
        return Ok(None);
    };
    let summary: Option<BatchSummary> = summary(pods, &attempt.job.name_any()).await?;
    Ok(summary.and_then(|summary| summary.landlock))
}

/// The latest round of `jobs`, and its Jobs (a Job without a round label is of the first round).
fn latest_round(jobs: impl Iterator<Item = Job>) -> (u32, Vec<Job>) {
    let round_of = |job: &Job| {
        job.labels()
            .get(labels::ROUND)
            .and_then(|round| round.parse().ok())
            .unwrap_or(1_u32)
    };
    let jobs: Vec<Job> = jobs.collect();
    let latest = jobs.iter().map(round_of).max().unwrap_or(1);
    let jobs = jobs
        .into_iter()
        .filter(|job| round_of(job) == latest)
        .collect();
    (latest, jobs)
}

impl ObservedAttempt {
    /// The attempt of `job`, whose index *i* works batch `pending[i]`; its shard is the Job's
    /// label.
    pub fn new(attempt: u32, job: Job, pending: Vec<u32>) -> Result<Self, ObserveError> {
        let batches = attempt_batches(&job, &pending)?;
        let shard = job
            .labels()
            .get(labels::SHARD)
            .and_then(|shard| shard.parse().ok())
            .unwrap_or(0);
        Ok(Self {
            attempt,
            shard,
            image: job.annotations().get(annotations::IMAGE).cloned(),
            unavailable: job
                .annotations()
                .get(annotations::IMAGE_UNAVAILABLE)
                .cloned(),
            build_failed: job
                .annotations()
                .contains_key(annotations::IMAGE_BUILD_FAILED),
            job,
            pending,
            pending_list: None,
            batches,
            failure: None,
        })
    }
}

/// The id each index of a generation Job works: the list (or ranges) in its plan `ConfigMap`, or
/// the identity when the `ConfigMap` has none (the first attempt runs batch *i* at index *i*);
/// and the plan's pending list on storage, when the ids are slots of it. Read once a Job: what
/// was `kept` of it is taken as it is; what its `ConfigMap` gave goes into `seen`.
async fn pending_list(
    maps: &Api<ConfigMap>,
    job: &Job,
    (kept, seen): (&RunEntry, &mut RunEntry),
) -> Result<(Vec<u32>, Option<String>), ObserveError> {
    let uid = job.uid();
    if let Some((uid, pending)) = uid.as_ref().and_then(|uid| Some((uid, kept.pending(uid)?))) {
        seen.keep_pending(uid.clone(), pending.clone());
        return Ok(pending.clone());
    }
    let completions = job
        .spec
        .as_ref()
        .and_then(|spec| spec.completions)
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or_default();
    let plan = maps
        .get_opt(&job.name_any())
        .await?
        .and_then(|map| map.data?.remove(paths::PLAN_FILE))
        .and_then(|text| serde_json::from_str::<RunPlan>(&text).ok());
    let list = plan.as_ref().and_then(|plan| plan.pending_list.clone());
    let read = plan.is_some();
    let listed = match plan.map(|plan| plan.pending_list()) {
        None => None,
        Some(Ok(listed)) => listed,
        Some(Err(reason)) => {
            return Err(ObserveError::UnreadablePlan {
                map: job.name_any(),
                reason,
            });
        }
    };
    let pending = (listed.unwrap_or_else(|| (0..completions).collect()), list);
    // A Job seen before its `ConfigMap` is applied gets the identity for now, and is read again.
    if let (true, Some(uid)) = (read, uid) {
        seen.keep_pending(uid, pending.clone());
    }
    Ok(pending)
}

/// Maps a generation Job's `completedIndexes` / `failedIndexes` back to batch ids through the
/// attempt's pending list.
pub fn attempt_batches(job: &Job, pending: &[u32]) -> Result<AttemptBatches, ObserveError> {
    let name = job.name_any();
    let status = job.status.as_ref();
    let map = |text: Option<&String>| -> Result<BTreeSet<u32>, ObserveError> {
        let text = text.map_or("", String::as_str);
        let indexes = contract::parse_ranges(text).map_err(|reason| ObserveError::BadIndexes {
            job: name.clone(),
            text: text.to_owned(),
            reason,
        })?;
        indexes
            .into_iter()
            .map(|index| {
                usize::try_from(index)
                    .ok()
                    .and_then(|i| pending.get(i).copied())
                    .ok_or(ObserveError::IndexOutOfRange {
                        job: name.clone(),
                        index,
                        pending: pending.len(),
                    })
            })
            .collect()
    };
    Ok(AttemptBatches {
        completed: map(status.and_then(|s| s.completed_indexes.as_ref()))?,
        failed: map(status.and_then(|s| s.failed_indexes.as_ref()))?,
    })
}

/// For a failed Job, what its failed pods reported: the report of a pod that stopped on a
/// configuration error first, else any. Nothing is read for a Job that did not fail.
async fn failure_if_failed(
    pods: &Api<Pod>,
    job: &Job,
) -> Result<Option<WorkerFailure>, kube::Error> {
    if !matches!(JobState::of(job), JobState::Failed { .. }) {
        return Ok(None);
    }
    let mut failures: Vec<WorkerFailure> = termination_messages(pods, &job.name_any(), None)
        .await?
        .iter()
        .filter_map(|message| serde_json::from_str(message).ok())
        .collect();
    failures.sort_by_key(|failure: &WorkerFailure| failure.exit_code != exit::PERMANENT_CONFIG);
    Ok(failures.into_iter().next())
}

/// The worker's summary from the termination message of the Job's succeeded pod.
async fn summary<T: DeserializeOwned>(
    pods: &Api<Pod>,
    job: &str,
) -> Result<Option<T>, kube::Error> {
    Ok(termination_messages(pods, job, Some("Succeeded"))
        .await?
        .iter()
        .find_map(|message| serde_json::from_str(message).ok()))
}

/// The termination messages of the worker containers of `job`'s pods (those in `phase` only, when
/// given).
async fn termination_messages(
    pods: &Api<Pod>,
    job: &str,
    phase: Option<&str>,
) -> Result<Vec<String>, kube::Error> {
    Ok(pod_messages(pods, job, phase, CONTAINER).await?.1)
}

/// How many pods of Job `job` there are, and the termination messages of their `container`s (of
/// the pods in `phase`, when given).
async fn pod_messages(
    pods: &Api<Pod>,
    job: &str,
    phase: Option<&str>,
    container: &str,
) -> Result<(usize, Vec<String>), kube::Error> {
    let selector = format!("batch.kubernetes.io/job-name={job}");
    let list = pods.list(&ListParams::default().labels(&selector)).await?;
    let count = list.items.len();
    let messages = list
        .items
        .into_iter()
        .filter(|pod| {
            phase.is_none_or(|phase| {
                pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some(phase)
            })
        })
        .flat_map(|pod| {
            pod.status
                .and_then(|s| s.container_statuses)
                .unwrap_or_default()
        })
        .filter(|status| status.name == container)
        .filter_map(|status| status.state?.terminated?.message)
        .collect();
    Ok((count, messages))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::JobFixture;

    /// (pending, completedIndexes, failedIndexes, completed batches, failed batches).
    type IndexCase<'a> = (
        &'a [u32],
        Option<&'a str>,
        Option<&'a str>,
        &'a [u32],
        &'a [u32],
    );

    fn job_with(completed: Option<&str>, failed: Option<&str>) -> Job {
        let mut job = JobFixture::generation(2);
        if let Some(completed) = completed {
            job = job.completed(completed);
        }
        if let Some(failed) = failed {
            job = job.failed_indexes(failed);
        }
        job.build()
    }

    #[test]
    fn job_indexes_map_back_to_batch_ids_through_the_pending_list() {
        let set = |ids: &[u32]| ids.iter().copied().collect::<BTreeSet<u32>>();
        let identity: Vec<u32> = (0..6).collect();
        let later = [2, 5, 7, 8, 11];
        let cases: [IndexCase; 5] = [
            (&identity, None, None, &[], &[]),
            (&identity, Some("0-2,4"), Some("5"), &[0, 1, 2, 4], &[5]),
            (&later, Some("0-1,3"), None, &[2, 5, 8], &[]),
            (&later, Some("4"), Some("0,2"), &[11], &[2, 7]),
            (&later, Some(""), Some(""), &[], &[]),
        ];
        for (pending, completed, failed, want_completed, want_failed) in cases {
            let batches = attempt_batches(&job_with(completed, failed), pending).unwrap();
            assert_eq!(batches.completed, set(want_completed), "{completed:?}");
            assert_eq!(batches.failed, set(want_failed), "{failed:?}");
        }
    }

    #[test]
    fn indexes_beyond_the_pending_list_or_unreadable_are_errors() {
        let error = attempt_batches(&job_with(Some("0-5"), None), &[1, 2]).unwrap_err();
        assert_eq!(error.label(), "IndexOutOfRange");
        assert!(error.is_permanent());
        assert!(error.to_string().contains("index 2"), "{error}");
        let error = attempt_batches(&job_with(Some("x"), None), &[1, 2]).unwrap_err();
        assert_eq!(error.label(), "BadIndexes");
    }

    /// A pod whose task container waits on its image, created `age` before now.
    fn waiting_pod(reason: &str, message: &str, age: std::time::Duration) -> Pod {
        use k8s_openapi::api::core::v1::{
            ContainerState, ContainerStateWaiting, ContainerStatus, PodStatus,
        };
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let now = k8s_openapi::jiff::Timestamp::now();
        let created = now - k8s_openapi::jiff::SignedDuration::try_from(age).unwrap();
        Pod {
            metadata: kube::api::ObjectMeta {
                creation_timestamp: Some(Time(created)),
                ..Default::default()
            },
            status: Some(PodStatus {
                init_container_statuses: Some(vec![ContainerStatus {
                    name: "task-0".into(),
                    image: "registry.local/swe/a:1".into(),
                    state: Some(ContainerState {
                        waiting: Some(ContainerStateWaiting {
                            reason: Some(reason.into()),
                            message: Some(message.into()),
                        }),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    /// An image the registry says is missing or forbidden, or a malformed reference, is
    /// unavailable at once; another pull error only after the grace; a pull in progress never.
    #[test]
    fn a_pull_failure_counts_at_once_when_it_cannot_heal_and_after_the_grace_otherwise() {
        let grace = std::time::Duration::from_secs(300);
        let now = k8s_openapi::jiff::Timestamp::now();
        let second = std::time::Duration::from_secs(1);
        let at_once = [
            (
                "ErrImagePull",
                "failed to resolve reference: registry.local/swe/a:1: not found",
            ),
            (
                "ImagePullBackOff",
                "Back-off pulling image: manifest unknown",
            ),
            (
                "ErrImagePull",
                "pull access denied, repository does not exist",
            ),
            ("InvalidImageName", "Failed to apply default image tag"),
        ];
        for (reason, message) in at_once {
            let why = pull_failure(&waiting_pod(reason, message, second), grace, now)
                .unwrap_or_else(|| panic!("{reason}: {message}"));
            assert!(why.starts_with("registry.local/swe/a:1 ("), "{why}");
            assert!(why.contains(message), "{why}");
        }
        let refused = "dial tcp 10.0.0.1:5000: connect: connection refused";
        assert_eq!(
            pull_failure(&waiting_pod("ErrImagePull", refused, second), grace, now),
            None
        );
        assert!(
            pull_failure(
                &waiting_pod("ErrImagePull", refused, grace + second),
                grace,
                now
            )
            .is_some()
        );
        let pulling = waiting_pod("PodInitializing", "", grace * 10);
        assert_eq!(pull_failure(&pulling, grace, now), None);
    }

    #[test]
    fn a_job_state_is_read_from_its_conditions() {
        assert_eq!(JobState::of(&JobFixture::plan().build()), JobState::Running);
        assert_eq!(
            JobState::of(&JobFixture::plan().complete().build()),
            JobState::Complete
        );
        assert_eq!(
            JobState::of(&JobFixture::plan().failed("BackoffLimitExceeded").build()),
            JobState::Failed {
                reason: "BackoffLimitExceeded".into(),
                message: "BackoffLimitExceeded happened".into(),
            }
        );
    }
}
