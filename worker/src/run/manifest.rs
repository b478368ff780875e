//! `manifest.json`: the run's identity and the batch layout, written once by `plan`.

use serde::{Deserialize, Serialize};

use super::RunError;
use crate::spec::RunSpec;
use crate::storage::RunDir;

/// Bumped when the manifest's meaning changes. Version 2: the dataset's segment digests replace
/// the per-batch digests of version 1.
pub const MANIFEST_VERSION: u32 = 2;

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
    /// The tools of the spec's MCP servers, as `plan` discovered them: every batch offers these,
    /// whatever the servers list later.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_tools: Vec<crate::tools::mcp::FrozenServer>,
    /// Per batch: the byte range of its lines in the dataset (a batch checks the bytes against
    /// the dataset's segment digests).
    pub batches: Vec<BatchLayout>,
    /// The container images the rows name (`image`, else `docker_image`), each once, in the
    /// order the dataset first names them. Empty when no row names one; then every batch holds
    /// `batchSize` prompts (the last one may be short), and the two lists below are empty too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<String>,
    /// Per batch, when rows name images: its image, as a position in [`Manifest::images`] from
    /// 1, or 0 for rows that name none. A batch holds rows of one image only: it is cut where
    /// the image changes, and holds at most [`crate::contract::task_batch_prompts`] prompts of
    /// an image (each conversation gets a container of its own in the batch's pod).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch_images: Vec<u32>,
    /// Per batch, when rows name images: the prompt index of its first prompt (batches are no
    /// longer all `batchSize` prompts long).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub first_prompts: Vec<u64>,
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
    /// `blake3:` digest of the whole file (as `b3sum` prints it).
    pub digest: String,
    pub bytes: u64,
    pub lines: u64,
    pub prompts: u64,
    pub invalid: u64,
    /// The file is cut every `segmentBytes` of offset ([`super::segments`]).
    pub segment_bytes: u64,
    /// Per segment, the first 32 hex digits of its BLAKE3 chaining value (the subtree hash the
    /// whole file's digest is merged from).
    pub segment_digests: Vec<String>,
}

/// `[start, end)` of one batch's lines: compact, since a run may have a million batches. The
/// range runs from its first valid line to the end of its last, invalid lines between included.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchLayout(pub u64, pub u64);

impl BatchLayout {
    pub fn start(&self) -> u64 {
        self.0
    }
    pub fn end(&self) -> u64 {
        self.1
    }
}

impl Manifest {
    pub fn load(run_dir: &RunDir) -> Result<Option<Self>, RunError> {
        /// Read first, so that another version is named as such rather than as a parse error.
        #[derive(Deserialize)]
        struct Version {
            version: u32,
        }
        let path = run_dir.manifest();
        let not_understood = |err: &dyn std::fmt::Display| {
            RunError::OutputMismatch(format!(
                "{} is not a manifest this worker understands: {err}",
                path.display()
            ))
        };
        match run_dir.store().read(&path) {
            Ok(bytes) => {
                let Version { version } =
                    serde_json::from_slice(&bytes).map_err(|err| not_understood(&err))?;
                if version != MANIFEST_VERSION {
                    return Err(not_understood(&format!(
                        "it has version {version} and this worker reads version {MANIFEST_VERSION}; \
                         plan into another spec.storage.outputPath"
                    )));
                }
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|err| not_understood(&err))
            }
            Err(err) if err.is_not_found() => Ok(None),
            Err(err) => Err(err.into()),
        }
    }

    /// Loads the manifest a batch or merge needs; its absence means `plan` never ran.
    pub fn require(run_dir: &RunDir) -> Result<Self, RunError> {
        Self::load(run_dir)?.ok_or_else(|| {
            RunError::Spec(format!(
                "{} does not exist: run `trajectory-worker plan` first (or the volume mounted \
                 at the storage root is not the run's)",
                run_dir.manifest().display()
            ))
        })
    }

    /// Prompt index of a batch's first prompt.
    pub fn first_prompt(&self, batch: u32) -> u64 {
        match self.first_prompts.get(batch as usize) {
            Some(first) => *first,
            None if self.first_prompts.is_empty() => u64::from(batch) * u64::from(self.batch_size),
            // Past the last batch.
            None => self.dataset.prompts,
        }
    }

    /// Prompts in a batch (the last one may be short; with images, any may be).
    pub fn prompts_in(&self, batch: u32) -> u64 {
        let first = self.first_prompt(batch);
        if self.first_prompts.is_empty() {
            return self
                .dataset
                .prompts
                .saturating_sub(first)
                .min(u64::from(self.batch_size));
        }
        self.first_prompt(batch.saturating_add(1))
            .min(self.dataset.prompts)
            .saturating_sub(first)
    }

    /// The container image a batch's rows name, if they name one.
    pub fn image_of(&self, batch: u32) -> Option<&str> {
        let position = *self.batch_images.get(batch as usize)?;
        self.images
            .get((position as usize).checked_sub(1)?)
            .map(String::as_str)
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
    // Declared HTTP tools are what the model is offered, so they count; added only when there are
    // any, so that the hash of a run without them is what it always was. (MCP servers' tools are
    // frozen in the manifest instead; their addresses are operational.)
    let mut generating = generating;
    if !spec.tools.http.is_empty() {
        generating["httpTools"] = serde_json::to_value(&spec.tools.http).unwrap_or_default();
    }
    // The verifier decides each record's reward and, with `passesPerPrompt`, which samples run;
    // added only when set, as above.
    // An oracle pass and a model's run of the same rows are different outputs; added only
    // when set, as above.
    if spec.agent.oracle {
        generating["agent"]["oracle"] = true.into();
    }
    if let Some(verifier) = &spec.verifier {
        generating["verifier"] = serde_json::to_value(verifier).unwrap_or_default();
    }
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
    fn a_manifest_of_another_version_is_refused_naming_both_versions() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path());
        std::fs::write(
            run_dir.manifest(),
            r#"{"version": 1, "batches": [[0, 10, "abc"]]}"#,
        )
        .unwrap();
        let error = Manifest::load(&run_dir).unwrap_err().to_string();
        assert!(
            error.contains("it has version 1 and this worker reads version 2"),
            "{error}"
        );
    }

    #[test]
    fn operational_fields_do_not_change_the_spec_hash() {
        let base = spec();
        let mut changed = base.clone();
        changed.workers = 99;
        changed.concurrency = 7;
        changed.model.base_url = String::new();
        changed.model.endpoints = vec![crate::spec::EndpointSpec {
            base_url: "http://b/v1".into(),
        }];
        changed.model.routing.load_bound = 2.0;
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
        let mut changed = spec();
        changed.filters.min_reward = Some(1.0);
        assert_ne!(base, spec_hash(&changed));
        let mut verified = spec();
        verified.verifier = Some(crate::spec::VerifierSpec::default());
        assert_ne!(base, spec_hash(&verified));
        let mut changed = verified.clone();
        changed.verifier.as_mut().unwrap().passes_per_prompt = Some(1);
        assert_ne!(spec_hash(&verified), spec_hash(&changed));
    }
}
