//! Observe: read what exists of a run's children (reads only). Jobs are found by the run label and
//! kept only when the run is their controller (a run re-created under the same name does not adopt
//! its predecessor's Jobs); summaries come from the termination message of a succeeded pod.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use serde::de::DeserializeOwned;
use trajectory_worker::contract::{RunPlan, paths};

use crate::api::TrajectoryRun;
use crate::desired::{CONTAINER, Stage, labels};
use crate::state::{JobState, Observed, ObservedAttempt};

/// Reads the children of `run`.
pub async fn observe(client: &Client, run: &TrajectoryRun) -> Result<Observed, kube::Error> {
    let namespace = run.namespace().unwrap_or_default();
    let name = run.name_any();
    let uid = run.uid();
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

    let mut observed = Observed::default();
    for job in owned {
        let labels = job.labels();
        match labels.get(labels::COMPONENT).map(String::as_str) {
            Some(component) if component == Stage::Plan.component() => {
                observed.plan_job = Some(job);
            }
            Some(component) if component == Stage::Merge.component() => {
                observed.merge_job = Some(job);
            }
            _ => {
                let Some(attempt) = labels.get(labels::ATTEMPT).and_then(|a| a.parse().ok()) else {
                    continue;
                };
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
                let pending = plan
                    .and_then(|plan| plan.batches)
                    .unwrap_or_else(|| (0..completions).collect());
                observed.attempts.push(ObservedAttempt {
                    attempt,
                    job,
                    pending,
                });
            }
        }
    }
    observed.attempts.sort_by_key(|attempt| attempt.attempt);
    if let Some(job) = observed
        .plan_job
        .as_ref()
        .filter(|j| JobState::of(j) == JobState::Complete)
    {
        observed.plan_summary = summary(&pods, &job.name_any()).await?;
    }
    if let Some(job) = observed
        .merge_job
        .as_ref()
        .filter(|j| JobState::of(j) == JobState::Complete)
    {
        observed.merge_summary = summary(&pods, &job.name_any()).await?;
    }
    Ok(observed)
}

/// The worker's summary from the termination message of the Job's succeeded pod.
async fn summary<T: DeserializeOwned>(
    pods: &Api<Pod>,
    job: &str,
) -> Result<Option<T>, kube::Error> {
    let selector = format!("batch.kubernetes.io/job-name={job}");
    let list = pods.list(&ListParams::default().labels(&selector)).await?;
    Ok(list
        .items
        .into_iter()
        .filter(|pod| pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded"))
        .flat_map(|pod| {
            pod.status
                .and_then(|s| s.container_statuses)
                .unwrap_or_default()
        })
        .filter(|status| status.name == CONTAINER)
        .filter_map(|status| status.state?.terminated?.message)
        .find_map(|message| serde_json::from_str(&message).ok()))
}
