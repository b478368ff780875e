//! The generated CRD file installed on the test cluster.

use std::time::Duration;

use crate::wait_for_object;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::wait::conditions;
use kube::{Api, Client};
use serde::Deserialize;
use tokio::sync::OnceCell;
use trajectory_operator::crd;

const FIELD_MANAGER: &str = "trajectory-tests";

/// Applies every document of the generated file (server-side apply), once per test binary, and waits
/// until the CRD is Established and the admission policy refuses a bad run.
pub async fn install_crds(client: &Client) {
    static INSTALLED: OnceCell<()> = OnceCell::const_new();
    INSTALLED
        .get_or_init(|| async {
            let path = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../",
                "crds/trajectories.dev_trajectoryruns.yaml"
            );
            let text = std::fs::read_to_string(path).expect("read the generated CRD file");
            for document in serde_yaml::Deserializer::from_str(&text) {
                let object = DynamicObject::deserialize(document).expect("a Kubernetes object");
                let types = object.types.clone().expect("apiVersion and kind");
                let gvk = GroupVersionKind::try_from(&types).expect("a valid apiVersion");
                let api: Api<DynamicObject> =
                    Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk));
                let name = object.metadata.name.clone().expect("a named object");
                api.patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&object),
                )
                .await
                .unwrap_or_else(|e| panic!("applying {} {name}: {e}", types.kind));
            }
            let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
            wait_for_object(
                &crds,
                crd::NAME,
                "Established",
                Duration::from_secs(30),
                conditions::is_crd_established(),
            )
            .await;
        })
        .await;
}
