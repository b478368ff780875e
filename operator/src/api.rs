//! The `TrajectoryRun` API (`trajectories.dev/v1alpha1`): the custom resource a researcher applies.
//!
//! The spec *is* the worker's [`RunSpec`] (one definition for the run file and the resource); this
//! module wraps it for kube's derive and adds what only the API server can enforce: bounds, CEL rules
//! with messages a user understands, and immutability of the fields that define what is generated.
//! Those rules are one table ([`spec_validations`]) so that a reader sees every rule in one place.
//!
//! The status is small by design: counts, ranges and conditions. Per-batch details and statistics
//! live on storage.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use trajectory_worker::spec::RunSpec;

/// A run that generates tool-using agent trajectories from a JSONL dataset of prompts.
///
/// The operator plans the run, works its batches in an Indexed Job (one completion index per batch),
/// and merges the batch files into one `trajectories.jsonl` on the storage volume.
// Several `printcolumn(..., type_ = "string", ...)` look like duplicated attributes to clippy.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "trajectories.dev",
    version = "v1alpha1",
    kind = "TrajectoryRun",
    namespaced,
    shortname = "trun",
    category = "trajectories",
    status = "TrajectoryRunStatus",
    derive = "PartialEq",
    doc = "A run that generates tool-using agent trajectories from a JSONL dataset of prompts.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Progress", type_ = "string", json_path = ".status.progress"),
    printcolumn(
        name = "Trajectories",
        type_ = "integer",
        json_path = ".status.output.trajectories"
    ),
    printcolumn(
        name = "Passed",
        type_ = "integer",
        json_path = ".status.verification.passed"
    ),
    printcolumn(name = "Cost", type_ = "string", json_path = ".status.cost.spent"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = spec_validations)]
pub struct TrajectoryRunSpec {
    /// The run spec shared with the worker's run files (`trajectory-worker local run.yaml`).
    #[serde(flatten)]
    pub run: RunSpec,
}

impl From<RunSpec> for TrajectoryRunSpec {
    fn from(run: RunSpec) -> Self {
        Self { run }
    }
}

/// Observed state of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = kubernetes_formats)]
pub struct TrajectoryRunStatus {
    /// The `metadata.generation` of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Standard conditions: `Ready`, `Progressing`, `Succeeded`, `Failed`, `Suspended`, the
    /// kstatus pair `Reconciling` / `Stalled`, and `Admitted` for a run naming a Kueue queue.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Where the run is, for humans: Pending, Planning, Running, Merging, Succeeded or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Prompt counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompts: Option<PromptCounts>,
    /// Batch counts and the ids of finished batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<BatchCounts>,
    /// Batches done out of all batches, e.g. `42/120`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// The round whose plan the batch counts come from: 1, or a later round started when a merge
    /// found batches incomplete and reopened them (absent: the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_round: Option<u32>,
    /// The generation attempt in progress (1 for the first Indexed Job, 2 for the one that re-runs
    /// the batches the first left undone, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// When the operator started the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the run succeeded or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// The merged output, once the merge Job succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<OutputStatus>,
    /// How the model's commands were confined, as the first generation pod that finished saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxStatus>,
    /// The container images the dataset's rows name (`image`, else `docker_image`), when they
    /// name any: each image's batches run in task containers of it, one a conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<ImageStatus>,
    /// What the rows' verifiers found, once the merge counted the kept records; absent when no
    /// record was verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<VerificationStatus>,
    /// What the run's model calls cost: so far and projected while its batches run, in all once
    /// merged; absent when the run has no prices (`spec.model.pricing`) and the provider reported
    /// no cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<CostStatus>,
}

/// What a run's model calls cost.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CostStatus {
    /// USD spent on the model so far, a decimal string of at most eight places (`"12.345"`):
    /// while batches run, what the run's pods had spent when the latest batch pod finished (as
    /// their claims on storage say); once merged, what the whole run spent, conversations without
    /// a record included (or, for runs whose pods kept no claims, what the kept records cost).
    pub spent: String,
    /// While batches run: what the whole run will have spent at the rate so far (`spent` over
    /// the share of batches done).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projected: Option<String>,
    /// Always `USD`.
    pub currency: String,
    /// While the run is held at its budget: the `spec.model.budget.maxCost` (USD) its pods
    /// found spent. The hold lasts while `maxCost` is not above it, after the pods that said so
    /// are gone; raising `maxCost` lets the run go on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exhausted_budget: Option<String>,
}

/// Verified records of a merged run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VerificationStatus {
    /// Kept records whose row's verifier ran: trajectories, and conversations `minReward`
    /// discarded.
    pub verified: u64,
    /// Of those, the ones whose reward reached `spec.verifier.passingReward`.
    pub passed: u64,
}

/// The images of the rows' own task containers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageStatus {
    /// Distinct images of the batches the round's plan found pending.
    pub total: u32,
    /// Images pulled and run: some batch of theirs is done.
    pub pulled: u32,
    /// Images that could not be pulled: every conversation of their rows is recorded failed with
    /// reason `image_unavailable`, without a model request.
    pub unavailable: u32,
    /// The first of them (up to 10), with the node's message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unavailable_images: Vec<UnavailableImage>,
    /// The images the run builds (`spec.sandbox.builds`), once their builds reported. Those that
    /// failed count as unavailable too, listed with the builder's message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builds: Option<BuildStatus>,
    /// What the generation pods waited for their images, counted as the status records the batch
    /// each finished (the report shows it per image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pulls: Option<PullStatus>,
}

/// The share of the generation pods' time spent waiting for image pulls. Each pod's worker
/// measures it on its node: from the run's sandbox container's start to the first task
/// container's (the task image's pull, nothing when the node held it, and one container's
/// start), and from the sandbox's start to the batch's end. Pods that stopped before their batch
/// ended are not counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PullStatus {
    /// Pods counted.
    pub pods: u64,
    /// Their time waiting for pulls, in milliseconds.
    pub pull_millis: u64,
    /// Their time from the sandbox's start to the batch's end, in milliseconds.
    pub pod_millis: u64,
    /// `pullMillis` as a share of `podMillis`, in percent with one decimal (`"12.5%"`).
    pub pull_share: String,
    /// The longest waits of single pods (up to 5), longest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub longest: Vec<ImagePull>,
}

/// One pod's wait for its image.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImagePull {
    /// The image, as the rows name it.
    pub image: String,
    /// The pod's wait for its pull, in milliseconds.
    pub pull_millis: u64,
}

/// How the builds of the round's images went.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BuildStatus {
    /// Built and pushed by the round's build Job.
    pub built: u32,
    /// Found in the registry (built before, by this run or another): not built again.
    pub reused: u32,
    /// Whose build failed: their rows are recorded failed with reason `image_build_failed`,
    /// without a model request.
    pub failed: u32,
}

/// An image that could not be pulled.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UnavailableImage {
    /// The image, as the rows name it.
    pub image: String,
    /// The image as pulled (after `spec.sandbox.imageRewrite`), the waiting reason and the
    /// node's message.
    pub message: String,
}

/// How the model's commands are confined where they run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    /// `Enforced`: Landlock confines each conversation's shell and jobs to its workspace.
    /// `NotEnforced`: the node's kernel (or the container runtime's seccomp profile) does not
    /// let Landlock work, and commands ran with the other layers only (`spec.sandbox.landlock:
    /// required` refuses to run so). `Off`: `spec.sandbox.landlock` is `off`.
    pub landlock: String,
}

/// The phase of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    /// Accepted; nothing started yet.
    Pending,
    /// The plan Job is validating the dataset and counting batches.
    Planning,
    /// An Indexed Job is working the batches.
    Running,
    /// The merge Job is writing `trajectories.jsonl`.
    Merging,
    /// The output is complete.
    Succeeded,
    /// The run stopped; the `Failed` condition says why.
    Failed,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Planning => "Planning",
            Self::Running => "Running",
            Self::Merging => "Merging",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
        }
    }

    /// True once nothing more will happen to the run.
    pub fn is_finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

/// Prompt counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PromptCounts {
    /// Valid prompts in the dataset (after `maxSamples`).
    pub total: u64,
    /// Prompts whose conversations were kept as trajectories.
    pub succeeded: u64,
    /// Prompts whose conversations were dropped by the filters.
    pub discarded: u64,
    /// Prompts whose conversations failed (listed in `failures.jsonl`).
    pub failed: u64,
    /// Dataset lines refused by the plan (listed in `invalid.jsonl`).
    pub invalid: u64,
}

/// Batch counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BatchCounts {
    /// Batches in the run.
    pub total: u32,
    /// Ids of the finished batches, as ranges in Kubernetes' `completedIndexes` format (`0-41,44`).
    /// Empty when the plan found the done batches too scattered to list (see `pendingList`):
    /// `completedCount` counts them then.
    #[serde(default)]
    pub completed: String,
    /// Ids of the batches that failed after their retries, in the same format (empty, likewise,
    /// with `pendingList`).
    #[serde(default)]
    pub failed: String,
    /// How many batches are finished (the Progress column's first number).
    #[serde(default)]
    pub completed_count: u32,
    /// How many batches failed after their retries and are not finished.
    #[serde(default)]
    pub failed_count: u32,
    /// Set when the plan found the batches done by an earlier run too scattered to list in its
    /// summary: it wrote the pending batches to this list on the storage volume instead, and the
    /// generation Jobs' completion indexes count positions in that list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_list: Option<PendingListStatus>,
}

/// The plan's list of pending batches on the storage volume.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PendingListStatus {
    /// Its path, relative to the run's output directory.
    pub path: String,
    /// How many batches it lists: those without a completion marker when the plan ran.
    pub batches: u32,
}

/// The merged output.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutputStatus {
    /// Output directory relative to the storage volume.
    pub path: String,
    /// Records in `trajectories.jsonl`.
    pub trajectories: u64,
    /// Size of `trajectories.jsonl` in bytes.
    pub bytes: u64,
    /// The run's report page (`report.html`: statistics, plots and a conversation browser),
    /// relative to the storage volume.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub report: String,
}

/// Condition types of a `TrajectoryRun`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConditionType {
    /// The run is complete and its output usable (kstatus' "Current" for a finished run).
    Ready,
    /// Work is under way.
    Progressing,
    /// The output is complete.
    Succeeded,
    /// The run stopped; the reason says why.
    Failed,
    /// `spec.suspend` is set; pods are stopped and finished batches stay finished.
    Suspended,
    /// kstatus: work is under way (planning, generating, merging); `False` once the run succeeded,
    /// failed or is suspended. Flux reads a run as in progress while it holds.
    Reconciling,
    /// kstatus: the run cannot make progress without a change.
    Stalled,
    /// A run naming a Kueue queue (`spec.queueName`): whether Kueue admitted its Jobs; the reason
    /// (`Admitted`, `Queued`, `Preempted`, `Evicted`, `Deactivated`) and message say where a Job
    /// waits and why.
    Admitted,
}

impl ConditionType {
    pub const ALL: [Self; 8] = [
        Self::Ready,
        Self::Progressing,
        Self::Succeeded,
        Self::Failed,
        Self::Suspended,
        Self::Reconciling,
        Self::Stalled,
        Self::Admitted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "Ready",
            Self::Progressing => "Progressing",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::Suspended => "Suspended",
            Self::Reconciling => "Reconciling",
            Self::Stalled => "Stalled",
            Self::Admitted => "Admitted",
        }
    }
}

/// What the API server enforces on the spec, beyond the types: bounds, CEL rules and immutability.
///
/// Applied as a schemars transform on the spec's schema. The spec types live in the worker crate,
/// which stays serde-only; keeping the rules here also keeps them in one table a reader can audit.
/// Immutable fields are those that define what is generated — the same fields the worker hashes
/// into the manifest's `specHash` — plus the output path; `workers`, `suspend`, `retry` and the
/// model server's address stay mutable.
fn spec_validations(schema: &mut schemars::Schema) {
    kubernetes_formats(schema);
    let Some(root) = schema.as_object_mut() else {
        return;
    };
    // `distribution` is a name or a map (an untagged enum). A structural schema cannot say "string
    // or object", so it is left untyped; CRD CEL rules cannot be compiled on an untyped field, so
    // its percent bounds and immutability are checked by the admission policy in `crd::policy`.
    let distribution = property(root, &["distribution"]);
    distribution.remove("anyOf");
    distribution.remove("type");
    distribution.insert("x-kubernetes-preserve-unknown-fields".into(), json!(true));

    let relative_path = |field: &str| {
        rule(
            "!self.startsWith('/') && !self.contains('//') && !self.matches('(^|/)[.][.](/|$)')",
            &format!(
                "{field} must be a path relative to the storage volume, without \"..\" or a leading \"/\""
            ),
        )
    };

    for (path, min) in [
        (&["batchSize"][..], 1),
        (&["workers"], 1),
        (&["concurrency"], 1),
        (&["samplesPerPrompt"], 1),
        (&["model", "requestTimeoutSeconds"], 1),
        (&["model", "maxAttempts"], 1),
        (&["agent", "maxTurns"], 1),
        (&["agent", "promptTimeoutSeconds"], 1),
        (&["tools", "terminal", "timeoutSeconds"], 1),
        (&["retry", "perBatch"], 0),
        (&["retry", "maxFailedBatches"], 0),
    ] {
        property(root, path).insert("minimum".into(), json!(min));
    }
    property(root, &["concurrency"]).insert("maximum".into(), json!(10_000));
    let temperature = property(root, &["model", "temperature"]);
    temperature.insert("minimum".into(), json!(0));
    temperature.insert("maximum".into(), json!(2));
    for path in [
        &["dataset", "path"][..],
        &["dataset", "promptField"],
        &["model", "name"],
    ] {
        property(root, path).insert("minLength".into(), json!(1));
    }

    add_rules(
        property(root, &["dataset", "path"]),
        [relative_path("dataset.path")],
    );
    add_rules(
        property(root, &["storage", "outputPath"]),
        [relative_path("storage.outputPath")],
    );
    add_rules(
        property(root, &["model"]),
        [rule(
            "(has(self.baseUrl) && self.baseUrl != '') != \
             (has(self.endpoints) && size(self.endpoints) > 0)",
            "model: set either baseUrl (one endpoint) or endpoints (several), one of them",
        )],
    );
    add_rules(
        property(root, &["model", "baseUrl"]),
        [rule(
            "self.startsWith('http://') || self.startsWith('https://')",
            "model.baseUrl must be an http:// or https:// URL",
        )],
    );

    // Fields that always exist after defaulting: `self == oldSelf` on the field itself.
    for (path, name) in [
        (&["dataset"][..], "dataset"),
        (&["batchSize"], "batchSize"),
        (&["seed"], "seed"),
        (&["samplesPerPrompt"], "samplesPerPrompt"),
        (&["model", "name"], "model.name"),
        (&["agent", "maxTurns"], "agent.maxTurns"),
        (&["tools", "terminal"], "tools.terminal"),
        (&["filters"], "filters"),
    ] {
        add_rules(property(root, path), [immutable("self == oldSelf", name)]);
    }
    // Optional fields: a transition rule on the parent, so that adding or removing one is refused
    // too (a rule on the field itself only runs when both old and new values exist).
    for (parent, fields, prefix) in [
        (
            &["model"][..],
            &["maxTokens", "temperature", "reasoning"][..],
            "model",
        ),
        (&["agent"], &["ephemeralSystemPrompt"], "agent"),
        (&["storage"], &["outputPath"], "storage"),
    ] {
        let rules = fields.iter().map(|field| {
            let mut rule = immutable(
                &format!(
                    "has(self.{field}) ? has(oldSelf.{field}) && self.{field} == oldSelf.{field} : !has(oldSelf.{field})"
                ),
                &format!("{prefix}.{field}"),
            );
            rule.insert("fieldPath".into(), json!(format!(".{field}")));
            rule
        });
        add_rules(property(root, parent), rules.collect::<Vec<_>>());
    }
}

/// The schema object of the property at `path` (by `properties`). Panics when the path does not
/// exist: the table above names fields of [`RunSpec`], and the CRD test catches a renamed one.
fn property<'a>(root: &'a mut Map<String, Value>, path: &[&str]) -> &'a mut Map<String, Value> {
    let mut node = root;
    for key in path {
        node = node
            .get_mut("properties")
            .and_then(|properties| properties.get_mut(*key))
            .and_then(Value::as_object_mut)
            .unwrap_or_else(|| panic!("the spec schema has no property {}", path.join(".")));
    }
    node
}

fn rule(rule: &str, message: &str) -> Map<String, Value> {
    let mut map = Map::new();
    map.insert("rule".into(), json!(rule));
    map.insert("message".into(), json!(message));
    map
}

fn immutable(expression: &str, field: &str) -> Map<String, Value> {
    rule(
        expression,
        &format!(
            "{field} is immutable: it defines what the run generates; create a new TrajectoryRun to change it"
        ),
    )
}

fn add_rules(node: &mut Map<String, Value>, rules: impl IntoIterator<Item = Map<String, Value>>) {
    let list = node
        .entry("x-kubernetes-validations")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Value::Array(list) = list {
        list.extend(rules.into_iter().map(Value::Object));
    }
}

/// Drops the integer formats Kubernetes does not know (`uint32`, `uint64`, ...: the API server warns
/// on each), keeping their bounds as `minimum` / `maximum`.
fn kubernetes_formats(schema: &mut schemars::Schema) {
    fn visit(value: &mut Value) {
        match value {
            Value::Object(map) => {
                let unsigned = map
                    .get("format")
                    .and_then(Value::as_str)
                    .filter(|format| format.starts_with("uint"))
                    .map(str::to_owned);
                if let Some(format) = unsigned {
                    map.remove("format");
                    map.entry("minimum").or_insert(json!(0));
                    if format == "uint32" {
                        map.entry("maximum").or_insert(json!(u32::MAX));
                    }
                }
                map.values_mut().for_each(visit);
            }
            Value::Array(items) => items.iter_mut().for_each(visit),
            _ => {}
        }
    }
    if let Some(root) = schema.pointer_mut("") {
        visit(root);
    }
}
