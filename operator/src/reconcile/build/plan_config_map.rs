//! The run plan `ConfigMap` a Job's pods mount (the worker contract's `plan.json`); it has the
//! Job's name.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use trajectory_worker::contract::{
    MAX_LISTED_BATCHES, RunPlan, compact_ranges, format_ranges, paths,
};

use super::{labels, metadata};
use crate::reconcile::children::Component;
use crate::reconcile::decide::Pending;
use crate::reconcile::validate::ValidatedRun;

/// The plan of the Job serving `component`. `pending` is the batch each completion index works; it
/// is written only when it is not the identity (index *i* = batch *i*), as ranges, and also as a
/// list while that is short (for worker images that read only the list). Slots of the plan's
/// pending list on storage are written as ranges with the list's path, and never as a plain list
/// (a reader of the list alone would take them for batch ids).
pub fn plan_config_map(
    run: &ValidatedRun<'_>,
    component: Component,
    pending: Option<&Pending>,
) -> ConfigMap {
    let name = run.child_name(component);
    let listed = pending.filter(|pending| !pending.is_identity());
    let batches = listed
        .filter(|pending| pending.ids().len() <= MAX_LISTED_BATCHES)
        .map(|pending| pending.ids().to_vec());
    let batch_ranges = listed.map(|pending| {
        // Pending lists are ascending: each attempt works the batches not done, in order.
        format_ranges(&compact_ranges(pending.ids().iter().copied()))
    });
    let mut plan = RunPlan {
        name: run.name.clone(),
        namespace: run.namespace.clone(),
        uid: run.uid.clone(),
        spec: run.spec.clone(),
        output_path: run.output_path.clone(),
        batches,
        batch_ranges,
        pending_list: None,
    };
    if let Some((list, slots)) = pending.and_then(|p| p.list().map(|list| (list, p.ids()))) {
        plan = plan.with_pending_slots(list, slots.iter().copied());
    }
    // A run plan holds strings, numbers and string-keyed maps, which serde_json always writes
    // (non-finite floats as null).
    let json = serde_json::to_string_pretty(&plan).expect("a run plan serialises to JSON");
    ConfigMap {
        metadata: metadata(run, &name, labels(run, component)),
        data: Some(BTreeMap::from([(paths::PLAN_FILE.to_owned(), json)])),
        ..ConfigMap::default()
    }
}
