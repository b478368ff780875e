//! `merge`: batch files, in batch order, into one dataset-ordered `trajectories.jsonl`, plus
//! `failures.jsonl` and `statistics.json`.
//!
//! A batch may have several records files, one per writer (see [`super::batch`]); merge reads them
//! all, in the order [`RunDir::records_files`] gives (the legacy single file, then the writers' in
//! name order), each up to its last whole line. Every line is validated, and exactly one record per
//! (`prompt_index`, sample) is kept: the best one (a trajectory, then a discarded record, then a
//! failed one), and of equally good ones the first in that file order and line order. Best first,
//! because every record of a key is a legitimate outcome of the same (prompt, sample) with the same
//! toolsets, and a trajectory is the one a user wants; a failed record is final only when it is
//! all there is. First in name order, because that is a function of the files alone: merging the
//! same files again writes the same bytes. A kept trajectory's `OpenAI`-form line comes from its
//! own writer's twin file (matched there by `finished_at`), never from another writer's.
//! Lines are copied byte for byte; statistics count the kept records only. Outputs are written to
//! temp names and renamed when complete, so a half-written merge never passes for a finished one.
//!
//! A batch marked done that lacks a key fails the merge (`IncompleteBatch`), after every batch has
//! been checked: the markers of all such batches are removed first, so that a new plan sees them
//! pending and their next run generates only the missing keys.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::BufRead as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use serde::{Deserialize, Serialize};
use serde_json::json;
use tracing::{info, warn};

use super::manifest::Manifest;
use super::oracle::{ORACLE_REPORT, OracleOutcome};
use super::{RunError, RunLocation};
use crate::contract::{MergeSummary, compact_ranges, format_ranges};
use crate::json_scan;
use crate::report;
use crate::storage::{Context, FilesLines, RunDir, StorageError, Store, temp_path, write_lines};
use crate::training::{EndpointCalls, IdSource, TOKENS_KEY, TokensAt, endpoints_of, source_of};

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
    /// Pairs a trajectory with its `OpenAI`-form line.
    #[serde(default, borrow)]
    finished_at: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    toolsets_used: Vec<Cow<'a, str>>,
    /// A discarded record's filter.
    #[serde(default, borrow)]
    filter: Option<Cow<'a, str>>,
    /// A verified record's reward.
    #[serde(default)]
    reward: Option<f64>,
    #[serde(default)]
    verification: Option<VerificationView>,
    /// What its model calls cost, when priced or reported.
    #[serde(default)]
    cost: Option<super::costs::CostView>,
    /// The paths the sandbox refused its commands, by prefix.
    #[serde(default, borrow)]
    sandbox_refusals: BTreeMap<Cow<'a, str>, u64>,
    /// An episode's outcome (rows with several user turns).
    #[serde(default)]
    episode: Option<super::episodes::EpisodeView>,
    /// What each of its calls answered in a provider batch waited (batch mode).
    #[serde(default)]
    batch_waits_ms: Vec<u64>,
    /// Whether the line ends with its tokens (read from whole lines only: a short line has
    /// them left out).
    #[serde(default)]
    tokens: Option<serde::de::IgnoredAny>,
}

/// A record's Harbor task names, read for an oracle run's report only, and apart from
/// [`RecordView`]: any other dataset's rows may hold anything under `source`, which must not make
/// their records unreadable.
#[derive(Debug, Default, Deserialize)]
struct HarborNames<'a> {
    #[serde(default, borrow)]
    source: SourceView<'a>,
}

#[derive(Debug, Default, Deserialize)]
struct SourceView<'a> {
    #[serde(default, borrow)]
    harbor: Option<HarborView<'a>>,
}

#[derive(Debug, Default, Deserialize)]
struct HarborView<'a> {
    #[serde(default, borrow)]
    task: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    name: Option<Cow<'a, str>>,
}

#[derive(Debug, Default, Deserialize)]
struct VerificationView {
    #[serde(default)]
    passed: bool,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
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

/// Writes `report.html` again from a merged run's outputs (`statistics.json`,
/// `trajectories.jsonl`, `failures.jsonl`), counting their records as merge counted them:
/// what `trajectory-worker report` does. Returns the report's path.
pub fn rewrite_report(run_dir: &RunDir) -> Result<PathBuf, RunError> {
    let path = run_dir.statistics();
    let text = std::fs::read(&path).at("read", &path)?;
    let statistics: serde_json::Value = serde_json::from_slice(&text).map_err(|err| {
        RunError::OutputMismatch(format!(
            "{}: not a merged run's statistics: {err}",
            path.display()
        ))
    })?;
    let mut totals = Totals::new(true);
    for file in [run_dir.trajectories(), run_dir.failures()] {
        let Some(mut reader) = open_output(&file)? else {
            continue;
        };
        let mut line = Vec::new();
        loop {
            line.clear();
            if reader.read_until(b'\n', &mut line).at("read", &file)? == 0 {
                break;
            }
            // Merge wrote these lines after checking them; one that does not parse now is
            // skipped, as merge skips one.
            if let Ok(view) = serde_json::from_slice::<RecordView<'_>>(&line) {
                totals.add(&view, &line);
            }
        }
    }
    Ok(report::write(
        run_dir,
        &statistics,
        totals.report.unwrap_or_default(),
    )?)
}

/// A merged output for reading; `None` when the run has none.
fn open_output(path: &Path) -> Result<Option<std::io::BufReader<File>>, RunError> {
    match File::open(path) {
        Ok(file) => Ok(Some(std::io::BufReader::with_capacity(1 << 20, file))),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(StorageError::new("open", path, err).into()),
    }
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
    /// Batch mode: every kept record's batch waits, and its rounds (calls in a batch).
    batch_waits: Vec<u64>,
    batch_rounds: Vec<u64>,
    /// Discarded records by their filter.
    discarded_by: BTreeMap<String, u64>,
    /// What the verifiers of the verified records found.
    rewards: super::rewards::Rewards,
    /// What the priced records' model calls cost.
    costs: super::costs::Costs,
    /// Conversations of rows naming an image, by the image's position in the manifest: how many
    /// ran in a container of it, how many were recorded `image_unavailable`, and how many
    /// `image_build_failed`.
    task_images: BTreeMap<u32, (u64, u64, u64)>,
    /// What the pods that finished the batches of rows naming an image waited for it.
    pulls: super::pulls::PullTotals,
    /// Paths the sandbox refused the commands of every kept record, by prefix.
    sandbox_refusals: BTreeMap<String, u64>,
    /// Trajectories with tokens, by where their ids came from: the server (every call), some
    /// calls, none.
    token_sources: [u64; 4],
    /// Their calls per endpoint, by base URL.
    token_endpoints: BTreeMap<String, EndpointCalls>,
    /// How the kept records of episodes went.
    episodes: super::episodes::Episodes,
    /// What `report.html` shows beyond the statistics (`None`: no report is written).
    report: Option<report::Collector>,
    /// An oracle run's records, each passed or not (`None`: not an oracle run).
    oracle: Option<Vec<OracleOutcome>>,
}

impl Totals {
    fn new(report: bool) -> Self {
        Self {
            report: report.then(report::Collector::default),
            ..Self::default()
        }
    }

    /// These totals keep each record's oracle outcome, when `oracle`.
    fn gathering_oracle(mut self, oracle: bool) -> Self {
        self.oracle = oracle.then(Vec::new);
        self
    }

    /// Adds another reader's totals.
    fn absorb(&mut self, other: Self) {
        self.succeeded += other.succeeded;
        self.discarded += other.discarded;
        for (filter, count) in other.discarded_by {
            *self.discarded_by.entry(filter).or_default() += count;
        }
        self.rewards.absorb(other.rewards);
        if let (Some(outcomes), Some(more)) = (self.oracle.as_mut(), other.oracle) {
            outcomes.extend(more);
        }
        self.costs.absorb(other.costs);
        self.episodes.absorb(other.episodes);
        self.failed += other.failed;
        self.completed += other.completed;
        self.partial += other.partial;
        self.api_calls += other.api_calls;
        for (class, count) in other.error_classes {
            *self.error_classes.entry(class).or_default() += count;
        }
        for (name, (count, success, failure)) in other.tools {
            let entry = self.tools.entry(name).or_default();
            entry.0 += count;
            entry.1 += success;
            entry.2 += failure;
        }
        self.assistant_turns += other.assistant_turns;
        self.turns_with_reasoning += other.turns_with_reasoning;
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.reasoning_tokens += other.reasoning_tokens;
        self.durations.extend(other.durations);
        self.batch_waits.extend(other.batch_waits);
        self.batch_rounds.extend(other.batch_rounds);
        for (total, part) in self.token_sources.iter_mut().zip(other.token_sources) {
            *total += part;
        }
        for (endpoint, calls) in other.token_endpoints {
            self.token_endpoints
                .entry(endpoint)
                .or_default()
                .add(&calls);
        }
        for (prefix, count) in other.sandbox_refusals {
            *self.sandbox_refusals.entry(prefix).or_default() += count;
        }
        for (image, (ran, unavailable, build_failed)) in other.task_images {
            let entry = self.task_images.entry(image).or_default();
            entry.0 += ran;
            entry.1 += unavailable;
            entry.2 += build_failed;
        }
        self.pulls.absorb(other.pulls);
        if let (Some(report), Some(other)) = (self.report.as_mut(), other.report) {
            report.absorb(other);
        }
    }

    /// Counts a kept trajectory's tokens line by the source of its ids, and its calls per
    /// endpoint.
    fn add_tokens(&mut self, tokens: &[u8]) {
        let slot = match source_of(tokens) {
            Some(IdSource::Server) => 0,
            Some(IdSource::Retokenized) => 1,
            Some(IdSource::Partial) => 2,
            Some(IdSource::None) | None => 3,
        };
        self.token_sources[slot] += 1;
        for calls in endpoints_of(tokens) {
            self.token_endpoints
                .entry(calls.endpoint.clone())
                .or_default()
                .add(&calls);
        }
    }

    /// Counts a kept record; `line` is its whole line.
    fn add(&mut self, view: &RecordView<'_>, line: &[u8]) {
        if let Some(collected) = self.report.as_mut() {
            let facts = report::RecordFacts {
                prompt_index: view.prompt_index,
                sample: view.sample,
                outcome: report::Outcome::of(
                    view.status.as_deref(),
                    (view.completed, view.partial),
                    view.filter.as_deref(),
                    view.error_class.as_deref(),
                ),
                api_calls: view.api_calls,
                tokens: view.usage.prompt_tokens + view.usage.completion_tokens,
                duration_ms: view.duration_ms,
                tool_calls: view.tool_stats.values().map(|tool| tool.count).sum(),
                tool_failures: view.tool_stats.values().map(|tool| tool.failure).sum(),
            };
            collected.add(&facts, view.toolsets_used.iter().map(AsRef::as_ref), line);
        }
        if let Some(cost) = &view.cost {
            self.costs.add(cost, view.status.is_none());
        }
        if let Some(outcomes) = self.oracle.as_mut() {
            let names = serde_json::from_slice::<HarborNames<'_>>(line).unwrap_or_default();
            let harbor = names.source.harbor.as_ref();
            outcomes.push(OracleOutcome::new(
                view.prompt_index,
                view.sample,
                (
                    harbor.and_then(|harbor| harbor.task.as_deref()),
                    harbor.and_then(|harbor| harbor.name.as_deref()),
                ),
                view.reward,
                view.error_class.as_deref(),
            ));
        }
        if let Some(episode) = &view.episode {
            self.episodes.add(episode);
        }
        // Every kept record's: a discarded conversation met the sandbox's walls as well.
        for (prefix, count) in &view.sandbox_refusals {
            *self.sandbox_refusals.entry(prefix.to_string()).or_default() += count;
        }
        if let (Some(reward), Some(verification)) = (view.reward, &view.verification) {
            self.rewards.add(super::rewards::VerifiedRecord {
                reward,
                passed: verification.passed,
                failed: verification.error.is_some(),
                toolsets: view.toolsets_used.iter().map(AsRef::as_ref),
                below_reward: view.filter.as_deref() == Some(super::batch::BELOW_REWARD),
            });
        }
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
                if !view.batch_waits_ms.is_empty() {
                    self.batch_rounds.push(view.batch_waits_ms.len() as u64);
                    self.batch_waits.extend(&view.batch_waits_ms);
                }
            }
            Some("discarded") => {
                self.discarded += 1;
                let filter = view.filter.as_deref().unwrap_or("unknown");
                *self.discarded_by.entry(filter.to_owned()).or_default() += 1;
            }
            Some(_) => {
                self.failed += 1;
                let class = view.error_class.as_deref().unwrap_or("unknown").to_owned();
                *self.error_classes.entry(class).or_default() += 1;
            }
        }
    }
}

impl Totals {
    /// `statistics.json`'s `sandbox_refusals`: the paths the sandbox refused the commands, by
    /// prefix, as the records' notes named them. `None` when there were none.
    fn sandbox_refusals(&self) -> Option<serde_json::Value> {
        (!self.sandbox_refusals.is_empty()).then(|| json!(self.sandbox_refusals))
    }

    /// Counts a kept record of a row that names the image at `image` in the manifest.
    fn add_task_image(&mut self, image: u32, view: &RecordView<'_>) {
        let entry = self.task_images.entry(image).or_default();
        match view.error_class.as_deref() {
            Some(super::batch::IMAGE_UNAVAILABLE) => entry.1 += 1,
            Some(super::batch::IMAGE_BUILD_FAILED) => entry.2 += 1,
            _ => entry.0 += 1,
        }
    }

    /// `statistics.json`'s `task_images`: the images the rows name, how many were pulled (a
    /// conversation ran in a container of theirs) and how many could not be, and the
    /// conversations of each outcome. `None` when no row names an image.
    fn task_images(&self) -> Option<serde_json::Value> {
        if self.task_images.is_empty() {
            return None;
        }
        let pulled = self
            .task_images
            .values()
            .filter(|(ran, ..)| *ran > 0)
            .count();
        let (ran, unavailable, build_failed) = self.task_images.values().fold(
            (0, 0, 0),
            |(ran, unavailable, build_failed), (r, u, b)| {
                (ran + r, unavailable + u, build_failed + b)
            },
        );
        let mut statistics = json!({
            "images": self.task_images.len(),
            "pulled": pulled,
            "unavailable": self.task_images.len() - pulled,
            "conversations": {"ran": ran, "image_unavailable": unavailable},
        });
        // Only for a run that builds images, and then only when some build failed.
        if build_failed > 0 {
            let failed_images = self
                .task_images
                .values()
                .filter(|(ran, _, b)| *ran == 0 && *b > 0)
                .count();
            statistics["build_failed"] = failed_images.into();
            statistics["conversations"]["image_build_failed"] = build_failed.into();
        }
        if let Some(pulls) = self.pulls.summary() {
            statistics["pulls"] = pulls;
        }
        Some(statistics)
    }
}

/// Bytes written to an output between two background syncs.
const SYNC_EVERY_BYTES: u64 = 32 << 20;

/// A file being written under a temp name, a batch's lines at a time.
///
/// A helper thread syncs the file every [`SYNC_EVERY_BYTES`] written, so the disk writes while
/// merge reads and validates the next batches, and the sync before the rename only waits for the
/// last stretch. The helper's sync error, if any, fails the output: a failed sync on Linux clears
/// the error, so the final sync alone could not be trusted to report it.
struct FileOutput {
    path: PathBuf,
    temp: PathBuf,
    file: File,
    bytes: u64,
    synced_at: u64,
    renamed: bool,
    syncer: Option<(
        mpsc::Sender<()>,
        std::thread::JoinHandle<std::io::Result<()>>,
    )>,
}

/// A merged output: a file on a volume, an upload to a bucket (which appears whole when it
/// completes, and not at all before).
enum Output {
    File(FileOutput),
    Object {
        output: crate::storage::Output,
        bytes: u64,
    },
}

impl Output {
    fn create(store: &Store, path: PathBuf) -> Result<Self, StorageError> {
        Ok(match store {
            Store::Volume => Self::File(FileOutput::create(path)?),
            Store::Bucket(_) => Self::Object {
                output: store.output(&path)?,
                bytes: 0,
            },
        })
    }

    fn lines(&mut self, lines: &[&[u8]]) -> Result<(), StorageError> {
        match self {
            Self::File(file) => file.lines(lines),
            Self::Object { output, bytes } => {
                for line in lines {
                    output
                        .write_all(line)
                        .and_then(|()| output.write_all(b"\n"))
                        .at("writing", output.path())?;
                    *bytes += line.len() as u64 + 1;
                }
                Ok(())
            }
        }
    }

    fn finish(self) -> Result<u64, StorageError> {
        match self {
            Self::File(file) => file.finish(),
            Self::Object { output, bytes } => output.finish().map(|()| bytes),
        }
    }
}

impl FileOutput {
    fn create(path: PathBuf) -> Result<Self, StorageError> {
        let temp = temp_path(&path);
        let file = File::create(&temp).at("creating", &temp)?;
        let to_sync = file.try_clone().at("opening", &temp)?;
        let (sync, requests) = mpsc::channel::<()>();
        let syncer = std::thread::spawn(move || {
            while requests.recv().is_ok() {
                // Requests sent while the last sync ran are all served by the next one.
                while requests.try_recv().is_ok() {}
                to_sync.sync_data()?;
            }
            Ok(())
        });
        Ok(Self {
            path,
            temp,
            file,
            bytes: 0,
            synced_at: 0,
            renamed: false,
            syncer: Some((sync, syncer)),
        })
    }

    /// Appends whole lines (a newline is added to each) with gathered writes.
    fn lines(&mut self, lines: &[&[u8]]) -> Result<(), StorageError> {
        write_lines(&mut self.file, lines).at("writing", &self.temp)?;
        self.bytes += lines.iter().map(|line| line.len() as u64 + 1).sum::<u64>();
        if self.bytes - self.synced_at >= SYNC_EVERY_BYTES
            && let Some((sync, _)) = &self.syncer
        {
            // A stopped helper reports its error at `finish`.
            let _ = sync.send(());
            self.synced_at = self.bytes;
        }
        Ok(())
    }

    fn stop_syncer(&mut self) -> std::io::Result<()> {
        let Some((sync, syncer)) = self.syncer.take() else {
            return Ok(());
        };
        drop(sync);
        syncer
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the sync thread panicked")))
    }

    fn finish(mut self) -> Result<u64, StorageError> {
        self.stop_syncer().at("syncing", &self.temp)?;
        self.file.sync_all().at("syncing", &self.temp)?;
        std::fs::rename(&self.temp, &self.path).at("renaming into place", &self.path)?;
        self.renamed = true;
        Ok(self.bytes)
    }
}

impl Drop for FileOutput {
    /// A merge that stopped at an error leaves no temp file: it can be as large as the output.
    fn drop(&mut self) {
        if !self.renamed {
            let _ = self.stop_syncer();
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// The record lines of one batch as [`RecordView`]s are parsed from them: each line that
/// [`json_scan`] vouches for without its `conversations` (most of a record's bytes), which is
/// then left out, so `serde_json` reads only the rest; any other line whole, which `serde_json`
/// then validates as before. A line is accepted exactly when it was before: the scanner vouches
/// only for what `serde_json` accepts.
struct ViewLines<'a> {
    data: &'a [u8],
    lines: &'a [(usize, usize)],
    /// The lines with `conversations` (and `tokens`) left out, one after another.
    short: Vec<u8>,
    /// For each line, its range in `short`, when it has one.
    spans: Vec<Option<(usize, usize)>>,
    /// For each line with a short form, where its tokens are (offsets in the line), if it has
    /// them.
    tokens: Vec<Option<TokensAt>>,
}

impl<'a> ViewLines<'a> {
    fn new(data: &'a [u8], lines: &'a [(usize, usize)]) -> Self {
        let mut short = Vec::with_capacity(lines.len() * 2048);
        let mut tokens_of = Vec::with_capacity(lines.len());
        let spans = lines
            .iter()
            .map(|&(start, end)| {
                let line = &data[start..end];
                let mut conversations = None;
                let mut tokens = None;
                let mut after_tokens = false;
                let sure = json_scan::object_line(line, |field| {
                    if after_tokens {
                        // The tokens are the last field, or they are not where merge cuts.
                        false
                    } else if field.is("conversations") {
                        conversations.replace(field.value.clone()).is_none()
                    } else if field.is(TOKENS_KEY) {
                        after_tokens = true;
                        let key_quote = field.raw_key.as_ptr().addr() - line.as_ptr().addr() - 1;
                        tokens = TokensAt::of_field(line, key_quote, field.value.clone());
                        tokens.is_some()
                    } else {
                        !field.key_escaped
                    }
                });
                let left_out = conversations.filter(|_| sure);
                tokens_of.push(tokens.clone().filter(|_| left_out.is_some()));
                let left_out = left_out?;
                let span_start = short.len();
                short.extend_from_slice(&line[..left_out.start]);
                short.extend_from_slice(b"null");
                match &tokens {
                    Some(tokens) => {
                        short.extend_from_slice(&line[left_out.end..tokens.value.start]);
                        short.extend_from_slice(b"null");
                        short.extend_from_slice(&line[tokens.value.end..]);
                    }
                    None => short.extend_from_slice(&line[left_out.end..]),
                }
                Some((span_start, short.len()))
            })
            .collect();
        Self {
            data,
            lines,
            short,
            spans,
            tokens: tokens_of,
        }
    }

    fn parse(&self, index: usize) -> Result<RecordView<'_>, serde_json::Error> {
        let (start, end) = self.lines[index];
        let line = &self.data[start..end];
        match self.spans[index] {
            // An error is worded from the whole line, so that its position is the line's own.
            Some((short_start, short_end)) => {
                serde_json::from_slice(&self.short[short_start..short_end])
                    .or_else(|_| serde_json::from_slice(line))
            }
            None => serde_json::from_slice(line),
        }
    }

    /// Where the tokens of line `index`, parsed as `view`, are, if it has them.
    fn tokens(&self, index: usize, view: &RecordView<'_>) -> Option<TokensAt> {
        if self.spans[index].is_some() {
            return self.tokens[index].clone();
        }
        let (start, end) = self.lines[index];
        view.tokens
            .as_ref()
            .and_then(|_| TokensAt::find(&self.data[start..end]))
    }
}

/// A kept trajectory's tokens (a byte range of its batch's data, when it has them) and its key.
type KeptTokens = (Option<(usize, usize)>, (u64, u32));

/// The tokens cut off the kept lines of a batch.
#[derive(Default)]
struct TokensCut {
    /// Where each line's record ends before its tokens: a `}` goes there once the lines are no
    /// longer borrowed.
    cuts: Vec<usize>,
    /// Each kept trajectory's tokens, in output order.
    kept: Vec<KeptTokens>,
}

impl TokensCut {
    /// Takes the kept line at `line` (a range of `data`) whose tokens are at `tokens`, a
    /// trajectory of key `trajectory` or a failed or discarded record (`None`); returns where its
    /// record ends.
    fn take(
        &mut self,
        (start, end): (usize, usize),
        tokens: Option<&TokensAt>,
        trajectory: Option<(u64, u32)>,
        data: &[u8],
        totals: &mut Totals,
    ) -> usize {
        let record_end = tokens.map_or(end, |tokens| {
            self.cuts.push(start + tokens.cut);
            start + tokens.cut + 1
        });
        if let Some(key) = trajectory {
            let value = tokens.map(|tokens| (start + tokens.value.start, start + tokens.value.end));
            if let Some((value_start, value_end)) = value {
                totals.add_tokens(&data[value_start..value_end]);
            }
            self.kept.push((value, key));
        }
        record_end
    }
}

/// One batch, read and sorted by the reader thread, for the writer.
struct SortedBatch {
    data: Vec<u8>,
    /// The kept lines in output order: byte range, and whether it is a trajectory (else a
    /// failed or discarded record).
    kept: Vec<(usize, usize, bool)>,
    /// The `OpenAI`-form line of each kept trajectory, when the run writes that form.
    openai: Vec<Option<Vec<u8>>>,
    /// The tokens of each kept trajectory, in output order.
    tokens: Vec<KeptTokens>,
    /// Set when the batch is marked done but lacks keys; nothing else is then filled in.
    incomplete: Option<Incomplete>,
}

/// The keys a batch marked done must hold: every sample of each of its prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ExpectedKeys {
    first_prompt: u64,
    prompts: u64,
    samples: u32,
}

impl ExpectedKeys {
    fn of(manifest: &Manifest, batch: u32) -> Self {
        Self {
            first_prompt: manifest.first_prompt(batch),
            prompts: manifest.prompts_in(batch),
            samples: manifest.samples_per_prompt,
        }
    }

    fn iter(self) -> impl Iterator<Item = (u64, u32)> {
        (self.first_prompt..self.first_prompt + self.prompts)
            .flat_map(move |prompt| (0..self.samples).map(move |sample| (prompt, sample)))
    }
}

/// Shown of the keys a done batch lacks, in its error.
const MISSING_KEYS_SHOWN: usize = 5;

/// Batches of the error whose missing keys it shows.
const INCOMPLETE_BATCHES_DETAILED: usize = 3;

/// Characters of the error given to the incomplete batches' ranges: with the sentence around them
/// they stay well inside what the termination message carries of an error
/// ([`crate::contract::WorkerFailure::MAX_ERROR_CHARS`]), so that "the markers were removed" always
/// arrives.
const INCOMPLETE_RANGES_CHARS: usize = 1000;

/// What a batch marked done lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Incomplete {
    batch: u32,
    missing: u64,
    total: u64,
    /// The first missing keys, at most [`MISSING_KEYS_SHOWN`].
    shown: Vec<(u64, u32)>,
}

/// A batch marked done holds a record for every one of its keys: it writes its marker only after
/// the last. A key without one was lost after that (a restore of an older copy of the volume, a
/// records file removed by hand), and merging on would leave a hole no status shows.
fn missing_keys(
    batch: u32,
    kept: impl Iterator<Item = (u64, u32)>,
    expected: ExpectedKeys,
) -> Option<Incomplete> {
    // Both in (prompt, sample) order, `kept` without repeats: one walk, nothing allocated for a
    // complete batch.
    let mut kept = kept.peekable();
    let (mut missing, mut shown) = (0_u64, Vec::new());
    for key in expected.iter() {
        while kept.next_if(|kept| *kept < key).is_some() {}
        if kept.next_if_eq(&key).is_none() {
            missing += 1;
            if shown.len() < MISSING_KEYS_SHOWN {
                shown.push(key);
            }
        }
    }
    (missing > 0).then(|| Incomplete {
        batch,
        missing,
        total: expected.prompts * u64::from(expected.samples),
        shown,
    })
}

/// The error of a merge that found `incomplete` batches (in batch order) and removed their
/// markers: first the batches as compact ranges and what was done about them, then the first
/// missing keys of the first few.
fn incomplete_error(incomplete: &[Incomplete]) -> RunError {
    let mut ranges = format_ranges(&compact_ranges(incomplete.iter().map(|batch| batch.batch)));
    if ranges.len() > INCOMPLETE_RANGES_CHARS {
        let cut = ranges[..INCOMPLETE_RANGES_CHARS].rfind(',').unwrap_or(0);
        ranges.truncate(cut);
        ranges.push_str(",...");
    }
    let head = if let [only] = incomplete {
        format!(
            "batch {} was marked done but lacks records; its .done marker was removed, so that a \
             new plan sees it pending and its next run generates only the missing keys",
            only.batch
        )
    } else {
        format!(
            "{} batches ({ranges}) were marked done but lack records; their .done markers were \
             removed, so that a new plan sees them pending and their next run generates only the \
             missing keys",
            incomplete.len()
        )
    };
    let details: Vec<String> = incomplete
        .iter()
        .take(INCOMPLETE_BATCHES_DETAILED)
        .map(|batch| {
            let shown: Vec<String> = batch
                .shown
                .iter()
                .map(|(prompt, sample)| format!("prompt {prompt} sample {sample}"))
                .collect();
            let more = if batch.missing > shown.len() as u64 {
                ", ..."
            } else {
                ""
            };
            format!(
                "batch {} holds no record for {} of its {} (prompt, sample) keys ({}{more})",
                batch.batch,
                batch.missing,
                batch.total,
                shown.join(", ")
            )
        })
        .collect();
    let more = if incomplete.len() > INCOMPLETE_BATCHES_DETAILED {
        "; ..."
    } else {
        ""
    };
    RunError::IncompleteBatch(format!("{head}: {}{more}", details.join("; ")))
}

/// Reads, validates and orders one batch (every records file of it), and counts its kept records
/// into `totals`. A batch marked done (`expected` given) that lacks keys is returned as
/// [`SortedBatch::incomplete`], with nothing to write.
fn sort_batch(
    run_dir: &RunDir,
    ToSort {
        batch,
        expected,
        image,
    }: ToSort,
    buffer: Vec<u8>,
    openai: bool,
    totals: &mut Totals,
    skipped_lines: &mut u64,
) -> Result<SortedBatch, RunError> {
    let files = run_dir.records_files(batch)?;
    let read = run_dir
        .store()
        .read_files_lines_into(files.iter().map(|file| file.records.as_path()), buffer)?;
    let viewed = ViewLines::new(&read.data, &read.lines);
    let mut order: Vec<(u64, u32, u8, usize)> = Vec::with_capacity(read.lines.len());
    let mut views = Vec::with_capacity(read.lines.len());
    for (index, (start, end)) in read.lines.iter().enumerate() {
        match viewed.parse(index) {
            Ok(view) => {
                let rank = match view.status.as_deref() {
                    None => 0,
                    Some("discarded") => 1,
                    Some(_) => 2,
                };
                let tokens = viewed.tokens(index, &view);
                order.push((view.prompt_index, view.sample, rank, views.len()));
                views.push((view, *start, *end, read.file_of(index), tokens));
            }
            Err(err) => {
                *skipped_lines += 1;
                let file = files[read.file_of(index)].records.display();
                warn!(batch, %file, offset = start, %err, "skipping an invalid record line");
            }
        }
    }
    // Dataset order; for one key the best record first, then the first in file and line order
    // (`views` is in that order).
    order.sort_unstable();
    let before = order.len();
    order.dedup_by_key(|(prompt_index, sample, ..)| (*prompt_index, *sample));
    *skipped_lines += (before - order.len()) as u64;
    if let Some(expected) = expected {
        let kept = order
            .iter()
            .map(|(prompt_index, sample, ..)| (*prompt_index, *sample));
        if let Some(incomplete) = missing_keys(batch, kept, expected) {
            drop(views);
            return Ok(SortedBatch {
                data: read.data,
                kept: Vec::new(),
                openai: Vec::new(),
                tokens: Vec::new(),
                incomplete: Some(incomplete),
            });
        }
    }

    // The pod that finished a batch of an image's rows said what it waited for the image.
    if expected.is_some()
        && image.is_some()
        && let Some(pull) = super::batch::done_pull(run_dir, batch)
    {
        totals.pulls.add(&pull);
    }

    // Each writer's `OpenAI`-form lines, read when one of its trajectories is kept.
    let mut openai_lines: Vec<Option<OpenaiIndex>> = files.iter().map(|_| None).collect();
    let mut kept = Vec::with_capacity(order.len());
    let mut openai_kept = Vec::new();
    let mut cut = TokensCut::default();
    for (prompt_index, sample, rank, position) in order {
        let (view, start, end, file, tokens) = &views[position];
        totals.add(view, &read.data[*start..*end]);
        if let Some(image) = image {
            totals.add_task_image(image, view);
        }
        let trajectory = (rank == 0).then_some((prompt_index, sample));
        let record_end = cut.take(
            (*start, *end),
            tokens.as_ref(),
            trajectory,
            &read.data,
            totals,
        );
        kept.push((*start, record_end, rank == 0));
        if openai && rank == 0 {
            let index = match &mut openai_lines[*file] {
                Some(index) => index,
                slot => slot.insert(openai_index(run_dir.store(), &files[*file].openai)?),
            };
            let twin = index
                .remove(&(prompt_index, sample))
                .and_then(|lines| twin_of(lines, view.finished_at.as_deref()));
            if twin.is_none() {
                warn!(
                    batch,
                    prompt_index, sample, "a trajectory has no OpenAI-form line"
                );
            }
            openai_kept.push(twin);
        }
    }
    drop(views);
    drop(viewed);
    let mut data = read.data;
    for at in cut.cuts {
        data[at] = b'}';
    }
    Ok(SortedBatch {
        data,
        kept,
        openai: openai_kept,
        tokens: cut.kept,
        incomplete: None,
    })
}

/// A batch for a reader to sort.
struct ToSort {
    batch: u32,
    /// The conversations a batch the status records done must hold.
    expected: Option<ExpectedKeys>,
    /// The position (from 1) in the manifest's `images` of the image its rows name.
    image: Option<u32>,
}

/// A reader thread's work: reads, validates and sorts `batches`, sending each to the writer
/// (whose buffers come back through `written`, for the next batches), until the writer or a batch
/// fails. Returns what the batches held.
fn sort_batches(
    run_dir: &RunDir,
    batches: impl Iterator<Item = ToSort>,
    openai: bool,
    (report, oracle): (bool, bool),
    to_writer: &mpsc::SyncSender<Result<SortedBatch, RunError>>,
    written: &mpsc::Receiver<Vec<u8>>,
) -> (Totals, u64) {
    let mut totals = Totals::new(report).gathering_oracle(oracle);
    let mut skipped_lines = 0u64;
    for batch in batches {
        let buffer = written.try_recv().unwrap_or_default();
        let result = sort_batch(
            run_dir,
            batch,
            buffer,
            openai,
            &mut totals,
            &mut skipped_lines,
        );
        let failed = result.is_err();
        // A closed channel: the writer stopped at an error.
        if to_writer.send(result).is_err() || failed {
            break;
        }
    }
    (totals, skipped_lines)
}

/// The merge's output files, written in dataset order.
struct Outputs {
    trajectories: Output,
    /// Failed and discarded records.
    failures: Output,
    openai: Option<Output>,
    /// Each trajectory's tokens, line for line beside `trajectories`.
    tokens: Option<Output>,
}

impl Outputs {
    fn create(run_dir: &RunDir, openai: bool, tokens: bool) -> Result<Self, RunError> {
        let optional = |wanted: bool, path| {
            wanted
                .then(|| Output::create(run_dir.store(), path))
                .transpose()
        };
        Ok(Self {
            trajectories: Output::create(run_dir.store(), run_dir.trajectories())?,
            failures: Output::create(run_dir.store(), run_dir.failures())?,
            openai: optional(openai, run_dir.trajectories_openai())?,
            tokens: optional(tokens, run_dir.trajectories_tokens())?,
        })
    }

    /// Appends a sorted batch's kept lines, each to its file.
    fn append(&mut self, sorted: &SortedBatch) -> Result<(), RunError> {
        let (mut trajectory_lines, mut failure_lines) = (Vec::new(), Vec::new());
        for &(start, end, trajectory) in &sorted.kept {
            let line = &sorted.data[start..end];
            if trajectory {
                trajectory_lines.push(line);
            } else {
                failure_lines.push(line);
            }
        }
        self.trajectories.lines(&trajectory_lines)?;
        self.failures.lines(&failure_lines)?;
        if let Some(out) = self.openai.as_mut() {
            let openai_lines: Vec<&[u8]> =
                sorted.openai.iter().flatten().map(Vec::as_slice).collect();
            out.lines(&openai_lines)?;
        }
        if let Some(out) = self.tokens.as_mut() {
            // A trajectory without tokens (recorded before the run kept them) keeps its place.
            let placeholders: Vec<Vec<u8>> = sorted
                .tokens
                .iter()
                .filter(|(value, _)| value.is_none())
                .map(|(_, (prompt_index, sample))| {
                    format!(
                        r#"{{"prompt_index":{prompt_index},"sample":{sample},"tokenization":{{"source":"none"}},"steps":[]}}"#
                    )
                    .into_bytes()
                })
                .collect();
            let mut placeholders = placeholders.iter();
            let token_lines: Vec<&[u8]> = sorted
                .tokens
                .iter()
                .filter_map(|(value, _)| match value {
                    Some((start, end)) => Some(&sorted.data[*start..*end]),
                    None => placeholders.next().map(Vec::as_slice),
                })
                .collect();
            out.lines(&token_lines)?;
        }
        Ok(())
    }
}

impl Outputs {
    /// Makes the outputs durable and puts them in place with `statistics.json`, and writes the
    /// report of `collected`, if any; returns the bytes of `trajectories.jsonl`. The report is
    /// drawn and written while the outputs are synced: the end of a merge waits for the disk, and
    /// the report then costs no time of its own.
    fn finish(
        self,
        run_dir: &RunDir,
        statistics: &serde_json::Value,
        collected: Option<report::Collector>,
    ) -> Result<u64, RunError> {
        let statistics_json = serde_json::to_vec_pretty(statistics)
            .map_err(|err| RunError::Internal(err.to_string()))?;
        std::thread::scope(|scope| {
            let report = collected
                .map(|collected| scope.spawn(|| report::write(run_dir, statistics, collected)));
            self.failures.finish()?;
            if let Some(out) = self.openai {
                out.finish()?;
            }
            if let Some(out) = self.tokens {
                out.finish()?;
            }
            run_dir
                .store()
                .write_atomic(&run_dir.statistics(), &statistics_json)?;
            // Last, so that a trajectories file on storage always comes with its statistics.
            let bytes = self.trajectories.finish()?;
            if let Some(report) = report {
                report
                    .join()
                    .map_err(|_| RunError::Internal("the report thread panicked".into()))??;
            }
            Ok(bytes)
        })
    }
}

/// Reader threads: each reads, validates and sorts every `READERS`-th batch. Validating the
/// records is most of a merge's work, so it is spread over two threads while this one writes.
const READERS: u32 = 2;

/// Batches each reader sorts ahead of the one being written.
const BATCHES_AHEAD: usize = 1;

/// Merges every batch of the run, and writes its report. Reader threads read, validate and sort
/// the next batches while this one writes the current one.
pub fn merge(location: &RunLocation) -> Result<MergeSummary, RunError> {
    merge_with(location, true)
}

/// A merge that gathers and writes no report: what merge cost before reports, for the
/// benchmark that measures what the report adds (`benches/run_modes.rs`).
#[doc(hidden)]
pub fn merge_without_report(location: &RunLocation) -> Result<MergeSummary, RunError> {
    merge_with(location, false)
}

fn merge_with(location: &RunLocation, report: bool) -> Result<MergeSummary, RunError> {
    let run_dir = location.run_dir();
    let manifest = Manifest::require(&run_dir)?;
    let openai = location.plan.spec.openai_format;
    let oracle = location.plan.spec.agent.oracle;
    // What the readers gather beside the outputs: the report's facts, the oracle's outcomes.
    let gather = (report, oracle);
    let mut outputs = Outputs::create(&run_dir, openai, location.plan.spec.model.tokens.is_some())?;
    let done: std::collections::HashSet<u32> = run_dir.done_batches()?.into_iter().collect();
    let missing: Vec<u32> = (0..manifest.batch_count())
        .filter(|batch| !done.contains(batch))
        .collect();

    let batch_count = manifest.batch_count();
    let mut incomplete = Vec::new();
    let (mut totals, skipped_lines) = std::thread::scope(|scope| {
        let mut inboxes = Vec::new();
        let mut recycle = Vec::new();
        let mut readers = Vec::new();
        for first in 0..READERS {
            let (to_writer, sorted) =
                mpsc::sync_channel::<Result<SortedBatch, RunError>>(BATCHES_AHEAD);
            inboxes.push(sorted);
            // The writer hands each batch's buffer back to its reader, for the next batch.
            let (to_reader, written) = mpsc::channel::<Vec<u8>>();
            recycle.push(to_reader);
            let reader_dir = &run_dir;
            let (manifest, done) = (&manifest, &done);
            let batches = (first..batch_count)
                .step_by(READERS as usize)
                .map(move |batch| {
                    let expected = done
                        .contains(&batch)
                        .then(|| ExpectedKeys::of(manifest, batch));
                    let image = manifest.batch_images.get(batch as usize).copied();
                    ToSort {
                        batch,
                        expected,
                        image: image.filter(|position| *position > 0),
                    }
                });
            readers.push(scope.spawn(move || {
                sort_batches(reader_dir, batches, openai, gather, &to_writer, &written)
            }));
        }
        let lost = || RunError::Internal("a merge reader thread stopped".into());
        for batch in 0..batch_count {
            let mut sorted = inboxes[(batch % READERS) as usize]
                .recv()
                .map_err(|_| lost())??;
            // Once a batch is incomplete the outputs are lost anyway; the other batches are still
            // checked, so that one merge names (and reopens) every incomplete batch.
            if let Some(missing) = sorted.incomplete.take() {
                incomplete.push(missing);
            } else if incomplete.is_empty() {
                outputs.append(&sorted)?;
            }
            // A reader that has stopped takes no buffers.
            let _ = recycle[(batch % READERS) as usize].send(sorted.data);
        }
        let mut totals = Totals::new(report).gathering_oracle(oracle);
        let mut skipped_lines = 0;
        for reader in readers {
            let (part, skipped) = reader.join().map_err(|_| lost())?;
            totals.absorb(part);
            skipped_lines += skipped;
        }
        Ok::<_, RunError>((totals, skipped_lines))
    })?;
    if !incomplete.is_empty() {
        drop(outputs);
        let error = incomplete_error(&incomplete);
        warn!(%error, "reopening the incomplete batches");
        let batches: Vec<u32> = incomplete.iter().map(|batch| batch.batch).collect();
        run_dir.remove_done_markers(&batches)?;
        return Err(error);
    }

    let mut statistics = statistics(location, &manifest, &mut totals, &missing);
    if let Some(mut outcomes) = totals.oracle.take() {
        name_failed_rows(location, &mut outcomes)?;
        statistics["oracle"] = write_oracle_report(&run_dir, outcomes)?;
    }
    let bytes = outputs.finish(&run_dir, &statistics, totals.report.take())?;
    run_dir.store().sync_dir(run_dir.root())?;
    if !missing.is_empty() {
        warn!(missing = %format_ranges(&compact_ranges(missing.iter().copied())), "merged with batches not done");
    }
    let summary = MergeSummary {
        trajectories: totals.succeeded,
        discarded: totals.discarded,
        failed: totals.failed,
        bytes,
        skipped_lines,
        verified: totals.rewards.verified(),
        passed: totals.rewards.passed(),
        cost: totals.costs.total().map(crate::contract::usd_text),
        spent: super::ledger::spent_by_claims(&run_dir)?.map(crate::contract::usd_text),
    };
    info!(
        trajectories = summary.trajectories,
        failed = summary.failed,
        bytes,
        "merged"
    );
    Ok(summary)
}

/// An `OpenAI`-form line and the `finished_at` it carries (absent in lines of older workers).
type OpenaiLine = (Option<String>, Vec<u8>);

/// The `OpenAI`-form lines of one writer's file, by key, in file order.
type OpenaiIndex = HashMap<(u64, u32), Vec<OpenaiLine>>;

/// `OpenAI`-form lines of one writer by key, in file order; its records file decides which are kept.
fn openai_index(store: &Store, path: &Path) -> Result<OpenaiIndex, RunError> {
    #[derive(Deserialize)]
    struct Key {
        prompt_index: u64,
        #[serde(default)]
        sample: u32,
        #[serde(default)]
        finished_at: Option<String>,
    }
    let FilesLines { data, lines, .. } = store.read_files_lines_into([path], Vec::new())?;
    let mut index = OpenaiIndex::new();
    for (start, end) in lines {
        if let Ok(key) = serde_json::from_slice::<Key>(&data[start..end]) {
            index
                .entry((key.prompt_index, key.sample))
                .or_default()
                .push((key.finished_at, data[start..end].to_vec()));
        }
    }
    Ok(index)
}

/// The `OpenAI`-form line of the very trajectory merge kept, among the lines of its key in its own
/// writer's twin file: the one with its `finished_at`. Other lines of the key there were left by a
/// write of the records file that failed after the twin's (a writer stops at that error), or, in
/// the legacy single file, by an earlier attempt killed between its two lines or by a second
/// writer. Lines without `finished_at` were written by older workers; of those the last is taken
/// (a writer writes a trajectory's `OpenAI` line just before it, so an earlier one can only be an
/// orphan of a kill).
fn twin_of(lines: Vec<OpenaiLine>, finished_at: Option<&str>) -> Option<Vec<u8>> {
    let mut legacy = None;
    for (stamp, line) in lines {
        match (stamp.as_deref(), finished_at) {
            (Some(stamp), Some(kept)) if stamp == kept => return Some(line),
            (None, _) => legacy = Some(line),
            _ => {}
        }
    }
    legacy
}

/// Batch mode's rounds and turnaround over the kept records: their calls answered in a
/// provider batch, the calls that went live (every call at another tier, from `cost`), the
/// rounds each conversation waited, and how long each call waited for its batch.
fn batch_mode_statistics(
    totals: &mut Totals,
    cost: &serde_json::Value,
) -> Option<serde_json::Value> {
    if totals.batch_waits.is_empty() {
        return None;
    }
    let live: u64 = ["standard", "flex", "priority"]
        .iter()
        .filter_map(|tier| cost["tiers"][tier]["calls"].as_u64())
        .sum();
    let mut statistics = json!({
        "calls": totals.batch_waits.len(),
        "live_calls": live,
        "rounds_per_conversation": percentiles(&mut totals.batch_rounds),
        "turnaround_ms": percentiles(&mut totals.batch_waits),
    });
    if let Some(saved) = cost.get("saved") {
        statistics["saved"] = saved.clone();
    }
    Some(statistics)
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

pub(super) fn rate(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        round2(part as f64 * 100.0 / whole as f64)
    }
}

/// `statistics.json`'s `token_ids`: trajectories by where their ids came from, and calls per
/// endpoint.
fn token_statistics(totals: &Totals) -> serde_json::Value {
    let [server, retokenized, partial, none] = totals.token_sources;
    let trajectories = server + retokenized + partial + none;
    let endpoints: serde_json::Map<String, serde_json::Value> = totals
        .token_endpoints
        .iter()
        .map(|(endpoint, calls)| {
            let counts = json!({
                "calls": calls.calls,
                "with_ids": calls.with_ids,
                "retokenized": calls.retokenized,
                "with_logprobs": calls.with_logprobs,
                "exact_rate": rate(calls.with_ids, calls.calls),
            });
            (endpoint.clone(), counts)
        })
        .collect();
    json!({
        "trajectories": trajectories,
        "server": server,
        "retokenized": retokenized,
        "partial": partial,
        "none": none,
        "exact_rate": rate(server, trajectories),
        "endpoints": endpoints,
    })
}

/// Names the Harbor task of each outcome whose record does not (a failed record keeps no
/// `source`: one whose image could not be pulled or built) from the run's rows, so that the
/// report names it and `excludeOracleFailures` can leave it out. The plan writes every task as a
/// valid row, so a row's prompt index is its line.
fn name_failed_rows(
    location: &RunLocation,
    outcomes: &mut [OracleOutcome],
) -> Result<(), RunError> {
    #[derive(Deserialize)]
    struct Row<'a> {
        #[serde(default, borrow)]
        harbor: Option<HarborView<'a>>,
    }
    if location.plan.spec.dataset.format != crate::spec::DatasetFormat::HarborTasks
        || outcomes.iter().all(|outcome| outcome.task.is_some())
    {
        return Ok(());
    }
    // Streamed: the rows carry their tests and solutions, only the names are kept.
    let path = location.dataset_path();
    let rows = std::io::BufReader::new(location.store.open(&path)?);
    let mut names: Vec<(Option<String>, Option<String>)> = Vec::new();
    for line in std::io::BufRead::split(rows, b'\n') {
        let line = line.map_err(|err| StorageError::new("reading", &path, err))?;
        if line.is_empty() {
            continue;
        }
        let harbor = serde_json::from_slice::<Row<'_>>(&line)
            .ok()
            .and_then(|row| row.harbor);
        let owned = |text: Option<&Cow<'_, str>>| text.map(ToString::to_string);
        names.push((
            owned(harbor.as_ref().and_then(|h| h.task.as_ref())),
            owned(harbor.as_ref().and_then(|h| h.name.as_ref())),
        ));
    }
    for outcome in outcomes.iter_mut().filter(|outcome| outcome.task.is_none()) {
        if let Some((task, name)) = usize::try_from(outcome.prompt_index)
            .ok()
            .and_then(|index| names.get(index))
        {
            outcome.task.clone_from(task);
            outcome.name.clone_from(name);
        }
    }
    Ok(())
}

/// Writes an oracle run's report beside its outputs; returns its summary for the statistics.
fn write_oracle_report(
    run_dir: &RunDir,
    outcomes: Vec<OracleOutcome>,
) -> Result<serde_json::Value, RunError> {
    let (jsonl, summary) = super::oracle::report(outcomes);
    run_dir
        .store()
        .write_atomic(&run_dir.root().join(ORACLE_REPORT), &jsonl)?;
    Ok(summary)
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
    let mut statistics = json!({
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
        "discarded_by_filter": totals.discarded_by,
        "discarded_no_reasoning": totals.discarded_by.get("require_reasoning").copied().unwrap_or(0),
        "tokens": {
            "prompt": totals.prompt_tokens,
            "completion": totals.completion_tokens,
            "reasoning": totals.reasoning_tokens,
            "total": totals.prompt_tokens + totals.completion_tokens,
        },
        "api_calls": {"total": totals.api_calls,
                      "mean": if totals.succeeded == 0 { 0.0 } else { round2(totals.api_calls as f64 / totals.succeeded as f64) }},
        "latency_ms": {"conversation": percentiles(&mut totals.durations)},
    });
    if spec.model.tokens.is_some() {
        statistics["token_ids"] = token_statistics(totals);
    }
    if let Some(cost) = totals.costs.summary() {
        statistics["cost"] = cost;
    }
    if let Some(episodes) = totals.episodes.summary() {
        statistics["episodes"] = episodes;
    }
    if let Some(batch_mode) = batch_mode_statistics(totals, &statistics["cost"]) {
        statistics["batch_mode"] = batch_mode;
    }
    if let Some(task_images) = totals.task_images() {
        statistics["task_images"] = task_images;
    }
    if let Some(refusals) = totals.sandbox_refusals() {
        statistics["sandbox_refusals"] = refusals;
    }
    if let Some(mut verification) = totals.rewards.summary() {
        let not_run = totals
            .discarded_by
            .get(super::sampling::ENOUGH_PASSED)
            .copied()
            .unwrap_or(0);
        if not_run > 0 {
            // What the samples not run would have cost, at the run's mean per trajectory.
            let per_conversation = (totals.prompt_tokens + totals.completion_tokens)
                .checked_div(totals.succeeded)
                .unwrap_or(0);
            verification["early_stop"] = json!({
                "samples_not_run": not_run,
                "tokens_saved_estimate": not_run * per_conversation,
            });
        }
        statistics["verification"] = verification;
    }
    statistics
}

#[cfg(test)]
mod tests {
    use super::*;

    fn incomplete(batch: u32, missing: u64) -> Incomplete {
        let expected = ExpectedKeys {
            first_prompt: u64::from(batch) * 4,
            prompts: 4,
            samples: 2,
        };
        let kept = expected.iter().skip(usize::try_from(missing).unwrap());
        missing_keys(batch, kept, expected).unwrap()
    }

    #[test]
    fn an_incomplete_batch_error_names_the_batches_as_ranges_and_the_removed_markers() {
        assert_eq!(
            incomplete_error(&[incomplete(3, 1)]).to_string(),
            "incomplete batch: batch 3 was marked done but lacks records; its .done marker was \
             removed, so that a new plan sees it pending and its next run generates only the \
             missing keys: batch 3 holds no record for 1 of its 8 (prompt, sample) keys \
             (prompt 12 sample 0)"
        );
        let batches: Vec<Incomplete> = [1, 2, 3, 7].map(|batch| incomplete(batch, 6)).into();
        let message = incomplete_error(&batches).to_string();
        assert!(
            message.starts_with(
                "incomplete batch: 4 batches (1-3,7) were marked done but lack records; their \
                 .done markers were removed"
            ) && message.contains(
                "batch 1 holds no record for 6 of its 8 (prompt, sample) keys (prompt 4 sample 0, \
                 prompt 4 sample 1, prompt 5 sample 0, prompt 5 sample 1, prompt 6 sample 0, ...)"
            ) && message.contains("batch 3 holds")
                && !message.contains("batch 7 holds")
                && message.ends_with("; ..."),
            "{message}"
        );
        // Scattered batches: the ranges are cut, the sentence about the markers stays whole.
        let scattered: Vec<Incomplete> = (0..2000).map(|i| incomplete(i * 2, 1)).collect();
        let message = incomplete_error(&scattered).to_string();
        let failure = crate::contract::WorkerFailure::new(&message, "IncompleteBatch", 78);
        assert!(
            failure.error.contains(
                ",...) were marked done but lack records; their .done markers \
                                    were removed, so that a new plan sees them pending"
            ),
            "{}",
            failure.error
        );
        assert!(
            failure
                .error
                .starts_with("incomplete batch: 2000 batches (0,2,4,")
        );
    }

    #[test]
    fn task_images_count_each_images_conversations_by_outcome() {
        let mut totals = Totals::new(false);
        assert_eq!(
            totals.task_images(),
            None,
            "absent when no row names an image"
        );
        let ran = br#"{"prompt_index": 0, "completed": true}"#;
        let unavailable =
            br#"{"prompt_index": 2, "status": "failed", "error_class": "image_unavailable"}"#;
        let timed_out = br#"{"prompt_index": 3, "status": "failed", "error_class": "timeout"}"#;
        for (image, line) in [
            (1, &ran[..]),
            (1, timed_out),
            (2, unavailable),
            (2, unavailable),
            (3, ran),
        ] {
            let view: RecordView<'_> = serde_json::from_slice(line).unwrap();
            totals.add_task_image(image, &view);
        }
        assert_eq!(
            totals.task_images(),
            Some(json!({"images": 3, "pulled": 2, "unavailable": 1,
                        "conversations": {"ran": 3, "image_unavailable": 2}}))
        );
    }

    #[test]
    fn sandbox_refusals_are_summed_over_every_kept_record_and_reader() {
        let lines: [&[u8]; 3] = [
            br#"{"prompt_index": 0, "sandbox_refusals": {"~/.pyenv": 2, "/tmp": 1}}"#,
            br#"{"prompt_index": 1, "status": "discarded", "filter": "f", "sandbox_refusals": {"~/.pyenv": 1}}"#,
            br#"{"prompt_index": 2}"#,
        ];
        let mut totals = Totals::new(false);
        assert_eq!(totals.sandbox_refusals(), None, "absent when none");
        for line in lines {
            let view: RecordView<'_> = serde_json::from_slice(line).unwrap();
            totals.add(&view, line);
        }
        let mut other = Totals::new(false);
        let line = br#"{"prompt_index": 3, "sandbox_refusals": {"/home/alice": 4, "/tmp": 2}}"#;
        other.add(&serde_json::from_slice(line).unwrap(), line);
        totals.absorb(other);
        assert_eq!(
            totals.sandbox_refusals(),
            Some(json!({"~/.pyenv": 3, "/tmp": 3, "/home/alice": 4}))
        );
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut values: Vec<u64> = (1..=100).rev().collect();
        let p = percentiles(&mut values).unwrap();
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50, 90, 99, 100));
        assert!(percentiles(&mut []).is_none());
    }

    #[test]
    fn records_read_without_their_conversation_read_as_whole_lines_do() {
        let record = r#"{"prompt_index": 7, "conversations": [{"from": "human", "value": "a \"b\" \u00e9"}], "sample": 1, "tool_stats": {"read_file": {"count": 2, "success": 1, "failure": 1}}, "usage": {"prompt_tokens": 10}, "api_calls": 3, "completed": true, "duration_ms": 12}"#;
        let lines = [
            record.to_owned(),
            // Not sure: serde_json decides.
            record.replace("\\u00e9", "\\ud800"),
            record.replace("\"sample\"", "\"conversations\": null, \"sample\""),
            record.replace("\"conversations\"", "\"conversation\\u0073\""),
            // Invalid, inside and outside the conversation, and torn.
            record.replace("\"human\"", "\"human"),
            record.replace("\"prompt_index\": 7", "\"prompt_index\": \"7\""),
            record[..record.len() - 20].to_owned(),
            r#"{"prompt_index": 1, "status": "failed", "error_class": "timeout"}"#.to_owned(),
        ];
        let mut data = Vec::new();
        let mut ranges = Vec::new();
        for line in &lines {
            ranges.push((data.len(), data.len() + line.len()));
            data.extend_from_slice(line.as_bytes());
            data.push(b'\n');
        }
        let viewed = ViewLines::new(&data, &ranges);
        assert_eq!(
            viewed.spans.iter().map(Option::is_some).collect::<Vec<_>>(),
            [true, false, false, false, false, true, false, false]
        );
        for (index, line) in lines.iter().enumerate() {
            let whole = serde_json::from_str::<RecordView<'_>>(line);
            let short = viewed.parse(index);
            assert_eq!(format!("{short:?}"), format!("{whole:?}"), "{line}");
        }
        assert_eq!(viewed.parse(0).unwrap().tool_stats["read_file"].failure, 1);
        assert!(viewed.parse(4).is_err() && viewed.parse(5).is_err() && viewed.parse(6).is_err());
    }
}
