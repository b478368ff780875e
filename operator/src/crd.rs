//! The `CustomResourceDefinition` of [`TrajectoryRun`], generated from the Rust types, and the
//! `ValidatingAdmissionPolicy` (with its binding) for what a CRD schema cannot check.
//!
//! `crds/trajectories.dev_trajectoryruns.yaml` is this output (three YAML documents), written by
//! `cargo run -p trajectory-operator -- crd > crds/trajectories.dev_trajectoryruns.yaml`; a test
//! fails when the file drifts from the types.
//!
//! Why a policy: `spec.distribution` is either a name or a map of toolset to percent. A structural
//! schema cannot type a "string or object" field, so it is untyped, and the API server refuses CEL
//! rules on untyped fields. An admission policy sees the object untyped (`dyn`) and can check it.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSON,
};
use kube::CustomResourceExt;
use serde_json::json;

use crate::api::TrajectoryRun;

/// Path of the generated file, relative to the repository root.
pub const CRD_FILE: &str = "crds/trajectories.dev_trajectoryruns.yaml";

/// The command that regenerates [`CRD_FILE`].
pub const REGENERATE: &str =
    "cargo run -p trajectory-operator -- crd > crds/trajectories.dev_trajectoryruns.yaml";

/// Name of the CRD, and of the admission policy and its binding.
pub const NAME: &str = "trajectoryruns.trajectories.dev";

/// The CRD object.
///
/// Its `status` defaults to `{observedGeneration: -1}`, as Flux's own CRDs do: a run the operator
/// has not seen yet then reads "in progress" to kstatus (Flux's health checks, `kubectl wait`),
/// where a run without a status would read "current" and pass a health check before any work.
pub fn definition() -> CustomResourceDefinition {
    let mut crd = TrajectoryRun::crd();
    for version in &mut crd.spec.versions {
        let status = version
            .schema
            .as_mut()
            .and_then(|schema| schema.open_api_v3_schema.as_mut())
            .and_then(|schema| schema.properties.as_mut())
            .and_then(|properties| properties.get_mut("status"));
        if let Some(status) = status {
            status.default = Some(JSON(json!({ "observedGeneration": -1 })));
        }
    }
    crd
}

/// The admission policy for the rules the CRD schema cannot hold (see the module docs).
pub fn policy() -> ValidatingAdmissionPolicy {
    let distribution = "object.spec.distribution";
    let percent_map = format!(
        "type({distribution}) == map && {distribution}.size() > 0 && {distribution}.all(k, \
         double({distribution}[k]) >= 0.0 && double({distribution}[k]) <= 100.0)"
    );
    let immutable = |field: &str| {
        let (new, old) = (
            format!("object.spec.{field}"),
            format!("oldObject.spec.{field}"),
        );
        let (leaf, parent_new, parent_old) = match field.rsplit_once('.') {
            Some((parent, leaf)) => (
                leaf.to_owned(),
                format!("object.spec.{parent}"),
                format!("oldObject.spec.{parent}"),
            ),
            None => (
                field.to_owned(),
                "object.spec".to_owned(),
                "oldObject.spec".to_owned(),
            ),
        };
        json!({
            "expression": format!(
                "request.operation != 'UPDATE' || \
                 (has({parent_new}.{leaf}) ? has({parent_old}.{leaf}) && {new} == {old} : !has({parent_old}.{leaf}))"
            ),
            "message": format!(
                "spec.{field} is immutable: it defines what the run generates; create a new TrajectoryRun to change it"
            ),
            "reason": "Invalid",
        })
    };
    // The manifest is a literal of known-good shape; the unit test below checks it deserialises.
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": { "name": NAME },
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": { "resourceRules": [{
                "apiGroups": ["trajectories.dev"],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["trajectoryruns"],
            }]},
            "validations": [
                {
                    "expression": format!(
                        "!has({distribution}) || type({distribution}) == string || ({percent_map})"
                    ),
                    "message": "spec.distribution must be the name of a distribution or a map of \
                                toolset name to percent between 0 and 100",
                    "reason": "Invalid",
                },
                immutable("distribution"),
                immutable("model.extraBody"),
            ],
        },
    }))
    .expect("the admission policy literal matches the ValidatingAdmissionPolicy type")
}

/// Binds [`policy`] to every namespace, refusing what it denies.
pub fn policy_binding() -> ValidatingAdmissionPolicyBinding {
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": { "name": NAME },
        "spec": { "policyName": NAME, "validationActions": ["Deny"] },
    }))
    .expect("the binding literal matches the ValidatingAdmissionPolicyBinding type")
}

/// The CRD, the policy and its binding as one YAML stream, with a header saying it is generated.
pub fn yaml() -> String {
    // Serialising plain Kubernetes objects (maps, strings, numbers) to YAML cannot fail.
    let documents = [
        serde_yaml::to_string(&definition()),
        serde_yaml::to_string(&policy()),
        serde_yaml::to_string(&policy_binding()),
    ]
    .map(|document| document.expect("Kubernetes objects serialise to YAML"));
    format!(
        "# Generated by `trajectory-operator crd`; do not edit. Regenerate with:\n#   {REGENERATE}\n---\n{}",
        documents.join("---\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crd_file_matches_the_types() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../crds/trajectories.dev_trajectoryruns.yaml"
        );
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            on_disk == yaml(),
            "{CRD_FILE} is out of date with the Rust types; regenerate it with:\n  {REGENERATE}"
        );
    }

    #[test]
    fn crd_has_names_columns_and_status() {
        let crd = definition();
        assert_eq!(crd.metadata.name.as_deref(), Some(NAME));
        assert_eq!(crd.spec.names.short_names, Some(vec!["trun".to_owned()]));
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        let columns: Vec<_> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            columns,
            ["Phase", "Progress", "Trajectories", "Passed", "Cost", "Age"]
        );
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
    }

    #[test]
    fn every_spec_field_is_documented() {
        fn undocumented(path: &str, schema: &serde_json::Value, out: &mut Vec<String>) {
            if let Some(properties) = schema.get("properties").and_then(|p| p.as_object()) {
                for (name, property) in properties {
                    let path = format!("{path}.{name}");
                    if property.get("description").is_none() {
                        out.push(path.clone());
                    }
                    undocumented(&path, property, out);
                }
            }
        }
        let crd = serde_json::to_value(definition()).unwrap();
        let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"];
        let mut missing = Vec::new();
        undocumented("spec", &schema["spec"], &mut missing);
        undocumented("status", &schema["status"], &mut missing);
        assert!(
            missing.is_empty(),
            "fields without a doc comment: {missing:?}"
        );
    }

    #[test]
    fn schema_uses_only_formats_kubernetes_knows() {
        let text = serde_json::to_string(&definition()).unwrap();
        assert!(!text.contains("\"format\":\"uint"), "{text}");
    }
}
