//! A conversation's background jobs (`terminal` with `background: true`), and the `process`
//! tool that manages them, with hermes-agent 0.19.0's actions and result shapes
//! (`tools/process_registry.py`).
//!
//! Each job is a program of its own under the executor ([`Program`]), in the conversation's
//! workspace, started from the shell's working directory and exported variables: its standard
//! input is a pipe (`write`, `submit`, `close`), its output goes to a rolling log read by a task
//! of the worker, and closing its connection (`kill`, the end of the conversation) ends it with
//! everything it started. Jobs are bounded: at most [`MAX_RUNNING`] at once, [`MAX_TRACKED`]
//! remembered, [`LOG_BYTES`] of output kept each, and a job that writes more than
//! [`OUTPUT_LIMIT`] in all, or goes past the sandbox's limits, is stopped with the reason in its
//! results.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio::time::Instant;
use trajectory_sandbox::protocol::SessionRequest;

use super::output::strip_ansi;
use super::shell::{Flavour, STOP_WAIT};
use crate::tools::sandbox::{Ended, LIMIT_EXIT, Program, REFUSED_EXIT, Sandbox};

/// Jobs of one conversation running at once.
pub(super) const MAX_RUNNING: usize = 8;
/// Jobs remembered (finished ones are forgotten oldest first past it), as the reference's.
const MAX_TRACKED: usize = 64;
/// Output kept per job: the reference's 200,000-character rolling buffer.
const LOG_BYTES: usize = 200_000;
/// Output a job may write in all before it is stopped: a flood costs CPU to relay even when
/// only the last bytes are kept.
pub(super) const OUTPUT_LIMIT: u64 = 64 << 20;
/// How long a job's start waits for the executor to report its pid.
const START_WAIT: Duration = Duration::from_secs(10);
/// The reference's exit code of a job its `kill` ended (`-SIGTERM`).
const KILLED_EXIT: i32 = -15;

/// The jobs of a conversation.
#[derive(Debug, Default)]
pub(super) struct Jobs {
    table: Mutex<Vec<Arc<Job>>>,
    /// Names the jobs: the n-th job of a conversation gets the same id in every attempt of it
    /// given the same seed, so a conversation resumed from its turn log (its jobs started again
    /// by replaying its calls) finds the ids its transcript names.
    seed: u64,
    /// How many jobs were started so far.
    count: AtomicU64,
}

impl Jobs {
    pub(super) fn with_seed(seed: u64) -> Self {
        Self {
            seed,
            ..Self::default()
        }
    }

    /// The id of the next job: 48 bits of a mix of the seed and the job's number.
    fn next_id(&self) -> String {
        let number = self.count.fetch_add(1, Ordering::SeqCst);
        let mixed = split_mix(self.seed ^ split_mix(number));
        format!("proc_{:012x}", mixed >> 16)
    }
}

/// `SplitMix64`'s finaliser: a bijection of `u64` that spreads nearby inputs far apart.
fn split_mix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One background job.
#[derive(Debug)]
pub(super) struct Job {
    pub(super) id: String,
    command: String,
    cwd: String,
    started: Instant,
    started_at: String,
    program: Program,
    killed: AtomicBool,
}

/// How a job stands.
struct Status {
    running: bool,
    exit_code: Option<i32>,
    completion_reason: &'static str,
    termination_source: &'static str,
    /// Why the sandbox stopped it, when it did.
    stopped: Option<String>,
}

impl Jobs {
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Job>>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts `command` as a job in `cwd` of `workspace`, with the variables `exported` sets
    /// (`export -p` of the shell); returns the `terminal` result.
    pub(super) async fn start(&self, sandbox: &Sandbox, start: JobStart<'_>) -> Value {
        let running = self
            .list()
            .iter()
            .filter(|job| job.program.state().ended.is_none())
            .count();
        if running >= MAX_RUNNING {
            return start_failed(&format!(
                "{MAX_RUNNING} background processes are already running in this conversation; \
                 kill one first (process action 'kill')"
            ));
        }
        let shell = match start.flavour {
            Flavour::Bash => "bash",
            Flavour::Posix => "sh",
        };
        // The command is an argument, never part of the script: nothing in it can change how
        // the script around it is read.
        let script = format!("exec 2>&1\n{}\neval \"$1\"\n", start.exported);
        let request = SessionRequest {
            argv: vec![
                shell.to_owned(),
                "-c".to_owned(),
                script,
                shell.to_owned(),
                start.command.to_owned(),
            ],
            env: [("TERM".to_owned(), "dumb".to_owned())].into(),
            landlock: sandbox.landlock,
            limits: sandbox.limits,
            cdp_pipe: false,
            workspace: Some(start.workspace.to_owned()),
            cwd: start.cwd.map(|cwd| cwd.display().to_string()),
        };
        let program = match Program::start(sandbox, &request, LOG_BYTES, OUTPUT_LIMIT).await {
            Ok(program) => program,
            Err(err) => return start_failed(&err.to_string()),
        };
        let pid = match wait_for_pid(&program).await {
            Ok(pid) => pid,
            Err(reason) => return start_failed(&reason),
        };
        let id = self.next_id();
        let job = Arc::new(Job {
            id: id.clone(),
            command: start.command.to_owned(),
            cwd: start.cwd.map_or_else(
                || start.workspace.to_owned(),
                |cwd| cwd.display().to_string(),
            ),
            started: Instant::now(),
            started_at: chrono::Local::now().format("%Y-%m-%dT%H:%M:%S").to_string(),
            program,
            killed: AtomicBool::new(false),
        });
        {
            let mut jobs = self.list();
            jobs.push(job);
            forget_oldest_finished(&mut jobs);
        }
        json!({
            "output": "Background process started",
            "session_id": id,
            "pid": pid,
            "exit_code": 0,
            "error": null,
        })
    }

    /// The job `id` names: the whole id, or (as the reference's) a prefix of at least four hex
    /// digits, bare or after `proc_`, that only one job has.
    fn find(&self, id: &str) -> Option<Arc<Job>> {
        let jobs = self.list();
        if let Some(job) = jobs.iter().find(|job| job.id == id) {
            return Some(Arc::clone(job));
        }
        let hex = id.strip_prefix("proc_").unwrap_or(id);
        if hex.len() < 4 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        let mut matching = jobs.iter().filter(|job| job.id[5..].starts_with(hex));
        match (matching.next(), matching.next()) {
            (Some(job), None) => Some(Arc::clone(job)),
            _ => None,
        }
    }

    /// Runs one `process` action; `wait_limit` is the longest a `wait` blocks.
    pub(super) async fn manage(&self, args: &Map<String, Value>, wait_limit: Duration) -> Value {
        let action = args.get("action").and_then(Value::as_str).unwrap_or("");
        if action == "list" {
            let jobs: Vec<Value> = self.list().iter().map(|job| job.list_entry()).collect();
            return json!({ "processes": jobs });
        }
        if !ACTIONS.contains(&action) {
            return json!({
                "error": format!(
                    "Unknown process action: {action}. Use: {}",
                    ACTIONS.join(", ")
                )
            });
        }
        let Some(id) = args
            .get("session_id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
        else {
            return json!({ "error": format!("session_id is required for {action}") });
        };
        let Some(job) = self.find(id) else {
            return json!({ "status": "not_found", "error": format!("No process with ID {id}") });
        };
        let data = args.get("data").and_then(Value::as_str).unwrap_or("");
        match action {
            "poll" => job.poll(),
            "log" => job.log(
                number(args, "offset").unwrap_or(0),
                number(args, "limit").unwrap_or(200),
            ),
            "wait" => job.wait(number(args, "timeout"), wait_limit).await,
            "kill" => job.kill().await,
            "write" => job.write(data.as_bytes()).await,
            "submit" => job.write(format!("{data}\n").as_bytes()).await,
            _ => job.close().await,
        }
    }

    /// Ends every job with everything it started, waiting until all are gone.
    pub(super) async fn stop_all(&self) {
        let jobs: Vec<Arc<Job>> = self.list().drain(..).collect();
        futures::future::join_all(jobs.iter().map(|job| job.program.stop(STOP_WAIT))).await;
    }
}

/// What a job starts from.
pub(super) struct JobStart<'a> {
    pub(super) command: &'a str,
    pub(super) workspace: &'a str,
    /// `None`: the workspace itself.
    pub(super) cwd: Option<&'a std::path::Path>,
    /// `export -p` of the shell: sets its exported variables again.
    pub(super) exported: &'a str,
    pub(super) flavour: Flavour,
}

/// The actions, in the reference's order (its error message lists them so).
const ACTIONS: [&str; 8] = [
    "list", "poll", "log", "wait", "kill", "write", "submit", "close",
];

fn number(args: &Map<String, Value>, name: &str) -> Option<u64> {
    match args.get(name) {
        Some(Value::Number(number)) => number.as_u64(),
        Some(Value::String(text)) => text.trim().parse().ok(),
        _ => None,
    }
}

fn start_failed(reason: &str) -> Value {
    json!({
        "output": "",
        "exit_code": -1,
        "error": format!("Failed to start background process: {reason}"),
    })
}

/// The job's pid, or why it did not start.
async fn wait_for_pid(program: &Program) -> Result<i32, String> {
    let started = program.until(|state| match (state.pid, state.ended) {
        (Some(pid), _) => Some(Ok(pid)),
        (None, Some(_)) => Some(Err(state
            .sandbox_reason()
            .unwrap_or_else(|| "the sandbox ended it before it ran".to_owned()))),
        (None, None) => None,
    });
    match tokio::time::timeout(START_WAIT, started).await {
        Ok(Some(started)) => started,
        Ok(None) => Err("the sandbox closed the connection".to_owned()),
        Err(_) => Err("the sandbox did not start it in time".to_owned()),
    }
}

/// Past [`MAX_TRACKED`], the oldest finished jobs are forgotten.
fn forget_oldest_finished(jobs: &mut Vec<Arc<Job>>) {
    while jobs.len() > MAX_TRACKED {
        let Some(oldest) = jobs
            .iter()
            .position(|job| job.program.state().ended.is_some())
        else {
            return;
        };
        jobs.remove(oldest);
    }
}

/// The last `count` characters of `text`.
fn last_chars(text: &str, count: usize) -> &str {
    let skip = text.chars().count().saturating_sub(count);
    text.char_indices()
        .nth(skip)
        .map_or("", |(at, _)| &text[at..])
}

impl Job {
    fn status(&self) -> Status {
        let state = self.program.state();
        let killed = self.killed.load(Ordering::SeqCst);
        let over_output = state.over_output_limit;
        match state.ended {
            None => Status {
                running: true,
                exit_code: None,
                completion_reason: "",
                termination_source: "",
                stopped: None,
            },
            Some(_) if killed => Status {
                running: false,
                exit_code: Some(KILLED_EXIT),
                completion_reason: "killed",
                termination_source: "process.kill",
                stopped: None,
            },
            Some(ended) => {
                let limit = state.sandbox_reason();
                let stopped = if over_output {
                    Some(format!(
                        "the process wrote more than {} of output and was stopped",
                        trajectory_sandbox::human_bytes(OUTPUT_LIMIT)
                    ))
                } else {
                    match ended {
                        Ended::Exited(LIMIT_EXIT | REFUSED_EXIT) => limit,
                        Ended::Lost => Some("the sandbox closed the connection".to_owned()),
                        Ended::Exited(_) => None,
                    }
                };
                Status {
                    running: false,
                    exit_code: Some(match ended {
                        Ended::Exited(code) => code,
                        Ended::Lost => -1,
                    }),
                    completion_reason: if stopped.is_some() {
                        "killed"
                    } else {
                        "exited"
                    },
                    termination_source: if stopped.is_some() {
                        "sandbox.limit"
                    } else {
                        ""
                    },
                    stopped,
                }
            }
        }
    }

    /// The whole kept output, escapes removed.
    fn output(&self) -> String {
        let bytes = self.program.state().output.snapshot();
        strip_ansi(&String::from_utf8_lossy(&bytes))
    }

    fn uptime(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    fn with_end(status: &Status, result: &mut Map<String, Value>) {
        result.insert("exit_code".to_owned(), json!(status.exit_code));
        result.insert(
            "completion_reason".to_owned(),
            json!(status.completion_reason),
        );
        result.insert(
            "termination_source".to_owned(),
            json!(status.termination_source),
        );
        if let Some(stopped) = &status.stopped {
            result.insert("stopped_reason".to_owned(), json!(stopped));
        }
    }

    fn state_name(status: &Status) -> &'static str {
        if status.running { "running" } else { "exited" }
    }

    fn list_entry(&self) -> Value {
        let status = self.status();
        let raw = String::from_utf8_lossy(&self.program.state().output.snapshot()).into_owned();
        let mut entry = json!({
            "session_id": self.id,
            "command": first_chars(&self.command, 200),
            "cwd": self.cwd,
            "pid": self.program.state().pid,
            "started_at": self.started_at,
            "uptime_seconds": self.uptime(),
            "status": Self::state_name(&status),
            "output_preview": last_chars(&raw, 200),
        });
        if let (Some(code), Some(map)) = (status.exit_code, entry.as_object_mut()) {
            map.insert("exit_code".to_owned(), json!(code));
        }
        entry
    }

    fn poll(&self) -> Value {
        let status = self.status();
        let output = self.output();
        let mut result = Map::new();
        result.insert("session_id".to_owned(), json!(self.id));
        result.insert("command".to_owned(), json!(self.command));
        result.insert("status".to_owned(), json!(Self::state_name(&status)));
        result.insert("pid".to_owned(), json!(self.program.state().pid));
        result.insert("uptime_seconds".to_owned(), json!(self.uptime()));
        result.insert(
            "output_preview".to_owned(),
            json!(last_chars(&output, 1000)),
        );
        if !status.running {
            Self::with_end(&status, &mut result);
        }
        Value::Object(result)
    }

    fn log(&self, offset: u64, limit: u64) -> Value {
        let status = self.status();
        let output = self.output();
        let lines: Vec<&str> = output.lines().collect();
        let (offset, limit) = (
            usize::try_from(offset).unwrap_or(usize::MAX),
            usize::try_from(limit).unwrap_or(usize::MAX),
        );
        let selected = if offset == 0 && limit > 0 {
            &lines[lines.len().saturating_sub(limit)..]
        } else {
            let start = offset.min(lines.len());
            &lines[start..start.saturating_add(limit).min(lines.len())]
        };
        json!({
            "session_id": self.id,
            "command": self.command,
            "status": Self::state_name(&status),
            "output": selected.join("\n"),
            "total_lines": lines.len(),
            "showing": format!("{} lines", selected.len()),
        })
    }

    async fn wait(&self, requested: Option<u64>, limit: Duration) -> Value {
        let limit_seconds = limit.as_secs();
        let (seconds, note) = match requested {
            Some(asked) if asked > limit_seconds => (
                limit_seconds,
                Some(format!(
                    "Requested wait of {asked}s was clamped to configured limit of {limit_seconds}s"
                )),
            ),
            Some(asked) if asked > 0 => (asked, None),
            _ => (limit_seconds, None),
        };
        let ended = self.program.wait(Duration::from_secs(seconds)).await;
        let status = self.status();
        let output = self.output();
        let mut result = Map::new();
        if ended.is_some() {
            result.insert("status".to_owned(), json!("exited"));
            result.insert("command".to_owned(), json!(self.command));
            Self::with_end(&status, &mut result);
            result.insert("output".to_owned(), json!(last_chars(&output, 2000)));
            if let Some(note) = note {
                result.insert("timeout_note".to_owned(), json!(note));
            }
        } else {
            result.insert("status".to_owned(), json!("timeout"));
            result.insert("command".to_owned(), json!(self.command));
            result.insert("output".to_owned(), json!(last_chars(&output, 1000)));
            result.insert(
                "timeout_note".to_owned(),
                json!(note.unwrap_or_else(|| format!("Waited {seconds}s, process still running"))),
            );
        }
        Value::Object(result)
    }

    async fn kill(&self) -> Value {
        let before = self.status();
        if !before.running {
            let mut result = Map::new();
            result.insert("status".to_owned(), json!("already_exited"));
            result.insert("command".to_owned(), json!(self.command));
            Self::with_end(&before, &mut result);
            result.insert("output".to_owned(), json!(last_chars(&self.output(), 2000)));
            return Value::Object(result);
        }
        self.killed.store(true, Ordering::SeqCst);
        self.program.stop(STOP_WAIT).await;
        json!({
            "status": "killed",
            "session_id": self.id,
            "completion_reason": "killed",
            "termination_source": "process.kill",
            "output": last_chars(&self.output(), 2000),
        })
    }

    async fn write(&self, bytes: &[u8]) -> Value {
        if !self.status().running {
            return already_exited();
        }
        match self.program.write(bytes).await {
            Ok(()) => json!({ "status": "ok", "bytes_written": bytes.len() }),
            Err(err) => json!({ "status": "error", "error": err.to_string() }),
        }
    }

    async fn close(&self) -> Value {
        if !self.status().running {
            return already_exited();
        }
        match self.program.close_input().await {
            Ok(()) => json!({ "status": "ok", "message": "stdin closed" }),
            Err(err) => json!({ "status": "error", "error": err.to_string() }),
        }
    }
}

fn already_exited() -> Value {
    json!({ "status": "already_exited", "error": "Process has already finished" })
}

/// The first `count` characters of `text` (the reference lists commands cut so).
fn first_chars(text: &str, count: usize) -> &str {
    text.char_indices()
        .nth(count)
        .map_or(text, |(at, _)| &text[..at])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_cut_on_characters() {
        assert_eq!(last_chars("héllo", 3), "llo");
        assert_eq!(last_chars("hé", 5), "hé");
        assert_eq!(first_chars("héllo", 2), "hé");
        assert_eq!(first_chars("hé", 5), "hé");
    }
}
