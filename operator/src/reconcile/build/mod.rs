//! Build: assemble the objects a [`Decision`](super::decide::Decision)'s children are made of,
//! from a [`ValidatedRun`]. No client and no errors: resource assembly only, one file per object.
//!
//! - [`plan_config_map`]: the run plan a Job's pods mount, named like the Job.
//! - [`plan_job`], [`generation_job`], [`merge_job`]: the three kinds of Job; a batch's Job is the
//!   generation Job of its attempt, one completion index per pending batch.
//! - [`pod_spec`]: the worker pod every Job runs; [`failure_policy`]: how its exits count.
//!
//! Every child carries the common labels and a controller owner reference to the run, so deleting
//! the run deletes them (and never the data on storage).

pub mod build_job;
pub mod failure_policy;
pub mod generation_job;
pub mod image_pages_job;
pub mod merge_job;
pub mod plan_config_map;
pub mod plan_job;
pub mod pod_spec;
pub mod prefetch_job;

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{ConfigMap, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use trajectory_worker::contract::ImageGroup;
use trajectory_worker::spec::RunSpec;

pub use self::generation_job::generation_job;
pub use self::merge_job::merge_job;
pub use self::plan_config_map::plan_config_map;
pub use self::plan_job::plan_job;
use super::children::{Component, MANAGER, image_index_name, labels};
use super::decide::{Child, Tasks};
use super::observe::IMAGE_INDEX_KEY;
use super::validate::ValidatedRun;
use crate::settings::Settings;

/// The objects to apply: `ConfigMap`s first, since the Jobs' pods mount them.
#[derive(Debug, Clone, Default)]
pub struct Children {
    pub config_maps: Vec<ConfigMap>,
    pub jobs: Vec<Job>,
}

/// The objects of `wanted`. A Job that does not exist yet comes with its plan `ConfigMap`; an
/// existing one is asserted alone (its `ConfigMap` is already there, and its batches never
/// change), but for a generation Job of a run with a budget (see [`Shard::held`]).
pub fn children(run: &ValidatedRun<'_>, settings: &Settings, wanted: &[Child]) -> Children {
    let mut children = Children::default();
    for child in wanted {
        if stopped_before_created(run, child) {
            continue;
        }
        let (map, job) = match child {
            Child::Plan { round, exists } => (
                (!exists).then(|| plan_config_map(run, Component::Plan { round: *round }, None)),
                plan_job(run, settings, *round, *exists),
            ),
            Child::ImageIndex { round, groups } => {
                children.config_maps.push(image_index(run, *round, groups));
                continue;
            }
            Child::ImagePages {
                round,
                index,
                pages,
                exists,
            } => (
                (!exists)
                    .then(|| plan_config_map(run, Component::ImagePages { round: *round }, None)),
                image_pages_job::image_pages_job(run, settings, (*round, index, *pages), *exists),
            ),
            Child::Build {
                round,
                builds,
                exists,
            } => (
                (!exists).then(|| plan_config_map(run, Component::Build { round: *round }, None)),
                build_job::build_job(run, settings, (*round, *builds), *exists),
            ),
            Child::Generation(shard) => {
                let job = generation_job(run, settings, shard);
                // Named like its Job, which a Job recording unavailable rows is not by default.
                // With a budget it is applied again: the pods a held Job starts once the budget
                // was raised read the raised one.
                let map = (!shard.exists || run.spec.model.budget.is_some()).then(|| {
                    let mut map = plan_config_map(run, shard.component(), Some(&shard.pending));
                    map.metadata.name.clone_from(&job.metadata.name);
                    map
                });
                (map, job)
            }
            Child::Prefetch {
                round,
                shard,
                image,
                ..
            } => (
                None,
                prefetch_job::prefetch_job(run, settings, (*round, *shard, image)),
            ),
            Child::Merge { round, exists } => (
                (!exists).then(|| plan_config_map(run, Component::Merge { round: *round }, None)),
                merge_job(run, settings, *round, *exists),
            ),
        };
        children.config_maps.extend(map);
        children.jobs.push(job);
    }
    children
}

/// The operator's copy of the image groups of `round`'s plan, one JSON group a line.
fn image_index(run: &ValidatedRun<'_>, round: u32, groups: &[ImageGroup]) -> ConfigMap {
    let text: String = groups
        .iter()
        .filter_map(|group| serde_json::to_string(group).ok())
        .map(|line| line + "\n")
        .collect();
    ConfigMap {
        metadata: metadata(
            run,
            &image_index_name(&run.name, round),
            labels(run, Component::Plan { round }),
        ),
        data: Some(BTreeMap::from([(IMAGE_INDEX_KEY.to_owned(), text)])),
        ..ConfigMap::default()
    }
}

/// The labels of every child serving `component`, and of its pods.
fn labels(run: &ValidatedRun<'_>, component: Component) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (labels::NAME.to_owned(), "trajectory-worker".to_owned()),
        (labels::INSTANCE.to_owned(), run.name.clone()),
        (labels::COMPONENT.to_owned(), component.label().to_owned()),
        (labels::MANAGED_BY.to_owned(), MANAGER.to_owned()),
        (labels::RUN.to_owned(), run.name.clone()),
    ]);
    if let Component::Generate { attempt, shard } = component {
        labels.insert(labels::ATTEMPT.to_owned(), attempt.to_string());
        // Only past the first shard: the first Job of an attempt is labelled as it always was.
        if shard > 0 {
            labels.insert(labels::SHARD.to_owned(), shard.to_string());
        }
    }
    if let Component::Prefetch { shard, .. } = component {
        labels.insert(labels::SHARD.to_owned(), shard.to_string());
    }
    if component.round() > 1 {
        labels.insert(labels::ROUND.to_owned(), component.round().to_string());
    }
    labels
}

/// A child's metadata: its name, the run's namespace, `labels`, the owner reference.
fn metadata(run: &ValidatedRun<'_>, name: &str, labels: BTreeMap<String, String>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(run.namespace.clone()),
        labels: Some(labels),
        owner_references: Some(vec![run.owner.clone()]),
        ..ObjectMeta::default()
    }
}

/// A Job with metadata and pod template filled; the caller sets the Job-level spec fields.
fn job_shell(run: &ValidatedRun<'_>, settings: &Settings, component: Component) -> Job {
    job_shell_named(
        run,
        settings,
        component,
        &run.child_name(component),
        &Tasks::Sandbox,
    )
}

/// [`job_shell`] of the Job `name`, its conversations' commands running as `tasks` says.
fn job_shell_named(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    component: Component,
    name: &str,
    tasks: &Tasks,
) -> Job {
    let name = name.to_owned();
    let pod_labels = labels(run, component);
    let mut job_labels = pod_labels.clone();
    // Always applied, also once Kueue admitted the Job: dropping it from the applied
    // configuration would make server-side apply remove the label, which Kueue refuses.
    if let Some(queue) = &run.spec.queue_name {
        job_labels.insert(labels::KUEUE_QUEUE.to_owned(), queue.clone());
    }
    let template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(pod_labels),
            annotations: run.overrides.annotations.clone(),
            ..ObjectMeta::default()
        }),
        spec: Some(pod_spec::pod_spec(run, settings, component, &name, tasks)),
    };
    Job {
        metadata: metadata(run, &name, job_labels),
        spec: Some(JobSpec {
            template,
            ..JobSpec::default()
        }),
        status: None,
    }
}

/// The Job's `suspend` as the operator asserts it. With a Kueue queue the Job is created
/// suspended and Kueue alone changes it afterwards: asserting `false` would start it past the
/// queue's quota, and asserting `true` while its Workload is admitted makes Kueue unsuspend it
/// again at once (a loop of pods created and killed); a stopped queued run deactivates its
/// Workloads instead (`reconcile::queue`). Otherwise the Job runs unless the run is suspended or
/// the Job `held` at the budget.
fn asserted_suspend(spec: &RunSpec, exists: bool, held: bool) -> Option<bool> {
    match (&spec.queue_name, exists) {
        (Some(_), true) => None,
        (Some(_), false) => Some(true),
        (None, _) => Some(spec.suspend || held),
    }
}

/// A queued Job the run would create while it is stopped (suspended, or held at its budget) is
/// not created yet: Kueue would admit it and start its pods before the operator could deactivate
/// its Workload.
fn stopped_before_created(run: &ValidatedRun<'_>, child: &Child) -> bool {
    if run.spec.queue_name.is_none() {
        return false;
    }
    match child {
        Child::Plan { exists, .. }
        | Child::ImagePages { exists, .. }
        | Child::Build { exists, .. }
        | Child::Merge { exists, .. } => !exists && run.spec.suspend,
        Child::Generation(shard) => !shard.exists && (run.spec.suspend || shard.held),
        Child::ImageIndex { .. } | Child::Prefetch { .. } => false,
    }
}

/// A plan or merge Job: one pod running `component`'s worker mode.
fn single_pod_job(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    component: Component,
    exists: bool,
) -> Job {
    let mut job = job_shell(run, settings, component);
    job.spec = Some(JobSpec {
        completions: Some(1),
        parallelism: Some(1),
        backoff_limit: Some(to_i32(run.spec.retry.per_batch)),
        pod_failure_policy: Some(failure_policy::failure_policy(false)),
        suspend: asserted_suspend(run.spec, exists, false),
        ..job.spec.take().unwrap_or_default()
    });
    job
}

/// Kubernetes counts in `int32`; spec values beyond it are clamped (the schema bounds them anyway).
fn to_i32(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests;
