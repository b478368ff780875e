//! Kueue: the Workloads through which a cluster's Kueue admits the Jobs of a run that names a
//! queue (`spec.queueName`), read into what the run's status says of them.
//!
//! Kueue makes one Workload per queued Job (owned by the Job, labelled with its uid). Once the
//! Workload is admitted Kueue owns the Job's `suspend`: a Job suspended behind its back while its
//! Workload is admitted is unsuspended again at once, so a run that suspended its own queued Jobs
//! would fight Kueue in a loop of pods created and killed (measured at 15 cycles a second). A
//! queued run is therefore stopped (`spec.suspend`, a budget hold) through Kueue's own mechanism:
//! its Workloads' `spec.active: false`, which evicts the Job (suspended, quota released) and keeps
//! it out of the queue until it is set `true` again. The operator marks the Workloads it
//! deactivated ([`STOPPED_BY_RUN`]) and reactivates only those: a Workload an administrator or
//! Kueue itself deactivated stays so.

use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::{Api, Client};
use serde_json::Value;

/// Kueue's label on a Workload: the uid of the Job it admits.
pub const JOB_UID_LABEL: &str = "kueue.x-k8s.io/job-uid";

/// Kueue's annotation on a Job created elastic: a change of `parallelism` resizes its Workload
/// in place (a new slice) instead of evicting the Job and queueing it again. Kueue accepts it
/// only at creation; a Kueue without elastic Jobs ignores it.
pub const ELASTIC_JOB: &str = "kueue.x-k8s.io/elastic-job";

/// The operator's annotation on a Workload it deactivated to stop its run.
pub const STOPPED_BY_RUN: &str = "trajectories.dev/stopped-by-run";

/// Kueue's API group; the Workload's versions, newest first (v1beta2 is stored since Kueue 0.15,
/// v1beta1 is what older ones serve).
const GROUP: &str = "kueue.x-k8s.io";
const VERSIONS: [&str; 2] = ["v1beta2", "v1beta1"];

/// The Workloads of a queued run's Jobs, as listed through the API version the cluster serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedQueue {
    /// The Workload API version the cluster serves (patched through the same).
    pub version: &'static str,
    pub workloads: Vec<QueuedWorkload>,
}

/// One Workload of a run's Job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedWorkload {
    pub name: String,
    /// The Job it admits.
    pub job: String,
    /// `spec.active`: false once deactivated (by the run's stop, an administrator or Kueue).
    pub active: bool,
    /// Deactivated by the operator ([`STOPPED_BY_RUN`]): only such a Workload is reactivated.
    pub stopped_by_run: bool,
    pub admission: Admission,
    /// How many times Kueue evicted it so far (preempted, deactivated, ...).
    pub evictions: u32,
}

/// Where a Workload stands in its queue, from its conditions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Admitted by `cluster_queue`: the Job runs.
    Admitted { cluster_queue: String },
    /// Evicted, for Kueue's `reason` (`Preempted`, `Deactivated`, `PodsReadyTimeout`, ...), and not
    /// admitted again yet.
    Evicted { reason: String, message: String },
    /// Waiting for quota: Kueue's `QuotaReserved` message says why (e.g. "insufficient quota for
    /// cpu in flavor default-flavor", or "`LocalQueue` team-a doesn't exist").
    Waiting { message: String },
    /// Finished (its Job ended, or an elastic Job's slice was replaced by a newer one).
    Finished,
}

impl QueuedWorkload {
    /// Reads one from the Workload object's JSON; `None` when it names no owning Job.
    pub fn of(object: &DynamicObject) -> Option<Self> {
        let job = object
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|owner| owner.kind == "Job")?
            .name
            .clone();
        let data = &object.data;
        let conditions = data["status"]["conditions"].as_array();
        let holding = |type_: &str| {
            conditions
                .into_iter()
                .flatten()
                .find(|c| c["type"].as_str() == Some(type_) && c["status"].as_str() == Some("True"))
        };
        let text = |condition: Option<&Value>, key: &str| {
            condition
                .and_then(|c| c[key].as_str())
                .unwrap_or_default()
                .to_owned()
        };
        let admission = if holding("Finished").is_some() {
            Admission::Finished
        } else if holding("Admitted").is_some() {
            Admission::Admitted {
                cluster_queue: data["status"]["admission"]["clusterQueue"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            }
        } else if let Some(evicted) = holding("Evicted") {
            Admission::Evicted {
                reason: text(Some(evicted), "reason"),
                message: text(Some(evicted), "message"),
            }
        } else {
            let reserved = conditions
                .into_iter()
                .flatten()
                .find(|c| c["type"].as_str() == Some("QuotaReserved"));
            Admission::Waiting {
                message: text(reserved, "message"),
            }
        };
        let evictions = data["status"]["schedulingStats"]["evictions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|eviction| eviction["count"].as_u64())
            .sum::<u64>();
        Some(Self {
            name: object.metadata.name.clone().unwrap_or_default(),
            job,
            active: data["spec"]["active"].as_bool().unwrap_or(true),
            stopped_by_run: object
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(STOPPED_BY_RUN)),
            admission,
            evictions: u32::try_from(evictions).unwrap_or(u32::MAX),
        })
    }
}

/// The Workload resource at `version`.
pub fn workload_resource(version: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, version, "Workload"),
        "workloads",
    )
}

/// The Workloads in `namespace` that admit one of the Jobs `job_uids`; `None` when the cluster
/// serves no Workload API (no Kueue installed).
pub async fn observe(
    client: &Client,
    namespace: &str,
    job_uids: &[String],
) -> Result<Option<ObservedQueue>, kube::Error> {
    for version in VERSIONS {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &workload_resource(version));
        let listed = match api.list(&ListParams::default().labels(JOB_UID_LABEL)).await {
            Ok(listed) => listed,
            Err(kube::Error::Api(status)) if status.code == 404 => continue,
            Err(error) => return Err(error),
        };
        let mut workloads: Vec<QueuedWorkload> = listed
            .items
            .iter()
            .filter(|object| {
                object
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|labels| labels.get(JOB_UID_LABEL))
                    .is_some_and(|uid| job_uids.contains(uid))
            })
            .filter_map(QueuedWorkload::of)
            .collect();
        workloads.sort_by(|a, b| a.name.cmp(&b.name));
        return Ok(Some(ObservedQueue { version, workloads }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn workload(status: &Value, spec: &Value, annotations: &Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "Workload",
            "metadata": {
                "name": "job-q-gen-1-abcde",
                "annotations": annotations,
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "q-gen-1", "uid": "u1", "controller": true}],
            },
            "spec": spec,
            "status": status,
        }))
        .expect("a Workload")
    }

    #[test]
    fn a_workload_waiting_for_quota_says_what_kueue_says() {
        let waiting = workload(
            &json!({"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                "message": "couldn't assign flavors to pod set main: insufficient quota for cpu in flavor default-flavor, request > maximum capacity (2 > 1)"}]}),
            &json!({"queueName": "team-a"}),
            &json!({}),
        );
        let read = QueuedWorkload::of(&waiting).expect("owned by a Job");
        assert_eq!(read.job, "q-gen-1");
        assert!(read.active, "active unless set false");
        assert!(!read.stopped_by_run);
        assert!(
            matches!(&read.admission, Admission::Waiting { message } if message.contains("insufficient quota for cpu")),
            "{read:?}"
        );
    }

    #[test]
    fn an_admitted_workload_names_its_cluster_queue_and_counts_its_evictions() {
        let admitted = workload(
            &json!({
                "conditions": [
                    {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": ""},
                    {"type": "Admitted", "status": "True", "reason": "Admitted", "message": ""},
                    {"type": "Evicted", "status": "False", "reason": "Preempted", "message": ""},
                ],
                "admission": {"clusterQueue": "trajectories"},
                "schedulingStats": {"evictions": [{"reason": "Preempted", "count": 2}, {"reason": "Deactivated", "count": 1}]},
            }),
            &json!({"active": true}),
            &json!({}),
        );
        let read = QueuedWorkload::of(&admitted).expect("owned by a Job");
        assert_eq!(
            read.admission,
            Admission::Admitted {
                cluster_queue: "trajectories".into()
            }
        );
        assert_eq!(read.evictions, 3);
    }

    #[test]
    fn a_preempted_workload_is_evicted_until_admitted_again_and_a_stopped_one_is_marked() {
        let preempted = workload(
            &json!({"conditions": [
                {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "waiting"},
                {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue"},
            ]}),
            &json!({"active": false}),
            &json!({STOPPED_BY_RUN: "true"}),
        );
        let read = QueuedWorkload::of(&preempted).expect("owned by a Job");
        assert!(!read.active);
        assert!(read.stopped_by_run);
        assert!(
            matches!(&read.admission, Admission::Evicted { reason, .. } if reason == "Preempted"),
            "{read:?}"
        );
    }
}
