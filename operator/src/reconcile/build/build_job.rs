//! The Job building the images of the round's plan's build list (`spec.sandbox.builds`): an
//! Indexed Job whose completion index *i* builds line *i*, in a pod of two containers, so that
//! the privileged one holds nothing of the run's (see `trajectory_worker::run::builds`):
//!
//! ```text
//! init  worker         worker image, restricted, the run's storage and plan mounted:
//!                      `trajectory-worker build-context` readies /build (named as every pod's
//!                      worker container, which the pod failure policy's rules name)
//! main  build          spec.sandbox.builds.image (default: the worker image), privileged,
//!                      root: `trajectory-worker build` with buildah; only /build and the push
//!                      Secret mounted; its report is its termination message
//! ```

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, SeccompProfile, SecretVolumeSource, SecurityContext,
    Volume, VolumeMount,
};
use trajectory_worker::contract::{env, paths};

use super::pod_spec::worker_image;
use super::{asserted_suspend, failure_policy, job_shell, to_i32};
use crate::reconcile::children::{BUILD_CONTAINER, Component};
use crate::reconcile::validate::ValidatedRun;
use crate::settings::Settings;

/// The volume the two containers share.
const BUILD_VOLUME: &str = "build";
/// The volume of the push Secret.
const PUSH_SECRET_VOLUME: &str = "push-secret";
/// Where the push Secret is mounted in the build container.
const PUSH_SECRET_DIR: &str = "/run/trajectory/push-secret";

/// The Job building the `builds` images of `round`'s build list.
pub fn build_job(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    (round, builds): (u32, u32),
    exists: bool,
) -> Job {
    let mut job = job_shell(run, settings, Component::Build { round });
    let mut spec = job.spec.take().unwrap_or_default();
    if let Some(pod) = spec.template.spec.as_mut() {
        let shared = VolumeMount {
            name: BUILD_VOLUME.to_owned(),
            mount_path: paths::BUILD_DIR.to_owned(),
            ..VolumeMount::default()
        };
        // The worker container, restricted, with the run's storage: it readies the build.
        let mut context = pod.containers.remove(0);
        context.args = Some(vec!["build-context".to_owned()]);
        context.termination_message_path = None;
        context
            .volume_mounts
            .get_or_insert_with(Vec::new)
            .push(shared.clone());
        pod.init_containers
            .get_or_insert_with(Vec::new)
            .push(context);
        pod.containers = vec![build_container(run, settings, shared)];
        let volumes = pod.volumes.get_or_insert_with(Vec::new);
        volumes.push(Volume {
            name: BUILD_VOLUME.to_owned(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        });
        if let Some(secret) = push_secret(run) {
            volumes.push(Volume {
                name: PUSH_SECRET_VOLUME.to_owned(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(secret.to_owned()),
                    ..SecretVolumeSource::default()
                }),
                ..Volume::default()
            });
        }
    }
    job.spec = Some(JobSpec {
        completion_mode: Some("Indexed".to_owned()),
        completions: Some(to_i32(builds)),
        parallelism: Some(to_i32(builds.min(run.spec.workers).max(1))),
        backoff_limit_per_index: Some(to_i32(run.spec.retry.per_batch)),
        pod_failure_policy: Some(failure_policy::failure_policy(true)),
        suspend: asserted_suspend(run.spec, exists, false),
        ..spec
    });
    job
}

fn push_secret<'a>(run: &'a ValidatedRun<'_>) -> Option<&'a str> {
    run.spec.sandbox.builds.as_ref()?.push_secret.as_deref()
}

/// The privileged container running buildah: root, privileged (buildah mounts, and changes root
/// for `RUN` steps), no seccomp filter (its namespaces need `unshare` and `mount`); nothing of
/// the run's but the readied build and the push credentials.
fn build_container(run: &ValidatedRun<'_>, settings: &Settings, shared: VolumeMount) -> Container {
    let builds = run.spec.sandbox.builds.as_ref();
    let image = builds
        .and_then(|builds| builds.image.clone())
        .unwrap_or_else(|| worker_image(run, settings));
    let var = |name: &str, value: &str| EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        value_from: None,
    };
    let mut env_vars = vec![
        var(env::BUILD_DIR, paths::BUILD_DIR),
        var(env::TERMINATION_LOG, paths::TERMINATION_LOG),
        var(env::LOG_FORMAT, &settings.worker_log_format),
    ];
    let mut mounts = vec![shared];
    if push_secret(run).is_some() {
        // buildah reads a kubernetes.io/dockerconfigjson Secret's one key as its auth file.
        env_vars.push(var(
            "REGISTRY_AUTH_FILE",
            &format!("{PUSH_SECRET_DIR}/.dockerconfigjson"),
        ));
        mounts.push(VolumeMount {
            name: PUSH_SECRET_VOLUME.to_owned(),
            mount_path: PUSH_SECRET_DIR.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }
    Container {
        name: BUILD_CONTAINER.to_owned(),
        image: Some(image),
        image_pull_policy: run.overrides.image_pull_policy.clone(),
        command: Some(vec!["trajectory-worker".to_owned()]),
        args: Some(vec!["build".to_owned()]),
        env: Some(env_vars),
        resources: run.build_resources.clone(),
        volume_mounts: Some(mounts),
        termination_message_path: Some(paths::TERMINATION_LOG.to_owned()),
        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
        security_context: Some(SecurityContext {
            privileged: Some(true),
            run_as_user: Some(0),
            run_as_group: Some(0),
            run_as_non_root: Some(false),
            seccomp_profile: Some(SeccompProfile {
                type_: "Unconfined".to_owned(),
                localhost_profile: None,
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}
