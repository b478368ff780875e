//! The merge Job: one pod running `trajectory-worker merge`, which writes `trajectories.jsonl`,
//! `failures.jsonl` and `statistics.json` from the batch files.

use k8s_openapi::api::batch::v1::Job;

use super::single_pod_job;
use crate::reconcile::children::Component;
use crate::reconcile::validate::ValidatedRun;
use crate::settings::Settings;

/// The merge Job of `round`. `exists`: as for [`super::generation_job`].
pub fn merge_job(run: &ValidatedRun<'_>, settings: &Settings, round: u32, exists: bool) -> Job {
    single_pod_job(run, settings, Component::Merge { round }, exists)
}
