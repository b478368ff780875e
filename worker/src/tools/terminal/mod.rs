//! The `terminal` toolset: `terminal`, which runs shell commands in the conversation's shell,
//! and `process`, which manages the background jobs `terminal` starts. Names, argument schemas,
//! result shapes, the output's truncation and clean-up, the timeouts and the `workdir` check are
//! hermes-agent 0.19.0's (`tools/terminal_tool.py`, `tools/process_registry.py`); the golden
//! tests compare them with outputs recorded from that release. What differs is in
//! `docs/tools/terminal.md`.
//!
//! A conversation's [`Terminal`] holds its [`shell`] (one `bash` for the whole conversation, so
//! that `cd` and `export` persist), its background [`jobs`] and its working directory, which the
//! file tools follow too. Everything runs under the executor ([`super::sandbox`]): confined to
//! the conversation's workspace, within the sandbox's limits, and ended with everything it
//! started when the conversation ends ([`Terminal::close`]).

mod jobs;
mod output;
mod refusals;
mod shell;

pub use refusals::refusal_counts;
pub use shell::{Flavour, command_script, start_script};

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::args::{optional_bool_arg, optional_string_arg, optional_u64_arg, string_arg};
use super::{ResumeRule, Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use crate::spec::ToolsSpec;
use jobs::{JobStart, Jobs};
use shell::{CommandEnd, Shell};

pub const TOOLSET: &str = "terminal";

/// The process tool's name (hermes-agent renamed it `process_manage` after 0.19.0).
pub const PROCESS_TOOL: &str = "process";

/// The longest foreground timeout a call may ask for, as the reference's
/// `TERMINAL_MAX_FOREGROUND_TIMEOUT`: longer work belongs in the background.
pub const MAX_FOREGROUND_TIMEOUT: u64 = 600;

pub fn tools(config: &ToolsSpec) -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(TerminalTool::new(config.terminal.timeout_seconds)),
        Arc::new(ProcessTool::new()),
    ]
}

/// A conversation's terminal: its shell, its background jobs and its working directory, shared
/// by the `terminal` and `process` tools and followed by the file tools.
#[derive(Debug)]
pub struct Terminal {
    shell: tokio::sync::Mutex<ShellSlot>,
    jobs: Jobs,
    /// The shell's working directory after the last command (`None`: the workspace itself).
    cwd: Mutex<Option<PathBuf>>,
    /// What its commands may read, to say why one was refused a path.
    reach: refusals::ConversationReach,
}

impl Default for Terminal {
    /// A terminal whose jobs are named from a random seed.
    fn default() -> Self {
        Self::with_job_seed(rand::random())
    }
}

#[derive(Debug, Default)]
struct ShellSlot {
    shell: Option<Shell>,
    /// The sandbox has no `bash`: shells are `sh`.
    posix: bool,
    /// The last shell ended in a call that did not say so (`exit`, a limit): the next command's
    /// output tells the model that its shell's state was reset.
    ended_unannounced: bool,
    /// The last shell was stopped between calls (a job it left running with `&` went past a
    /// limit): the sandbox's reason, for the next command's output.
    stopped_between_calls: Option<String>,
}

/// What the first command in a new shell shows when the last one ended with an earlier call.
const SHELL_RESET_NOTE: &str = "[The shell ended in an earlier command (exit, or a sandbox limit) \
     and this one ran in a new shell in the same directory: exported variables, functions and \
     aliases were reset]";

impl Terminal {
    /// A terminal whose n-th background job gets the same id whenever it is made with `seed`.
    pub fn with_job_seed(seed: u64) -> Self {
        Self {
            shell: tokio::sync::Mutex::default(),
            jobs: Jobs::with_seed(seed),
            cwd: Mutex::default(),
            reach: refusals::ConversationReach::default(),
        }
    }

    /// The shell's working directory, as it last reported it (`None` before any command).
    pub fn cwd(&self) -> Option<PathBuf> {
        self.cwd
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The workspace the executor is asked for, and the directory to start in (`workdir`, as
    /// `cd` would take it, relative to where the shell is): the conversation's workspace and the
    /// shell's last directory while it still exists; in a task container, the row's directory
    /// (or the image's) and the shell's last directory in the container, or none before the
    /// first command (the executor starts in the workspace).
    fn start_place(&self, ctx: &ToolContext, workdir: Option<&str>) -> (String, Option<PathBuf>) {
        let here = if let Some(task) = &ctx.sandbox.task {
            (task.workspace().to_owned(), self.cwd())
        } else {
            let root = ctx.workspace.root();
            let cwd = self
                .cwd()
                .filter(|cwd| cwd.is_dir())
                .unwrap_or_else(|| root.to_owned());
            (root.display().to_string(), Some(cwd))
        };
        match (here, workdir) {
            ((workspace, Some(cwd)), Some(dir)) => (workspace, Some(cwd.join(dir))),
            ((workspace, None), Some(dir)) => {
                let base = PathBuf::from(&workspace);
                (workspace, Some(base.join(dir)))
            }
            (here, None) => here,
        }
    }

    fn set_cwd(&self, cwd: PathBuf) {
        *self.cwd.lock().unwrap_or_else(PoisonError::into_inner) = Some(cwd);
    }

    /// Ends the shell and every job with everything they started, and waits until the
    /// executors say all of it is gone: afterwards nothing of the conversation runs, and its
    /// workspace can be handed on or removed.
    pub async fn close(&self) {
        let shell = self.shell.lock().await.shell.take();
        let stop_shell = async {
            if let Some(shell) = &shell {
                shell.stop().await;
            }
        };
        tokio::join!(stop_shell, self.jobs.stop_all());
    }

    /// The shell, started if there is none (in the last known directory).
    async fn shell<'a>(
        &self,
        slot: &'a mut ShellSlot,
        ctx: &ToolContext,
    ) -> Result<&'a Shell, String> {
        if slot.shell.is_none() {
            let flavour = if slot.posix {
                Flavour::Posix
            } else {
                Flavour::Bash
            };
            let (workspace, cwd) = self.start_place(ctx, None);
            let shell = Shell::start(&ctx.sandbox, &workspace, cwd.as_deref(), flavour)
                .await
                .map_err(|err| format!("could not start the shell: {err}"))?;
            slot.shell = Some(shell);
        }
        Ok(slot.shell.as_ref().expect("started above"))
    }

    /// Runs a foreground command; the `terminal` result.
    async fn run(
        &self,
        ctx: &ToolContext,
        command: &str,
        workdir: Option<&str>,
        timeout: Duration,
    ) -> ToolOutcome {
        let mut slot = self.shell.lock().await;
        // A shell stopped before the command reached it is replaced once; a new one stopped
        // too is past the limit from its start (a workspace a job filled), and the command says so.
        let mut replaced = false;
        loop {
            let shell = match self.shell(&mut slot, ctx).await {
                Ok(shell) => shell,
                Err(message) => return ToolOutcome::Err(message),
            };
            if let Some(reason) = shell.stopped_while_waiting() {
                slot.shell = None;
                if std::mem::replace(&mut replaced, true) {
                    return ToolOutcome::Err(reason);
                }
                slot.stopped_between_calls = Some(reason);
                continue;
            }
            let flavour = shell.flavour();
            let (end, kept) = shell
                .run(command, workdir, timeout, ctx.limits.max_output_bytes)
                .await;
            let note = if matches!(
                end,
                CommandEnd::NotStarted(_) | CommandEnd::StoppedBeforeIt(_)
            ) {
                None
            } else if let Some(reason) = slot.stopped_between_calls.take() {
                slot.ended_unannounced = false;
                Some(format!(
                    "[The shell was stopped after the last call: {reason}. This command ran in a \
                     new shell in the same directory: exported variables, functions and aliases \
                     were reset]"
                ))
            } else {
                std::mem::take(&mut slot.ended_unannounced).then(|| SHELL_RESET_NOTE.to_owned())
            };
            let note = with_past_limit(note, end.past_limit());
            let with_note = |output: String| match (note.as_deref(), output.is_empty()) {
                (None, _) => output,
                (Some(note), true) => note.to_owned(),
                (Some(note), false) => format!("{note}\n{output}"),
            };
            match end {
                CommandEnd::Finished { exit_code, cwd, .. } => {
                    self.set_cwd(cwd);
                    let output = with_note(kept.render(""));
                    return ToolOutcome::Ok(finished(command, &output, exit_code));
                }
                CommandEnd::TimedOut { shell_lost, .. } => {
                    if shell_lost {
                        slot.shell = None;
                    }
                    let mut note = format!("\n\n[Command timed out after {}s]", timeout.as_secs());
                    if shell_lost {
                        note.push_str(
                            "\n[The shell did not stop with the command and was restarted: \
                             variables exported so far are gone]",
                        );
                    }
                    return ToolOutcome::Ok(json!({
                        "output": with_note(kept.render(&note)),
                        "exit_code": 124,
                        "error": null,
                    }));
                }
                CommandEnd::ShellEnded { exit_code, reason } => {
                    slot.shell = None;
                    slot.ended_unannounced = true;
                    let output = with_note(kept.render(""));
                    return match reason {
                        Some(reason) => ToolOutcome::Err(limit_error(&output, &reason)),
                        None => ToolOutcome::Ok(finished(command, &output, exit_code)),
                    };
                }
                CommandEnd::StoppedBeforeIt(reason) => {
                    // As when the stop is seen before the command: the command runs in a new
                    // shell, and what the old one's jobs wrote goes with them.
                    slot.shell = None;
                    if std::mem::replace(&mut replaced, true) {
                        return ToolOutcome::Err(reason);
                    }
                    slot.stopped_between_calls = Some(reason);
                }
                CommandEnd::NotStarted(reason) => {
                    slot.shell = None;
                    if reason.contains("cannot start") {
                        if flavour == Flavour::Bash {
                            slot.posix = true;
                            continue;
                        }
                        // A task image without a shell (distroless, a bare binary): say so.
                        return ToolOutcome::Err(format!(
                            "the command was not run: this environment has no shell (neither \
                             bash nor sh: {reason})"
                        ));
                    }
                    return ToolOutcome::Err(format!("the command was not run: {reason}"));
                }
            }
        }
    }

    /// Starts a background job from the shell's directory and exported variables; the
    /// `terminal` result.
    async fn start_job(&self, ctx: &ToolContext, command: &str, workdir: Option<&str>) -> Value {
        loop {
            let (exported, flavour) = {
                let mut slot = self.shell.lock().await;
                match self.shell(&mut slot, ctx).await {
                    Ok(shell) => (shell.exported().await, shell.flavour()),
                    Err(message) => {
                        return json!({"output": "", "exit_code": -1, "error": message});
                    }
                }
            };
            let (workspace, cwd) = self.start_place(ctx, workdir);
            let started = self
                .jobs
                .start(
                    &ctx.sandbox,
                    JobStart {
                        command,
                        workspace: &workspace,
                        cwd: cwd.as_deref(),
                        exported: exported.as_deref().unwrap_or(""),
                        flavour,
                    },
                )
                .await;
            // An image without bash is found out by the first program it is asked to start: a
            // job started before any command falls back to `sh`, as a command does.
            let no_bash = started["error"]
                .as_str()
                .is_some_and(|error| error.contains("cannot start bash:"));
            if flavour == Flavour::Bash && no_bash {
                let mut slot = self.shell.lock().await;
                slot.shell = None;
                slot.posix = true;
                continue;
            }
            return started;
        }
    }
}

/// The notes a command's output starts with: `shell`'s (why it ran in a new shell), then the
/// sandbox's on a workspace still past its limit, which is the model's to clean up (a job filled
/// it; a command that makes it grow is stopped).
fn with_past_limit(shell: Option<String>, past_limit: Option<&str>) -> Option<String> {
    let past_limit = past_limit.map(|past| format!("[{past}]"));
    match (shell, past_limit) {
        (Some(shell), Some(past)) => Some(format!("{shell}\n{past}")),
        (shell, past) => shell.or(past),
    }
}

/// The result of a command that ran to its end.
fn finished(command: &str, output: &str, exit_code: i32) -> Value {
    let mut result = json!({ "output": output, "exit_code": exit_code, "error": null });
    if let (Some(meaning), Some(map)) = (
        exit_code_meaning(command, exit_code),
        result.as_object_mut(),
    ) {
        map.insert("exit_code_meaning".to_owned(), json!(meaning));
    }
    result
}

/// The tool error of a command stopped at a limit: the reason first, then the output so far
/// (the model may want to see how far it got).
fn limit_error(before: &str, reason: &str) -> String {
    if before.is_empty() {
        reason.to_owned()
    } else {
        format!("{reason}. Output before it was stopped:\n{before}")
    }
}

/// The reference's note on an exit code that is not an error for the command that gave it
/// (`_interpret_exit_code`): the last command of a pipeline or list, by its first word.
fn exit_code_meaning(command: &str, exit_code: i32) -> Option<&'static str> {
    if exit_code == 0 {
        return None;
    }
    let last = command
        .split("||")
        .flat_map(|part| part.split("&&"))
        .flat_map(|part| part.split(['|', ';']))
        .last()?
        .trim();
    let program = last
        .split_whitespace()
        .find(|word| !word.contains('=') || word.starts_with('-'))?;
    let program = program.rsplit('/').next()?;
    let no_match = "No matches found (not an error)";
    let differ = "Files differ (expected, not an error)";
    let condition = "Condition evaluated to false (expected, not an error)";
    match (program, exit_code) {
        ("grep" | "egrep" | "fgrep" | "rg" | "ag" | "ack", 1) => Some(no_match),
        ("diff" | "colordiff", 1) => Some(differ),
        ("find", 1) => {
            Some("Some directories were inaccessible (partial results may still be valid)")
        }
        ("test" | "[", 1) => Some(condition),
        ("curl", 6) => Some("Could not resolve host"),
        ("curl", 7) => Some("Failed to connect to host"),
        ("curl", 22) => Some("HTTP response code indicated error (e.g. 404, 500)"),
        ("curl", 28) => Some("Operation timed out"),
        ("git", 1) => {
            Some("Non-zero exit (often normal — e.g. 'git diff' returns 1 when files differ)")
        }
        _ => None,
    }
}

/// The reference's check of `workdir`: an allow-list of path characters, so that no shell
/// metacharacter reaches the `cd`.
fn workdir_refusal(workdir: &str) -> Option<String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "/\\:_-.~ +@=,".contains(c);
    workdir.chars().find(|c| !allowed(*c)).map(|bad| {
        format!(
            "Blocked: workdir contains disallowed character {}. Use a simple filesystem path \
             without shell metacharacters.",
            python_repr(bad)
        )
    })
}

/// A character as Python's `repr` shows it (the reference's message uses it).
fn python_repr(c: char) -> String {
    match c {
        '\'' => "\"'\"".to_owned(),
        '\n' => "'\\n'".to_owned(),
        '\t' => "'\\t'".to_owned(),
        '\r' => "'\\r'".to_owned(),
        '\\' => "'\\\\'".to_owned(),
        c if c.is_control() => format!("'\\x{:02x}'", u32::from(c)),
        c => format!("'{c}'"),
    }
}

/// Runs shell commands in the conversation's shell.
#[derive(Debug)]
struct TerminalTool {
    spec: ToolSpec,
}

impl TerminalTool {
    fn new(default_timeout: u64) -> Self {
        let description = format!(
            "Execute shell commands on a Linux environment. Filesystem, current working \
             directory, and exported environment variables persist between calls.\n\n\
             Do NOT use cat/head/tail to read files — use read_file instead.\n\
             Do NOT use grep/rg/find to search — use search_files instead.\n\
             Do NOT use ls to list directories — use search_files(target='files') instead.\n\
             Do NOT use sed/awk to edit files — use patch instead.\n\
             Do NOT use echo/cat heredoc to create files — use write_file instead.\n\
             Reserve terminal for: builds, installs, git, processes, scripts, network, package \
             managers, and anything that needs a shell.\n\
             Because exported environment state persists, activate a virtualenv or export setup \
             variables once per session; do not re-source the same environment before every \
             command unless a command proves the shell state was reset.\n\n\
             Foreground (default): Commands return INSTANTLY when done, even if the timeout is \
             high. Set timeout=300 for long builds/scripts — you'll still get the result in \
             seconds if it's fast. Prefer foreground for short commands.\n\
             Background: Set background=true to get a session_id, for long-lived processes \
             (servers, watchers, daemons) and long-running tasks. Use process(action=\"poll\") \
             for progress checks, process(action=\"wait\") to block until done. Background \
             processes end when the conversation ends.\n\
             For servers/watchers, do NOT use shell-level background wrappers \
             (nohup/disown/setsid/trailing '&') in foreground mode. Use background=true so \
             their lifecycle and output can be tracked.\n\
             After starting a server, verify readiness with a health check or log signal, then \
             run tests in a separate terminal() call. Avoid blind sleep loops.\n\
             Working directory: Use 'workdir' for per-command cwd.\n\n\
             Commands are non-interactive (stdin is empty, TERM=dumb): pass flags such as -y \
             to tools that would prompt, and pipe git output to cat if it might page. The \
             default timeout is {default_timeout}s."
        );
        Self {
            spec: ToolSpec {
                name: "terminal".to_owned(),
                description,
                parameters: json!({
                    "type": "object",
                    "properties": {
                        "command": {
                            "type": "string",
                            "description": "The command to execute on the VM"
                        },
                        "background": {
                            "type": "boolean",
                            "description": "Run the command in the background and return a \
                                session_id at once. For long-lived processes that never exit \
                                (servers, watchers, daemons) and long-running tasks; follow \
                                them with the process tool. For short commands, prefer \
                                foreground with a generous timeout instead.",
                            "default": false
                        },
                        "timeout": {
                            "type": "integer",
                            "description": format!(
                                "Max seconds to wait (default: {default_timeout}, foreground \
                                 max: {MAX_FOREGROUND_TIMEOUT}). Returns INSTANTLY when command \
                                 finishes — set high for long tasks, you won't wait \
                                 unnecessarily. Foreground timeout above \
                                 {MAX_FOREGROUND_TIMEOUT}s is rejected; use background=true for \
                                 longer commands."
                            ),
                            "minimum": 1
                        },
                        "workdir": {
                            "type": "string",
                            "description": "Working directory for this command (absolute \
                                path). Defaults to the session working directory."
                        }
                    },
                    "required": ["command"]
                }),
            },
        }
    }
}

impl Tool for TerminalTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    /// Commands run again in order rebuild the workspace, the shell's directory and variables,
    /// and its background jobs; their output often names a time or a process id, so a
    /// difference is noted, not fatal.
    fn on_resume(&self) -> ResumeRule {
        ResumeRule::RerunKeepGoing
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            let command = match string_arg(&args, "command") {
                Ok(command) if command.trim().is_empty() => {
                    return ToolOutcome::Err("argument `command` is empty".to_owned());
                }
                Ok(command) => command,
                Err(message) => return ToolOutcome::Err(message),
            };
            let (background, requested, workdir) = match (
                optional_bool_arg(&args, "background"),
                optional_u64_arg(&args, "timeout"),
                optional_string_arg(&args, "workdir"),
            ) {
                (Ok(background), Ok(timeout), Ok(workdir)) => (
                    background.unwrap_or(false),
                    timeout,
                    workdir.filter(|dir| !dir.is_empty()),
                ),
                (Err(message), ..) | (_, Err(message), _) | (.., Err(message)) => {
                    return ToolOutcome::Err(message);
                }
            };
            if let Some(refusal) = workdir.and_then(workdir_refusal) {
                return ToolOutcome::Ok(json!({
                    "output": "",
                    "exit_code": -1,
                    "error": refusal,
                    "status": "blocked",
                }));
            }
            if background {
                return ToolOutcome::Ok(ctx.terminal.start_job(ctx, command, workdir).await);
            }
            let timeout = match requested {
                Some(seconds) if seconds > MAX_FOREGROUND_TIMEOUT => {
                    return ToolOutcome::Err(format!(
                        "Foreground timeout {seconds}s exceeds the maximum of \
                         {MAX_FOREGROUND_TIMEOUT}s. Use background=true for long-running \
                         commands."
                    ));
                }
                // A zero timeout would kill the command before it starts: the shortest, then.
                Some(seconds) => Duration::from_secs(seconds.max(1)),
                None => ctx.limits.command_timeout,
            };
            let outcome = ctx.terminal.run(ctx, command, workdir, timeout).await;
            ctx.terminal.reach.note_outcome(ctx, outcome)
        })
    }
}

/// Manages the conversation's background jobs.
#[derive(Debug)]
struct ProcessTool {
    spec: ToolSpec,
}

impl ProcessTool {
    fn new() -> Self {
        Self {
            spec: ToolSpec {
                name: PROCESS_TOOL.to_owned(),
                description: "Manage background processes started with \
                    terminal(background=true). Actions: 'list' (show all), 'poll' (check status \
                    + new output), 'log' (full output with pagination), 'wait' (block until done \
                    or timeout), 'kill' (terminate), 'write' (send raw stdin data without \
                    newline), 'submit' (send data + Enter, for answering prompts), 'close' \
                    (close stdin/send EOF)."
                    .to_owned(),
                parameters: json!({
                    "type": "object",
                    "properties": {
                        "action": {
                            "type": "string",
                            "enum": ["list", "poll", "log", "wait", "kill", "write", "submit", "close"],
                            "description": "Action to perform on background processes"
                        },
                        "session_id": {
                            "type": "string",
                            "description": "Process session ID (from terminal background \
                                output). Required for all actions except 'list'."
                        },
                        "data": {
                            "type": "string",
                            "description": "Text to send to process stdin (for 'write' and \
                                'submit' actions)"
                        },
                        "timeout": {
                            "type": "integer",
                            "description": "Max seconds to block for 'wait' action. Returns \
                                partial output on timeout.",
                            "minimum": 1
                        },
                        "offset": {
                            "type": "integer",
                            "description": "Line offset for 'log' action (default: last 200 lines)"
                        },
                        "limit": {
                            "type": "integer",
                            "description": "Max lines to return for 'log' action",
                            "minimum": 1
                        }
                    },
                    "required": ["action"]
                }),
            },
        }
    }
}

impl Tool for ProcessTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    /// A job's output and state depend on when it is polled: run again, differences noted.
    fn on_resume(&self) -> ResumeRule {
        ResumeRule::RerunKeepGoing
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            let result = ctx
                .terminal
                .jobs
                .manage(&args, ctx.limits.command_timeout)
                .await;
            match result.get("error").and_then(Value::as_str) {
                // The reference's bare `{"error": ...}` results are tool errors.
                Some(message) if result.as_object().is_some_and(|map| map.len() == 1) => {
                    ToolOutcome::Err(message.to_owned())
                }
                _ => ctx
                    .terminal
                    .reach
                    .note_outcome(ctx, ToolOutcome::Ok(result)),
            }
        })
    }
}

/// Where a relative path of a file tool starts: the terminal's working directory, relative to
/// the workspace root (empty before any command); an error when the shell is outside the
/// workspace, where the file tools cannot follow it.
pub fn file_base(terminal: &Terminal, root: &Path) -> Result<PathBuf, String> {
    let Some(cwd) = terminal.cwd() else {
        return Ok(PathBuf::new());
    };
    let real = cwd.canonicalize().unwrap_or(cwd.clone());
    real.strip_prefix(root).map(Path::to_owned).map_err(|_| {
        format!(
            "relative paths follow the terminal's working directory, which is {} and outside \
             the workspace; cd back into the workspace ({}) first",
            cwd.display(),
            root.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_that_are_not_errors_are_explained() {
        assert_eq!(
            exit_code_meaning("echo abc | grep zzz", 1),
            Some("No matches found (not an error)")
        );
        assert_eq!(
            exit_code_meaning("LC_ALL=C /usr/bin/diff a b", 1),
            Some("Files differ (expected, not an error)")
        );
        assert_eq!(exit_code_meaning("grep x f", 2), None);
        assert_eq!(
            exit_code_meaning("false && curl -s x", 7),
            Some("Failed to connect to host")
        );
        assert_eq!(exit_code_meaning("grep x f", 0), None);
    }

    #[test]
    fn a_workdir_with_a_shell_metacharacter_is_blocked_naming_it() {
        assert_eq!(
            workdir_refusal("/tmp; rm -rf /").as_deref(),
            Some(
                "Blocked: workdir contains disallowed character ';'. Use a simple filesystem \
                 path without shell metacharacters."
            )
        );
        assert_eq!(workdir_refusal("/w/a b/c-d_e.f~+@=,"), None);
        assert!(workdir_refusal("/w/$(id)").unwrap().contains("'$'"));
    }

    #[test]
    fn a_workspace_past_its_limit_is_noted_after_the_new_shells_note() {
        assert_eq!(with_past_limit(None, None), None);
        assert_eq!(
            with_past_limit(None, Some("Full")).as_deref(),
            Some("[Full]")
        );
        assert_eq!(
            with_past_limit(Some("[New shell]".to_owned()), Some("Full")).as_deref(),
            Some("[New shell]\n[Full]")
        );
    }

    #[test]
    fn the_toolset_offers_terminal_and_process() {
        let tools = tools(&ToolsSpec::default());
        let names: Vec<&str> = tools.iter().map(|tool| tool.spec().name.as_str()).collect();
        assert_eq!(names, ["terminal", PROCESS_TOOL]);
        assert_eq!(tools[0].spec().parameters["required"], json!(["command"]));
        assert_eq!(tools[1].spec().parameters["required"], json!(["action"]));
    }
}
