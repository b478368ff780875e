//! A run's Jobs as the operator builds them (`trajectory_operator::reconcile::build`), without a
//! controller: for the tests that check what the API server makes of them.

use k8s_openapi::api::batch::v1::Job;
use trajectory_operator::reconcile::build;
use trajectory_operator::reconcile::decide::{Pending, Shard, Tasks};
use trajectory_operator::reconcile::validate::ValidatedRun;
use trajectory_operator::settings::Settings;

/// A Job of every stage and of every label variant: the plan (round 1, and round 2, labelled with
/// its round), the first generation Job of attempt 1 and a second shard of attempt 2 (labelled with
/// its attempt and shard), the merge.
pub fn jobs_of_every_stage(run: &ValidatedRun<'_>, settings: &Settings) -> Vec<Job> {
    let shard = |attempt, shard| Shard {
        attempt,
        shard,
        pending: Pending::new(vec![0, 1, 2]).expect("three batches"),
        exists: false,
        parallelism: run.spec.workers,
        tasks: Tasks::Sandbox,
        held: false,
        prefer_node: None,
        task_resources: None,
    };
    vec![
        build::plan_job(run, settings, 1, false),
        build::plan_job(run, settings, 2, false),
        build::generation_job(run, settings, &shard(1, 0)),
        build::generation_job(run, settings, &shard(2, 1)),
        build::merge_job(run, settings, 1, false),
    ]
}
