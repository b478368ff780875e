//! The run modes: `plan`, `batch`, `merge`, and `local` (all three on one machine).
//!
//! Each mode reads the run plan (or a run file), works on the run's directory on storage, and
//! reports a summary. Errors carry the exit code of the worker contract ([`crate::contract::exit`]).

pub mod batch;
pub mod builds;
mod conversation;
mod costs;
pub mod distributions;
mod engine;
mod episodes;
pub mod ledger;
pub mod local;
pub mod manifest;
pub mod merge;
pub mod oracle;
pub mod plan;
pub mod prompt;
pub mod pulls;
mod resume;
mod rewards;
pub mod sampling;
pub mod segments;
mod turns;
mod windows;

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::contract::{RunPlan, exit};
use crate::spec::RunSpec;
use crate::storage::{Bucket, BucketOptions, ObjectUrl, StorageError, StorageFault, Store};

/// Why a run mode stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Reading or writing the run's storage failed; [`StorageError::fault`] says whether a retry
    /// can help.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// Another `local` run works in the same output directory.
    #[error("{0}")]
    OutputInUse(String),
    /// A merged run could not be exported (`export`): the message names the file and line.
    #[error(transparent)]
    Export(#[from] crate::export::ExportError),
    /// The storage root does not exist (the volume is not mounted where the plan says).
    #[error("{0}")]
    StorageMissing(String),
    /// The spec or run file is wrong; the message names the file and field.
    #[error("{0}")]
    Spec(String),
    /// The dataset cannot be used at all (missing, unreadable, no valid line).
    #[error("invalid dataset: {0}")]
    InvalidDataset(String),
    /// An oracle pass ran to its end, and some rows' solutions did not pass; names them.
    #[error("{0}")]
    OracleFailed(String),
    /// The output directory belongs to another dataset or spec.
    #[error("{0}")]
    OutputMismatch(String),
    /// Rows name a container image of their own, and the run has no container to honour it
    /// (a local run); the message names the rows.
    #[error("{0}")]
    NeedsContainers(String),
    /// The batch's input is not what the plan recorded.
    #[error("bad batch input: {0}")]
    BadBatchInput(String),
    /// A batch marked done lacks records (merge): they were lost after it finished.
    #[error("incomplete batch: {0}")]
    IncompleteBatch(String),
    /// The model server refused the configuration; every prompt would fail.
    #[error("stopped: {0}")]
    ModelConfiguration(String),
    /// The model or its path does not exist on the server (404, an unknown model name); every
    /// prompt would fail.
    #[error("stopped: check spec.model.baseUrl and spec.model.name: {0}")]
    ModelNotFound(String),
    /// The model server failed past its retries (unreachable, 5xx, 429, timeouts), or the batch's
    /// circuit opened; nothing was recorded for the prompts it stopped.
    #[error(
        "model server unavailable; the affected prompts were not recorded and are retried on resume: {0}"
    )]
    ModelUnavailable(String),
    /// The run reached `spec.model.budget`: no conversation starts any more; what is done stays
    /// done.
    #[error(
        "budget exhausted: the run spent {} USD of its budget of {} USD \
         (spec.model.budget.maxCost), and {not_started} conversations of a batch were not \
         started; raise the budget and run again to finish them (what is done stays done)",
        crate::contract::usd_text(*.spent),
        crate::contract::usd_text(*.max_cost)
    )]
    BudgetExhausted {
        max_cost: f64,
        /// What the whole run had spent, as the claims said when the batch stopped.
        spent: f64,
        /// The batch's conversations that were not started.
        not_started: usize,
    },
    /// Stopped by a signal after leaving storage consistent.
    #[error("interrupted; run the same command again to resume")]
    Interrupted,
    /// Records a batch counted at its start were gone from storage when it finished: it is
    /// not marked done, and runs again for the missing keys.
    #[error("records lost: {0}")]
    RecordsLost(String),
    /// A batch task failed unexpectedly.
    #[error("internal error: {0}")]
    Internal(String),
}

impl RunError {
    /// The process exit code for this error, per the worker contract.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Spec(_)
            | Self::InvalidDataset(_)
            | Self::OutputMismatch(_)
            | Self::NeedsContainers(_)
            | Self::ModelConfiguration(_)
            | Self::ModelNotFound(_)
            | Self::StorageMissing(_)
            | Self::IncompleteBatch(_)
            | Self::OutputInUse(_)
            | Self::Export(_) => exit::PERMANENT_CONFIG,
            Self::BadBatchInput(_) => exit::BAD_BATCH_INPUT,
            Self::OracleFailed(_) => exit::ORACLE_FAILED,
            Self::Interrupted => exit::INTERRUPTED,
            Self::BudgetExhausted { .. } => exit::BUDGET_EXHAUSTED,
            Self::Storage(error) => match error.fault() {
                StorageFault::ReadOnly | StorageFault::Denied | StorageFault::Missing => {
                    exit::PERMANENT_CONFIG
                }
                // Full: space can be freed while the Job backs off; the batch checks free space
                // before it spends a token, so a retry on a full volume costs nothing.
                StorageFault::Full | StorageFault::Transient => exit::TRANSIENT,
            },
            Self::Internal(_) | Self::ModelUnavailable(_) | Self::RecordsLost(_) => exit::TRANSIENT,
        }
    }

    /// A `PascalCase` reason for the operator's status.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Storage(error) => match error.fault() {
                StorageFault::Transient => "StorageError",
                StorageFault::Full => "StorageFull",
                StorageFault::ReadOnly => "StorageReadOnly",
                StorageFault::Denied => "StoragePermissionDenied",
                StorageFault::Missing => "StorageMissing",
            },
            Self::StorageMissing(_) => "StorageMissing",
            Self::OutputInUse(_) => "OutputInUse",
            Self::Export(_) => "ExportFailed",
            Self::Spec(_) => "InvalidSpec",
            Self::InvalidDataset(_) => "InvalidDataset",
            Self::OutputMismatch(_) => "OutputMismatch",
            Self::NeedsContainers(_) => "NeedsContainers",
            Self::BadBatchInput(_) => "BadBatchInput",
            Self::OracleFailed(_) => "OracleFailed",
            Self::IncompleteBatch(_) => "IncompleteBatch",
            Self::ModelConfiguration(_) => "ModelUnauthorized",
            Self::ModelNotFound(_) => "ModelNotFound",
            Self::ModelUnavailable(_) => "ModelUnavailable",
            Self::Interrupted => "Interrupted",
            Self::BudgetExhausted { .. } => "BudgetExhausted",
            Self::RecordsLost(_) => "RecordsLost",
            Self::Internal(_) => "InternalError",
        }
    }
}

/// An error reading `path`, which spec field `field` names: a file that is not there is a spec
/// error naming the field and what it should name (`names`), relative to the storage root.
fn named_if_missing(error: StorageError, field: &str, path: &Path, names: &str) -> RunError {
    if error.is_not_found() {
        RunError::Spec(format!(
            "{field}: {} does not exist (it names {names}, relative to the storage root)",
            path.display()
        ))
    } else {
        error.into()
    }
}

/// A run file: the same YAML a user would `kubectl apply`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunFile {
    pub api_version: String,
    pub kind: String,
    pub metadata: RunFileMetadata,
    pub spec: RunSpec,
}

/// The part of `metadata` a local run uses.
#[derive(Debug, Clone, Deserialize)]
pub struct RunFileMetadata {
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
}

/// The namespace local runs use when the run file names none.
pub const LOCAL_NAMESPACE: &str = "local";

impl RunFile {
    /// Reads and validates a run file; errors name the file and the field.
    pub fn load(path: &Path) -> Result<Self, RunError> {
        let file = Self::read(path)?;
        check_spec(path, &file.spec)?;
        Ok(file)
    }

    /// Reads a run file without validating its spec (for listings that report what is wrong
    /// instead of refusing it); errors name the file, line and column.
    pub fn read(path: &Path) -> Result<Self, RunError> {
        let text = std::fs::read_to_string(path).map_err(|err| {
            RunError::Spec(format!("cannot read run file {}: {err}", path.display()))
        })?;
        // The API server refuses (or prunes) fields the CRD does not know; a run file gets the
        // same strictness, so that a misspelt setting is not silently left at its default.
        let mut unknown = Vec::new();
        let file: Self =
            serde_ignored::deserialize(serde_yaml::Deserializer::from_str(&text), |field| {
                unknown.push(field.to_string());
            })
            .map_err(|err| {
                let place = err
                    .location()
                    .map(|location| format!(":{}:{}", location.line(), location.column()))
                    .unwrap_or_default();
                RunError::Spec(format!("{}{place}: {err}", path.display()))
            })?;
        // Outside the spec (status, metadata.uid, ...) a file exported from a cluster may hold
        // anything.
        unknown.retain(|field| field.starts_with("spec."));
        if !unknown.is_empty() {
            return Err(RunError::Spec(format!(
                "{}: unknown field{} {}",
                path.display(),
                if unknown.len() == 1 { "" } else { "s" },
                unknown.join(", ")
            )));
        }
        if file.kind != "TrajectoryRun" {
            return Err(RunError::Spec(format!(
                "{}: kind is {:?}, expected \"TrajectoryRun\"",
                path.display(),
                file.kind
            )));
        }
        Ok(file)
    }

    /// The run plan this file stands for.
    pub fn to_plan(&self) -> RunPlan {
        let namespace = self
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| LOCAL_NAMESPACE.to_owned());
        RunPlan {
            output_path: self.spec.output_path(&namespace, &self.metadata.name),
            name: self.metadata.name.clone(),
            namespace,
            uid: String::new(),
            spec: self.spec.clone(),
            batches: None,
            batch_ranges: None,
            pending_list: None,
        }
    }
}

/// Reads a run plan JSON (the mounted `ConfigMap` in a pod).
pub fn load_plan(path: &Path) -> Result<RunPlan, RunError> {
    let text = std::fs::read_to_string(path)
        .map_err(|err| RunError::Spec(format!("cannot read run plan {}: {err}", path.display())))?;
    let plan: RunPlan = serde_json::from_str(&text)
        .map_err(|err| RunError::Spec(format!("{}: invalid run plan: {err}", path.display())))?;
    check_spec(path, &plan.spec)?;
    if let Some(list) = &plan.pending_list {
        // It is joined to the run directory: an absolute path or `..` would leave it.
        let inside = Path::new(list)
            .components()
            .all(|part| matches!(part, std::path::Component::Normal(_)));
        if !inside || list.is_empty() {
            return Err(RunError::Spec(format!(
                "{}: pendingList {list:?} is not a path inside the run's output directory",
                path.display()
            )));
        }
    }
    Ok(plan)
}

/// Every bound the spec violates, named by file and field.
fn check_spec(path: &Path, spec: &RunSpec) -> Result<(), RunError> {
    let violations = spec.validate();
    if violations.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = violations.iter().map(ToString::to_string).collect();
    Err(RunError::Spec(format!(
        "{}: {}",
        path.display(),
        list.join("; ")
    )))
}

/// Where a run's files live: the storage root (a directory, or an `s3://bucket/prefix`
/// location), the store that reaches it, and the plan.
#[derive(Debug, Clone)]
pub struct RunLocation {
    pub storage_root: PathBuf,
    pub store: Store,
    pub plan: RunPlan,
}

impl RunLocation {
    /// The run's location under `storage_root`: a volume's directory, or, for an `s3://` URL, the
    /// bucket's prefix reached with `bucket` (checked at once: a bucket that is not there, or
    /// refuses these credentials, fails here, before anything is read).
    pub fn open(
        storage_root: PathBuf,
        bucket: &BucketOptions,
        plan: RunPlan,
    ) -> Result<Self, RunError> {
        let text = storage_root.to_string_lossy();
        if !crate::storage::object::is_object_location(&text) {
            let location = Self {
                storage_root,
                store: Store::Volume,
                plan,
            };
            location.require_storage()?;
            return Ok(location);
        }
        let url = ObjectUrl::parse(&text).map_err(RunError::Spec)?;
        let client = Bucket::open(&url, bucket).map_err(|error| {
            RunError::Spec(format!("cannot reach the bucket of {url}: {error}"))
        })?;
        if let Err(error) = client.check() {
            let error = StorageError::new("listing", &url.root(), error);
            return Err(match error.fault() {
                StorageFault::Missing => RunError::StorageMissing(format!(
                    "the bucket {:?} does not exist, or these credentials may not see it \
                     (listing {url})",
                    url.bucket
                )),
                _ => error.into(),
            });
        }
        Ok(Self {
            storage_root: url.root(),
            store: Store::Bucket(std::sync::Arc::new(client)),
            plan,
        })
    }

    /// The run's location as its plan says: the bucket of `spec.storage.object` when it names
    /// one (reached as it says, where `flags` do not say otherwise), else `storage_root`.
    pub fn of_plan(
        storage_root: PathBuf,
        flags: &BucketOptions,
        plan: RunPlan,
    ) -> Result<Self, RunError> {
        let Some(object) = plan.spec.storage.object.clone() else {
            return Self::open(storage_root, flags, plan);
        };
        let options = BucketOptions {
            endpoint: flags.endpoint.clone().or(object.endpoint),
            region: flags.region.clone().or(object.region),
            path_style: flags.path_style || object.path_style,
            keys: flags.keys.clone(),
        };
        Self::open(PathBuf::from(object.url), &options, plan)
    }

    /// Fails when the storage root is not a directory: the volume is not mounted (or mounted
    /// elsewhere), which no retry of the same pod spec fixes.
    pub fn require_storage(&self) -> Result<(), RunError> {
        if self.store.is_bucket() {
            return Ok(());
        }
        match std::fs::metadata(&self.storage_root) {
            Ok(metadata) if metadata.is_dir() => Ok(()),
            Ok(_) => Err(RunError::StorageMissing(format!(
                "the storage root {} is not a directory",
                self.storage_root.display()
            ))),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                Err(RunError::StorageMissing(format!(
                    "the storage root {} does not exist: is the volume (spec.storage.volume) \
                     mounted there?",
                    self.storage_root.display()
                )))
            }
            Err(err) => Err(StorageError::new("reading", &self.storage_root, err).into()),
        }
    }

    pub fn run_dir(&self) -> crate::storage::RunDir {
        crate::storage::RunDir::on(
            self.store.clone(),
            self.storage_root.join(&self.plan.output_path),
        )
    }

    /// The JSONL file of the run's rows: `spec.dataset.path`, or the rows the plan made of the
    /// Harbor tasks it names.
    pub fn dataset_path(&self) -> PathBuf {
        match self.plan.spec.dataset.format {
            crate::spec::DatasetFormat::Jsonl => self.dataset_source(),
            crate::spec::DatasetFormat::HarborTasks => self.run_dir().harbor_rows(),
        }
    }

    /// What `spec.dataset.path` names on the run's storage.
    pub fn dataset_source(&self) -> PathBuf {
        self.storage_root.join(&self.plan.spec.dataset.path)
    }

    /// Reads the oracle report `spec.dataset.excludeOracleFailures` names, with its path, when
    /// it names one; an error names the field when there is no such file.
    pub fn read_oracle_report(&self) -> Result<Option<(PathBuf, Vec<u8>)>, RunError> {
        let Some(report) = self.plan.spec.dataset.oracle_report() else {
            return Ok(None);
        };
        let path = self.storage_root.join(report);
        match self.store.read(&path) {
            Ok(bytes) => Ok(Some((path, bytes))),
            Err(error) => Err(named_if_missing(
                error,
                "spec.dataset.excludeOracleFailures",
                &path,
                "an oracle run's output directory, or its oracle.jsonl",
            )),
        }
    }

    /// The trajectories `spec.replay.from` names, when the run replays another's tool outputs.
    pub fn replay_source(&self) -> Option<PathBuf> {
        let replay = self.plan.spec.replay.as_ref()?;
        Some(self.storage_root.join(replay.trajectories()))
    }

    /// Reads the first `limit` bytes of the replay source (all of it: `None`); an error names
    /// `spec.replay.from` when there is no such file.
    pub fn read_replay_source(&self, limit: Option<u64>) -> Result<Option<Vec<u8>>, RunError> {
        let Some(path) = self.replay_source() else {
            return Ok(None);
        };
        let read = match limit {
            Some(limit) => self.store.read_range(&path, 0..limit),
            None => self.store.read(&path),
        };
        read.map(Some).map_err(|error| {
            named_if_missing(
                error,
                "spec.replay.from",
                &path,
                "another run's output directory, or its trajectories file",
            )
        })
    }

    /// The batch Job completion index `index` works: through the run plan alone, or, when it has
    /// a [`RunPlan::pending_list`], through its slot in that list on storage, read once and never
    /// expanded. An index past the end of either, or a list missing or unreadable, is bad batch
    /// input for this index alone (exit 65); a failing read of the list (EIO, ESTALE) is the
    /// storage's, and transient.
    pub fn batch_for_index(&self, index: u32) -> Result<u32, RunError> {
        let no_batch = || {
            RunError::BadBatchInput(format!(
                "completion index {index} has no batch in the run plan"
            ))
        };
        let Some(list) = &self.plan.pending_list else {
            return self.plan.batch_for_index(index).ok_or_else(no_batch);
        };
        let slot = self.plan.slot_for_index(index).ok_or_else(no_batch)?;
        let path = self.run_dir().root().join(list);
        let bad = |why: String| {
            RunError::BadBatchInput(format!("the plan's pending list {}: {why}", path.display()))
        };
        let text = self
            .store
            .read_to_string(&path)
            .map_err(|err| pending_list_read_error(&path, err.source))?;
        match crate::contract::nth_in_ranges(&text, slot) {
            Ok(Some(batch)) => Ok(batch),
            Ok(None) => Err(bad(format!(
                "completion index {index} works slot {slot}, past the end of the list"
            ))),
            Err(err) => Err(bad(err)),
        }
    }
}

/// A failed read of a pending list: a list that is not there or not text is bad input for the
/// index (no retry of the pod makes it readable); any other error (EIO, ESTALE on NFS) is the
/// storage's, and transient.
fn pending_list_read_error(path: &Path, error: std::io::Error) -> RunError {
    match error.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::InvalidData => {
            RunError::BadBatchInput(format!(
                "the plan's pending list {}: cannot read it: {error}",
                path.display()
            ))
        }
        _ => StorageError::new("reading the pending list", path, error).into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Errors as the kernel reports them (no filesystem here can be made to answer EIO).
    #[test]
    fn a_failing_read_of_the_pending_list_is_transient_and_a_missing_one_is_bad_input() {
        let path = Path::new("/data/out/plan/pending-0123456789abcdef.ranges");
        for errno in [nix::errno::Errno::EIO, nix::errno::Errno::ESTALE] {
            let error =
                pending_list_read_error(path, std::io::Error::from_raw_os_error(errno as i32));
            assert_eq!(error.exit_code(), exit::TRANSIENT, "{error}");
            assert!(
                error.to_string().contains(&*path.to_string_lossy()),
                "{error}"
            );
        }
        for kind in [
            std::io::ErrorKind::NotFound,
            std::io::ErrorKind::InvalidData,
        ] {
            let error = pending_list_read_error(path, kind.into());
            assert_eq!(error.exit_code(), exit::BAD_BATCH_INPUT, "{error}");
            assert!(
                error.to_string().contains(&*path.to_string_lossy()),
                "{error}"
            );
        }
    }

    #[test]
    fn a_misspelt_spec_field_is_refused_by_name_and_fields_outside_the_spec_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.yaml");
        let file = |tools: &str| {
            format!(
                "apiVersion: trajectories.dev/v1alpha1\nkind: TrajectoryRun\n\
                 metadata: {{name: r, uid: abc, resourceVersion: '7'}}\nstatus: {{phase: Running}}\n\
                 spec:\n  dataset: {{path: d.jsonl}}\n  model: {{baseUrl: 'http://m/v1', name: m}}\n\
                 tools: {tools}\n"
            )
            .replace("tools: ", "  tools: ")
        };
        std::fs::write(&path, file("{keepWorkspaces: true}")).unwrap();
        let run = RunFile::read(&path).expect("an exported run file reads");
        assert!(run.spec.tools.keep_workspaces);

        std::fs::write(
            &path,
            file("{keepWorkspace: true, terminal: {timeoutSecs: 5}}"),
        )
        .unwrap();
        let error = RunFile::read(&path).unwrap_err();
        assert_eq!(error.exit_code(), exit::PERMANENT_CONFIG);
        assert_eq!(
            error.to_string(),
            format!(
                "{}: unknown fields spec.tools.keepWorkspace, spec.tools.terminal.timeoutSecs",
                path.display()
            )
        );
    }

    #[test]
    fn a_run_plan_whose_pending_list_leaves_the_run_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        let plan_with = |list: &str| {
            serde_json::json!({
                "name": "r", "namespace": "ns", "outputPath": "out", "pendingList": list,
                "spec": {"dataset": {"path": "d.jsonl"}, "model": {"baseUrl": "http://m/v1", "name": "m"}},
            })
            .to_string()
        };
        for list in [
            "/etc/passwd",
            "../other/plan/pending.ranges",
            "plan/../../x",
            "",
        ] {
            std::fs::write(&path, plan_with(list)).unwrap();
            let error = load_plan(&path).unwrap_err();
            assert_eq!(error.exit_code(), exit::PERMANENT_CONFIG, "{list}: {error}");
            assert!(error.to_string().contains("pendingList"), "{error}");
        }
        std::fs::write(&path, plan_with("plan/pending-0123456789abcdef.ranges")).unwrap();
        let plan = load_plan(&path).unwrap();
        assert_eq!(
            plan.pending_list.as_deref(),
            Some("plan/pending-0123456789abcdef.ranges")
        );
    }
}
