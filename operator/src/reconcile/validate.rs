//! Validate: check a run's spec once, into a [`ValidatedRun`] that carries everything the builders
//! need already parsed (pod overrides, the data volume, the owner reference, the output path), so
//! that building children cannot fail on spec grounds.
//!
//! Two kinds of bad spec end differently, as they always have:
//! - a spec that breaks its own rules ([`RunSpec::validate`], the rules the CRD's schema also
//!   states, met by a run stored before the schema had them) is a [`Validation::Refused`] run: a
//!   decision like any other, the run fails with reason `InvalidSpec`;
//! - a spec the operator cannot turn into children (no volume, a pod template with a typo, a name
//!   too long for its children) is an [`Invalid`] error: permanent, the run stalls until it changes.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, ResourceRequirements, Toleration, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};
use regex::Regex;
use serde::Deserialize;
use trajectory_worker::spec::RunSpec;

use super::children::{ATTEMPT_DIGITS, Component, MAX_NAME_LENGTH, MAX_RUN_NAME_LENGTH};
use crate::api::{TrajectoryRun, TrajectoryRunStatus};

/// Volume name of the shared storage inside a worker pod.
pub const DATA_VOLUME: &str = "data";

/// Why the operator cannot build the children of a run.
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
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
        "spec.storage.volume or spec.storage.object is required on a cluster: a volume every pod of the run can mount, e.g. {{persistentVolumeClaim: {{claimName: trajectories}}}} on a ReadWriteMany claim, or a bucket, e.g. {{url: s3://my-bucket/trajectories}}"
    )]
    MissingVolume,
    #[error("spec.storage.volume is not a Kubernetes volume source: {0}")]
    InvalidVolume(#[source] serde_json::Error),
    #[error("spec.podTemplate is invalid: {0}")]
    InvalidPodTemplate(#[source] serde_json::Error),
    #[error("{field} is not a container's resources (requests, limits): {err}")]
    InvalidResources {
        field: &'static str,
        #[source]
        err: serde_json::Error,
    },
    #[error("{field}: {value:?} is not a quantity (e.g. 500m, 2, 4Gi)")]
    InvalidQuantity { field: String, value: String },
}

impl Invalid {
    /// True when nothing but a change of the run can fix it. A run without a uid was not read from
    /// the API server: the next read has one.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, Self::NotStored)
    }

    /// A short label for logs and tests.
    pub fn label(&self) -> &'static str {
        match self {
            Self::NameTooLong { .. } => "NameTooLong",
            Self::NotStored => "NotStored",
            Self::MissingVolume => "MissingVolume",
            Self::InvalidVolume(_) => "InvalidVolume",
            Self::InvalidPodTemplate(_) | Self::InvalidQuantity { .. } => "InvalidPodTemplate",
            Self::InvalidResources {
                field: "spec.sandbox.resources",
                ..
            } => "InvalidSandboxResources",
            Self::InvalidResources { .. } => "InvalidBuildResources",
        }
    }
}

/// The outcome of validating a run whose children can be named and parsed.
#[derive(Debug)]
pub enum Validation<'a> {
    /// Everything the builders need, checked (boxed: the pod overrides make it large).
    Valid(Box<ValidatedRun<'a>>),
    /// The spec breaks its own rules; the message names every field.
    Refused(String),
}

/// A run whose spec was checked: the builders take it and cannot fail.
#[derive(Debug, Clone)]
pub struct ValidatedRun<'a> {
    pub run: &'a TrajectoryRun,
    pub spec: &'a RunSpec,
    pub name: String,
    pub namespace: String,
    pub uid: String,
    /// The controller reference every child carries.
    pub owner: OwnerReference,
    /// `spec.podTemplate`, parsed.
    pub overrides: PodOverrides,
    /// `spec.sandbox.resources`, parsed: the sandbox container's.
    pub sandbox_resources: Option<ResourceRequirements>,
    /// `spec.sandbox.builds.resources`, parsed: a build container's.
    pub build_resources: Option<ResourceRequirements>,
    /// `spec.storage.volume` as the pod's `data` volume; none when the run is on a bucket
    /// (`spec.storage.object`, which the pods read from their plan).
    pub data_volume: Option<Volume>,
    /// The output directory relative to the storage volume.
    pub output_path: String,
    /// Only [`validate`] makes a `ValidatedRun`.
    _checked: Checked,
}

/// Private: the proof that a [`ValidatedRun`] came from [`validate`].
#[derive(Debug, Clone, Copy)]
struct Checked;

impl ValidatedRun<'_> {
    /// The name of the child serving `component`; it fits, as validation checked.
    pub fn child_name(&self, component: Component) -> String {
        component.child_name(&self.name)
    }

    /// What the run's status showed before this reconcile.
    pub fn status(&self) -> Option<&TrajectoryRunStatus> {
        self.run.status.as_ref()
    }
}

/// Checks `run` once for everything its children need.
pub fn validate(run: &TrajectoryRun) -> Result<Validation<'_>, Invalid> {
    let spec = &run.spec.run;
    let violations = spec.validate();
    if !violations.is_empty() {
        let message = violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        return Ok(Validation::Refused(message));
    }
    let name = run.name_any();
    check_name(&name)?;
    // Blocking, as the built-in controllers' references are: a foreground deletion of the run
    // (`kubectl delete --cascade=foreground`, a GitOps prune) ends only once its Jobs and
    // ConfigMaps are gone, so a run re-created under the same name never meets them.
    let owner = OwnerReference {
        block_owner_deletion: Some(true),
        ..run.controller_owner_ref(&()).ok_or(Invalid::NotStored)?
    };
    let namespace = run.namespace().ok_or(Invalid::NotStored)?;
    let uid = run.uid().ok_or(Invalid::NotStored)?;
    let overrides = PodOverrides::from_spec(spec)?;
    let sandbox_resources = resources(spec.sandbox.resources.as_ref(), "spec.sandbox.resources")?;
    let build_resources = resources(
        spec.sandbox
            .builds
            .as_ref()
            .and_then(|builds| builds.resources.as_ref()),
        "spec.sandbox.builds.resources",
    )?;
    let data_volume = data_volume(spec)?;
    Ok(Validation::Valid(Box::new(ValidatedRun {
        run,
        spec,
        output_path: spec.output_path(&namespace, &name),
        name,
        namespace,
        uid,
        owner,
        overrides,
        sandbox_resources,
        build_resources,
        data_volume,
        _checked: Checked,
    })))
}

/// Every child's name must fit in [`MAX_NAME_LENGTH`], with room for any attempt number.
fn check_name(name: &str) -> Result<(), Invalid> {
    if name.len() <= MAX_RUN_NAME_LENGTH {
        return Ok(());
    }
    Err(Invalid::NameTooLong {
        name: name.to_owned(),
        child: format!("{name}-gen-{}", "1".repeat(ATTEMPT_DIGITS)),
        max: MAX_RUN_NAME_LENGTH,
    })
}

fn data_volume(spec: &RunSpec) -> Result<Option<Volume>, Invalid> {
    if spec.storage.object.is_some() {
        // Validated with the spec: never together with a volume.
        return Ok(None);
    }
    let source = spec.storage.volume.clone().ok_or(Invalid::MissingVolume)?;
    let mut volume: Volume = serde_json::from_value(source).map_err(Invalid::InvalidVolume)?;
    DATA_VOLUME.clone_into(&mut volume.name);
    Ok(Some(volume))
}

/// A container's resources from the spec's `field`. Only `requests` and `limits`: an unknown key
/// (a typo, `limit`) is refused rather than silently leaving the container unlimited.
fn resources(
    value: Option<&serde_json::Value>,
    field: &'static str,
) -> Result<Option<ResourceRequirements>, Invalid> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Known {
        #[serde(rename = "requests")]
        _requests: Option<serde_json::Value>,
        #[serde(rename = "limits")]
        _limits: Option<serde_json::Value>,
    }
    let Some(value) = value else {
        return Ok(None);
    };
    let invalid = |err| Invalid::InvalidResources { field, err };
    serde_json::from_value::<Known>(value.clone()).map_err(invalid)?;
    let resources: ResourceRequirements = serde_json::from_value(value.clone()).map_err(invalid)?;
    check_quantities(&resources, field)?;
    Ok(Some(resources))
}

/// The API server answers a Job with a malformed quantity with 500 Internal Server Error (it
/// fails converting the applied object), which looks transient; checked here, it is a bad spec
/// that names its field (`prefix`.requests.cpu).
fn check_quantities(resources: &ResourceRequirements, prefix: &str) -> Result<(), Invalid> {
    static QUANTITY: LazyLock<Regex> = LazyLock::new(|| {
        // The API server's own pattern (k8s.io/apimachinery resource.Quantity).
        Regex::new(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$").expect("a valid pattern")
    });
    for (kind, quantities) in [
        ("requests", &resources.requests),
        ("limits", &resources.limits),
    ] {
        for (name, quantity) in quantities.iter().flatten() {
            if !QUANTITY.is_match(&quantity.0) {
                return Err(Invalid::InvalidQuantity {
                    field: format!("{prefix}.{kind}.{name}"),
                    value: quantity.0.clone(),
                });
            }
        }
    }
    Ok(())
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
    /// Annotations of the pods (e.g. `karpenter.sh/do-not-disrupt: "true"`, which keeps an
    /// autoscaler from consolidating a node while a batch runs on it).
    pub annotations: Option<BTreeMap<String, String>>,
    /// How long a stopped pod (a drained node, a preemption) has to finish its conversations in
    /// flight after `SIGTERM`, before they are killed and redone elsewhere.
    pub termination_grace_period_seconds: Option<u32>,
}

impl PodOverrides {
    pub fn from_spec(spec: &RunSpec) -> Result<Self, Invalid> {
        let overrides: Self = spec.pod_template.as_ref().map_or_else(
            || Ok(Self::default()),
            |value| serde_json::from_value(value.clone()).map_err(Invalid::InvalidPodTemplate),
        )?;
        overrides.check_quantities()?;
        Ok(overrides)
    }

    fn check_quantities(&self) -> Result<(), Invalid> {
        match &self.resources {
            Some(resources) => check_quantities(resources, "spec.podTemplate.resources"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn invalid(run: &TrajectoryRun) -> Invalid {
        validate(run).expect_err("the run is invalid")
    }

    #[test]
    fn run_name_too_long_for_its_children_is_a_permanent_error() {
        let longest = "r".repeat(MAX_NAME_LENGTH - "-gen-".len() - ATTEMPT_DIGITS);
        assert!(validate(&TrajectoryRun::test().named(&longest).build()).is_ok());
        let too_long = format!("{longest}x");
        let error = invalid(&TrajectoryRun::test().named(&too_long).build());
        assert!(error.is_permanent());
        assert!(
            error.to_string().contains("at most 55 characters"),
            "{error}"
        );
        assert_eq!(error.label(), "NameTooLong");
    }

    #[test]
    fn sandbox_resources_must_be_a_containers_resources_with_quantities() {
        let with = |resources: serde_json::Value| {
            TrajectoryRun::test()
                .with(|spec| spec.sandbox.resources = Some(resources))
                .build()
        };
        assert!(validate(&with(json!({"limits": {"memory": "2Gi"}}))).is_ok());
        let typo = invalid(&with(json!({"limit": {"memory": "2Gi"}})));
        assert_eq!(typo.label(), "InvalidSandboxResources");
        assert!(typo.is_permanent());
        let bad = invalid(&with(json!({"limits": {"memory": "lots"}})));
        assert_eq!(
            bad.to_string(),
            "spec.sandbox.resources.limits.memory: \"lots\" is not a quantity (e.g. 500m, 2, 4Gi)"
        );
    }

    #[test]
    fn storage_volume_is_required_and_must_be_a_volume_source() {
        let error = invalid(
            &TrajectoryRun::test()
                .with(|spec| spec.storage.volume = None)
                .build(),
        );
        assert_eq!(error.label(), "MissingVolume");
        assert!(error.is_permanent());
        let bad = TrajectoryRun::test()
            .with(|spec| spec.storage.volume = Some(json!({"hostPath": 7})))
            .build();
        assert_eq!(invalid(&bad).label(), "InvalidVolume");

        let on_a_bucket = TrajectoryRun::test()
            .with(|spec| {
                spec.storage.volume = None;
                spec.storage.object = Some(trajectory_worker::spec::ObjectStorageSpec {
                    url: "s3://trajectories".into(),
                    ..Default::default()
                });
            })
            .build();
        let Ok(Validation::Valid(valid)) = validate(&on_a_bucket) else {
            panic!("a run on a bucket needs no volume");
        };
        assert!(valid.data_volume.is_none());
    }

    #[test]
    fn a_malformed_quantity_in_the_pod_template_is_refused_naming_it() {
        let run = TrajectoryRun::test()
            .with_pod_template(json!({
                "resources": {"requests": {"cpu": "500m", "memory": "4Gi"}, "limits": {"cpu": "plenty"}},
            }))
            .build();
        let error = invalid(&run);
        assert!(error.is_permanent());
        assert_eq!(
            error.to_string(),
            "spec.podTemplate.resources.limits.cpu: \"plenty\" is not a quantity (e.g. 500m, 2, 4Gi)"
        );
        for good in ["1", "0.5", "250m", "1e3", "128Mi", "+2"] {
            let run = TrajectoryRun::test()
                .with_pod_template(json!({"resources": {"requests": {"cpu": good}}}))
                .build();
            assert!(validate(&run).is_ok(), "{good}");
        }
    }

    #[test]
    fn a_negative_termination_grace_is_refused_naming_it() {
        let run = TrajectoryRun::test()
            .with_pod_template(json!({"terminationGracePeriodSeconds": -1}))
            .build();
        let error = invalid(&run).to_string();
        assert!(error.starts_with("spec.podTemplate is invalid"), "{error}");
        assert!(error.contains("-1"), "{error}");
    }

    #[test]
    fn a_typo_in_the_pod_template_is_refused() {
        let run = TrajectoryRun::test()
            .with_pod_template(json!({"nodeSelectors": {"pool": "cpu"}}))
            .build();
        let error = invalid(&run);
        assert_eq!(error.label(), "InvalidPodTemplate");
        assert!(error.to_string().contains("nodeSelectors"), "{error}");
    }

    #[test]
    fn a_run_not_read_from_the_api_server_has_no_children() {
        let error = invalid(&TrajectoryRun::test().without_uid().build());
        assert_eq!(error.label(), "NotStored");
        assert!(!error.is_permanent());
    }

    #[test]
    fn a_spec_that_breaks_its_own_rules_is_refused_naming_the_field() {
        let run = TrajectoryRun::test()
            .with(|spec| spec.batch_size = 0)
            .build();
        let Ok(Validation::Refused(message)) = validate(&run) else {
            panic!("a batch size of 0 is refused");
        };
        assert!(message.contains("spec.batchSize"), "{message}");
    }

    #[test]
    fn a_valid_run_carries_its_parsed_children_settings() {
        let run = TrajectoryRun::test()
            .with_pod_template(json!({"nodeSelector": {"pool": "cpu"}}))
            .build();
        let Ok(Validation::Valid(valid)) = validate(&run) else {
            panic!("the fixture is valid");
        };
        assert_eq!(valid.name, "coding-v1");
        assert_eq!(valid.output_path, "runs/research/coding-v1");
        assert_eq!(valid.data_volume.as_ref().unwrap().name, DATA_VOLUME);
        assert_eq!(
            valid
                .overrides
                .node_selector
                .as_ref()
                .map(|s| s["pool"].as_str()),
            Some("cpu")
        );
        assert_eq!(valid.owner.block_owner_deletion, Some(true));
        assert_eq!(valid.owner.controller, Some(true));
    }
}
