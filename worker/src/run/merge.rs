//! `merge`: batch files, in batch order, into one dataset-ordered `trajectories.jsonl`, plus
//! `failures.jsonl` and `statistics.json`.
//!
//! Every line is validated; exactly one record per (`prompt_index`, sample) is kept (a trajectory
//! wins over a failure); lines are copied byte for byte. Outputs are written to temp names and
//! renamed when complete, so a half-written merge never passes for a finished one.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::json;
use tracing::{info, warn};

use super::manifest::Manifest;
use super::{RunError, RunLocation};
use crate::plan::{MergeSummary, compact_ranges, format_ranges};
use crate::storage::{Context, StorageError, read_whole_lines, sync_dir, temp_path, write_atomic};

/// The fields of a record line that merge and statistics read; the conversation is skipped.
#[derive(Debug, Deserialize)]
struct RecordView<'a> {
    prompt_index: u64,
    #[serde(default)]
    sample: u32,
    #[serde(default, borrow)]
    status: Option<Cow<'a, str>>,
    #[serde(default)]
    completed: bool,
    #[serde(default)]
    partial: bool,
    #[serde(default)]
    api_calls: u64,
    #[serde(default, borrow)]
    tool_stats: BTreeMap<Cow<'a, str>, ToolCountsView>,
    #[serde(default)]
    usage: UsageView,
    #[serde(default)]
    reasoning_stats: ReasoningView,
    #[serde(default)]
    duration_ms: u64,
    #[serde(default, borrow)]
    error_class: Option<Cow<'a, str>>,
}

#[derive(Debug, Default, Deserialize)]
struct ToolCountsView {
    #[serde(default)]
    count: u64,
    #[serde(default)]
    success: u64,
    #[serde(default)]
    failure: u64,
}

// The field names mirror the record's JSON keys.
#[allow(clippy::struct_field_names)]
#[derive(Debug, Default, Deserialize)]
struct UsageView {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    reasoning_tokens: u64,
}

#[derive(Debug, Default, Deserialize)]
struct ReasoningView {
    #[serde(default)]
    total_assistant_turns: u64,
    #[serde(default)]
    turns_with_reasoning: u64,
}

/// Running totals for `statistics.json`.
#[derive(Debug, Default)]
struct Totals {
    succeeded: u64,
    discarded: u64,
    failed: u64,
    completed: u64,
    partial: u64,
    api_calls: u64,
    error_classes: BTreeMap<String, u64>,
    tools: BTreeMap<String, (u64, u64, u64)>,
    assistant_turns: u64,
    turns_with_reasoning: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    reasoning_tokens: u64,
    durations: Vec<u64>,
}

impl Totals {
    fn add(&mut self, view: &RecordView<'_>) {
        match view.status.as_deref() {
            None => {
                self.succeeded += 1;
                self.completed += u64::from(view.completed);
                self.partial += u64::from(view.partial);
                self.api_calls += view.api_calls;
                for (name, counts) in &view.tool_stats {
                    let entry = self.tools.entry(name.to_string()).or_default();
                    entry.0 += counts.count;
                    entry.1 += counts.success;
                    entry.2 += counts.failure;
                }
                self.assistant_turns += view.reasoning_stats.total_assistant_turns;
                self.turns_with_reasoning += view.reasoning_stats.turns_with_reasoning;
                self.prompt_tokens += view.usage.prompt_tokens;
                self.completion_tokens += view.usage.completion_tokens;
                self.reasoning_tokens += view.usage.reasoning_tokens;
                self.durations.push(view.duration_ms);
            }
            Some("discarded") => self.discarded += 1,
            Some(_) => {
                self.failed += 1;
                let class = view.error_class.as_deref().unwrap_or("unknown").to_owned();
                *self.error_classes.entry(class).or_default() += 1;
            }
        }
    }
}

/// A file being written under a temp name.
struct Output {
    path: PathBuf,
    temp: PathBuf,
    writer: BufWriter<File>,
    bytes: u64,
}

impl Output {
    fn create(path: PathBuf) -> Result<Self, StorageError> {
        let temp = temp_path(&path);
        let file = File::create(&temp).at("creating", &temp)?;
        Ok(Self {
            writer: BufWriter::with_capacity(1 << 20, file),
            path,
            temp,
            bytes: 0,
        })
    }

    fn line(&mut self, line: &[u8]) -> Result<(), StorageError> {
        self.writer
            .write_all(line)
            .and_then(|()| self.writer.write_all(b"\n"))
            .at("writing", &self.temp)?;
        self.bytes += line.len() as u64 + 1;
        Ok(())
    }

    fn finish(self) -> Result<u64, StorageError> {
        let file = self
            .writer
            .into_inner()
            .map_err(|err| StorageError::new("writing", &self.temp, err.into_error()))?;
        file.sync_all().at("syncing", &self.temp)?;
        std::fs::rename(&self.temp, &self.path).at("renaming into place", &self.path)?;
        Ok(self.bytes)
    }
}

/// Merges every batch of the run.
pub fn merge(location: &RunLocation) -> Result<MergeSummary, RunError> {
    let run_dir = location.run_dir();
    let manifest = Manifest::require(&run_dir)?;
    let openai = location.plan.spec.openai_format;
    let mut trajectories = Output::create(run_dir.trajectories())?;
    let mut failures = Output::create(run_dir.failures())?;
    let mut openai_out = if openai {
        Some(Output::create(run_dir.trajectories_openai())?)
    } else {
        None
    };
    let mut totals = Totals::default();
    let mut skipped_lines = 0u64;
    let done: std::collections::HashSet<u32> = run_dir.done_batches()?.into_iter().collect();
    let mut missing = Vec::new();

    for batch in 0..manifest.batch_count() {
        if !done.contains(&batch) {
            missing.push(batch);
        }
        let (data, lines) = read_whole_lines(&run_dir.batch_records(batch))?;
        let mut kept: Vec<(u64, u32, u8, usize)> = Vec::with_capacity(lines.len());
        let mut views = Vec::with_capacity(lines.len());
        for (start, end) in &lines {
            match serde_json::from_slice::<RecordView<'_>>(&data[*start..*end]) {
                Ok(view) => {
                    let rank = match view.status.as_deref() {
                        None => 0,
                        Some("discarded") => 1,
                        Some(_) => 2,
                    };
                    kept.push((view.prompt_index, view.sample, rank, views.len()));
                    views.push((view, *start, *end));
                }
                Err(err) => {
                    skipped_lines += 1;
                    warn!(batch, offset = start, %err, "skipping an invalid record line");
                }
            }
        }
        // Dataset order; for one key the best record first, then the first written.
        kept.sort_unstable();
        let before = kept.len();
        kept.dedup_by_key(|(prompt_index, sample, ..)| (*prompt_index, *sample));
        skipped_lines += (before - kept.len()) as u64;

        let openai_lines = if openai {
            openai_index(&run_dir.batch_openai_records(batch))?
        } else {
            HashMap::new()
        };
        for (prompt_index, sample, rank, position) in kept {
            let (view, start, end) = &views[position];
            totals.add(view);
            let line = &data[*start..*end];
            if rank == 0 {
                trajectories.line(line)?;
                if let (Some(out), Some(openai_line)) = (
                    openai_out.as_mut(),
                    openai_lines.get(&(prompt_index, sample)),
                ) {
                    out.line(openai_line)?;
                }
            } else {
                failures.line(line)?;
            }
        }
    }

    failures.finish()?;
    if let Some(out) = openai_out {
        out.finish()?;
    }
    let statistics = statistics(location, &manifest, &mut totals, &missing);
    let statistics_json = serde_json::to_vec_pretty(&statistics)
        .map_err(|err| RunError::Internal(err.to_string()))?;
    write_atomic(&run_dir.statistics(), &statistics_json)?;
    // Last, so that a trajectories file on storage always comes with its statistics.
    let bytes = trajectories.finish()?;
    sync_dir(run_dir.root())?;
    if !missing.is_empty() {
        warn!(missing = %format_ranges(&compact_ranges(missing.iter().copied())), "merged with batches not done");
    }
    let summary = MergeSummary {
        trajectories: totals.succeeded,
        discarded: totals.discarded,
        failed: totals.failed,
        bytes,
        skipped_lines,
    };
    info!(
        trajectories = summary.trajectories,
        failed = summary.failed,
        bytes,
        "merged"
    );
    Ok(summary)
}

/// OpenAI-form lines of a batch by key; the main file decides which of them are kept.
fn openai_index(path: &Path) -> Result<HashMap<(u64, u32), Vec<u8>>, RunError> {
    #[derive(Deserialize)]
    struct Key {
        prompt_index: u64,
        #[serde(default)]
        sample: u32,
    }
    let (data, lines) = read_whole_lines(path)?;
    let mut index = HashMap::new();
    for (start, end) in lines {
        if let Ok(key) = serde_json::from_slice::<Key>(&data[start..end]) {
            index
                .entry((key.prompt_index, key.sample))
                .or_insert_with(|| data[start..end].to_vec());
        }
    }
    Ok(index)
}

#[derive(Debug, Serialize)]
struct Percentiles {
    p50: u64,
    p90: u64,
    p99: u64,
    max: u64,
    mean: f64,
}

fn percentiles(values: &mut [u64]) -> Option<Percentiles> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    // Nearest rank: the smallest value with at least `percent`% of the values at or below it.
    let at = |percent: usize| {
        let rank = (values.len() * percent).div_ceil(100);
        values[rank.saturating_sub(1).min(values.len() - 1)]
    };
    let sum: u64 = values.iter().sum();
    Some(Percentiles {
        p50: at(50),
        p90: at(90),
        p99: at(99),
        max: values[values.len() - 1],
        mean: round2(sum as f64 / values.len() as f64),
    })
}

fn round2(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}

fn rate(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        round2(part as f64 * 100.0 / whole as f64)
    }
}

fn statistics(
    location: &RunLocation,
    manifest: &Manifest,
    totals: &mut Totals,
    missing: &[u32],
) -> serde_json::Value {
    let spec = &location.plan.spec;
    let mut tools: Vec<_> = totals
        .tools
        .iter()
        .filter(|(_, (count, ..))| *count > 0)
        .collect();
    tools.sort_by(|a, b| b.1.0.cmp(&a.1.0).then_with(|| a.0.cmp(b.0)));
    let tool_statistics: serde_json::Map<String, serde_json::Value> = tools
        .into_iter()
        .map(|(name, (count, success, failure))| {
            (
                name.clone(),
                json!({
                    "count": count, "success": success, "failure": failure,
                    "success_rate": rate(*success, success + failure),
                    "failure_rate": rate(*failure, success + failure),
                }),
            )
        })
        .collect();
    let records = totals.succeeded + totals.discarded + totals.failed;
    json!({
        "run_name": location.plan.name,
        "namespace": location.plan.namespace,
        "model": spec.model.name,
        "distribution": spec.distribution,
        "dataset": {"path": manifest.dataset.path, "digest": manifest.dataset.digest,
                    "prompts": manifest.dataset.prompts, "invalid": manifest.dataset.invalid},
        "batch_size": manifest.batch_size,
        "samples_per_prompt": manifest.samples_per_prompt,
        "total_batches": manifest.batch_count(),
        "missing_batches": format_ranges(&compact_ranges(missing.iter().copied())),
        "completed_at": crate::hermes::timestamp(chrono::Utc::now()),
        "counts": {
            "records": records,
            "succeeded": totals.succeeded,
            "discarded": totals.discarded,
            "failed": totals.failed,
            "completed": totals.completed,
            "partial": totals.partial,
            "failure_rate": rate(totals.failed, records),
        },
        "error_classes": totals.error_classes,
        "tool_statistics": tool_statistics,
        "reasoning_statistics": {
            "total_assistant_turns": totals.assistant_turns,
            "turns_with_reasoning": totals.turns_with_reasoning,
            "turns_without_reasoning": totals.assistant_turns - totals.turns_with_reasoning,
            "coverage": rate(totals.turns_with_reasoning, totals.assistant_turns),
        },
        "discarded_no_reasoning": totals.discarded,
        "tokens": {
            "prompt": totals.prompt_tokens,
            "completion": totals.completion_tokens,
            "reasoning": totals.reasoning_tokens,
            "total": totals.prompt_tokens + totals.completion_tokens,
        },
        "api_calls": {"total": totals.api_calls,
                      "mean": if totals.succeeded == 0 { 0.0 } else { round2(totals.api_calls as f64 / totals.succeeded as f64) }},
        "latency_ms": {"conversation": percentiles(&mut totals.durations)},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut values: Vec<u64> = (1..=100).rev().collect();
        let p = percentiles(&mut values).unwrap();
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50, 90, 99, 100));
        assert!(percentiles(&mut []).is_none());
    }
}
