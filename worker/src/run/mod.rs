//! The run modes: `plan`, `batch`, `merge`, and `local` (all three on one machine).
//!
//! Each mode reads the run plan (or a run file), works on the run's directory on storage, and
//! reports a summary. Errors carry the exit code of the worker contract ([`crate::contract::exit`]).

pub mod batch;
pub mod local;
pub mod manifest;
pub mod merge;
pub mod plan;
pub mod prompt;
pub mod segments;

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::contract::{RunPlan, exit};
use crate::spec::RunSpec;
use crate::storage::{StorageError, StorageFault};

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
    /// The storage root does not exist (the volume is not mounted where the plan says).
    #[error("{0}")]
    StorageMissing(String),
    /// The spec or run file is wrong; the message names the file and field.
    #[error("{0}")]
    Spec(String),
    /// The dataset cannot be used at all (missing, unreadable, no valid line).
    #[error("invalid dataset: {0}")]
    InvalidDataset(String),
    /// The output directory belongs to another dataset or spec.
    #[error("{0}")]
    OutputMismatch(String),
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
    /// Stopped by a signal after leaving storage consistent.
    #[error("interrupted; run the same command again to resume")]
    Interrupted,
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
            | Self::ModelConfiguration(_)
            | Self::ModelNotFound(_)
            | Self::StorageMissing(_)
            | Self::IncompleteBatch(_)
            | Self::OutputInUse(_) => exit::PERMANENT_CONFIG,
            Self::BadBatchInput(_) => exit::BAD_BATCH_INPUT,
            Self::Interrupted => exit::INTERRUPTED,
            Self::Storage(error) => match error.fault() {
                StorageFault::ReadOnly | StorageFault::Denied => exit::PERMANENT_CONFIG,
                // Full: space can be freed while the Job backs off; the batch checks free space
                // before it spends a token, so a retry on a full volume costs nothing.
                StorageFault::Full | StorageFault::Transient => exit::TRANSIENT,
            },
            Self::Internal(_) | Self::ModelUnavailable(_) => exit::TRANSIENT,
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
            },
            Self::StorageMissing(_) => "StorageMissing",
            Self::OutputInUse(_) => "OutputInUse",
            Self::Spec(_) => "InvalidSpec",
            Self::InvalidDataset(_) => "InvalidDataset",
            Self::OutputMismatch(_) => "OutputMismatch",
            Self::BadBatchInput(_) => "BadBatchInput",
            Self::IncompleteBatch(_) => "IncompleteBatch",
            Self::ModelConfiguration(_) => "ModelUnauthorized",
            Self::ModelNotFound(_) => "ModelNotFound",
            Self::ModelUnavailable(_) => "ModelUnavailable",
            Self::Interrupted => "Interrupted",
            Self::Internal(_) => "InternalError",
        }
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
        let text = std::fs::read_to_string(path).map_err(|err| {
            RunError::Spec(format!("cannot read run file {}: {err}", path.display()))
        })?;
        let file: Self = serde_yaml::from_str(&text).map_err(|err| {
            let place = err
                .location()
                .map(|location| format!(":{}:{}", location.line(), location.column()))
                .unwrap_or_default();
            RunError::Spec(format!("{}{place}: {err}", path.display()))
        })?;
        if file.kind != "TrajectoryRun" {
            return Err(RunError::Spec(format!(
                "{}: kind is {:?}, expected \"TrajectoryRun\"",
                path.display(),
                file.kind
            )));
        }
        check_spec(path, &file.spec)?;
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

/// Where a run's files live: the storage root and the plan.
#[derive(Debug, Clone)]
pub struct RunLocation {
    pub storage_root: PathBuf,
    pub plan: RunPlan,
}

impl RunLocation {
    /// Fails when the storage root is not a directory: the volume is not mounted (or mounted
    /// elsewhere), which no retry of the same pod spec fixes.
    pub fn require_storage(&self) -> Result<(), RunError> {
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
        crate::storage::RunDir::new(self.storage_root.join(&self.plan.output_path))
    }

    pub fn dataset_path(&self) -> PathBuf {
        self.storage_root.join(&self.plan.spec.dataset.path)
    }
}
