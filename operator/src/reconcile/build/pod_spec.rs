//! The worker pod every Job of a run runs: the worker contract's environment ([`env`]), the API key
//! only through a `secretKeyRef`, the plan `ConfigMap` and the storage volume mounted, and the
//! restricted Pod Security Standard met.
//!
//! A generation pod also runs the model's terminal commands, never in the worker's container, and
//! the tools' long-lived programs (MCP stdio servers, Chromium) beside them:
//!
//! ```text
//! init  install-executor   worker image: copies the static trajectory-executor to /sandbox/bin
//! init  sandbox (sidecar)  the run's task image (spec.sandbox.image): trajectory-executor serve
//!                          mounts: /sandbox/bin (ro), /sandbox/socket, /workspace, /tmp (the
//!                          sessions' private directories) — nothing else
//! main  worker             API key, /data, plan; sends each command and session over
//!                          /sandbox/socket
//! ```
//!
//! A plan pod has the same sandbox when the run declares stdio MCP servers: the plan starts each
//! one to list its tools, and it must run where the batches will run it, away from the worker's
//! secrets and storage. Other plan pods, and merge pods, run nothing of the model's or a tool's.
//!
//! The sandbox is a native sidecar (an init container that restarts always), so it starts before
//! the worker and is stopped when the worker has exited, and the Job counts the worker's exit
//! alone. The containers do not share a process namespace: the commands cannot see the worker's
//! processes at all.

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    PodSecurityContext, PodSpec, SeccompProfile, SecretKeySelector, SecurityContext, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use trajectory_worker::contract::{env, paths, secret_env, shutdown_grace, task_slots};
use trajectory_worker::spec::SecretKeyRef;

use crate::reconcile::children::{CONTAINER, Component};
use crate::reconcile::decide::Tasks;
use crate::reconcile::validate::{DATA_VOLUME, ValidatedRun};
use crate::settings::Settings;

/// Volume names inside a worker pod besides [`DATA_VOLUME`].
mod volumes {
    pub const PLAN: &str = "plan";
    pub const WORKSPACE: &str = "workspace";
    pub const TMP: &str = "tmp";
    pub const SANDBOX_BIN: &str = "sandbox-bin";
    pub const SANDBOX_SOCKET: &str = "sandbox-socket";
    pub const SANDBOX_TMP: &str = "sandbox-tmp";
}

/// Container names of a generation pod besides [`CONTAINER`].
pub mod containers {
    pub const INSTALL_EXECUTOR: &str = "install-executor";
    pub const SANDBOX: &str = "sandbox";
}

/// The executor binary inside the worker image.
pub(super) const IMAGE_EXECUTOR: &str = "/usr/local/bin/trajectory-executor";

/// The group of the worker image's user (`nonroot`, 65532, as in distroless images).
const WORKER_GROUP: i64 = 65532;

/// The sandbox container's user and group, whatever its image's: the worker's, so that both
/// can create and remove files in the workspaces, and never root.
pub(super) const SANDBOX_USER: i64 = 65532;

/// The pod of the Job `job_name` serving `component`, its conversations' commands running as
/// `tasks` says.
pub fn pod_spec(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    component: Component,
    job_name: &str,
    tasks: &Tasks,
) -> PodSpec {
    let overrides = run.overrides.clone();
    let sandboxed = has_sandbox(run, component, tasks);
    let slots = match tasks {
        Tasks::Image(_) => task_slots(run.spec.batch_size, run.spec.samples_per_prompt),
        Tasks::Sandbox | Tasks::Unavailable { .. } => 0,
    };
    let mut init_containers = Vec::new();
    if sandboxed {
        init_containers.extend(sandbox_containers(run, settings));
    }
    if let Tasks::Image(image) = tasks {
        init_containers.extend(task_containers(run, image, slots));
    }
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
        termination_grace_period_seconds: overrides.termination_grace_period_seconds.map(i64::from),
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
        init_containers: (!init_containers.is_empty()).then_some(init_containers),
        containers: vec![worker_container(run, settings, component, tasks, slots)],
        // The task containers hand their environment to the model's commands: nothing of the
        // namespace's Services goes into it.
        enable_service_links: (slots > 0).then_some(false),
        volumes: Some(
            std::iter::once(Volume {
                name: volumes::PLAN.to_owned(),
                config_map: Some(ConfigMapVolumeSource {
                    name: job_name.to_owned(),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            })
            .chain(run.data_volume.clone())
            .chain([empty_dir(volumes::WORKSPACE), empty_dir(volumes::TMP)])
            .chain(
                sandboxed
                    .then(|| {
                        [
                            empty_dir(volumes::SANDBOX_BIN),
                            empty_dir(volumes::SANDBOX_SOCKET),
                            empty_dir(volumes::SANDBOX_TMP),
                        ]
                    })
                    .into_iter()
                    .flatten(),
            )
            .chain((0..slots).map(|slot| Volume {
                name: task_volume(slot),
                empty_dir: Some(EmptyDirVolumeSource {
                    medium: Some("Memory".to_owned()),
                    size_limit: Some(Quantity("1Mi".to_owned())),
                }),
                ..Volume::default()
            }))
            .collect(),
        ),
        ..PodSpec::default()
    }
}

/// The start of the names of the task containers (`task-<slot>`).
pub(super) const TASK_CONTAINER_PREFIX: &str = "task-";

/// The volume holding task container `slot`'s socket, shared with the worker alone.
fn task_volume(slot: u32) -> String {
    format!("task-{slot}")
}

/// One task container a conversation slot, of `image` (after the run's registry rewrite): a fresh
/// filesystem of the row's image for each conversation, its executor (`serve --task`) the
/// container's first process, its socket on a volume of its own that the worker mounts as
/// `slot-<slot>`. Native sidecars, so they start before the worker and are stopped after it.
///
/// Unlike the run's sandbox container, a task container runs as its image's user (task images
/// such as SWE-bench's are root's, their repository root's to change) with a writable root
/// filesystem: the container is the conversation's, and ends with the pod. Privilege escalation
/// stays off and every capability is dropped; the executor drops them for the commands as well.
fn task_containers(run: &ValidatedRun<'_>, image: &str, slots: u32) -> Vec<Container> {
    let image = run.spec.sandbox.rewritten_image(image);
    (0..slots)
        .map(|slot| Container {
            name: format!("{TASK_CONTAINER_PREFIX}{slot}"),
            image: Some(image.clone()),
            image_pull_policy: Some("IfNotPresent".to_owned()),
            restart_policy: Some("Always".to_owned()),
            command: Some(vec![
                format!("{}/trajectory-executor", paths::SANDBOX_BIN_DIR),
                "serve".to_owned(),
                "--task".to_owned(),
                "--socket".to_owned(),
                format!(
                    "{}/{}",
                    paths::SANDBOX_SOCKET_DIR,
                    paths::SANDBOX_SOCKET_FILE
                ),
            ]),
            volume_mounts: Some(vec![
                mount(volumes::SANDBOX_BIN, paths::SANDBOX_BIN_DIR, true),
                mount(&task_volume(slot), paths::SANDBOX_SOCKET_DIR, false),
            ]),
            security_context: Some(SecurityContext {
                run_as_non_root: Some(false),
                allow_privilege_escalation: Some(false),
                capabilities: Some(Capabilities {
                    drop: Some(vec!["ALL".to_owned()]),
                    add: None,
                }),
                seccomp_profile: Some(runtime_default()),
                ..SecurityContext::default()
            }),
            resources: run.sandbox_resources.clone(),
            ..Container::default()
        })
        .collect()
}

/// Whether `component`'s pods have a sandbox container: the generation pods (the model's
/// commands, MCP stdio servers, Chromium), and the plan pods of a run with stdio MCP servers
/// (which the plan starts to list their tools).
fn has_sandbox(run: &ValidatedRun<'_>, component: Component, tasks: &Tasks) -> bool {
    match component {
        // A pod recording its rows' image unavailable runs nothing of theirs.
        Component::Generate { .. } => !matches!(tasks, Tasks::Unavailable { .. }),
        Component::Plan { .. } => run
            .spec
            .tools
            .mcp
            .iter()
            .any(|server| server.stdio.is_some()),
        Component::Merge { .. }
        | Component::ImagePages { .. }
        | Component::Build { .. }
        | Component::Prefetch { .. } => false,
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// The image of the worker's own container.
pub(super) fn worker_image(run: &ValidatedRun<'_>, settings: &Settings) -> String {
    run.overrides
        .image
        .clone()
        .unwrap_or_else(|| settings.worker_image.clone())
}

/// The init container that copies the executor out of the worker image, then the sandbox sidecar
/// that runs it in the task image.
fn sandbox_containers(run: &ValidatedRun<'_>, settings: &Settings) -> Vec<Container> {
    let worker_image = worker_image(run, settings);
    let socket = format!(
        "{}/{}",
        paths::SANDBOX_SOCKET_DIR,
        paths::SANDBOX_SOCKET_FILE
    );
    let install = Container {
        name: containers::INSTALL_EXECUTOR.to_owned(),
        image: Some(worker_image.clone()),
        image_pull_policy: run.overrides.image_pull_policy.clone(),
        command: Some(vec![
            IMAGE_EXECUTOR.to_owned(),
            "install".to_owned(),
            paths::SANDBOX_BIN_DIR.to_owned(),
        ]),
        volume_mounts: Some(vec![mount(
            volumes::SANDBOX_BIN,
            paths::SANDBOX_BIN_DIR,
            false,
        )]),
        security_context: Some(restricted(None)),
        ..Container::default()
    };
    let mut serve = vec![
        format!("{}/trajectory-executor", paths::SANDBOX_BIN_DIR),
        "serve".to_owned(),
        "--socket".to_owned(),
        socket,
        "--workspace-root".to_owned(),
        paths::WORKSPACE_ROOT.to_owned(),
        "--session-root".to_owned(),
        "/tmp".to_owned(),
    ];
    // A task image's files are the task's (a repository at /testbed): its commands read them.
    if run.spec.sandbox.image.is_some() {
        serve.push("--image-readable".to_owned());
    }
    let sandbox = Container {
        name: containers::SANDBOX.to_owned(),
        image: Some(run.spec.sandbox.image.clone().unwrap_or(worker_image)),
        image_pull_policy: run.overrides.image_pull_policy.clone(),
        // A native sidecar: started before the worker, stopped after it.
        restart_policy: Some("Always".to_owned()),
        command: Some(serve),
        volume_mounts: Some(vec![
            mount(volumes::SANDBOX_BIN, paths::SANDBOX_BIN_DIR, true),
            mount(volumes::SANDBOX_SOCKET, paths::SANDBOX_SOCKET_DIR, false),
            mount(volumes::WORKSPACE, paths::WORKSPACE_ROOT, false),
            // The root filesystem is read-only: the sessions' private directories (an MCP
            // server's home, Chromium's profile) are made here, on a volume of the sandbox's own.
            mount(volumes::SANDBOX_TMP, "/tmp", false),
        ]),
        security_context: Some(restricted(Some(SANDBOX_USER))),
        // Its own, never the worker's: the OOM killer and the kubelet act on the container in
        // which the model's commands run.
        resources: run.sandbox_resources.clone(),
        ..Container::default()
    };
    vec![install, sandbox]
}

fn worker_container(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    component: Component,
    tasks: &Tasks,
    slots: u32,
) -> Container {
    let overrides = &run.overrides;
    let mut volume_mounts: Vec<VolumeMount> =
        std::iter::once(mount(volumes::PLAN, paths::PLAN_DIR, true))
            .chain(
                run.data_volume
                    .is_some()
                    .then(|| mount(DATA_VOLUME, paths::STORAGE_ROOT, false)),
            )
            .chain([
                mount(volumes::WORKSPACE, paths::WORKSPACE_ROOT, false),
                mount(volumes::TMP, "/tmp", false),
            ])
            .collect();
    if has_sandbox(run, component, tasks) {
        volume_mounts.push(mount(
            volumes::SANDBOX_SOCKET,
            paths::SANDBOX_SOCKET_DIR,
            false,
        ));
    }
    volume_mounts.extend((0..slots).map(|slot| {
        mount(
            &task_volume(slot),
            &format!("{}/slot-{slot}", paths::TASK_SOCKETS_DIR),
            false,
        )
    }));
    Container {
        name: CONTAINER.to_owned(),
        image: Some(worker_image(run, settings)),
        image_pull_policy: overrides.image_pull_policy.clone(),
        command: Some(vec!["trajectory-worker".to_owned()]),
        args: Some(vec![component.command().to_owned()]),
        env: Some(environment(run, settings, component, tasks)),
        resources: overrides.resources.clone(),
        volume_mounts: Some(volume_mounts),
        termination_message_path: Some(paths::TERMINATION_LOG.to_owned()),
        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
        security_context: Some(restricted(None)),
        ..Container::default()
    }
}

/// The worker contract's variable saying where a generation pod's conversations run their
/// commands, or why they cannot run.
fn tasks_env(tasks: &Tasks) -> Option<(&'static str, String)> {
    match tasks {
        Tasks::Sandbox => None,
        Tasks::Image(_) => Some((env::TASK_SOCKETS, paths::TASK_SOCKETS_DIR.to_owned())),
        Tasks::Unavailable {
            image,
            why,
            build_failed: false,
        } => Some((
            env::IMAGE_UNAVAILABLE,
            format!("the image {image} could not be pulled: {why}"),
        )),
        Tasks::Unavailable {
            image,
            why,
            build_failed: true,
        } => Some((
            env::IMAGE_BUILD_FAILED,
            format!("the image {image} could not be built: {why}"),
        )),
    }
}

/// The restricted Pod Security Standard's container settings, and a read-only root filesystem;
/// `user` when the image's own user must not be trusted.
pub(super) fn restricted(user: Option<i64>) -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        run_as_user: user,
        run_as_group: user,
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        seccomp_profile: Some(runtime_default()),
        ..SecurityContext::default()
    }
}

/// The user's extra environment, then the worker contract's variables (which win), then the API
/// key from its Secret.
fn environment(
    run: &ValidatedRun<'_>,
    settings: &Settings,
    component: Component,
    tasks: &Tasks,
) -> Vec<EnvVar> {
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
    if has_sandbox(run, component, tasks) {
        env_vars.push(contract(
            env::SANDBOX_SOCKET,
            &format!(
                "{}/{}",
                paths::SANDBOX_SOCKET_DIR,
                paths::SANDBOX_SOCKET_FILE
            ),
        ));
    }
    if matches!(component, Component::Generate { .. }) {
        let grace = shutdown_grace(run.overrides.termination_grace_period_seconds);
        env_vars.push(contract(env::SHUTDOWN_GRACE_SECONDS, &grace.to_string()));
    }
    env_vars.extend(tasks_env(tasks).map(|(name, value)| contract(name, &value)));
    let secret = |name: String, secret: &SecretKeyRef| EnvVar {
        name,
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.name.clone(),
                key: secret.key.clone(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
    };
    if let Some(key) = &run.spec.model.api_key_secret_ref {
        env_vars.push(secret(env::MODEL_API_KEY.to_owned(), key));
    }
    if let Some(key) = run
        .spec
        .user_simulator
        .as_ref()
        .and_then(|simulator| simulator.model.api_key_secret_ref.as_ref())
    {
        env_vars.push(secret(env::USER_SIMULATOR_API_KEY.to_owned(), key));
    }
    // The bucket's keys, as every S3 client reads them; the worker's alone.
    if let Some(name) = run
        .spec
        .storage
        .object
        .as_ref()
        .and_then(|object| object.credentials_secret.as_ref())
    {
        for (key, optional) in [
            ("AWS_ACCESS_KEY_ID", false),
            ("AWS_SECRET_ACCESS_KEY", false),
            ("AWS_SESSION_TOKEN", true),
        ] {
            let mut var = secret(
                key.to_owned(),
                &SecretKeyRef {
                    name: name.clone(),
                    key: key.to_owned(),
                },
            );
            if let Some(selector) = var
                .value_from
                .as_mut()
                .and_then(|from| from.secret_key_ref.as_mut())
            {
                selector.optional = Some(optional);
            }
            env_vars.push(var);
        }
    }
    // The tools' backend keys (web search, MCP and HTTP tool headers): the worker's alone.
    env_vars.extend(
        secret_env(&run.spec.tools)
            .into_iter()
            .map(|(name, key)| secret(name, key)),
    );
    env_vars
}

pub(super) fn runtime_default() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".to_owned(),
        localhost_profile: None,
    }
}
