//! The contract between the operator and the worker: the run plan a pod receives, the names of
//! the environment variables and mount paths, the exit codes, and the summaries the worker
//! reports through the pod's termination message.
//!
//! It builds with serde alone so that the operator can depend on it (`default-features = false`)
//! without pulling in the HTTP client or the tools. Change it only in ways both sides understand:
//! the operator of one version may schedule worker images of another.

use serde::{Deserialize, Serialize};

use crate::spec::RunSpec;

/// Environment variables, named in one place for the operator (which writes pod specs) and the
/// worker (which reads them).
pub mod env {
    /// Path of the run plan JSON (a mounted `ConfigMap` in a pod).
    pub const PLAN_PATH: &str = "TRAJ_PLAN_PATH";
    /// Root of the shared storage volume; dataset and output paths are relative to it.
    pub const STORAGE_ROOT: &str = "TRAJ_STORAGE_ROOT";
    /// The batch index Kubernetes gives each pod of an Indexed Job.
    pub const JOB_COMPLETION_INDEX: &str = "JOB_COMPLETION_INDEX";
    /// The model API key, from a Secret reference.
    pub const MODEL_API_KEY: &str = "TRAJ_MODEL_API_KEY";
    /// A file holding the model API key (a mounted Secret), used when the variable above is unset.
    pub const MODEL_API_KEY_FILE: &str = "TRAJ_MODEL_API_KEY_FILE";
    /// Where the termination summary is written.
    pub const TERMINATION_LOG: &str = "TRAJ_TERMINATION_LOG";
    /// Directory under which per-conversation tool workspaces are created.
    pub const WORKSPACE_ROOT: &str = "TRAJ_WORKSPACE_ROOT";
    /// `json` or `pretty` log output.
    pub const LOG_FORMAT: &str = "TRAJ_LOG_FORMAT";
}

/// Paths inside a worker pod.
pub mod paths {
    /// Mount point of the plan `ConfigMap`.
    pub const PLAN_DIR: &str = "/etc/trajectory";
    /// File name of the run plan inside [`PLAN_DIR`].
    pub const PLAN_FILE: &str = "plan.json";
    /// Mount point of the shared storage volume.
    pub const STORAGE_ROOT: &str = "/data";
    /// Kubernetes' default termination message path.
    pub const TERMINATION_LOG: &str = "/dev/termination-log";
    /// Scratch space for tool workspaces (an emptyDir).
    pub const WORKSPACE_ROOT: &str = "/workspace";
}

/// Process exit codes. Anything not listed is transient: the Job retries the index.
pub mod exit {
    /// Everything asked was done.
    pub const OK: i32 = 0;
    /// A configuration error no retry can fix (401/403 from the model, exhausted credit, a bad
    /// plan). The operator's pod failure policy fails the whole Job on it.
    pub const PERMANENT_CONFIG: i32 = 78;
    /// The batch's input is bad (e.g. the dataset changed under the plan). Fails only this index.
    pub const BAD_BATCH_INPUT: i32 = 65;
    /// A transient failure; retried.
    pub const TRANSIENT: i32 = 1;
    /// Stopped by a signal (SIGTERM / Ctrl-C) after leaving storage consistent; retried.
    pub const INTERRUPTED: i32 = 130;
}

/// Kubernetes truncates termination messages at 4096 bytes.
pub const TERMINATION_MESSAGE_LIMIT: usize = 4096;

/// Everything a worker pod needs to know about its run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunPlan {
    /// Name of the run (the resource name, or the run file's `metadata.name`).
    pub name: String,
    /// Namespace of the run (`local` for local runs).
    pub namespace: String,
    /// UID of the resource; recorded in the manifest as the run's identity.
    #[serde(default)]
    pub uid: String,
    /// The spec as applied.
    pub spec: RunSpec,
    /// Output directory relative to the storage root.
    pub output_path: String,
    /// The batch id each completion index works (`batches[index]`), when index *i* is not batch
    /// *i*. Written as well as [`RunPlan::batch_ranges`] while the list is short, for worker images
    /// that read only this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<Vec<u32>>,
    /// The same list in the compact ranges form (`3-99999,100004`): the *i*-th id of the ranges
    /// is the batch of index *i*. Preferred over [`RunPlan::batches`] when both are present. It
    /// keeps the plan `ConfigMap` small for any number of batches (a generation Job works up to
    /// [`MAX_JOB_COMPLETIONS`] of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_ranges: Option<String>,
}

/// Kubernetes refuses an Indexed Job with `backoffLimitPerIndex` and more completions than this;
/// a generation attempt of more batches runs as several Jobs.
pub const MAX_JOB_COMPLETIONS: u32 = 100_000;

/// The longest pending list also written as [`RunPlan::batches`] (about 8 bytes an id).
pub const MAX_LISTED_BATCHES: usize = 10_000;

impl RunPlan {
    /// The batch a Job completion index works; `None` past the end of the list, or when the
    /// ranges cannot be read.
    pub fn batch_for_index(&self, index: u32) -> Option<u32> {
        if let Some(ranges) = &self.batch_ranges {
            return nth_in_ranges(ranges, index);
        }
        match &self.batches {
            None => Some(index),
            Some(batches) => usize::try_from(index)
                .ok()
                .and_then(|i| batches.get(i).copied()),
        }
    }

    /// Every batch of the list, in index order; `None` for the identity (index *i* is batch *i*).
    pub fn pending_list(&self) -> Result<Option<Vec<u32>>, String> {
        match (&self.batch_ranges, &self.batches) {
            (Some(ranges), _) => parse_ranges(ranges).map(Some),
            (None, list) => Ok(list.clone()),
        }
    }
}

/// The `index`-th id of `ranges` (`3-5,9`: index 3 is 9) without expanding them.
fn nth_in_ranges(ranges: &str, index: u32) -> Option<u32> {
    let mut skipped = 0_u32;
    for part in ranges.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        let (first, last): (u32, u32) = (first.parse().ok()?, last.parse().ok()?);
        let len = last.checked_sub(first)?.checked_add(1)?;
        if index - skipped < len {
            return first.checked_add(index - skipped);
        }
        skipped = skipped.checked_add(len)?;
    }
    None
}

/// What `plan` reports (termination message, stdout, and the operator's status).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanSummary {
    /// Valid prompts after `maxSamples`.
    pub prompts: u64,
    /// Rejected dataset lines (listed in `invalid.jsonl`).
    pub invalid: u64,
    /// Batches in the run.
    pub batches: u32,
    /// Batches already done on storage (from an earlier attempt or run).
    pub done: Vec<BatchRange>,
    /// `blake3:` digest of the dataset file (as `b3sum` prints it).
    pub dataset_digest: String,
    /// Digest of the generating fields of the spec.
    pub spec_hash: String,
    /// True when `done` lists only its first ranges, so that the summary fits the termination
    /// message: the batches it leaves out are done too, and their pods find them done and end at
    /// once. Absent (false) in a full summary.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub done_truncated: bool,
}

impl PlanSummary {
    /// The summary as the termination message can hold it: `done` cut to the ranges that fit in
    /// `limit` bytes (marked [`PlanSummary::done_truncated`]). The ranges kept are the first, so a
    /// run resumed after long progress in order (a few ranges) always keeps them all.
    #[must_use]
    pub fn fitting(mut self, limit: usize) -> Self {
        let size = |summary: &Self| serde_json::to_string(summary).map_or(usize::MAX, |t| t.len());
        if size(&self) <= limit {
            return self;
        }
        self.done_truncated = true;
        // Halve the list until it fits, then grow it back range by range: few serialisations.
        let all = std::mem::take(&mut self.done);
        let mut keep = all.len();
        while keep > 0 {
            self.done = all[..keep].to_vec();
            if size(&self) <= limit {
                break;
            }
            keep /= 2;
        }
        while keep < all.len() {
            self.done.push(all[keep]);
            if size(&self) > limit {
                self.done.pop();
                break;
            }
            keep += 1;
        }
        self
    }
}

/// What `batch` reports.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchSummary {
    pub batch: u32,
    pub succeeded: u64,
    pub discarded: u64,
    pub failed: u64,
    /// Records found on storage from an earlier attempt and not redone.
    pub resumed: u64,
    /// Set when the batch stopped early, with the error class (e.g. `unauthorized`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
}

/// What `merge` reports.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MergeSummary {
    pub trajectories: u64,
    pub discarded: u64,
    pub failed: u64,
    /// Size of `trajectories.jsonl` in bytes.
    pub bytes: u64,
    /// Duplicate or torn lines that were skipped.
    pub skipped_lines: u64,
}

/// An inclusive range of batch ids, for compact lists (`0-41,44`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchRange {
    pub first: u32,
    pub last: u32,
}

/// Compacts sorted, de-duplicated ids into ranges.
pub fn compact_ranges(ids: impl IntoIterator<Item = u32>) -> Vec<BatchRange> {
    let mut ranges: Vec<BatchRange> = Vec::new();
    for id in ids {
        match ranges.last_mut() {
            Some(range) if range.last.checked_add(1) == Some(id) => range.last = id,
            Some(range) if range.last >= id => {}
            _ => ranges.push(BatchRange {
                first: id,
                last: id,
            }),
        }
    }
    ranges
}

/// Formats ranges the way Kubernetes formats `completedIndexes`: `0-41,44`.
pub fn format_ranges(ranges: &[BatchRange]) -> String {
    ranges
        .iter()
        .map(|range| {
            if range.first == range.last {
                range.first.to_string()
            } else {
                format!("{}-{}", range.first, range.last)
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Parses `0-41,44` (Kubernetes' `completedIndexes` format) into ids.
pub fn parse_ranges(text: &str) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    for part in text
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
    {
        let (first, last) = match part.split_once('-') {
            Some((first, last)) => (first, last),
            None => (part, part),
        };
        let first: u32 = first
            .parse()
            .map_err(|_| format!("bad index range {part:?}"))?;
        let last: u32 = last
            .parse()
            .map_err(|_| format!("bad index range {part:?}"))?;
        if first > last {
            return Err(format!("bad index range {part:?}"));
        }
        ids.extend(first..=last);
    }
    Ok(ids)
}

/// What a worker that stopped on an error reports in its termination message, for the operator's
/// status: the error, its `PascalCase` reason (`ModelUnauthorized`, `InvalidDataset`, ...) and the
/// exit code.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerFailure {
    pub error: String,
    pub reason: String,
    pub exit_code: i32,
}

impl WorkerFailure {
    /// The longest error text reported: with the reason it stays well inside the termination
    /// message's 4 KiB, so the reason always arrives.
    pub const MAX_ERROR_CHARS: usize = 2000;

    pub fn new(error: &str, reason: &str, exit_code: i32) -> Self {
        Self {
            error: error.chars().take(Self::MAX_ERROR_CHARS).collect(),
            reason: reason.to_owned(),
            exit_code,
        }
    }
}

/// Serialises a summary for the termination message, which Kubernetes caps at 4 KiB.
pub fn termination_message<T: Serialize>(summary: &T) -> String {
    let text =
        serde_json::to_string(summary).unwrap_or_else(|err| format!("{{\"error\":\"{err}\"}}"));
    if text.len() <= TERMINATION_MESSAGE_LIMIT {
        text
    } else {
        // A summary never legitimately grows this large; say so rather than write broken JSON.
        format!("{{\"truncated\":true,\"bytes\":{}}}", text.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_round_trip_in_kubernetes_format() {
        let ids = [0, 1, 2, 3, 5, 7, 8];
        let ranges = compact_ranges(ids);
        assert_eq!(format_ranges(&ranges), "0-3,5,7-8");
        assert_eq!(parse_ranges("0-3,5,7-8").unwrap(), ids);
        assert_eq!(parse_ranges("").unwrap(), Vec::<u32>::new());
        assert!(parse_ranges("3-1").is_err());
        assert!(parse_ranges("x").is_err());
    }

    #[test]
    fn later_attempts_map_indexes_through_the_pending_list() {
        let spec = serde_json::from_value(serde_json::json!({
            "dataset": {"path": "d.jsonl"},
            "model": {"baseUrl": "http://m/v1", "name": "m"},
        }))
        .unwrap();
        let mut plan = RunPlan {
            name: "r".into(),
            namespace: "ns".into(),
            uid: String::new(),
            spec,
            output_path: "runs/ns/r".into(),
            batches: None,
            batch_ranges: None,
        };
        assert_eq!(plan.batch_for_index(7), Some(7));
        assert_eq!(plan.pending_list(), Ok(None));
        plan.batches = Some(vec![4, 9]);
        assert_eq!(plan.batch_for_index(1), Some(9));
        assert_eq!(plan.batch_for_index(2), None);
        assert_eq!(plan.pending_list(), Ok(Some(vec![4, 9])));

        // The ranges win over the list, and are read without expanding them.
        plan.batch_ranges = Some("100000-199999,250000,300000-300001".into());
        let cases = [
            (0, Some(100_000)),
            (99_999, Some(199_999)),
            (100_000, Some(250_000)),
            (100_002, Some(300_001)),
            (100_003, None),
        ];
        for (index, batch) in cases {
            assert_eq!(plan.batch_for_index(index), batch, "index {index}");
        }
        assert_eq!(plan.pending_list().unwrap().unwrap().len(), 100_003);
        plan.batch_ranges = Some("7-x".into());
        assert_eq!(plan.batch_for_index(0), None);
        assert!(plan.pending_list().is_err());
    }

    #[test]
    fn a_worker_failure_keeps_its_reason_however_long_the_error() {
        let failure = WorkerFailure::new(
            &"x".repeat(10_000),
            "ModelUnauthorized",
            exit::PERMANENT_CONFIG,
        );
        let message = termination_message(&failure);
        assert!(message.len() <= TERMINATION_MESSAGE_LIMIT);
        let read: WorkerFailure = serde_json::from_str(&message).unwrap();
        assert_eq!(
            (read.reason.as_str(), read.exit_code),
            ("ModelUnauthorized", 78)
        );
        assert!(message.contains("\"exitCode\":78"), "{message}");
    }

    #[test]
    fn a_plan_summary_with_many_gaps_keeps_its_first_done_ranges_within_the_limit() {
        let summary = |done: Vec<BatchRange>| PlanSummary {
            prompts: 2_000_000,
            invalid: 0,
            batches: 1_000_000,
            done,
            dataset_digest: format!("blake3:{}", "0".repeat(64)),
            spec_hash: format!("blake3:{}", "1".repeat(64)),
            done_truncated: false,
        };
        // Every other batch done: 500,000 ranges, far beyond 4 KiB.
        let gaps: Vec<BatchRange> = (0..500_000)
            .map(|i| BatchRange {
                first: i * 2,
                last: i * 2,
            })
            .collect();
        let fitted = summary(gaps.clone()).fitting(TERMINATION_MESSAGE_LIMIT);
        let message = termination_message(&fitted);
        assert!(
            message.len() <= TERMINATION_MESSAGE_LIMIT,
            "{}",
            message.len()
        );
        assert!(!message.contains("truncated\":true,\"bytes"), "{message}");
        let read: PlanSummary = serde_json::from_str(&message).unwrap();
        assert!(read.done_truncated);
        assert!(read.done.len() > 100, "{} ranges kept", read.done.len());
        assert_eq!(read.done[..], gaps[..read.done.len()]);
        // A summary that fits is left whole, and says nothing of truncation.
        let few = summary(gaps[..3].to_vec()).fitting(TERMINATION_MESSAGE_LIMIT);
        assert!(!few.done_truncated && few.done.len() == 3);
        assert!(!termination_message(&few).contains("doneTruncated"));
    }

    #[test]
    fn a_plan_without_ranges_reads_as_it_always_did() {
        // A ConfigMap written by an operator of an earlier release.
        let plan: RunPlan = serde_json::from_value(serde_json::json!({
            "name": "r", "namespace": "ns", "outputPath": "runs/ns/r", "batches": [3, 5],
            "spec": {"dataset": {"path": "d.jsonl"}, "model": {"baseUrl": "http://m/v1", "name": "m"}},
        }))
        .unwrap();
        assert_eq!(plan.batch_ranges, None);
        assert_eq!(plan.batch_for_index(1), Some(5));
    }
}
