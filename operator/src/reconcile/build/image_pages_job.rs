//! The Job reporting the pages of a plan's image index: an Indexed Job whose completion index *i*
//! runs `trajectory-worker image-page` on page *i* and reports it as its termination message. Only
//! for a plan whose summary could not list every image group (a dataset of many images).

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::EnvVar;
use trajectory_worker::contract::env;

use super::{asserted_suspend, failure_policy, job_shell, to_i32};
use crate::reconcile::children::Component;
use crate::reconcile::validate::ValidatedRun;
use crate::settings::Settings;

/// The Job reading the `pages` pages of the image index `index` of `round`'s plan.
pub fn image_pages_job(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    (round, index, pages): (u32, &str, u32),
    exists: bool,
) -> Job {
    let mut job = job_shell(run, settings, Component::ImagePages { round });
    let mut spec = job.spec.take().unwrap_or_default();
    if let Some(worker) = spec
        .template
        .spec
        .as_mut()
        .and_then(|pod| pod.containers.first_mut())
    {
        worker.env.get_or_insert_with(Vec::new).push(EnvVar {
            name: env::IMAGE_INDEX.to_owned(),
            value: Some(index.to_owned()),
            value_from: None,
        });
    }
    job.spec = Some(JobSpec {
        completion_mode: Some("Indexed".to_owned()),
        completions: Some(to_i32(pages)),
        // Each page is a file read: a few pods at once are plenty.
        parallelism: Some(to_i32(pages.min(run.spec.workers).max(1))),
        backoff_limit_per_index: Some(to_i32(run.spec.retry.per_batch)),
        pod_failure_policy: Some(failure_policy::failure_policy(true)),
        suspend: asserted_suspend(run.spec, exists, false),
        ..spec
    });
    job
}
