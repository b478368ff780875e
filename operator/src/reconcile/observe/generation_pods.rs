//! The generation pods of a run's image Jobs, listed once a reconcile while such Jobs exist: whose
//! pods cannot pull their image, and what the pods that finished waited for it; and the nodes
//! that pulled images ahead.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use trajectory_worker::contract::{BatchSummary, PodPull};

use super::{JobState, ObservedAttempt};
use crate::api::TrajectoryRun;
use crate::reconcile::children::{CONTAINER, Component, labels};

/// The label the Job controller puts on a Job's pods.
const JOB_NAME_LABEL: &str = "batch.kubernetes.io/job-name";

/// The annotation the Job controller puts on an Indexed Job's pods: the pod's completion index.
const COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";

/// What the pod of completion `index` of generation Job `job` waited for its image, as its
/// worker's summary said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullReport {
    pub job: String,
    pub index: u32,
    pub pull: PodPull,
}

/// What the run's image Jobs' pods and prefetch pods say: whose pods cannot pull, what the
/// finished ones waited, where images were pulled ahead.
pub async fn read(
    pods: &Api<Pod>,
    run: &TrajectoryRun,
    observed: &mut super::Observed,
) -> Result<(), kube::Error> {
    let name = run.name_any();
    let generation_pods = list(pods, &name, &observed.attempts).await?;
    observed.unpullable = unpullable(&generation_pods, run, &observed.attempts);
    observed.pull_reports = pull_reports(&generation_pods);
    observed.prefetched = prefetched(pods, &name, &observed.prefetch_jobs).await?;
    Ok(())
}

/// The run's generation pods, in one list, while a Job of rows naming an image (not one recording
/// them unavailable) exists; none otherwise.
async fn list(
    pods: &Api<Pod>,
    run_name: &str,
    attempts: &[ObservedAttempt],
) -> Result<Vec<Pod>, kube::Error> {
    if !attempts
        .iter()
        .any(|attempt| attempt.image.is_some() && attempt.unavailable.is_none())
    {
        return Ok(Vec::new());
    }
    let selector = format!(
        "{}={run_name},{}={}",
        labels::RUN,
        labels::COMPONENT,
        Component::generation(1).label()
    );
    Ok(pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items)
}

/// The nodes the succeeded pods of the round's prefetch Jobs (`jobs`) pulled on, by the piece
/// (shard label) whose image they pulled: one list of the run's prefetch pods while such Jobs
/// exist.
async fn prefetched(
    pods: &Api<Pod>,
    run_name: &str,
    jobs: &[k8s_openapi::api::batch::v1::Job],
) -> Result<BTreeMap<u32, String>, kube::Error> {
    if jobs.is_empty() {
        return Ok(BTreeMap::new());
    }
    let selector = format!(
        "{}={run_name},{}={}",
        labels::RUN,
        labels::COMPONENT,
        Component::Prefetch { round: 1, shard: 0 }.label()
    );
    let shard_of: BTreeMap<String, u32> = jobs
        .iter()
        .filter_map(|job| {
            Some((
                job.name_any(),
                job.labels().get(labels::SHARD)?.parse().ok()?,
            ))
        })
        .collect();
    let mut nodes = BTreeMap::new();
    for pod in pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
    {
        let succeeded = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded");
        let shard = pod
            .labels()
            .get(JOB_NAME_LABEL)
            .and_then(|job| shard_of.get(job));
        let node = pod.spec.as_ref().and_then(|spec| spec.node_name.clone());
        if let (true, Some(shard), Some(node)) = (succeeded, shard, node) {
            nodes.insert(*shard, node);
        }
    }
    Ok(nodes)
}

/// The running generation Jobs of rows naming an image whose pods cannot pull it, with why.
fn unpullable(
    pods: &[Pod],
    run: &TrajectoryRun,
    attempts: &[ObservedAttempt],
) -> BTreeMap<String, String> {
    let running: BTreeSet<String> = attempts
        .iter()
        .filter(|attempt| attempt.image.is_some() && attempt.unavailable.is_none())
        .filter(|attempt| JobState::of(&attempt.job) == JobState::Running)
        .map(|attempt| attempt.job.name_any())
        .collect();
    let grace =
        std::time::Duration::from_secs(run.spec.run.sandbox.image_unavailable_after_seconds);
    let now = k8s_openapi::jiff::Timestamp::now();
    let mut found = BTreeMap::new();
    for pod in pods {
        let Some(job) = pod
            .labels()
            .get(JOB_NAME_LABEL)
            .filter(|job| running.contains(*job))
        else {
            continue;
        };
        if let Some(why) = pull_failure(pod, grace, now) {
            found.entry(job.clone()).or_insert(why);
        }
    }
    found
}

/// What the succeeded pods among `pods` waited for their image, as their workers' summaries
/// (termination messages) say; pods whose summary says nothing of it are left out.
pub fn pull_reports(pods: &[Pod]) -> Vec<PullReport> {
    pods.iter()
        .filter(|pod| pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded"))
        .filter_map(|pod| {
            let job = pod.labels().get(JOB_NAME_LABEL)?.clone();
            let index = pod.annotations().get(COMPLETION_INDEX)?.parse().ok()?;
            let message = pod
                .status
                .as_ref()?
                .container_statuses
                .iter()
                .flatten()
                .find(|status| status.name == CONTAINER)?
                .state
                .as_ref()?
                .terminated
                .as_ref()?
                .message
                .as_deref()?;
            let summary: BatchSummary = serde_json::from_str(message.trim()).ok()?;
            Some(PullReport {
                job,
                index,
                pull: summary.pull?,
            })
        })
        .collect()
}

/// Why `pod`'s task containers cannot pull their image, once that counts as unavailable: at once
/// for a reference the runtime cannot parse or a registry that says the image does not exist or
/// may not be read; after `grace` since the pod was created for other pull errors (a registry
/// that is down, a rate limit). A pull in progress is not an error.
pub fn pull_failure(
    pod: &Pod,
    grace: std::time::Duration,
    now: k8s_openapi::jiff::Timestamp,
) -> Option<String> {
    let status = pod.status.as_ref()?;
    let waiting = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .filter_map(|container| {
            let waiting = container.state.as_ref()?.waiting.as_ref()?;
            Some((container, waiting))
        })
        .find(|(_, waiting)| {
            matches!(
                waiting.reason.as_deref(),
                Some(
                    "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull"
                )
            )
        });
    let (container, waiting) = waiting?;
    let reason = waiting.reason.as_deref().unwrap_or_default();
    let message = waiting.message.as_deref().unwrap_or_default();
    let lowered = message.to_lowercase();
    let cannot_heal = matches!(reason, "InvalidImageName" | "ErrImageNeverPull")
        || [
            "not found",
            "manifest unknown",
            "unauthorized",
            "denied",
            "forbidden",
            "invalid reference",
        ]
        .iter()
        .any(|sign| lowered.contains(sign));
    let created = pod.metadata.creation_timestamp.as_ref().map(|time| time.0);
    let waited = created.map(|created| now.duration_since(created).unsigned_abs());
    let too_long = waited.is_some_and(|waited| waited >= grace);
    (cannot_heal || too_long).then(|| format!("{} ({reason}): {message}", container.image.as_str()))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStatus, PodStatus,
    };
    use kube::api::ObjectMeta;

    use super::*;

    fn finished_pod(phase: &str, index: &str, message: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                labels: Some([(JOB_NAME_LABEL.to_owned(), "r-gen-1-3".to_owned())].into()),
                annotations: Some([(COMPLETION_INDEX.to_owned(), index.to_owned())].into()),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                phase: Some(phase.to_owned()),
                container_statuses: Some(vec![ContainerStatus {
                    name: CONTAINER.to_owned(),
                    state: Some(ContainerState {
                        terminated: Some(ContainerStateTerminated {
                            message: Some(message.to_owned()),
                            ..ContainerStateTerminated::default()
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

    #[test]
    fn pull_reports_come_from_succeeded_pods_whose_summary_has_one() {
        let with_pull = r#"{"batch":7,"succeeded":2,"discarded":0,"failed":0,"resumed":0,
            "pull":{"image":"python:3.12","pullMs":1500,"startMs":300,"podMs":9000}}"#;
        let without = r#"{"batch":8,"succeeded":2,"discarded":0,"failed":0,"resumed":0}"#;
        let reports = pull_reports(&[
            finished_pod("Succeeded", "2", with_pull),
            finished_pod("Failed", "3", with_pull),
            finished_pod("Succeeded", "4", without),
            finished_pod("Succeeded", "5", "not json"),
        ]);
        assert_eq!(
            reports,
            vec![PullReport {
                job: "r-gen-1-3".to_owned(),
                index: 2,
                pull: PodPull {
                    image: "python:3.12".to_owned(),
                    pull_ms: 1500,
                    start_ms: 300,
                    pod_ms: 9000,
                },
            }]
        );
    }
}
