//! Desired state: pure functions from a `TrajectoryRun` (and what was observed of its Jobs) to the
//! objects it should own and the status it should show. No client, no clock (the time is passed in),
//! so every decision is tested with tables.
//!
//! - Names are deterministic: `{run}-plan`, `{run}-gen-{attempt}`, `{run}-merge`; each Job's plan
//!   `ConfigMap` has the Job's name. A run name too long for its children is a permanent error.
//! - Every child carries the common labels and a controller owner reference to the run, so deleting
//!   the run deletes them (and never the data on storage).
//! - Every pod meets the restricted Pod Security Standard, gets the worker contract's environment
//!   ([`contract::env`]) and the API key only through a `secretKeyRef`.
//! - Job status is mapped back to batch ids through the pending list of the attempt.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement,
    PodFailurePolicyOnPodConditionsPattern, PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMap, ConfigMapVolumeSource, Container, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, LocalObjectReference, PodSecurityContext, PodSpec, PodTemplateSpec,
    ResourceRequirements, SeccompProfile, SecretKeySelector, SecurityContext, Toleration, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, OwnerReference, Time};
use kube::{Resource, ResourceExt};
use regex::Regex;
use serde::Deserialize;
use trajectory_worker::contract::{self, RunPlan, compact_ranges, env, exit, format_ranges, paths};
use trajectory_worker::spec::RunSpec;

use crate::api::{BatchCounts, ConditionType, TrajectoryRun};
use crate::controller::Pacing;

/// Kubernetes limits label values (and so Job names, which become the `job-name` label) to 63.
pub const MAX_NAME_LENGTH: usize = 63;

/// Attempts are numbered from 1; this many digits are reserved for the attempt in name checks.
const ATTEMPT_DIGITS: usize = 3;

/// Label keys.
pub mod labels {
    pub const NAME: &str = "app.kubernetes.io/name";
    pub const INSTANCE: &str = "app.kubernetes.io/instance";
    pub const COMPONENT: &str = "app.kubernetes.io/component";
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    /// The run a child belongs to (the selector the controller uses).
    pub const RUN: &str = "trajectories.dev/run";
    /// The generation attempt of a `gen` Job.
    pub const ATTEMPT: &str = "trajectories.dev/attempt";
    /// Kueue admits Jobs carrying this label through the named `LocalQueue`.
    pub const KUEUE_QUEUE: &str = "kueue.x-k8s.io/queue-name";
}

/// Value of `app.kubernetes.io/managed-by`, and the server-side apply field manager.
pub const MANAGER: &str = "trajectory-operator";

/// The worker container's name (named in the pod failure policy's exit-code rules).
pub const CONTAINER: &str = "worker";

/// Volume names inside a worker pod.
mod volumes {
    pub const PLAN: &str = "plan";
    pub const DATA: &str = "data";
    pub const WORKSPACE: &str = "workspace";
    pub const TMP: &str = "tmp";
}

/// The group of the worker image's user (`nonroot`, 65532, as in distroless images).
const WORKER_GROUP: i64 = 65532;

/// Operator-wide settings: what shapes the children, which runs to act on, and the pace of writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Worker image used when `spec.podTemplate.image` is unset.
    pub worker_image: String,
    /// `TRAJ_LOG_FORMAT` of the worker pods (`json` or `pretty`).
    pub worker_log_format: String,
    /// The only namespace whose runs the operator acts on (the Helm chart's `scope: Namespace`,
    /// where RBAC grants nothing elsewhere); `None`: every namespace.
    pub watch_namespace: Option<String>,
    /// How often the controller writes status and retries after errors (no effect on children).
    pub pacing: Pacing,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            // The image `scripts/images/build.sh` tags for this workspace version (it tags no
            // `latest`), so an operator started without the chart runs workers of its own release.
            worker_image: concat!(
                "ghcr.io/trajectory-operator/trajectory-worker:",
                env!("CARGO_PKG_VERSION")
            )
            .to_owned(),
            worker_log_format: "json".to_owned(),
            watch_namespace: None,
            pacing: Pacing::default(),
        }
    }
}

/// Why the desired state cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum DesiredError {
    #[error(
        "the run name {name:?} is too long: its child {child:?} would exceed {MAX_NAME_LENGTH} characters; use a name of at most {max} characters"
    )]
    NameTooLong {
        name: String,
        child: String,
        max: usize,
    },
    #[error("the run has no uid or namespace: it was not read from the API server")]
    NotStored,
    #[error(
        "spec.storage.volume is required on a cluster: a volume every pod of the run can mount, e.g. {{persistentVolumeClaim: {{claimName: trajectories}}}} on a ReadWriteMany claim"
    )]
    MissingVolume,
    #[error("spec.storage.volume is not a Kubernetes volume source: {0}")]
    InvalidVolume(#[source] serde_json::Error),
    #[error("spec.podTemplate is invalid: {0}")]
    InvalidPodTemplate(#[source] serde_json::Error),
    #[error("{field}: {value:?} is not a quantity (e.g. 500m, 2, 4Gi)")]
    InvalidQuantity { field: String, value: String },
    #[error("the run plan cannot be serialised: {0}")]
    Plan(#[source] serde_json::Error),
    #[error("a generation Job needs at least one pending batch")]
    NothingPending,
    #[error("Job {job} reports unreadable indexes {text:?}: {reason}")]
    BadIndexes {
        job: String,
        text: String,
        reason: String,
    },
    #[error("Job {job} reports index {index}, but its attempt has {pending} pending batches")]
    IndexOutOfRange {
        job: String,
        index: u32,
        pending: usize,
    },
}

impl DesiredError {
    /// True when nothing but a change of the run (or of the operator) can fix it.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, Self::NotStored)
    }

    /// A short label for metrics and condition reasons.
    pub fn label(&self) -> &'static str {
        match self {
            Self::NameTooLong { .. } => "NameTooLong",
            Self::NotStored => "NotStored",
            Self::MissingVolume => "MissingVolume",
            Self::InvalidVolume(_) => "InvalidVolume",
            Self::InvalidPodTemplate(_) | Self::InvalidQuantity { .. } => "InvalidPodTemplate",
            Self::Plan(_) => "InvalidPlan",
            Self::NothingPending => "NothingPending",
            Self::BadIndexes { .. } => "BadIndexes",
            Self::IndexOutOfRange { .. } => "IndexOutOfRange",
        }
    }
}

/// The stage a child Job belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `trajectory-worker plan`: validate the dataset, write the manifest.
    Plan,
    /// `trajectory-worker batch`: the Indexed Job of one attempt.
    Generate { attempt: u32 },
    /// `trajectory-worker merge`.
    Merge,
}

impl Stage {
    /// The `app.kubernetes.io/component` label value.
    pub fn component(self) -> &'static str {
        match self {
            Self::Plan => "plan",
            Self::Generate { .. } => "generate",
            Self::Merge => "merge",
        }
    }

    /// The worker subcommand.
    fn command(self) -> &'static str {
        match self {
            Self::Plan => "plan",
            Self::Generate { .. } => "batch",
            Self::Merge => "merge",
        }
    }

    /// The child's name, checked against [`MAX_NAME_LENGTH`] (with room for any attempt number).
    pub fn child_name(self, run: &str) -> Result<String, DesiredError> {
        let (name, longest_suffix) = match self {
            Self::Plan => (format!("{run}-plan"), "-plan".len()),
            Self::Generate { attempt } => (
                format!("{run}-gen-{attempt}"),
                "-gen-".len() + ATTEMPT_DIGITS.max(attempt.to_string().len()),
            ),
            Self::Merge => (format!("{run}-merge"), "-merge".len()),
        };
        let max = MAX_NAME_LENGTH - "-gen-".len() - ATTEMPT_DIGITS;
        if run.len() + longest_suffix > MAX_NAME_LENGTH || run.len() > max {
            return Err(DesiredError::NameTooLong {
                name: run.to_owned(),
                child: name,
                max,
            });
        }
        Ok(name)
    }
}

/// Pod settings a user may give in `spec.podTemplate`. Unknown keys are refused, so that a typo
/// (`nodeSelectors`) is a clear error instead of a silently ignored setting.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodOverrides {
    pub image: Option<String>,
    pub image_pull_policy: Option<String>,
    pub resources: Option<ResourceRequirements>,
    pub node_selector: Option<BTreeMap<String, String>>,
    pub tolerations: Option<Vec<Toleration>>,
    pub affinity: Option<Affinity>,
    pub service_account_name: Option<String>,
    pub priority_class_name: Option<String>,
    /// Extra environment; the worker contract's variables are set after it and win.
    pub env: Option<Vec<EnvVar>>,
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

impl PodOverrides {
    pub fn from_spec(spec: &RunSpec) -> Result<Self, DesiredError> {
        let overrides: Self = spec.pod_template.as_ref().map_or_else(
            || Ok(Self::default()),
            |value| serde_json::from_value(value.clone()).map_err(DesiredError::InvalidPodTemplate),
        )?;
        overrides.check_quantities()?;
        Ok(overrides)
    }

    /// The API server answers a Job with a malformed quantity with 500 Internal Server Error (it
    /// fails converting the applied object), which looks transient; checked here, it is a bad spec
    /// that names its field.
    fn check_quantities(&self) -> Result<(), DesiredError> {
        static QUANTITY: LazyLock<Regex> = LazyLock::new(|| {
            // The API server's own pattern (k8s.io/apimachinery resource.Quantity).
            Regex::new(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$").expect("a valid pattern")
        });
        let Some(resources) = &self.resources else {
            return Ok(());
        };
        for (kind, quantities) in [
            ("requests", &resources.requests),
            ("limits", &resources.limits),
        ] {
            for (name, quantity) in quantities.iter().flatten() {
                if !QUANTITY.is_match(&quantity.0) {
                    return Err(DesiredError::InvalidQuantity {
                        field: format!("spec.podTemplate.resources.{kind}.{name}"),
                        value: quantity.0.clone(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// What every child of one run shares: identity, labels, owner reference.
#[derive(Debug, Clone)]
struct Owner<'a> {
    name: String,
    namespace: String,
    uid: String,
    reference: OwnerReference,
    spec: &'a RunSpec,
}

impl<'a> Owner<'a> {
    fn of(run: &'a TrajectoryRun) -> Result<Self, DesiredError> {
        // Blocking, as the built-in controllers' references are: a foreground deletion of the run
        // (`kubectl delete --cascade=foreground`, a GitOps prune) ends only once its Jobs and
        // ConfigMaps are gone, so a run re-created under the same name never meets them.
        let reference = OwnerReference {
            block_owner_deletion: Some(true),
            ..run
                .controller_owner_ref(&())
                .ok_or(DesiredError::NotStored)?
        };
        Ok(Self {
            name: run.name_any(),
            namespace: run.namespace().ok_or(DesiredError::NotStored)?,
            uid: run.uid().ok_or(DesiredError::NotStored)?,
            reference,
            spec: &run.spec.run,
        })
    }

    fn labels(&self, stage: Stage) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([
            (labels::NAME.to_owned(), "trajectory-worker".to_owned()),
            (labels::INSTANCE.to_owned(), self.name.clone()),
            (labels::COMPONENT.to_owned(), stage.component().to_owned()),
            (labels::MANAGED_BY.to_owned(), MANAGER.to_owned()),
            (labels::RUN.to_owned(), self.name.clone()),
        ]);
        if let Stage::Generate { attempt } = stage {
            labels.insert(labels::ATTEMPT.to_owned(), attempt.to_string());
        }
        labels
    }

    fn metadata(&self, name: &str, labels: BTreeMap<String, String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(self.namespace.clone()),
            labels: Some(labels),
            owner_references: Some(vec![self.reference.clone()]),
            ..ObjectMeta::default()
        }
    }
}

/// The run plan `ConfigMap` a Job's pods mount; it has the Job's name. `pending` is the batch each
/// completion index works; it is written only when it is not the identity (index *i* = batch *i*).
pub fn plan_config_map(
    run: &TrajectoryRun,
    stage: Stage,
    pending: Option<&[u32]>,
) -> Result<ConfigMap, DesiredError> {
    let owner = Owner::of(run)?;
    let name = stage.child_name(&owner.name)?;
    let batches = pending
        .filter(|pending| !pending.iter().copied().eq(0..len_u32(pending)))
        .map(<[u32]>::to_vec);
    let plan = RunPlan {
        name: owner.name.clone(),
        namespace: owner.namespace.clone(),
        uid: owner.uid.clone(),
        spec: owner.spec.clone(),
        output_path: owner.spec.output_path(&owner.namespace, &owner.name),
        batches,
    };
    let json = serde_json::to_string_pretty(&plan).map_err(DesiredError::Plan)?;
    Ok(ConfigMap {
        metadata: owner.metadata(&name, owner.labels(stage)),
        data: Some(BTreeMap::from([(paths::PLAN_FILE.to_owned(), json)])),
        ..ConfigMap::default()
    })
}

/// The plan Job: one pod running `trajectory-worker plan`. `exists`: as for [`generation_job`].
pub fn plan_job(
    run: &TrajectoryRun,
    settings: &Settings,
    exists: bool,
) -> Result<Job, DesiredError> {
    single_pod_job(run, settings, Stage::Plan, exists)
}

/// The merge Job: one pod running `trajectory-worker merge`. `exists`: as for [`generation_job`].
pub fn merge_job(
    run: &TrajectoryRun,
    settings: &Settings,
    exists: bool,
) -> Result<Job, DesiredError> {
    single_pod_job(run, settings, Stage::Merge, exists)
}

fn single_pod_job(
    run: &TrajectoryRun,
    settings: &Settings,
    stage: Stage,
    exists: bool,
) -> Result<Job, DesiredError> {
    let owner = Owner::of(run)?;
    let spec = owner.spec;
    let mut job = job_shell(&owner, settings, stage)?;
    job.spec = Some(JobSpec {
        completions: Some(1),
        parallelism: Some(1),
        backoff_limit: Some(to_i32(spec.retry.per_batch)),
        pod_failure_policy: Some(failure_policy(false)),
        suspend: asserted_suspend(spec, exists),
        ..job.spec.take().unwrap_or_default()
    });
    Ok(job)
}

/// The Indexed Job of generation attempt `attempt`: index *i* works batch `pending[i]`.
///
/// `exists` says whether the Job is already there: with a Kueue queue the Job is created suspended
/// and Kueue owns `suspend` afterwards, so the operator stops asserting it.
pub fn generation_job(
    run: &TrajectoryRun,
    settings: &Settings,
    attempt: u32,
    pending: &[u32],
    exists: bool,
) -> Result<Job, DesiredError> {
    if pending.is_empty() {
        return Err(DesiredError::NothingPending);
    }
    let owner = Owner::of(run)?;
    let spec = owner.spec;
    let stage = Stage::Generate { attempt };
    let mut job = job_shell(&owner, settings, stage)?;
    let suspend = asserted_suspend(spec, exists);
    job.spec = Some(JobSpec {
        completion_mode: Some("Indexed".to_owned()),
        completions: Some(to_i32(len_u32(pending))),
        parallelism: Some(to_i32(spec.workers)),
        backoff_limit_per_index: Some(to_i32(spec.retry.per_batch)),
        // The API server refuses a limit above `completions`; a limit of all of them is the same.
        max_failed_indexes: Some(to_i32(spec.retry.max_failed_batches.min(len_u32(pending)))),
        pod_failure_policy: Some(failure_policy(true)),
        suspend,
        ..job.spec.take().unwrap_or_default()
    });
    Ok(job)
}

/// The Job's `suspend` as the operator asserts it: the run's `suspend` wins; with a Kueue queue
/// the Job is created suspended and Kueue alone unsuspends it once admitted (asserting `false`
/// afterwards would start it past the queue's quota); otherwise the Job runs.
fn asserted_suspend(spec: &RunSpec, exists: bool) -> Option<bool> {
    match (&spec.queue_name, exists) {
        _ if spec.suspend => Some(true),
        (Some(_), true) => None,
        (Some(_), false) => Some(true),
        (None, _) => Some(false),
    }
}

/// Ignore disruptions (preemption, spot loss, scale-down); fail the Job on a permanent
/// configuration error; on an Indexed Job, fail only the index on bad batch input.
fn failure_policy(indexed: bool) -> PodFailurePolicy {
    let on_exit = |action: &str, code: i32| PodFailurePolicyRule {
        action: action.to_owned(),
        on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
            container_name: Some(CONTAINER.to_owned()),
            operator: "In".to_owned(),
            values: vec![code],
        }),
        on_pod_conditions: None,
    };
    let mut rules = vec![
        PodFailurePolicyRule {
            action: "Ignore".to_owned(),
            on_exit_codes: None,
            on_pod_conditions: Some(vec![PodFailurePolicyOnPodConditionsPattern {
                status: Some("True".to_owned()),
                type_: "DisruptionTarget".to_owned(),
            }]),
        },
        on_exit("FailJob", exit::PERMANENT_CONFIG),
    ];
    if indexed {
        rules.push(on_exit("FailIndex", exit::BAD_BATCH_INPUT));
    }
    PodFailurePolicy { rules }
}

/// A Job with metadata and pod template filled; the caller sets the Job-level spec fields.
fn job_shell(owner: &Owner<'_>, settings: &Settings, stage: Stage) -> Result<Job, DesiredError> {
    let name = stage.child_name(&owner.name)?;
    let overrides = PodOverrides::from_spec(owner.spec)?;
    let pod_labels = owner.labels(stage);
    let mut job_labels = pod_labels.clone();
    // Always applied, also once Kueue admitted the Job: dropping it from the applied
    // configuration would make server-side apply remove the label, which Kueue refuses.
    if let Some(queue) = &owner.spec.queue_name {
        job_labels.insert(labels::KUEUE_QUEUE.to_owned(), queue.clone());
    }
    let template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(pod_labels),
            ..ObjectMeta::default()
        }),
        spec: Some(pod_spec(owner, settings, stage, &name, overrides)?),
    };
    Ok(Job {
        metadata: owner.metadata(&name, job_labels),
        spec: Some(JobSpec {
            template,
            ..JobSpec::default()
        }),
        status: None,
    })
}

fn pod_spec(
    owner: &Owner<'_>,
    settings: &Settings,
    stage: Stage,
    job_name: &str,
    overrides: PodOverrides,
) -> Result<PodSpec, DesiredError> {
    let volume_source = owner
        .spec
        .storage
        .volume
        .clone()
        .ok_or(DesiredError::MissingVolume)?;
    let mut data_volume: Volume =
        serde_json::from_value(volume_source).map_err(DesiredError::InvalidVolume)?;
    volumes::DATA.clone_into(&mut data_volume.name);

    let contract = |name: &str, value: &str| EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        value_from: None,
    };
    let mut env_vars = overrides.env.unwrap_or_default();
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
    if let Some(secret) = &owner.spec.model.api_key_secret_ref {
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

    let mount = |name: &str, path: &str, read_only: bool| VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    };
    let empty_dir = |name: &str| Volume {
        name: name.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    };
    let runtime_default = || SeccompProfile {
        type_: "RuntimeDefault".to_owned(),
        localhost_profile: None,
    };

    Ok(PodSpec {
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
        containers: vec![Container {
            name: CONTAINER.to_owned(),
            image: Some(
                overrides
                    .image
                    .unwrap_or_else(|| settings.worker_image.clone()),
            ),
            image_pull_policy: overrides.image_pull_policy,
            command: Some(vec!["trajectory-worker".to_owned()]),
            args: Some(vec![stage.command().to_owned()]),
            env: Some(env_vars),
            resources: overrides.resources,
            volume_mounts: Some(vec![
                mount(volumes::PLAN, paths::PLAN_DIR, true),
                mount(volumes::DATA, paths::STORAGE_ROOT, false),
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
        }],
        volumes: Some(vec![
            Volume {
                name: volumes::PLAN.to_owned(),
                config_map: Some(ConfigMapVolumeSource {
                    name: job_name.to_owned(),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            },
            data_volume,
            empty_dir(volumes::WORKSPACE),
            empty_dir(volumes::TMP),
        ]),
        ..PodSpec::default()
    })
}

/// The batches not yet done, in order: what the next attempt works.
pub fn pending_batches(total: u32, done: &BTreeSet<u32>) -> Vec<u32> {
    (0..total).filter(|batch| !done.contains(batch)).collect()
}

/// Batches an attempt finished and gave up on, as batch ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptOutcome {
    pub completed: BTreeSet<u32>,
    pub failed: BTreeSet<u32>,
}

/// Maps a generation Job's `completedIndexes` / `failedIndexes` back to batch ids through the
/// attempt's pending list.
pub fn attempt_outcome(job: &Job, pending: &[u32]) -> Result<AttemptOutcome, DesiredError> {
    let name = job.name_any();
    let status = job.status.as_ref();
    let map = |text: Option<&String>| -> Result<BTreeSet<u32>, DesiredError> {
        let text = text.map_or("", String::as_str);
        let indexes = contract::parse_ranges(text).map_err(|reason| DesiredError::BadIndexes {
            job: name.clone(),
            text: text.to_owned(),
            reason,
        })?;
        indexes
            .into_iter()
            .map(|index| {
                usize::try_from(index)
                    .ok()
                    .and_then(|i| pending.get(i).copied())
                    .ok_or(DesiredError::IndexOutOfRange {
                        job: name.clone(),
                        index,
                        pending: pending.len(),
                    })
            })
            .collect()
    };
    Ok(AttemptOutcome {
        completed: map(status.and_then(|s| s.completed_indexes.as_ref()))?,
        failed: map(status.and_then(|s| s.failed_indexes.as_ref()))?,
    })
}

/// The status' batch counts: done batches (from the plan's recovery scan and every attempt) and the
/// batches that failed and are not done.
pub fn batch_counts(total: u32, done: &BTreeSet<u32>, failed: &BTreeSet<u32>) -> BatchCounts {
    let failed: Vec<u32> = failed.difference(done).copied().collect();
    BatchCounts {
        total,
        completed: format_ranges(&compact_ranges(done.iter().copied())),
        failed: format_ranges(&compact_ranges(failed)),
    }
}

/// `done/total`, the Progress printer column.
pub fn progress(done: &BTreeSet<u32>, total: u32) -> String {
    format!("{}/{total}", done.len())
}

/// Condition reasons (`PascalCase`, as Kubernetes conventions ask).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Pending,
    Planning,
    Generating,
    Merging,
    Suspended,
    Resumed,
    Succeeded,
    InvalidSpec,
    InvalidDataset,
    TooManyFailedBatches,
    /// A worker exited with the "permanent configuration error" code (e.g. 401 from the model).
    WorkerConfigError,
    MergeFailed,
    PlanFailed,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Planning => "Planning",
            Self::Generating => "Generating",
            Self::Merging => "Merging",
            Self::Suspended => "Suspended",
            Self::Resumed => "Resumed",
            Self::Succeeded => "Succeeded",
            Self::InvalidSpec => "InvalidSpec",
            Self::InvalidDataset => "InvalidDataset",
            Self::TooManyFailedBatches => "TooManyFailedBatches",
            Self::WorkerConfigError => "WorkerConfigError",
            Self::MergeFailed => "MergeFailed",
            Self::PlanFailed => "PlanFailed",
        }
    }
}

/// Sets a condition. `lastTransitionTime` changes only when the status flips; reason, message and
/// `observedGeneration` are updated in place. Returns true when anything changed.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: ConditionType,
    status: bool,
    reason: Reason,
    message: &str,
    generation: Option<i64>,
    now: &Time,
) -> bool {
    let status = if status { "True" } else { "False" };
    let wanted = Condition {
        type_: type_.as_str().to_owned(),
        status: status.to_owned(),
        reason: reason.as_str().to_owned(),
        message: message.to_owned(),
        observed_generation: generation,
        last_transition_time: now.clone(),
    };
    match conditions.iter_mut().find(|c| c.type_ == wanted.type_) {
        None => {
            conditions.push(wanted);
            true
        }
        Some(existing) => {
            let transition_time = if existing.status == wanted.status {
                existing.last_transition_time.clone()
            } else {
                wanted.last_transition_time.clone()
            };
            let updated = Condition {
                last_transition_time: transition_time,
                ..wanted
            };
            let changed = *existing != updated;
            *existing = updated;
            changed
        }
    }
}

fn len_u32(items: &[u32]) -> u32 {
    u32::try_from(items.len()).unwrap_or(u32::MAX)
}

/// Kubernetes counts in `int32`; spec values beyond it are clamped (the schema bounds them anyway).
fn to_i32(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::batch::v1::JobStatus;
    use k8s_openapi::jiff::Timestamp;
    use serde_json::json;

    use super::*;
    use crate::api::TrajectoryRunSpec;

    /// A stored run (name, namespace, uid) with a volume and defaults; change it with `.with(...)`.
    struct Fixture(TrajectoryRun);

    impl Fixture {
        fn new() -> Self {
            Self::named("coding-v1")
        }

        fn named(name: &str) -> Self {
            let spec: RunSpec = serde_json::from_value(json!({
                "dataset": {"path": "datasets/coding.jsonl"},
                "model": {"baseUrl": "http://vllm:8000/v1", "name": "hermes"},
                "storage": {"volume": {"persistentVolumeClaim": {"claimName": "trajectories"}}},
            }))
            .unwrap();
            let mut run = TrajectoryRun::new(name, TrajectoryRunSpec::from(spec));
            run.metadata.namespace = Some("research".into());
            run.metadata.uid = Some("0b7c-uid".into());
            Self(run)
        }

        fn with(mut self, change: impl FnOnce(&mut RunSpec)) -> Self {
            change(&mut self.0.spec.run);
            self
        }

        fn with_pod_template(self, template: serde_json::Value) -> Self {
            self.with(|spec| spec.pod_template = Some(template))
        }
    }

    /// (pending list given, batches expected in the plan).
    type PendingCase = (Option<&'static [u32]>, Option<Vec<u32>>);
    /// (pending, completedIndexes, failedIndexes, completed batches, failed batches).
    type IndexCase<'a> = (
        &'a [u32],
        Option<&'a str>,
        Option<&'a str>,
        &'a [u32],
        &'a [u32],
    );

    fn settings() -> Settings {
        Settings::default()
    }

    fn pod(job: &Job) -> &PodSpec {
        job.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
    }

    fn env_value<'a>(job: &'a Job, name: &str) -> Option<&'a EnvVar> {
        pod(job).containers[0]
            .env
            .iter()
            .flatten()
            .rev()
            .find(|var| var.name == name)
    }

    #[test]
    fn children_have_deterministic_names() {
        let cases = [
            (Stage::Plan, "coding-v1-plan"),
            (Stage::Generate { attempt: 1 }, "coding-v1-gen-1"),
            (Stage::Generate { attempt: 12 }, "coding-v1-gen-12"),
            (Stage::Merge, "coding-v1-merge"),
        ];
        for (stage, expected) in cases {
            assert_eq!(stage.child_name("coding-v1").unwrap(), expected);
        }
    }

    #[test]
    fn run_name_too_long_for_its_children_is_a_permanent_error() {
        let longest = "r".repeat(MAX_NAME_LENGTH - "-gen-".len() - ATTEMPT_DIGITS);
        assert!(
            Stage::Generate { attempt: 999 }
                .child_name(&longest)
                .is_ok()
        );
        let too_long = format!("{longest}x");
        for stage in [Stage::Plan, Stage::Generate { attempt: 1 }, Stage::Merge] {
            let error = stage.child_name(&too_long).unwrap_err();
            assert!(error.is_permanent());
            assert!(
                error.to_string().contains("at most 55 characters"),
                "{error}"
            );
        }
        let error = plan_job(&Fixture::named(&too_long).0, &settings(), false).unwrap_err();
        assert_eq!(error.label(), "NameTooLong");
    }

    #[test]
    fn generation_job_is_indexed_with_retry_limits_and_failure_policy() {
        let run = Fixture::new().with(|spec| {
            spec.workers = 8;
            spec.retry.per_batch = 2;
            spec.retry.max_failed_batches = 5;
        });
        let pending = [3, 4, 9];
        let many: Vec<u32> = (0..40).collect();
        let big = generation_job(&run.0, &settings(), 1, &many, false).unwrap();
        assert_eq!(big.spec.as_ref().unwrap().max_failed_indexes, Some(5));
        let job = generation_job(&run.0, &settings(), 2, &pending, false).unwrap();
        assert_eq!(job.metadata.name.as_deref(), Some("coding-v1-gen-2"));
        let spec = job.spec.as_ref().unwrap();
        assert_eq!(spec.completion_mode.as_deref(), Some("Indexed"));
        assert_eq!(spec.completions, Some(3));
        assert_eq!(spec.parallelism, Some(8));
        assert_eq!(spec.backoff_limit_per_index, Some(2));
        // At most `completions`, or the API server refuses the Job.
        assert_eq!(spec.max_failed_indexes, Some(3));
        assert_eq!(spec.suspend, Some(false));
        assert_eq!(pod(&job).restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            pod(&job).containers[0].args.as_deref(),
            Some(&["batch".to_owned()][..])
        );

        let rules = &spec.pod_failure_policy.as_ref().unwrap().rules;
        let summary: Vec<(String, Option<i32>, Option<String>)> = rules
            .iter()
            .map(|rule| {
                (
                    rule.action.clone(),
                    rule.on_exit_codes.as_ref().map(|codes| codes.values[0]),
                    rule.on_pod_conditions
                        .as_ref()
                        .map(|conditions| conditions[0].type_.clone()),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "Ignore".to_owned(),
                    None,
                    Some("DisruptionTarget".to_owned())
                ),
                ("FailJob".to_owned(), Some(exit::PERMANENT_CONFIG), None),
                ("FailIndex".to_owned(), Some(exit::BAD_BATCH_INPUT), None),
            ]
        );
    }

    #[test]
    fn plan_and_merge_jobs_run_one_pod_of_their_worker_mode() {
        for (job, mode, name) in [
            (
                plan_job(&Fixture::new().0, &settings(), false).unwrap(),
                "plan",
                "coding-v1-plan",
            ),
            (
                merge_job(&Fixture::new().0, &settings(), false).unwrap(),
                "merge",
                "coding-v1-merge",
            ),
        ] {
            assert_eq!(job.metadata.name.as_deref(), Some(name));
            let spec = job.spec.as_ref().unwrap();
            assert_eq!((spec.completions, spec.parallelism), (Some(1), Some(1)));
            assert_eq!(spec.completion_mode, None);
            assert_eq!(spec.backoff_limit, Some(3));
            let actions: Vec<_> = spec
                .pod_failure_policy
                .as_ref()
                .unwrap()
                .rules
                .iter()
                .map(|rule| rule.action.as_str())
                .collect();
            assert_eq!(actions, ["Ignore", "FailJob"]);
            assert_eq!(
                pod(&job).containers[0].args.as_deref(),
                Some(&[mode.to_owned()][..])
            );
            // The plan ConfigMap is the Job's namesake.
            let volume = &pod(&job).volumes.as_ref().unwrap()[0];
            assert_eq!(volume.config_map.as_ref().unwrap().name, name);
        }
    }

    #[test]
    fn children_carry_common_labels_and_a_controller_owner_reference() {
        let run = Fixture::new().0;
        let job = generation_job(&run, &settings(), 1, &[0, 1], false).unwrap();
        let map = plan_config_map(&run, Stage::Generate { attempt: 1 }, Some(&[0, 1])).unwrap();
        for metadata in [&job.metadata, &map.metadata] {
            let labels = metadata.labels.as_ref().unwrap();
            assert_eq!(labels[labels::RUN], "coding-v1");
            assert_eq!(labels[labels::MANAGED_BY], MANAGER);
            assert_eq!(labels[labels::COMPONENT], "generate");
            assert_eq!(labels[labels::ATTEMPT], "1");
            assert_eq!(metadata.namespace.as_deref(), Some("research"));
            let owner = &metadata.owner_references.as_ref().unwrap()[0];
            assert_eq!(
                (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
                ("TrajectoryRun", "coding-v1", "0b7c-uid")
            );
            assert_eq!(owner.controller, Some(true));
            assert_eq!(owner.block_owner_deletion, Some(true));
        }
        let pod_labels = job
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .as_ref()
            .unwrap();
        assert_eq!(
            pod_labels.labels.as_ref().unwrap()[labels::RUN],
            "coding-v1"
        );
    }

    #[test]
    fn a_run_not_read_from_the_api_server_has_no_children() {
        let mut run = Fixture::new().0;
        run.metadata.uid = None;
        let error = plan_job(&run, &settings(), false).unwrap_err();
        assert_eq!(error.label(), "NotStored");
        assert!(!error.is_permanent());
    }

    #[test]
    fn plan_config_map_lists_pending_batches_only_when_not_the_identity() {
        let run = Fixture::new().with(|spec| spec.storage.output_path = Some("runs/coding".into()));
        let cases: [PendingCase; 4] = [
            (None, None),
            (Some(&[0, 1, 2]), None),
            (Some(&[1, 2]), Some(vec![1, 2])),
            (Some(&[0, 4, 7]), Some(vec![0, 4, 7])),
        ];
        for (pending, expected) in cases {
            let map = plan_config_map(&run.0, Stage::Generate { attempt: 2 }, pending).unwrap();
            assert_eq!(map.metadata.name.as_deref(), Some("coding-v1-gen-2"));
            let text = &map.data.as_ref().unwrap()[paths::PLAN_FILE];
            let plan: RunPlan = serde_json::from_str(text).unwrap();
            assert_eq!(plan.batches, expected, "pending {pending:?}");
            assert_eq!(plan.output_path, "runs/coding");
            assert_eq!(
                (plan.name.as_str(), plan.namespace.as_str()),
                ("coding-v1", "research")
            );
            assert_eq!(plan.uid, "0b7c-uid");
            assert_eq!(plan.spec, run.0.spec.run);
        }
    }

    #[test]
    fn pods_get_the_worker_contract_environment_and_the_key_only_by_secret_ref() {
        let run = Fixture::new().with(|spec| {
            spec.model.api_key_secret_ref = Some(trajectory_worker::spec::SecretKeyRef {
                name: "llm-key".into(),
                key: "api-key".into(),
            });
        });
        let job = generation_job(&run.0, &settings(), 1, &[0], false).unwrap();
        let value = |name| env_value(&job, name).and_then(|var| var.value.clone());
        assert_eq!(
            value(env::PLAN_PATH).as_deref(),
            Some("/etc/trajectory/plan.json")
        );
        assert_eq!(
            value(env::STORAGE_ROOT).as_deref(),
            Some(paths::STORAGE_ROOT)
        );
        assert_eq!(
            value(env::WORKSPACE_ROOT).as_deref(),
            Some(paths::WORKSPACE_ROOT)
        );
        assert_eq!(
            value(env::TERMINATION_LOG).as_deref(),
            Some(paths::TERMINATION_LOG)
        );
        assert_eq!(value(env::LOG_FORMAT).as_deref(), Some("json"));
        let key = env_value(&job, env::MODEL_API_KEY).unwrap();
        assert_eq!(key.value, None);
        let selector = key
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        assert_eq!(
            (selector.name.as_str(), selector.key.as_str()),
            ("llm-key", "api-key")
        );

        let without = generation_job(&Fixture::new().0, &settings(), 1, &[0], false).unwrap();
        assert!(env_value(&without, env::MODEL_API_KEY).is_none());
    }

    #[test]
    fn every_pod_meets_the_restricted_pod_security_standard() {
        let run = Fixture::new().0;
        let jobs = [
            plan_job(&run, &settings(), false).unwrap(),
            generation_job(&run, &settings(), 1, &[0], false).unwrap(),
            merge_job(&run, &settings(), false).unwrap(),
        ];
        for job in &jobs {
            let pod = pod(job);
            assert_eq!(pod.automount_service_account_token, Some(false));
            let pod_context = pod.security_context.as_ref().unwrap();
            assert_eq!(pod_context.run_as_non_root, Some(true));
            assert_eq!(pod_context.fs_group, Some(65532));
            assert_eq!(
                pod_context.fs_group_change_policy.as_deref(),
                Some("OnRootMismatch")
            );
            assert_eq!(
                pod_context.seccomp_profile.as_ref().unwrap().type_,
                "RuntimeDefault"
            );
            for container in &pod.containers {
                let context = container.security_context.as_ref().unwrap();
                assert_eq!(context.allow_privilege_escalation, Some(false));
                assert_eq!(context.read_only_root_filesystem, Some(true));
                assert_eq!(context.run_as_non_root, Some(true));
                assert_eq!(
                    context.capabilities.as_ref().unwrap().drop.as_deref(),
                    Some(&["ALL".to_owned()][..])
                );
                assert_eq!(
                    context.seccomp_profile.as_ref().unwrap().type_,
                    "RuntimeDefault"
                );
                // The read-only root needs writable scratch: the workspace and /tmp are emptyDirs.
                let mounts: Vec<_> = container
                    .volume_mounts
                    .iter()
                    .flatten()
                    .map(|m| (m.name.as_str(), m.mount_path.as_str()))
                    .collect();
                assert!(mounts.contains(&("workspace", paths::WORKSPACE_ROOT)));
                assert!(mounts.contains(&("tmp", "/tmp")));
            }
            let empty_dirs: Vec<_> = pod
                .volumes
                .iter()
                .flatten()
                .filter(|v| v.empty_dir.is_some())
                .map(|v| v.name.as_str())
                .collect();
            assert_eq!(empty_dirs, ["workspace", "tmp"]);
        }
    }

    #[test]
    fn storage_volume_is_mounted_and_required() {
        let job = plan_job(&Fixture::new().0, &settings(), false).unwrap();
        let data = pod(&job)
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "data")
            .unwrap();
        assert_eq!(
            data.persistent_volume_claim.as_ref().unwrap().claim_name,
            "trajectories"
        );
        let without = Fixture::new().with(|spec| spec.storage.volume = None);
        let error = plan_job(&without.0, &settings(), false).unwrap_err();
        assert_eq!(error.label(), "MissingVolume");
        assert!(error.is_permanent());
        let bad = Fixture::new().with(|spec| spec.storage.volume = Some(json!({"hostPath": 7})));
        assert_eq!(
            plan_job(&bad.0, &settings(), false).unwrap_err().label(),
            "InvalidVolume"
        );
    }

    #[test]
    fn queue_name_labels_the_job_for_kueue_and_creates_it_suspended() {
        let run = Fixture::new().with(|spec| spec.queue_name = Some("team-a".into()));
        let cases = [
            // (exists, spec.suspend) -> suspend asserted by the operator
            (false, false, Some(true)),
            (true, false, None),
            (true, true, Some(true)),
        ];
        for (exists, suspend, expected) in cases {
            let run = Fixture(run.0.clone()).with(|spec| spec.suspend = suspend);
            // Every stage goes through the queue: plan, generation and merge alike.
            let jobs = [
                plan_job(&run.0, &settings(), exists).unwrap(),
                generation_job(&run.0, &settings(), 1, &[0], exists).unwrap(),
                merge_job(&run.0, &settings(), exists).unwrap(),
            ];
            for job in jobs {
                let name = job.metadata.name.clone().unwrap();
                assert_eq!(
                    job.spec.as_ref().unwrap().suspend,
                    expected,
                    "{name}: exists {exists}"
                );
                let labels = job.metadata.labels.as_ref().unwrap();
                assert_eq!(
                    labels.get(labels::KUEUE_QUEUE).map(String::as_str),
                    Some("team-a"),
                    "{name}: exists {exists}"
                );
            }
        }
        let plain = generation_job(&Fixture::new().0, &settings(), 1, &[0], false).unwrap();
        assert!(
            !plain
                .metadata
                .labels
                .as_ref()
                .unwrap()
                .contains_key(labels::KUEUE_QUEUE)
        );
        let suspended = Fixture::new().with(|spec| spec.suspend = true);
        let job = generation_job(&suspended.0, &settings(), 1, &[0], true).unwrap();
        assert_eq!(job.spec.as_ref().unwrap().suspend, Some(true));
    }

    #[test]
    fn pod_template_fields_reach_the_pods() {
        let run = Fixture::new().with_pod_template(json!({
            "image": "registry.local/worker:1.2",
            "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
            }}},
            "serviceAccountName": "trajectories",
            "priorityClassName": "batch-low",
            "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}, {"name": "TRAJ_STORAGE_ROOT", "value": "/elsewhere"}],
            "imagePullSecrets": [{"name": "registry"}],
        }));
        let job = generation_job(&run.0, &settings(), 1, &[0], false).unwrap();
        let pod = pod(&job);
        let container = &pod.containers[0];
        assert_eq!(
            container.image.as_deref(),
            Some("registry.local/worker:1.2")
        );
        let requests = container
            .resources
            .as_ref()
            .unwrap()
            .requests
            .as_ref()
            .unwrap();
        assert_eq!(requests["cpu"].0, "2");
        assert_eq!(pod.node_selector.as_ref().unwrap()["pool"], "cpu");
        assert_eq!(
            pod.tolerations.as_ref().unwrap()[0].key.as_deref(),
            Some("spot")
        );
        assert!(pod.affinity.as_ref().unwrap().node_affinity.is_some());
        assert_eq!(pod.service_account_name.as_deref(), Some("trajectories"));
        assert_eq!(pod.priority_class_name.as_deref(), Some("batch-low"));
        assert_eq!(pod.image_pull_secrets.as_ref().unwrap()[0].name, "registry");
        assert_eq!(
            env_value(&job, "HTTPS_PROXY").unwrap().value.as_deref(),
            Some("http://proxy:3128")
        );
        // The contract's variables come last, so they win over a user's.
        assert_eq!(
            env_value(&job, env::STORAGE_ROOT).unwrap().value.as_deref(),
            Some(paths::STORAGE_ROOT)
        );

        let default = generation_job(&Fixture::new().0, &settings(), 1, &[0], false).unwrap();
        assert_eq!(
            default
                .spec
                .as_ref()
                .unwrap()
                .template
                .spec
                .as_ref()
                .unwrap()
                .containers[0]
                .image
                .as_deref(),
            Some(settings().worker_image.as_str())
        );
    }

    #[test]
    fn a_malformed_quantity_in_the_pod_template_is_refused_naming_it() {
        let run = Fixture::new().with_pod_template(json!({
            "resources": {"requests": {"cpu": "500m", "memory": "4Gi"}, "limits": {"cpu": "plenty"}},
        }));
        let error = plan_job(&run.0, &settings(), false).unwrap_err();
        assert!(error.is_permanent());
        assert_eq!(
            error.to_string(),
            "spec.podTemplate.resources.limits.cpu: \"plenty\" is not a quantity (e.g. 500m, 2, 4Gi)"
        );
        for good in ["1", "0.5", "250m", "1e3", "128Mi", "+2"] {
            let run =
                Fixture::new().with_pod_template(json!({"resources": {"requests": {"cpu": good}}}));
            assert!(plan_job(&run.0, &settings(), false).is_ok(), "{good}");
        }
    }

    #[test]
    fn a_typo_in_the_pod_template_is_refused() {
        let run = Fixture::new().with_pod_template(json!({"nodeSelectors": {"pool": "cpu"}}));
        let error = plan_job(&run.0, &settings(), false).unwrap_err();
        assert_eq!(error.label(), "InvalidPodTemplate");
        assert!(error.to_string().contains("nodeSelectors"), "{error}");
    }

    #[test]
    fn empty_pending_list_makes_no_generation_job() {
        let error = generation_job(&Fixture::new().0, &settings(), 1, &[], false).unwrap_err();
        assert_eq!(error.label(), "NothingPending");
    }

    fn job_with(completed: Option<&str>, failed: Option<&str>) -> Job {
        Job {
            metadata: ObjectMeta {
                name: Some("coding-v1-gen-2".into()),
                ..ObjectMeta::default()
            },
            spec: None,
            status: Some(JobStatus {
                completed_indexes: completed.map(str::to_owned),
                failed_indexes: failed.map(str::to_owned),
                ..JobStatus::default()
            }),
        }
    }

    #[test]
    fn job_indexes_map_back_to_batch_ids_through_the_pending_list() {
        let set = |ids: &[u32]| ids.iter().copied().collect::<BTreeSet<u32>>();
        let identity: Vec<u32> = (0..6).collect();
        let later = [2, 5, 7, 8, 11];
        let cases: [IndexCase; 5] = [
            (&identity, None, None, &[], &[]),
            (&identity, Some("0-2,4"), Some("5"), &[0, 1, 2, 4], &[5]),
            (&later, Some("0-1,3"), None, &[2, 5, 8], &[]),
            (&later, Some("4"), Some("0,2"), &[11], &[2, 7]),
            (&later, Some(""), Some(""), &[], &[]),
        ];
        for (pending, completed, failed, want_completed, want_failed) in cases {
            let outcome = attempt_outcome(&job_with(completed, failed), pending).unwrap();
            assert_eq!(outcome.completed, set(want_completed), "{completed:?}");
            assert_eq!(outcome.failed, set(want_failed), "{failed:?}");
        }
    }

    #[test]
    fn indexes_beyond_the_pending_list_or_unreadable_are_errors() {
        let error = attempt_outcome(&job_with(Some("0-5"), None), &[1, 2]).unwrap_err();
        assert_eq!(error.label(), "IndexOutOfRange");
        assert!(error.to_string().contains("index 2"), "{error}");
        let error = attempt_outcome(&job_with(Some("x"), None), &[1, 2]).unwrap_err();
        assert_eq!(error.label(), "BadIndexes");
    }

    #[test]
    fn batch_counts_use_compact_ranges_and_progress_counts_done_batches() {
        let done: BTreeSet<u32> = (0..=41).chain([44]).collect();
        let failed: BTreeSet<u32> = [42, 44, 50].into();
        let counts = batch_counts(120, &done, &failed);
        assert_eq!(counts.total, 120);
        assert_eq!(counts.completed, "0-41,44");
        // A batch that failed in one attempt and finished in a later one is not failed.
        assert_eq!(counts.failed, "42,50");
        assert_eq!(progress(&done, 120), "43/120");
        assert_eq!(
            batch_counts(3, &BTreeSet::new(), &BTreeSet::new()).completed,
            ""
        );
    }

    #[test]
    fn pending_batches_skip_the_done_ones() {
        let done: BTreeSet<u32> = [0, 1, 3].into();
        assert_eq!(pending_batches(6, &done), [2, 4, 5]);
        assert_eq!(pending_batches(2, &[0, 1].into()), Vec::<u32>::new());
        assert_eq!(pending_batches(3, &BTreeSet::new()), [0, 1, 2]);
    }

    #[test]
    fn conditions_keep_their_transition_time_while_the_status_holds() {
        let t0 = Time(Timestamp::from_second(1_000).unwrap());
        let t1 = Time(Timestamp::from_second(2_000).unwrap());
        let t2 = Time(Timestamp::from_second(3_000).unwrap());
        let mut conditions = Vec::new();
        let progressing = ConditionType::Progressing;

        assert!(set_condition(
            &mut conditions,
            progressing,
            true,
            Reason::Planning,
            "planning",
            Some(1),
            &t0
        ));
        assert_eq!(conditions[0].last_transition_time, t0);

        // Same status, new reason: updated in place, transition time kept.
        assert!(set_condition(
            &mut conditions,
            progressing,
            true,
            Reason::Generating,
            "2/10 batches",
            Some(1),
            &t1
        ));
        assert_eq!(conditions[0].last_transition_time, t0);
        assert_eq!(conditions[0].reason, "Generating");

        // Nothing new: no change reported, so no status write.
        assert!(!set_condition(
            &mut conditions,
            progressing,
            true,
            Reason::Generating,
            "2/10 batches",
            Some(1),
            &t2
        ));

        // The status flips: the transition time moves.
        assert!(set_condition(
            &mut conditions,
            progressing,
            false,
            Reason::Succeeded,
            "done",
            Some(2),
            &t2
        ));
        assert_eq!(conditions[0].last_transition_time, t2);
        assert_eq!(conditions[0].status, "False");
        assert_eq!(conditions[0].observed_generation, Some(2));

        // Another type is a separate entry.
        assert!(set_condition(
            &mut conditions,
            ConditionType::Succeeded,
            true,
            Reason::Succeeded,
            "done",
            Some(2),
            &t2
        ));
        let types: Vec<_> = conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Progressing", "Succeeded"]);
    }
}
