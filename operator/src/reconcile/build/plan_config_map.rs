//! The run plan `ConfigMap` a Job's pods mount (the worker contract's `plan.json`); it has the
//! Job's name.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use trajectory_worker::contract::{RunPlan, paths};

use super::{labels, metadata};
use crate::reconcile::children::Component;
use crate::reconcile::decide::Pending;
use crate::reconcile::validate::ValidatedRun;

/// The plan of the Job serving `component`. `pending` is the batch each completion index works; it
/// is written only when it is not the identity (index *i* = batch *i*).
pub fn plan_config_map(
    run: &ValidatedRun<'_>,
    component: Component,
    pending: Option<&Pending>,
) -> ConfigMap {
    let name = run.child_name(component);
    let batches = pending
        .filter(|pending| !pending.is_identity())
        .map(|pending| pending.batches().to_vec());
    let plan = RunPlan {
        name: run.name.clone(),
        namespace: run.namespace.clone(),
        uid: run.uid.clone(),
        spec: run.spec.clone(),
        output_path: run.output_path.clone(),
        batches,
    };
    // A run plan holds strings, numbers and string-keyed maps, which serde_json always writes
    // (non-finite floats as null).
    let json = serde_json::to_string_pretty(&plan).expect("a run plan serialises to JSON");
    ConfigMap {
        metadata: metadata(run, &name, labels(run, component)),
        data: Some(BTreeMap::from([(paths::PLAN_FILE.to_owned(), json)])),
        ..ConfigMap::default()
    }
}
