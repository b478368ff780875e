//! A generation Job of one attempt (one shard of it, when the attempt has more batches than one
//! Job may hold): an Indexed Job whose completion index *i* works batch `pending[i]`, its share
//! of the run's `workers` pods at a time, each batch retried on its own.

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelectorRequirement, NodeSelectorTerm, PodSpec,
    PreferredSchedulingTerm, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use trajectory_worker::contract::TaskResources;

use std::collections::BTreeMap;

use super::{asserted_suspend, failure_policy, job_shell, job_shell_named, to_i32};
use crate::reconcile::children::annotations;
use crate::reconcile::decide::{Shard, Tasks};
use crate::reconcile::queue::ELASTIC_JOB;
use crate::reconcile::validate::ValidatedRun;
use crate::settings::Settings;

/// The Indexed Job of one shard of a generation attempt.
///
/// `shard.exists` says whether the Job is already there: with a Kueue queue the Job is created
/// suspended and Kueue owns `suspend` afterwards, so the operator stops asserting it (see
/// `asserted_suspend`).
pub fn generation_job(run: &ValidatedRun<'_>, settings: &Settings, shard: &Shard) -> Job {
    let spec = run.spec;
    let pending = &shard.pending;
    let component = shard.component();
    let mut job = match &shard.tasks {
        Tasks::Sandbox => job_shell(run, settings, component),
        tasks => job_shell_named(run, settings, component, &shard.job_name(run), tasks),
    };
    let mut annotations = match &shard.tasks {
        Tasks::Sandbox => BTreeMap::new(),
        Tasks::Image(image) => BTreeMap::from([(annotations::IMAGE.to_owned(), image.clone())]),
        Tasks::Unavailable {
            image,
            why,
            build_failed,
        } => {
            let mut annotations = BTreeMap::from([
                (annotations::IMAGE.to_owned(), image.clone()),
                (annotations::IMAGE_UNAVAILABLE.to_owned(), why.clone()),
            ]);
            if *build_failed {
                annotations.insert(
                    annotations::IMAGE_BUILD_FAILED.to_owned(),
                    "true".to_owned(),
                );
            }
            annotations
        }
    };
    // `workers` changed mid-run changes the Job's parallelism: elastic, Kueue resizes its
    // Workload in place; otherwise it would evict the Job (every pod, every conversation in
    // flight) and queue it again.
    if spec.queue_name.is_some() {
        annotations.insert(ELASTIC_JOB.to_owned(), "true".to_owned());
    }
    if !annotations.is_empty() {
        job.metadata.annotations = Some(annotations);
    }
    if let (Some(asked), Some(pod)) = (
        &shard.task_resources,
        job.spec.as_mut().and_then(|s| s.template.spec.as_mut()),
    ) {
        limit_task_containers(pod, run.sandbox_resources.as_ref(), asked);
    }
    if let (Some(node), Some(pod)) = (
        &shard.prefer_node,
        job.spec.as_mut().and_then(|s| s.template.spec.as_mut()),
    ) {
        prefer_node(pod, node);
    }
    job.spec = Some(JobSpec {
        completion_mode: Some("Indexed".to_owned()),
        completions: Some(to_i32(pending.count())),
        parallelism: Some(to_i32(shard.parallelism)),
        backoff_limit_per_index: Some(to_i32(spec.retry.per_batch)),
        // The API server refuses a limit above `completions`; a limit of all of them is the same.
        max_failed_indexes: Some(to_i32(spec.retry.max_failed_batches.min(pending.count()))),
        pod_failure_policy: Some(failure_policy::failure_policy(true)),
        suspend: asserted_suspend(spec, shard.exists, shard.held),
        ..job.spec.take().unwrap_or_default()
    });
    job
}

/// Has `pod` prefer `node` (the one that pulled its image ahead) above any preference of the
/// run's own: a node already holding the image starts the pod without a pull.
fn prefer_node(pod: &mut PodSpec, node: &str) {
    let preferred = pod
        .affinity
        .get_or_insert_with(Affinity::default)
        .node_affinity
        .get_or_insert_with(NodeAffinity::default)
        .preferred_during_scheduling_ignored_during_execution
        .get_or_insert_with(Vec::new);
    preferred.push(PreferredSchedulingTerm {
        weight: 100,
        preference: NodeSelectorTerm {
            // The node's name itself: its hostname label need not match it.
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".to_owned(),
                operator: "In".to_owned(),
                values: Some(vec![node.to_owned()]),
            }]),
            match_expressions: None,
        },
    });
}

/// Sets the limits of `pod`'s task containers to what their tasks ask (`asked`), over the run's
/// `spec.sandbox.resources` (`run`): as Harbor's Docker environment applies a task's `cpus` and
/// `memory_mb` (`--cpus`, `--memory`), a cap, not a reservation. A resource the tasks limit is
/// requested as the run requests it, else not at all (`0`): Kubernetes would otherwise take the
/// limit as the request and reserve it for each of the pod's conversations.
fn limit_task_containers(
    pod: &mut PodSpec,
    run: Option<&ResourceRequirements>,
    asked: &TaskResources,
) {
    let limited = [
        ("cpu", asked.millicpus.map(|millis| format!("{millis}m"))),
        ("memory", asked.memory_mb.map(|mb| format!("{mb}Mi"))),
        (
            "ephemeral-storage",
            asked.storage_mb.map(|mb| format!("{mb}Mi")),
        ),
    ];
    let mut resources = run.cloned().unwrap_or_default();
    for (name, limit) in limited {
        let Some(limit) = limit else { continue };
        resources
            .limits
            .get_or_insert_with(Default::default)
            .insert(name.to_owned(), Quantity(limit));
        resources
            .requests
            .get_or_insert_with(Default::default)
            .entry(name.to_owned())
            .or_insert_with(|| Quantity("0".to_owned()));
    }
    for container in pod.init_containers.iter_mut().flatten() {
        if container
            .name
            .starts_with(super::pod_spec::TASK_CONTAINER_PREFIX)
        {
            container.resources = Some(resources.clone());
        }
    }
}
