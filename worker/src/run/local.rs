//! `local`: a whole run on one machine, from the same run file a user would `kubectl apply`.
//!
//! Plan, then up to `workers` batches at once (each with `concurrency` conversations in flight),
//! then merge. Interrupted runs resume where they stopped when the same command runs again: the
//! data on storage, not this process, says what is done.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use tracing::info;

use super::batch::{ConversationOutcome, Engine, Progress, Shutdown, run_batch};
use super::ledger::Ledger;
use super::{RunError, RunFile, RunLocation, merge, plan};
use crate::contract::{MergeSummary, PlanSummary};
use crate::storage::{BucketOptions, LockError};
use crate::tools::sandbox::Sandbox;

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// A bar on a terminal, periodic log lines otherwise.
    Auto,
    /// Periodic log lines only.
    Lines,
}

/// Options of a local run.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    pub run_file: PathBuf,
    /// Root of "the storage volume" (or an `s3://bucket/prefix` location); defaults to the run
    /// file's directory.
    pub storage: Option<PathBuf>,
    /// How to reach the bucket when `storage` is one.
    pub bucket: BucketOptions,
    /// Overrides `spec.model.baseUrl` (an operational field: it does not change the spec hash).
    pub base_url: Option<String>,
    /// Runs the oracle pass whatever the run file says (`spec.agent.oracle`).
    pub oracle: bool,
    pub workspace_root: PathBuf,
    /// How terminal commands are confined.
    pub sandbox: Sandbox,
    /// The entries of this machine's `PATH` that the confined commands cannot run programs from,
    /// and so do not get: said again in the summary.
    pub path_dropped: Vec<PathBuf>,
    pub progress: ProgressMode,
}

/// What a finished local run reports.
#[derive(Debug, Clone)]
pub struct LocalReport {
    pub run_dir: PathBuf,
    /// The merged run's `statistics.json`, as merge wrote it (`None` when it cannot be read).
    pub statistics: Option<serde_json::Value>,
    pub plan: PlanSummary,
    pub merge: MergeSummary,
    pub elapsed: Duration,
    /// The entries of this machine's `PATH` the commands did not get ([`LocalOptions`]).
    pub path_dropped: Vec<PathBuf>,
}

/// Runs plan, every pending batch and merge.
pub async fn run_local(
    options: &LocalOptions,
    shutdown: &Shutdown,
) -> Result<LocalReport, RunError> {
    let started = Instant::now();
    let mut run_file = RunFile::load(&options.run_file)?;
    if let Some(base_url) = &options.base_url {
        run_file.spec.model.base_url.clone_from(base_url);
        run_file.spec.model.endpoints.clear();
    }
    run_file.spec.agent.oracle |= options.oracle;
    note_cluster_only_fields(&run_file);
    let location = local_location(options, &run_file)?;
    // Two local runs on one directory would run the same conversations twice and race on every
    // file; the second is refused while the first holds the lock.
    let _lock = location.run_dir().lock().map_err(|error| match error {
        LockError::Held(path) => RunError::OutputInUse(format!(
            "another `trajectory-worker local` is running in {} (it holds {}); wait for it or stop \
             it, then run this again",
            location.run_dir().root().display(),
            path.display()
        )),
        LockError::Storage(error) => error.into(),
    })?;
    let plan_location = location.clone();
    let (manifest, plan_summary) =
        tokio::task::spawn_blocking(move || plan::plan_in(&plan_location, plan::Environment::Host))
            .await
            .map_err(|err| RunError::Internal(err.to_string()))??;
    let run_dir = location.run_dir();
    eprintln!(
        "planned {}: {} prompts ({} invalid lines), {} batches, {} already done",
        run_dir.root().display(),
        plan_summary.prompts,
        plan_summary.invalid,
        plan_summary.batches,
        plan_summary.done_count
    );

    let mut engine = Engine::new(&location.plan.spec, options.workspace_root.clone())?;
    engine.sandbox = options.sandbox.clone();
    engine.learn_chat_template().await;
    // One process runs every batch: the whole of each limit is its own.
    engine.keep_limits(&location.plan.spec, 1);
    // What earlier runs of this directory spent is in their claims, against the same budget.
    if let Some(ledger) = Ledger::for_run(&location.plan.spec, &run_dir, 1)? {
        // Another process on the same directory reads what this one spent (ends once finished).
        let _refresher = ledger.keep_fresh();
        engine.keep_ledger(ledger);
    }
    let done: std::collections::HashSet<u32> = run_dir.done_batches()?.into_iter().collect();
    let pending: Vec<u32> = (0..manifest.batch_count())
        .filter(|batch| !done.contains(batch))
        .collect();
    let total = manifest.dataset.prompts * u64::from(manifest.samples_per_prompt);
    // Done batches hold all their records; the others report what they find as they start.
    let already: u64 = done
        .iter()
        .filter(|batch| **batch < manifest.batch_count())
        .map(|batch| manifest.prompts_in(*batch) * u64::from(manifest.samples_per_prompt))
        .sum();
    let tracker = Arc::new(Tracker::new(total, already, options.progress));
    let workers = usize::try_from(location.plan.spec.workers)
        .unwrap_or(1)
        .max(1);

    let ticker = tracker.clone().start_ticker();
    let progress_tracker = tracker.clone();
    let progress = move |progress: Progress| progress_tracker.record(progress);
    let mut results = futures::stream::iter(pending)
        .map(|batch| run_batch(&engine, &location, &manifest, batch, shutdown, &progress))
        .buffer_unordered(workers);
    let mut first_error = None;
    while let Some(result) = results.next().await {
        if let Err(error) = result {
            // Interruption is reported once, after every batch has wound down.
            if first_error.is_none() || matches!(first_error, Some(RunError::Interrupted)) {
                first_error = Some(error);
            }
        }
    }
    drop(results);
    ticker.abort();
    tracker.finish();
    finish_ledger(&mut engine).await?;
    if let Some(error) = first_error {
        return Err(error);
    }
    if shutdown.is_triggered() {
        return Err(RunError::Interrupted);
    }
    let merge_location = location.clone();
    let merge_summary = tokio::task::spawn_blocking(move || merge::merge(&merge_location))
        .await
        .map_err(|err| RunError::Internal(err.to_string()))??;
    let statistics = run_dir
        .store()
        .read(&run_dir.statistics())
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    Ok(LocalReport {
        run_dir: run_dir.root().to_path_buf(),
        statistics,
        plan: plan_summary,
        merge: merge_summary,
        elapsed: started.elapsed(),
        path_dropped: options.path_dropped.clone(),
    })
}

/// Where a local run's files are: `--storage` wins; else the run file's bucket, if it names one;
/// else its directory.
fn local_location(options: &LocalOptions, run_file: &RunFile) -> Result<RunLocation, RunError> {
    match &options.storage {
        Some(root) => RunLocation::open(root.clone(), &options.bucket, run_file.to_plan()),
        None if run_file.spec.storage.object.is_some() => {
            RunLocation::of_plan(PathBuf::new(), &options.bucket, run_file.to_plan())
        }
        None => {
            let directory = options
                .run_file
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
            RunLocation::open(directory, &options.bucket, run_file.to_plan())
        }
    }
}

fn note_cluster_only_fields(run_file: &RunFile) {
    let spec = &run_file.spec;
    let ignored: Vec<&str> = [
        (spec.pod_template.is_some(), "podTemplate"),
        (spec.sandbox.image.is_some(), "sandbox.image"),
        (spec.queue_name.is_some(), "queueName"),
        (spec.storage.volume.is_some(), "storage.volume"),
        // Locally the keys come from this machine's environment (AWS_ACCESS_KEY_ID, ...).
        (
            spec.storage
                .object
                .as_ref()
                .is_some_and(|object| object.credentials_secret.is_some()),
            "storage.object.credentialsSecret",
        ),
        (
            spec.model.api_key_secret_ref.is_some(),
            "model.apiKeySecretRef",
        ),
    ]
    .into_iter()
    .filter_map(|(set, name)| set.then_some(name))
    .collect();
    if !ignored.is_empty() {
        info!(
            "local run: ignoring cluster-only fields: {}",
            ignored.join(", ")
        );
    }
}

/// Progress: a bar on a terminal, log lines every few seconds otherwise.
struct Tracker {
    bar: Option<ProgressBar>,
    total: u64,
    done: AtomicU64,
    failed: AtomicU64,
    discarded: AtomicU64,
    started: Instant,
    /// Records there were before this run (not counted in its rate).
    initial: AtomicU64,
}

impl Tracker {
    fn new(total: u64, initial: u64, mode: ProgressMode) -> Self {
        let bar = (mode == ProgressMode::Auto && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(total);
            // The template is a constant known to be valid.
            let style = ProgressStyle::with_template(
                "{spinner} {bar:40} {pos}/{len} prompts • {per_sec} • ETA {eta} • {msg}",
            )
            .expect("constant progress template is valid");
            bar.set_style(style);
            bar.set_position(initial);
            bar.reset_eta();
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Self {
            bar,
            total,
            done: AtomicU64::new(initial),
            failed: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            started: Instant::now(),
            initial: AtomicU64::new(initial),
        }
    }

    fn record(&self, progress: Progress) {
        let outcome = match progress {
            Progress::Resumed(records) => {
                self.done.fetch_add(records, Ordering::Relaxed);
                self.initial.fetch_add(records, Ordering::Relaxed);
                if let Some(bar) = &self.bar {
                    bar.inc(records);
                    bar.reset_eta();
                }
                return;
            }
            Progress::Finished(outcome) => outcome,
        };
        self.done.fetch_add(1, Ordering::Relaxed);
        match outcome {
            ConversationOutcome::Failed => {
                self.failed.fetch_add(1, Ordering::Relaxed);
            }
            ConversationOutcome::Discarded => {
                self.discarded.fetch_add(1, Ordering::Relaxed);
            }
            ConversationOutcome::Succeeded => {}
        }
        if let Some(bar) = &self.bar {
            bar.inc(1);
            bar.set_message(format!(
                "{} failed, {} discarded",
                self.failed.load(Ordering::Relaxed),
                self.discarded.load(Ordering::Relaxed)
            ));
        }
    }

    fn line(&self) -> String {
        let done = self.done.load(Ordering::Relaxed);
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = done.saturating_sub(self.initial.load(Ordering::Relaxed)) as f64 / elapsed;
        let eta = if rate > 0.0 {
            format!("{:.0}s", (self.total - done.min(self.total)) as f64 / rate)
        } else {
            "?".into()
        };
        format!(
            "progress: {done}/{} prompts, {rate:.2}/s, ETA {eta}, {} failed, {} discarded",
            self.total,
            self.failed.load(Ordering::Relaxed),
            self.discarded.load(Ordering::Relaxed)
        )
    }

    fn start_ticker(self: Arc<Self>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            if self.bar.is_some() {
                return;
            }
            let mut interval = tokio::time::interval(Duration::from_secs(10));
            interval.tick().await;
            loop {
                interval.tick().await;
                eprintln!("{}", self.line());
            }
        })
    }

    fn finish(&self) {
        match &self.bar {
            Some(bar) => bar.finish_and_clear(),
            None => eprintln!("{}", self.line()),
        }
    }
}

/// The end-of-run summary table.
/// Writes the run's claim finished, before the merge sums the claims (and before an error ends
/// the run).
async fn finish_ledger(engine: &mut Engine) -> Result<(), RunError> {
    if let Some(ledger) = engine.ledger.take() {
        tokio::task::spawn_blocking(move || ledger.finish())
            .await
            .map_err(|err| RunError::Internal(err.to_string()))??;
    }
    Ok(())
}

/// How many trajectories carry the server's own ids, and each endpoint's calls with ids and
/// logprobs (a run that keeps tokens).
fn token_lines(statistics: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let Some(ids) = statistics.get("token_ids") else {
        return String::new();
    };
    let count = |value: &serde_json::Value, key: &str| value[key].as_u64().unwrap_or(0);
    let mut out = format!(
        "\n  token ids: {} of {} trajectories with the server's own (made again from text: {}; \
         partly: {})\n",
        count(ids, "server"),
        count(ids, "trajectories"),
        count(ids, "retokenized"),
        count(ids, "partial")
    );
    if let Some(endpoints) = ids["endpoints"].as_object() {
        let _ = writeln!(
            out,
            "  {:<40} {:>7} {:>8} {:>11} {:>9}",
            "endpoint", "calls", "with ids", "retokenized", "logprobs"
        );
        for (endpoint, calls) in endpoints {
            let _ = writeln!(
                out,
                "  {endpoint:<40} {:>7} {:>8} {:>11} {:>9}",
                count(calls, "calls"),
                count(calls, "with_ids"),
                count(calls, "retokenized"),
                count(calls, "with_logprobs")
            );
        }
    }
    out
}

/// The summary a local run prints when it has merged.
/// The calls per service tier and what they saved, from `statistics.json`'s `cost`; empty when
/// every call was at the standard tier.
fn tiers_note(cost: &Value) -> String {
    let Some(Value::Object(tiers)) = cost.get("tiers") else {
        return String::new();
    };
    let calls: Vec<String> = tiers
        .iter()
        .map(|(tier, spent)| format!("{tier} {}", spent["calls"]))
        .collect();
    let saved = cost
        .get("saved")
        .and_then(Value::as_f64)
        .unwrap_or_default();
    format!(
        "   (calls: {}; {saved:.4} less than at the standard tier)",
        calls.join(", ")
    )
}

pub fn render_report(report: &LocalReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let merge = &report.merge;
    let _ = writeln!(
        out,
        "\nRUN COMPLETE in {:.1}s",
        report.elapsed.as_secs_f64()
    );
    let _ = writeln!(
        out,
        "  prompts        {:>8}   (invalid lines: {})",
        report.plan.prompts, report.plan.invalid
    );
    let _ = writeln!(out, "  trajectories   {:>8}", merge.trajectories);
    let _ = writeln!(out, "  discarded      {:>8}", merge.discarded);
    let _ = writeln!(out, "  failed         {:>8}", merge.failed);
    if merge.verified > 0 {
        let _ = writeln!(
            out,
            "  verified       {:>8}   (passed: {})",
            merge.verified, merge.passed
        );
    }
    if let Some(cost) = &merge.cost {
        let tiers = report
            .statistics
            .as_ref()
            .and_then(|s| s.get("cost"))
            .map(tiers_note)
            .unwrap_or_default();
        let _ = writeln!(out, "  cost (USD)     {cost:>8}{tiers}");
    }
    if let Some(tools) = report
        .statistics
        .as_ref()
        .and_then(|s| s.get("tool_statistics"))
        .and_then(|t| t.as_object())
    {
        if tools.is_empty() {
            let _ = writeln!(out, "\n  No tool calls were made.");
        } else {
            let _ = writeln!(
                out,
                "\n  {:<16} {:>7} {:>8} {:>8} {:>8}",
                "tool", "count", "success", "failure", "rate"
            );
            for (name, counts) in tools {
                let _ = writeln!(
                    out,
                    "  {:<16} {:>7} {:>8} {:>8} {:>7.1}%",
                    name,
                    counts["count"].as_u64().unwrap_or(0),
                    counts["success"].as_u64().unwrap_or(0),
                    counts["failure"].as_u64().unwrap_or(0),
                    counts["success_rate"].as_f64().unwrap_or(0.0)
                );
            }
        }
    }
    if let Some(statistics) = &report.statistics {
        out.push_str(&token_lines(statistics));
        out.push_str(&refusal_lines(statistics));
    }
    if !report.path_dropped.is_empty() {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let _ = writeln!(
            out,
            "\n  the commands' PATH left out {}: the sandbox cannot run programs there",
            shown_paths(&report.path_dropped, home.as_deref())
        );
    }
    let _ = writeln!(
        out,
        "\n  trajectories: {}",
        report.run_dir.join("trajectories.jsonl").display()
    );
    let _ = writeln!(
        out,
        "  failures:     {}",
        report.run_dir.join("failures.jsonl").display()
    );
    let _ = writeln!(
        out,
        "  statistics:   {}",
        report.run_dir.join("statistics.json").display()
    );
    let _ = writeln!(
        out,
        "  report:       {} (open it in a browser)",
        report
            .run_dir
            .join(crate::contract::paths::REPORT_FILE)
            .display()
    );
    out
}

/// `paths` for people, comma-separated, the home directory written `~`.
pub fn shown_paths(paths: &[PathBuf], home: Option<&Path>) -> String {
    paths
        .iter()
        .map(
            |path| match home.and_then(|home| path.strip_prefix(home).ok()) {
                Some(below) => format!("~/{}", below.display()),
                None => path.display().to_string(),
            },
        )
        .collect::<Vec<_>>()
        .join(", ")
}

/// The summary's lines on `statistics.json`'s `sandbox_refusals`: where the commands were
/// refused, so that a researcher sees what to open (`spec.sandbox.toolDirs`) or to stop using
/// without reading the statistics. Empty when there were none.
fn refusal_lines(statistics: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let Some(refusals) = statistics["sandbox_refusals"]
        .as_object()
        .filter(|refusals| !refusals.is_empty())
    else {
        return String::new();
    };
    let mut out = format!(
        "\n  {:<24} {:>7}   (paths outside the commands' reach; the model was told why)\n",
        "sandbox refused", "count"
    );
    for (prefix, count) in refusals {
        let _ = writeln!(out, "  {:<24} {:>7}", prefix, count.as_u64().unwrap_or(0));
    }
    out.push_str(
        "  to give the commands a toolchain, name its directory: --tool-dir or spec.sandbox.toolDirs\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_lists_the_sandboxs_refusals_by_prefix_only_when_there_were_some() {
        assert_eq!(refusal_lines(&serde_json::json!({"counts": {}})), "");
        assert_eq!(
            refusal_lines(&serde_json::json!({"sandbox_refusals": {"/tmp": 3, "~/.pyenv": 12}})),
            "\n  sandbox refused            count   (paths outside the commands' reach; the model \
             was told why)\n  \
             /tmp                           3\n  \
             ~/.pyenv                      12\n  \
             to give the commands a toolchain, name its directory: --tool-dir or \
             spec.sandbox.toolDirs\n"
        );
    }
}
