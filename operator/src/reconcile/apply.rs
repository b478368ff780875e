//! Apply: write the built children and the status (thin I/O, no decisions).
//!
//! New children are created by server-side apply under one field manager ([`MANAGER`]). A Job's pod
//! template is immutable once created, so an existing Job gets only its live-tunable fields
//! (`parallelism`, `suspend`) by a merge patch; applying the whole Job again would either conflict
//! on the template or, by dropping fields, ask the API server to change it.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::build::Children;
use super::children::MANAGER;
use super::observe::Observed;
use super::queue::{STOPPED_BY_RUN, workload_resource};
use crate::api::{TrajectoryRun, TrajectoryRunStatus};

/// Applies the `ConfigMap`s and Jobs of `run`.
pub async fn apply(
    client: &Client,
    namespace: &str,
    observed: &Observed,
    desired: &Children,
) -> Result<(), kube::Error> {
    let params = PatchParams::apply(MANAGER).force();
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    for map in &desired.config_maps {
        maps.patch(&map.name_any(), &params, &Patch::Apply(map))
            .await?;
    }
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let existing: Vec<&Job> = observed.jobs().collect();
    for job in &desired.jobs {
        let name = job.name_any();
        let Some(current) = existing.iter().find(|j| j.name_any() == name) else {
            jobs.patch(&name, &params, &Patch::Apply(job)).await?;
            continue;
        };
        let (want, have) = (job.spec.as_ref(), current.spec.as_ref());
        let parallelism = want.and_then(|s| s.parallelism);
        let suspend = want.and_then(|s| s.suspend);
        if parallelism != have.and_then(|s| s.parallelism)
            || suspend.is_some_and(|s| Some(s) != have.and_then(|h| h.suspend))
        {
            let mut spec = serde_json::Map::new();
            spec.insert("parallelism".into(), json!(parallelism));
            if let Some(suspend) = suspend {
                spec.insert("suspend".into(), json!(suspend));
            }
            let patch = Patch::Merge(json!({ "spec": spec }));
            jobs.patch(&name, &PatchParams::default(), &patch).await?;
        }
    }
    Ok(())
}

/// Sets `spec.active` of the Kueue Workloads `changes` (name, active), served at `version`: a
/// Workload the run deactivates is marked so ([`STOPPED_BY_RUN`]), and only such a one is
/// activated again (see [`super::queue`]). One already gone is fine.
pub async fn activate(
    client: &Client,
    namespace: &str,
    version: &str,
    changes: &[(String, bool)],
) -> Result<(), kube::Error> {
    let workloads: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &workload_resource(version));
    for (name, active) in changes {
        let mark = (!active).then_some("true");
        let patch = Patch::Merge(json!({
            "metadata": { "annotations": { STOPPED_BY_RUN: mark } },
            "spec": { "active": active },
        }));
        match workloads.patch(name, &PatchParams::default(), &patch).await {
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            other => drop(other?),
        }
    }
    Ok(())
}

/// Deletes the Jobs `names` with their pods (in the background) and their plan `ConfigMap`s; one
/// already gone is fine.
pub async fn delete(client: &Client, namespace: &str, names: &[String]) -> Result<(), kube::Error> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    for name in names {
        for result in [
            jobs.delete(name, &DeleteParams::background())
                .await
                .map(drop),
            maps.delete(name, &DeleteParams::default()).await.map(drop),
        ] {
            match result {
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                other => other?,
            }
        }
    }
    Ok(())
}

/// Writes `status` when it differs from the run's; returns whether it wrote.
///
/// The write is conditional on the run's `resourceVersion`: a reconcile of a stale copy of the run
/// (the watch cache lags the controller's own status writes) gets a 409 Conflict, is retried on the
/// fresh copy, and so neither overwrites newer status nor announces a phase change twice.
pub async fn update_status(
    client: &Client,
    run: &TrajectoryRun,
    status: &TrajectoryRunStatus,
) -> Result<bool, kube::Error> {
    if run.status.as_ref() == Some(status) {
        return Ok(false);
    }
    let runs: Api<TrajectoryRun> =
        Api::namespaced(client.clone(), &run.namespace().unwrap_or_default());
    let patch = Patch::Merge(json!({
        "metadata": { "resourceVersion": run.resource_version() },
        "status": status,
    }));
    runs.patch_status(&run.name_any(), &PatchParams::default(), &patch)
        .await?;
    Ok(true)
}
