//! `plan`: one streaming pass over the dataset that validates every line, records the batch
//! layout and the run's identity, and finds batches already done.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};

use tracing::info;

use super::manifest::{
    BatchLayout, DatasetInfo, MANIFEST_VERSION, Manifest, RunIdentity, spec_hash,
};
use super::{RunError, RunLocation};
use crate::dataset::{LineReader, MAX_LINE_BYTES, probe_line};
use crate::distribution::Distribution;
use crate::plan::{PlanSummary, compact_ranges};
use crate::storage::{Context, StorageError, sync_dir, temp_path, write_atomic};
use crate::tools::Registry;

/// Validates the dataset and writes `manifest.json` and `invalid.jsonl`.
pub fn plan(location: &RunLocation) -> Result<(Manifest, PlanSummary), RunError> {
    let spec = &location.plan.spec;
    let registry = Registry::builtin(&spec.tools);
    let distribution = Distribution::resolve(&spec.distribution, &registry)
        .map_err(|err| RunError::Spec(err.to_string()))?;
    let catalog = registry.catalog(&distribution.possible_toolsets());
    let run_dir = location.run_dir();
    let dataset_path = location.dataset_path();
    let file = File::open(&dataset_path).map_err(|err| {
        RunError::InvalidDataset(format!(
            "cannot open spec.dataset.path {}: {err}",
            dataset_path.display()
        ))
    })?;

    std::fs::create_dir_all(run_dir.root()).at("creating", run_dir.root())?;
    let invalid_path = run_dir.invalid();
    let invalid_temp = temp_path(&invalid_path);
    let mut invalid_out =
        BufWriter::new(File::create(&invalid_temp).at("creating", &invalid_temp)?);

    let max_samples = spec.dataset.max_samples.unwrap_or(u64::MAX);
    let batch_size = u64::from(spec.batch_size);
    let mut reader = LineReader::new(BufReader::with_capacity(1 << 20, file), MAX_LINE_BYTES);
    let mut file_hasher = blake3::Hasher::new();
    let mut batch_hasher = blake3::Hasher::new();
    let mut buffer = Vec::new();
    let mut batches: Vec<BatchLayout> = Vec::new();
    let (mut lines, mut prompts, mut invalid, mut bytes) = (0u64, 0u64, 0u64, 0u64);
    let mut batch_start = 0u64;
    let mut valid_end = 0u64;
    let mut observe = |chunk: &[u8]| {
        file_hasher.update(chunk);
    };
    loop {
        let next = reader.next_line(&mut buffer, &mut observe).map_err(|err| {
            RunError::InvalidDataset(format!("cannot read {}: {err}", dataset_path.display()))
        })?;
        let Some(line) = next else { break };
        lines += 1;
        bytes = line.offset + line.length;
        if prompts >= max_samples {
            continue;
        }
        match probe_line(&buffer, &line, &spec.dataset.prompt_field) {
            Ok(()) => {
                if prompts % batch_size == 0 {
                    batch_start = line.offset;
                }
                batch_hasher.update(&buffer);
                batch_hasher.update(b"\n");
                prompts += 1;
                valid_end = bytes;
                if prompts % batch_size == 0 {
                    batches.push(BatchLayout(
                        batch_start,
                        valid_end,
                        batch_hasher.finalize().to_hex()[..32].to_owned(),
                    ));
                    batch_hasher = blake3::Hasher::new();
                }
            }
            Err(rejection) => {
                invalid += 1;
                let excerpt =
                    String::from_utf8_lossy(&buffer[..buffer.len().min(200)]).into_owned();
                let entry = serde_json::json!({
                    "line": line.number,
                    "offset": line.offset,
                    "reason": rejection.reason.as_str(),
                    "message": rejection.message,
                    "excerpt": excerpt,
                });
                serde_json::to_writer(&mut invalid_out, &entry)
                    .map_err(std::io::Error::from)
                    .and_then(|()| invalid_out.write_all(b"\n"))
                    .at("writing", &invalid_temp)?;
            }
        }
    }
    if prompts % batch_size != 0 {
        batches.push(BatchLayout(
            batch_start,
            valid_end,
            batch_hasher.finalize().to_hex()[..32].to_owned(),
        ));
    }
    let file = invalid_out
        .into_inner()
        .map_err(|err| StorageError::new("writing", &invalid_temp, err.into_error()))?;

    let dataset = DatasetInfo {
        path: spec.dataset.path.clone(),
        digest: format!("blake3:{}", file_hasher.finalize().to_hex()),
        bytes,
        lines,
        prompts,
        invalid,
    };
    let fail = |error: RunError| {
        let _ = std::fs::remove_file(&invalid_temp);
        Err(error)
    };
    if prompts == 0 {
        return fail(RunError::InvalidDataset(format!(
            "{} has no valid prompt ({lines} lines, {invalid} invalid)",
            dataset_path.display()
        )));
    }
    let spec_hash = spec_hash(spec);
    let manifest = match Manifest::load(&run_dir) {
        Err(error) => return fail(error),
        Ok(Some(existing)) => {
            if existing.dataset.digest != dataset.digest || existing.spec_hash != spec_hash {
                return fail(RunError::OutputMismatch(format!(
                    "output directory {} belongs to a run with dataset {} and spec {}, but this run has \
                     dataset {} and spec {}; restore the dataset and generating fields, or use another \
                     spec.storage.outputPath",
                    run_dir.root().display(),
                    existing.dataset.digest,
                    existing.spec_hash,
                    dataset.digest,
                    spec_hash
                )));
            }
            existing
        }
        Ok(None) => Manifest {
            version: MANIFEST_VERSION,
            run: RunIdentity {
                name: location.plan.name.clone(),
                namespace: location.plan.namespace.clone(),
                uid: location.plan.uid.clone(),
            },
            created_at: crate::hermes::timestamp(chrono::Utc::now()),
            dataset,
            spec_hash,
            batch_size: spec.batch_size,
            samples_per_prompt: spec.samples_per_prompt,
            tool_catalog: catalog,
            batches,
        },
    };
    file.sync_all().at("syncing", &invalid_temp)?;
    std::fs::rename(&invalid_temp, &invalid_path).at("renaming into place", &invalid_path)?;
    let manifest_json =
        serde_json::to_vec(&manifest).map_err(|err| RunError::Internal(err.to_string()))?;
    write_atomic(&run_dir.manifest(), &manifest_json)?;
    sync_dir(run_dir.root())?;

    let done = run_dir.done_batches()?;
    let summary = PlanSummary {
        prompts: manifest.dataset.prompts,
        invalid: manifest.dataset.invalid,
        batches: manifest.batch_count(),
        done: compact_ranges(done.into_iter().filter(|id| *id < manifest.batch_count())),
        dataset_digest: manifest.dataset.digest.clone(),
        spec_hash: manifest.spec_hash.clone(),
    };
    info!(
        prompts = summary.prompts,
        invalid = summary.invalid,
        batches = summary.batches,
        "planned {}",
        run_dir.root().display()
    );
    Ok((manifest, summary))
}
