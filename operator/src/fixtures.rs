//! Builders of test objects with sensible defaults, so that a test states only what it is about:
//! `TrajectoryRun::test().suspended().build()`, `JobFixture::generation(1).completed("0-3")`,
//! `ObservedFixture::planned(5).done(0, 1).attempt(...)`.

use k8s_openapi::api::batch::v1::{Job, JobCondition, JobStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use serde_json::json;
use trajectory_worker::contract::{
    BatchRange, BuildReport, ImageGroup, ImagePage, ImagePlan, MergeSummary, PlanSummary,
    WorkerFailure, exit,
};
use trajectory_worker::spec::RunSpec;

use crate::api::{TrajectoryRun, TrajectoryRunSpec, TrajectoryRunStatus};
use crate::reconcile::children::{Component, annotations, labels, unavailable_job_name};
use crate::reconcile::observe::{Observed, ObservedAttempt};

/// The time every fixture's "now" is.
pub fn now() -> Time {
    Time(Timestamp::from_second(10_000).expect("a valid timestamp"))
}

impl TrajectoryRun {
    /// A stored run `coding-v1` in `research` (a uid, generation 1) of `datasets/coding.jsonl`,
    /// with a volume and every other field at its default.
    pub fn test() -> RunFixture {
        let spec: RunSpec = serde_json::from_value(json!({
            "dataset": {"path": "datasets/coding.jsonl"},
            "model": {"baseUrl": "http://vllm:8000/v1", "name": "hermes"},
            "storage": {"volume": {"persistentVolumeClaim": {"claimName": "trajectories"}}},
        }))
        .expect("a valid spec");
        let mut run = TrajectoryRun::new("coding-v1", TrajectoryRunSpec::from(spec));
        run.metadata.namespace = Some("research".into());
        run.metadata.uid = Some("0b7c-uid".into());
        run.metadata.generation = Some(1);
        RunFixture(run)
    }
}

/// A [`TrajectoryRun`] being built; see [`TrajectoryRun::test`].
#[derive(Debug, Clone)]
pub struct RunFixture(TrajectoryRun);

impl RunFixture {
    pub fn named(mut self, name: &str) -> Self {
        self.0.metadata.name = Some(name.into());
        self
    }

    pub fn namespace(mut self, namespace: &str) -> Self {
        self.0.metadata.namespace = Some(namespace.into());
        self
    }

    pub fn uid(mut self, uid: &str) -> Self {
        self.0.metadata.uid = Some(uid.into());
        self
    }

    /// As if never read from the API server.
    pub fn without_uid(mut self) -> Self {
        self.0.metadata.uid = None;
        self
    }

    pub fn generation(mut self, generation: i64) -> Self {
        self.0.metadata.generation = Some(generation);
        self
    }

    pub fn suspended(self) -> Self {
        self.with(|spec| spec.suspend = true)
    }

    /// `retry.perBatch` and `retry.maxFailedBatches`.
    pub fn retry(self, per_batch: u32, max_failed_batches: u32) -> Self {
        self.with(|spec| {
            spec.retry.per_batch = per_batch;
            spec.retry.max_failed_batches = max_failed_batches;
        })
    }

    pub fn with(mut self, change: impl FnOnce(&mut RunSpec)) -> Self {
        change(&mut self.0.spec.run);
        self
    }

    pub fn with_pod_template(self, template: serde_json::Value) -> Self {
        self.with(|spec| spec.pod_template = Some(template))
    }

    pub fn with_status(mut self, status: Option<TrajectoryRunStatus>) -> Self {
        self.0.status = status;
        self
    }

    pub fn build(self) -> TrajectoryRun {
        self.0
    }
}

/// A child Job of the run `coding-v1` as the Job controller reports it; running until told
/// otherwise.
#[derive(Debug, Clone)]
pub struct JobFixture {
    job: Job,
    attempt: Option<u32>,
}

impl JobFixture {
    fn of(component: Component) -> Self {
        let mut job = Job {
            metadata: ObjectMeta {
                name: Some(component.child_name("coding-v1")),
                ..ObjectMeta::default()
            },
            spec: None,
            status: Some(JobStatus {
                conditions: Some(Vec::new()),
                ..JobStatus::default()
            }),
        };
        let mut job_labels = std::collections::BTreeMap::from([(
            labels::COMPONENT.to_owned(),
            component.label().to_owned(),
        )]);
        let attempt = match component {
            Component::Generate { attempt, .. } => {
                job_labels.insert(labels::ATTEMPT.to_owned(), attempt.to_string());
                Some(attempt)
            }
            _ => None,
        };
        if component.round() > 1 {
            job_labels.insert(labels::ROUND.to_owned(), component.round().to_string());
        }
        job.metadata.labels = Some(job_labels);
        Self { job, attempt }
    }

    pub fn plan() -> Self {
        Self::of(Component::Plan { round: 1 })
    }

    /// The plan Job of a later round.
    pub fn plan_of_round(round: u32) -> Self {
        Self::of(Component::Plan { round })
    }

    pub fn generation(attempt: u32) -> Self {
        Self::of(Component::generation(attempt))
    }

    pub fn merge() -> Self {
        Self::of(Component::Merge { round: 1 })
    }

    /// The Job reporting the pages of the first round's image index.
    pub fn image_pages() -> Self {
        Self::of(Component::ImagePages { round: 1 })
    }

    /// The Job building the first round's images.
    pub fn builds() -> Self {
        Self::of(Component::Build { round: 1 })
    }

    /// The merge Job of a later round.
    pub fn merge_of_round(round: u32) -> Self {
        Self::of(Component::Merge { round })
    }

    /// Shard `shard` of a generation Job's attempt (named and labelled as the operator does).
    pub fn shard(mut self, shard: u32) -> Self {
        let attempt = self.attempt.expect("a generation Job");
        self.job.metadata.name =
            Some(Component::Generate { attempt, shard }.child_name("coding-v1"));
        if shard > 0 {
            self.job
                .metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert(labels::SHARD.to_owned(), shard.to_string());
        }
        self
    }

    /// A Job of rows naming `image`.
    pub fn image(mut self, image: &str) -> Self {
        self.job
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(annotations::IMAGE.to_owned(), image.to_owned());
        self
    }

    /// The Job recording its rows' image unavailable, for `why`.
    pub fn unavailable(mut self, why: &str) -> Self {
        let name = self.job.metadata.name.clone().unwrap_or_default();
        self.job.metadata.name = Some(unavailable_job_name(&name));
        self.job
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(annotations::IMAGE_UNAVAILABLE.to_owned(), why.to_owned());
        self
    }

    fn status(&mut self) -> &mut JobStatus {
        self.job.status.get_or_insert_with(JobStatus::default)
    }

    fn condition(mut self, type_: &str, reason: &str) -> Self {
        self.status()
            .conditions
            .get_or_insert_with(Vec::new)
            .push(JobCondition {
                type_: type_.into(),
                status: "True".into(),
                reason: Some(reason.into()),
                message: Some(format!("{reason} happened")),
                ..JobCondition::default()
            });
        self
    }

    /// The Job completed (`Complete`, reason `CompletionsReached`).
    pub fn complete(self) -> Self {
        self.condition("Complete", "CompletionsReached")
    }

    /// The Job failed with the condition reason `reason` (and the message "`reason` happened").
    pub fn failed(self, reason: &str) -> Self {
        self.condition("Failed", reason)
    }

    /// `status.completedIndexes`.
    pub fn completed(mut self, indexes: &str) -> Self {
        self.status().completed_indexes = Some(indexes.into());
        self
    }

    /// `status.failedIndexes`.
    pub fn failed_indexes(mut self, indexes: &str) -> Self {
        self.status().failed_indexes = Some(indexes.into());
        self
    }

    pub fn build(self) -> Job {
        self.job
    }
}

/// What observe would have read of a run's children.
#[derive(Debug, Clone, Default)]
pub struct ObservedFixture(Observed);

impl ObservedFixture {
    /// Nothing yet: a new run.
    pub fn new() -> Self {
        Self::default()
    }

    /// A completed plan of `batches` batches of 10 prompts, 2 lines invalid, none done before.
    pub fn planned(batches: u32) -> Self {
        Self(Observed {
            plan_job: Some(JobFixture::plan().complete().build()),
            plan_summary: Some(PlanSummary {
                prompts: u64::from(batches) * 10,
                invalid: 2,
                batches,
                done: Vec::new(),
                done_count: 0,
                dataset_digest: "sha256:x".into(),
                spec_hash: "blake3:y".into(),
                done_truncated: false,
                pending_list: None,
                images: None,
            }),
            ..Observed::default()
        })
    }

    /// A run of `batches` batches, all done, whose merge wrote `trajectories` (and one discarded
    /// record, 4096 bytes).
    pub fn merged(batches: u32, trajectories: u64) -> Self {
        let mut merged = Self::planned(batches)
            .done(0, batches - 1)
            .merge(JobFixture::merge().complete());
        merged.0.merge_summary = Some(MergeSummary {
            trajectories,
            discarded: 1,
            failed: 0,
            bytes: 4096,
            skipped_lines: 0,
            verified: 0,
            passed: 0,
            cost: None,
            spent: None,
        });
        merged
    }

    /// The merge counted `verified` records whose row's verifier ran, `passed` of them passing.
    pub fn verified(mut self, verified: u64, passed: u64) -> Self {
        if let Some(summary) = &mut self.0.merge_summary {
            summary.verified = verified;
            summary.passed = passed;
        }
        self
    }

    /// The merge summed the kept records' cost to `spent` USD.
    pub fn priced(mut self, spent: &str) -> Self {
        if let Some(summary) = &mut self.0.merge_summary {
            summary.cost = Some(spent.to_owned());
        }
        self
    }

    /// The plan found batches `first..=last` done (by an earlier run on the same storage).
    pub fn done(mut self, first: u32, last: u32) -> Self {
        if let Some(summary) = &mut self.0.plan_summary {
            summary.done.push(BatchRange { first, last });
            summary.done_count += last - first + 1;
        }
        self
    }

    /// The plan found `done_count` batches done, too scattered to list: it listed only
    /// `0..=listed_last` in its summary and wrote the pending batches to `list` on storage.
    pub fn scattered(mut self, done_count: u32, listed_last: u32, list: &str) -> Self {
        if let Some(summary) = &mut self.0.plan_summary {
            summary.done = vec![BatchRange {
                first: 0,
                last: listed_last,
            }];
            summary.done_count = done_count;
            summary.done_truncated = true;
            summary.pending_list = Some(list.to_owned());
        }
        self
    }

    /// The plan grouped its pending batches by image: `(image, id ranges)`, all listed.
    pub fn images(mut self, groups: &[(&str, &str)]) -> Self {
        let listed: Vec<ImageGroup> = groups
            .iter()
            .map(|(image, ids)| ImageGroup::new((*image).to_owned(), (*ids).to_owned()))
            .collect();
        if let Some(summary) = &mut self.0.plan_summary {
            summary.images = Some(ImagePlan {
                groups: u32::try_from(listed.len()).unwrap_or(u32::MAX),
                listed,
                index: None,
                pages: 0,
            });
        }
        self
    }

    /// The plan's summary lists none of its image groups: they are in `pages` pages of the
    /// index `index` on storage.
    pub fn images_in_pages(mut self, index: &str, pages: u32) -> Self {
        if let Some(images) = self
            .0
            .plan_summary
            .as_mut()
            .and_then(|summary| summary.images.as_mut())
        {
            images.listed.clear();
            images.index = Some(index.to_owned());
            images.pages = pages;
        }
        self
    }

    /// The Job reporting the image index's pages, and the pages its pods reported.
    pub fn image_pages(mut self, job: JobFixture, pages: Vec<ImagePage>) -> Self {
        self.0.image_pages_job = Some(job.build());
        self.0.image_pages = pages;
        self
    }

    /// The plan builds the images of `lines`: `(image, its line of the build list)`.
    pub fn built_images(mut self, lines: &[(&str, u32)]) -> Self {
        if let Some(images) = self
            .0
            .plan_summary
            .as_mut()
            .and_then(|summary| summary.images.as_mut())
        {
            for group in &mut images.listed {
                group.build = lines
                    .iter()
                    .find(|(image, _)| *image == group.image)
                    .map(|(_, line)| *line);
            }
        }
        self
    }

    /// The Job building the round's images, and what its succeeded pods reported.
    pub fn build_job(mut self, job: JobFixture, reports: Vec<BuildReport>) -> Self {
        self.0.build_job = Some(job.build());
        self.0.build_reports = reports;
        self
    }

    /// The complete build Job has no pod left.
    pub fn build_pods_gone(mut self) -> Self {
        self.0.build_pods_gone = true;
        self
    }

    /// The operator keeps `groups` as the round's image index.
    pub fn image_index(mut self, groups: Vec<ImageGroup>) -> Self {
        self.0.image_index = Some(groups);
        self
    }

    /// The operator kept the plan's image groups in its `ConfigMap`.
    pub fn image_index_kept(mut self) -> Self {
        self.0.image_index = self
            .0
            .plan_summary
            .as_ref()
            .and_then(|summary| summary.images.as_ref())
            .map(|images| images.listed.clone());
        self
    }

    /// The pods of the running Job `job` cannot pull its image, for `why`.
    pub fn unpullable(mut self, job: &str, why: &str) -> Self {
        self.0.unpullable.insert(job.to_owned(), why.to_owned());
        self
    }

    /// The plan Job in another state.
    pub fn plan(mut self, job: JobFixture) -> Self {
        self.0.plan_job = Some(job.build());
        self
    }

    /// A generation attempt whose index *i* works `pending[i]`.
    pub fn attempt(mut self, job: JobFixture, pending: &[u32]) -> Self {
        let attempt = job.attempt.expect("a generation Job");
        let attempt =
            ObservedAttempt::new(attempt, job.build(), pending.to_vec()).expect("readable indexes");
        self.0.attempts.push(attempt);
        self
    }

    pub fn merge(mut self, job: JobFixture) -> Self {
        self.0.merge_job = Some(job.build());
        self
    }

    /// The last attempt's failed pod reported `reason` and `error` (exit code 78).
    pub fn worker_failure(mut self, reason: &str, error: &str) -> Self {
        let attempt = self.0.attempts.last_mut().expect("an attempt");
        attempt.failure = Some(WorkerFailure::new(error, reason, exit::PERMANENT_CONFIG));
        self
    }

    /// The failed merge pod reported `reason` and `error` (exit code 78).
    pub fn merge_failure(mut self, reason: &str, error: &str) -> Self {
        self.0.merge_failure = Some(WorkerFailure::new(error, reason, exit::PERMANENT_CONFIG));
        self
    }

    /// The children observed are those of `round` (the plan and merge Jobs take its names).
    pub fn round(mut self, round: u32) -> Self {
        self.0.round = round;
        self
    }

    /// The failed plan pod reported `reason` and `error` (exit code 78).
    pub fn plan_failure(mut self, reason: &str, error: &str) -> Self {
        self.0.plan_failure = Some(WorkerFailure::new(error, reason, exit::PERMANENT_CONFIG));
        self
    }

    /// The plan pod is gone (and with it its termination message).
    pub fn without_plan_summary(mut self) -> Self {
        self.0.plan_summary = None;
        self.0.plan_pod_gone = true;
        self
    }

    /// The plan pod succeeded without a summary (an image that is not this project's worker).
    pub fn silent_plan_pod(mut self) -> Self {
        self.0.plan_summary = None;
        self.0.plan_pod_gone = false;
        self
    }

    /// The merge pod is gone.
    pub fn without_merge_summary(mut self) -> Self {
        self.0.merge_summary = None;
        self
    }

    pub fn build(self) -> Observed {
        self.0
    }
}

/// The names of the Jobs `desired` applies, in order.
pub fn job_names(desired: &crate::reconcile::Desired) -> Vec<&str> {
    desired
        .children
        .jobs
        .iter()
        .filter_map(|job| job.metadata.name.as_deref())
        .collect()
}

/// The Job `name` that `desired` applies.
pub fn job_named<'a>(desired: &'a crate::reconcile::Desired, name: &str) -> &'a Job {
    desired
        .children
        .jobs
        .iter()
        .find(|job| job.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no Job {name}"))
}

/// The pod template of `job`.
pub fn pod_of(job: &Job) -> &k8s_openapi::api::core::v1::PodSpec {
    job.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}
