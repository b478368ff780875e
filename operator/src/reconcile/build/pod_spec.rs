//! The worker pod every Job of a run runs: the worker contract's environment ([`env`]), the API key
//! only through a `secretKeyRef`, the plan `ConfigMap` and the storage volume mounted, and the
//! restricted Pod Security Standard met.

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    PodSecurityContext, PodSpec, SeccompProfile, SecretKeySelector, SecurityContext, Volume,
    VolumeMount,
};
use trajectory_worker::contract::{env, paths};

use crate::reconcile::children::{CONTAINER, Component};
use crate::reconcile::validate::{DATA_VOLUME, ValidatedRun};
use crate::settings::Settings;

/// Volume names inside a worker pod besides [`DATA_VOLUME`].
mod volumes {
    pub const PLAN: &str = "plan";
    pub const WORKSPACE: &str = "workspace";
    pub const TMP: &str = "tmp";
}

/// The group of the worker image's user (`nonroot`, 65532, as in distroless images).
const WORKER_GROUP: i64 = 65532;

/// The pod of the Job `job_name` serving `component`.
pub fn pod_spec(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    component: Component,
    job_name: &str,
) -> PodSpec {
    let overrides = run.overrides.clone();
    let empty_dir = |name: &str| Volume {
        name: name.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    };
    PodSpec {
        restart_policy: Some("Never".to_owned()),
        service_account_name: overrides.service_account_name,
        // The worker never calls the Kubernetes API: a mounted token would only be something to
        // steal from a pod that runs model-chosen shell commands. (Cloud identity webhooks such
        // as EKS IRSA inject their own projected token regardless.)
        automount_service_account_token: Some(false),
        priority_class_name: overrides.priority_class_name,
        node_selector: overrides.node_selector,
        tolerations: overrides.tolerations,
        affinity: overrides.affinity,
        image_pull_secrets: overrides.image_pull_secrets,
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            // A fresh volume is usually root's: with its driver honouring fsGroup, the kubelet
            // makes it writable for the worker image's group (uid and gid 65532), and checks only
            // the root's ownership on later mounts instead of walking a volume of millions of
            // records for every pod.
            fs_group: Some(WORKER_GROUP),
            fs_group_change_policy: Some("OnRootMismatch".to_owned()),
            seccomp_profile: Some(runtime_default()),
            ..PodSecurityContext::default()
        }),
        containers: vec![worker_container(run, settings, component)],
        volumes: Some(vec![
            Volume {
                name: volumes::PLAN.to_owned(),
                config_map: Some(ConfigMapVolumeSource {
                    name: job_name.to_owned(),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            },
            run.data_volume.clone(),
            empty_dir(volumes::WORKSPACE),
            empty_dir(volumes::TMP),
        ]),
        ..PodSpec::default()
    }
}

fn worker_container(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    component: Component,
) -> Container {
    let overrides = &run.overrides;
    let mount = |name: &str, path: &str, read_only: bool| VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    };
    Container {
        name: CONTAINER.to_owned(),
        image: Some(
            overrides
                .image
                .clone()
                .unwrap_or_else(|| settings.worker_image.clone()),
        ),
        image_pull_policy: overrides.image_pull_policy.clone(),
        command: Some(vec!["trajectory-worker".to_owned()]),
        args: Some(vec![component.command().to_owned()]),
        env: Some(environment(run, settings)),
        resources: overrides.resources.clone(),
        volume_mounts: Some(vec![
            mount(volumes::PLAN, paths::PLAN_DIR, true),
            mount(DATA_VOLUME, paths::STORAGE_ROOT, false),
            mount(volumes::WORKSPACE, paths::WORKSPACE_ROOT, false),
            mount(volumes::TMP, "/tmp", false),
        ]),
        termination_message_path: Some(paths::TERMINATION_LOG.to_owned()),
        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                add: None,
            }),
            seccomp_profile: Some(runtime_default()),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

/// The user's extra environment, then the worker contract's variables (which win), then the API
/// key from its Secret.
fn environment(run: &ValidatedRun<'_>, settings: &Settings) -> Vec<EnvVar> {
    let contract = |name: &str, value: &str| EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        value_from: None,
    };
    let mut env_vars = run.overrides.env.clone().unwrap_or_default();
    env_vars.extend([
        contract(
            env::PLAN_PATH,
            &format!("{}/{}", paths::PLAN_DIR, paths::PLAN_FILE),
        ),
        contract(env::STORAGE_ROOT, paths::STORAGE_ROOT),
        contract(env::TERMINATION_LOG, paths::TERMINATION_LOG),
        contract(env::WORKSPACE_ROOT, paths::WORKSPACE_ROOT),
        contract(env::LOG_FORMAT, &settings.worker_log_format),
    ]);
    if let Some(secret) = &run.spec.model.api_key_secret_ref {
        env_vars.push(EnvVar {
            name: env::MODEL_API_KEY.to_owned(),
            value: None,
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: secret.name.clone(),
                    key: secret.key.clone(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
        });
    }
    env_vars
}

fn runtime_default() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".to_owned(),
        localhost_profile: None,
    }
}
