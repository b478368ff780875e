//! The plan Job: one pod running `trajectory-worker plan`, which validates the dataset and writes
//! the manifest.

use k8s_openapi::api::batch::v1::Job;

use super::single_pod_job;
use crate::reconcile::children::Component;
use crate::reconcile::validate::ValidatedRun;
use crate::settings::Settings;

/// The plan Job of `round`. `exists`: as for [`super::generation_job`].
pub fn plan_job(run: &ValidatedRun<'_>, settings: &Settings, round: u32, exists: bool) -> Job {
    single_pod_job(run, settings, Component::Plan { round }, exists)
}
