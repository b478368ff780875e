//! `manifest.json`: the run's identity and the batch layout, written once by `plan`.

use serde::{Deserialize, Serialize};

use super::RunError;
use crate::spec::RunSpec;
use crate::storage::RunDir;

/// Bumped when the manifest's meaning changes.
pub const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub version: u32,
    pub run: RunIdentity,
    pub created_at: String,
    pub dataset: DatasetInfo,
    /// Digest of the spec fields that decide what is generated.
    pub spec_hash: String,
    pub batch_size: u32,
    pub samples_per_prompt: u32,
    /// Every tool the run's distribution can offer; `tool_stats` are normalised over it.
    pub tool_catalog: Vec<String>,
    /// Per batch: the byte range of its lines in the dataset and the digest of those bytes.
    pub batches: Vec<BatchLayout>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub uid: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DatasetInfo {
    pub path: String,
    /// `blake3:` digest of the whole file.
    pub digest: String,
    pub bytes: u64,
    pub lines: u64,
    pub prompts: u64,
    pub invalid: u64,
}

/// `[start, end, digest]` of one batch: compact, since a run may have a million batches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchLayout(pub u64, pub u64, pub String);

impl BatchLayout {
    pub fn start(&self) -> u64 {
        self.0
    }
    pub fn end(&self) -> u64 {
        self.1
    }
    pub fn digest(&self) -> &str {
        &self.2
    }
}

impl Manifest {
    pub fn load(run_dir: &RunDir) -> Result<Option<Self>, RunError> {
        let path = run_dir.manifest();
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|err| {
                RunError::OutputMismatch(format!(
                    "{} is not a manifest this worker understands: {err}",
                    path.display()
                ))
            }),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(crate::storage::StorageError::new("reading", &path, err).into()),
        }
    }

    /// Loads the manifest a batch or merge needs; its absence means `plan` never ran.
    pub fn require(run_dir: &RunDir) -> Result<Self, RunError> {
        Self::load(run_dir)?.ok_or_else(|| {
            RunError::Spec(format!(
                "{} does not exist: run `trajectory-worker plan` first",
                run_dir.manifest().display()
            ))
        })
    }

    /// Prompt index of a batch's first prompt.
    pub fn first_prompt(&self, batch: u32) -> u64 {
        u64::from(batch) * u64::from(self.batch_size)
    }

    /// Prompts in a batch (the last one may be short).
    pub fn prompts_in(&self, batch: u32) -> u64 {
        let first = self.first_prompt(batch);
        self.dataset
            .prompts
            .saturating_sub(first)
            .min(u64::from(self.batch_size))
    }

    pub fn batch_count(&self) -> u32 {
        u32::try_from(self.batches.len()).unwrap_or(u32::MAX)
    }
}

/// The spec fields that decide what a run generates. Changing any of them under an existing
/// output directory would mix two different datasets, so `plan` refuses it. Operational fields
/// (workers, concurrency, retries, timeouts, the server's address, suspend) may change freely.
pub fn spec_hash(spec: &RunSpec) -> String {
    let generating = serde_json::json!({
        "dataset": {
            "path": spec.dataset.path,
            "promptField": spec.dataset.prompt_field,
            "maxSamples": spec.dataset.max_samples,
        },
        "batchSize": spec.batch_size,
        "distribution": spec.distribution,
        "seed": spec.seed,
        "samplesPerPrompt": spec.samples_per_prompt,
        "model": {
            "name": spec.model.name,
            "maxTokens": spec.model.max_tokens,
            "temperature": spec.model.temperature,
            "reasoning": spec.model.reasoning,
            "extraBody": spec.model.extra_body,
        },
        "agent": {
            "maxTurns": spec.agent.max_turns,
            "ephemeralSystemPrompt": spec.agent.ephemeral_system_prompt,
        },
        "tools": spec.tools.terminal,
        "filters": spec.filters,
    });
    let hash = blake3::hash(generating.to_string().as_bytes());
    format!("blake3:{}", &hash.to_hex()[..32])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RunSpec {
        serde_json::from_value(serde_json::json!({
            "dataset": {"path": "d.jsonl"},
            "model": {"baseUrl": "http://a/v1", "name": "m"},
        }))
        .unwrap()
    }

    #[test]
    fn operational_fields_do_not_change_the_spec_hash() {
        let base = spec();
        let mut changed = base.clone();
        changed.workers = 99;
        changed.concurrency = 7;
        changed.model.base_url = "http://b/v1".into();
        changed.suspend = true;
        assert_eq!(spec_hash(&base), spec_hash(&changed));
    }

    #[test]
    fn generating_fields_change_the_spec_hash() {
        let base = spec_hash(&spec());
        let mut changed = spec();
        changed.batch_size = 11;
        assert_ne!(base, spec_hash(&changed));
        let mut changed = spec();
        changed.seed = 1;
        assert_ne!(base, spec_hash(&changed));
        let mut changed = spec();
        changed.model.name = "other".into();
        assert_ne!(base, spec_hash(&changed));
    }
}
