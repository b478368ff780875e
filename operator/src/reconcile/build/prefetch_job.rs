//! The Job pulling a piece's image onto a node ahead of the piece's Job (`spec.sandbox.prefetch`):
//! one pod whose container is of that image and exits at once. Nothing of the run's is in it: no
//! storage, no plan, no key, no service account token; the executor it runs comes from the worker
//! image, as in a generation pod, since the task image may have no program of its own.
//!
//! ```text
//! init  install-executor   worker image: copies the static trajectory-executor to /sandbox/bin
//! main  pull               the task image (after spec.sandbox.imageRewrite): `trajectory-executor
//!                          pulled`, which exits 0; unprivileged, /sandbox/bin alone mounted
//! ```

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec,
    ResourceRequirements, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use trajectory_worker::contract::paths;

use super::pod_spec::{
    IMAGE_EXECUTOR, SANDBOX_USER, containers, restricted, runtime_default, worker_image,
};
use super::{labels, metadata};
use crate::reconcile::children::{Component, annotations};
use crate::reconcile::validate::ValidatedRun;
use crate::settings::Settings;

/// The prefetch pod's container of the task image.
pub const PULL_CONTAINER: &str = "pull";

/// The volume holding the executor.
const BIN_VOLUME: &str = "bin";

/// The Job pulling `image` (as the rows name it) ahead of piece `shard` of `round`.
pub fn prefetch_job(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    (round, shard, image): (u32, u32, &str),
) -> Job {
    let component = Component::Prefetch { round, shard };
    let name = run.child_name(component);
    let overrides = run.overrides.clone();
    let bin = |read_only: bool| VolumeMount {
        name: BIN_VOLUME.to_owned(),
        mount_path: paths::SANDBOX_BIN_DIR.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    };
    let install = Container {
        name: containers::INSTALL_EXECUTOR.to_owned(),
        image: Some(worker_image(run, settings)),
        image_pull_policy: overrides.image_pull_policy.clone(),
        command: Some(vec![
            IMAGE_EXECUTOR.to_owned(),
            "install".to_owned(),
            paths::SANDBOX_BIN_DIR.to_owned(),
        ]),
        volume_mounts: Some(vec![bin(false)]),
        security_context: Some(restricted(None)),
        resources: Some(small()),
        ..Container::default()
    };
    let pull = Container {
        name: PULL_CONTAINER.to_owned(),
        image: Some(run.spec.sandbox.rewritten_image(image)),
        image_pull_policy: Some("IfNotPresent".to_owned()),
        command: Some(vec![
            format!("{}/trajectory-executor", paths::SANDBOX_BIN_DIR),
            component.command().to_owned(),
        ]),
        volume_mounts: Some(vec![bin(true)]),
        // Whatever the image's user: it runs nothing of the image's.
        security_context: Some(restricted(Some(SANDBOX_USER))),
        resources: Some(small()),
        ..Container::default()
    };
    let pod = PodSpec {
        restart_policy: Some("Never".to_owned()),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        priority_class_name: overrides.priority_class_name,
        node_selector: overrides.node_selector,
        tolerations: overrides.tolerations,
        affinity: overrides.affinity,
        image_pull_secrets: overrides.image_pull_secrets,
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            seccomp_profile: Some(runtime_default()),
            ..PodSecurityContext::default()
        }),
        init_containers: Some(vec![install]),
        containers: vec![pull],
        volumes: Some(vec![Volume {
            name: BIN_VOLUME.to_owned(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        }]),
        ..PodSpec::default()
    };
    let mut meta = metadata(run, &name, labels(run, component));
    meta.annotations = Some(BTreeMap::from([(
        annotations::IMAGE.to_owned(),
        image.to_owned(),
    )]));
    Job {
        metadata: meta,
        spec: Some(JobSpec {
            completions: Some(1),
            parallelism: Some(1),
            // A pull that fails is the piece's Job's to find: this one is a head start only.
            backoff_limit: Some(0),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(run, component)),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            ..JobSpec::default()
        }),
        status: None,
    }
}

/// What each of its containers requests and may use: they copy one file and exit.
fn small() -> ResourceRequirements {
    let quantity = |value: &str| Quantity(value.to_owned());
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), quantity("10m")),
            ("memory".to_owned(), quantity("16Mi")),
        ])),
        limits: Some(BTreeMap::from([("memory".to_owned(), quantity("64Mi"))])),
        ..ResourceRequirements::default()
    }
}
