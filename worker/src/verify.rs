//! Verifiers: a row's check, run after its conversation in the environment the conversation left,
//! whose reward goes into the record.
//!
//! A row names its verifier as the datasets carry it: terminal-bench and Harbor rows as
//! `tests_tar` (base64 of a tar of the tests) and `test_sh` (the script that runs them), SWE-style
//! rows as a plain command (`test`, else `verify`); `spec.verifier.command` verifies the rows that
//! name none. Rows without a verifier, in runs without a default, are not verified.
//!
//! What runs, in order, once the conversation ended and everything it started is gone
//! ([`crate::tools::ToolContext::close`]), before its workspace or container is cleaned:
//! 1. The tests' and the reward's directories are made afresh, and the tests unpacked into them
//!    ([`trajectory_sandbox::verifier`]): nothing the model wrote there is read.
//! 2. The command, under the same sandbox as the model's commands, starting where the
//!    conversation started, with `$TESTS_DIR`, `$REWARD_FILE` and `$LOGS_DIR`, within
//!    `spec.verifier.timeoutSeconds`.
//! 3. The reward: Harbor's `reward.json` beside the reward file when there is one (its
//!    `reward`, else its only value), else the number in the reward file, else 1 for exit 0 and
//!    0 otherwise (the reference's terminal-bench rule).
//!
//! In a task container the directories are the spec's paths as they are (`/tests`,
//! `/logs/verifier`, as terminal-bench's scripts expect); in a workspace, which has no root of
//! its own, the same paths under its `.verifier` directory.
//!
//! A verifier that cannot run, crashes or times out gives reward 0 and says why in
//! [`Verification::error`]; the conversation's record is kept all the same.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use trajectory_sandbox::protocol::VerifierStep;
use trajectory_sandbox::verifier::TEST_SCRIPT;

use crate::spec::VerifierSpec;
use crate::tools::sandbox::{Sandbox, shell_quoted};

/// Row fields holding a verifier command, in the order they are looked for.
pub const COMMAND_FIELDS: [&str; 2] = ["test", "verify"];
/// The row field of terminal-bench's tests archive (base64 of a tar, gzipped or not).
pub const TESTS_TAR_FIELD: &str = "tests_tar";
/// The row field of terminal-bench's test script.
pub const TEST_SH_FIELD: &str = "test_sh";
/// The row field of the row's own verifier timeout, in seconds (Harbor's
/// `[verifier] timeout_sec`), over `spec.verifier.timeoutSeconds`.
pub const VERIFIER_TIMEOUT_FIELD: &str = "verifier_timeout_sec";

/// Harbor's file of named rewards, in the reward file's directory.
pub const REWARD_JSON: &str = "reward.json";

/// The directory of a workspace under which the verifier's paths lie.
pub const WORKSPACE_VERIFIER_DIR: &str = ".verifier";

/// Bytes of the verifier's output kept in the record (its end: where test runners summarise).
pub const OUTPUT_TAIL_BYTES: usize = 4000;

/// A row's verifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verifier {
    /// Run with `bash -c` (or `sh`).
    pub command: String,
    pub tests_tar: Option<String>,
    pub test_sh: Option<String>,
    /// The row's own timeout, over the run's.
    pub timeout: Option<Duration>,
}

impl Verifier {
    /// The verifier of a row: its own command, else its tests run by their `test.sh`, else the
    /// run's default command; `None` when there is none. A verifier field that is not a string
    /// is an error naming it.
    pub fn of_row(
        row: &Map<String, Value>,
        settings: &VerifierSpec,
    ) -> Result<Option<Self>, String> {
        let text = |field: &str| match row.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) if text.trim().is_empty() => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(other) => Err(format!(
                "the row's `{field}` must be a string, not {}",
                json_kind(other)
            )),
        };
        let own_command = match text(COMMAND_FIELDS[0])? {
            Some(command) => Some(command),
            None => text(COMMAND_FIELDS[1])?,
        };
        let tests_tar = text(TESTS_TAR_FIELD)?;
        let test_sh = text(TEST_SH_FIELD)?;
        let has_tests = tests_tar.is_some() || test_sh.is_some();
        let command = own_command
            .or_else(|| has_tests.then(|| format!("bash \"$TESTS_DIR/{TEST_SCRIPT}\"")))
            .or_else(|| settings.command.clone());
        let timeout = match row.get(VERIFIER_TIMEOUT_FIELD) {
            None | Some(Value::Null) => None,
            Some(seconds) => Some(
                seconds
                    .as_f64()
                    .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
                    .filter(|timeout| !timeout.is_zero())
                    .ok_or_else(|| {
                        format!(
                            "the row's `{VERIFIER_TIMEOUT_FIELD}` must be a positive number of seconds, not {seconds}"
                        )
                    })?,
            ),
        };
        Ok(command.map(|command| Self {
            command,
            tests_tar,
            test_sh,
            timeout,
        }))
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// What a verifier found.
#[derive(Debug, Clone, PartialEq)]
pub struct Verification {
    pub reward: f64,
    /// The reward reached `spec.verifier.passingReward` and the verifier ran to its end.
    pub passed: bool,
    /// The command's exit code; `None` when it did not run or was stopped at its timeout.
    pub exit_code: Option<i32>,
    pub duration: Duration,
    /// The end of its output.
    pub output: String,
    /// Why the verifier gave no reward of its own (reward 0): it could not run, timed out, or
    /// wrote something that is not a number.
    pub error: Option<String>,
}

impl Verification {
    /// A verifier that could not be run at all.
    pub fn failed(error: String, started: Instant) -> Self {
        Self {
            reward: 0.0,
            passed: false,
            exit_code: None,
            duration: started.elapsed(),
            output: String::new(),
            error: Some(error),
        }
    }
}

/// Where the verifier's files are, as the executor is told.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Places {
    tests_dir: String,
    reward_file: String,
    /// Harbor's named rewards, beside the reward file.
    reward_json: String,
    logs_dir: String,
}

impl Places {
    /// In a task container, the spec's paths; in the workspace `workspace`, under its
    /// [`WORKSPACE_VERIFIER_DIR`].
    fn new(in_container: bool, workspace: &Path, settings: &VerifierSpec) -> Self {
        let place = |path: &str| {
            if in_container {
                path.to_owned()
            } else {
                workspace
                    .join(WORKSPACE_VERIFIER_DIR)
                    .join(path.trim_start_matches('/'))
                    .display()
                    .to_string()
            }
        };
        let reward_file = place(&settings.reward_file);
        let logs_dir = Path::new(&reward_file)
            .parent()
            .map_or_else(|| reward_file.clone(), |dir| dir.display().to_string());
        let reward_json = Path::new(&logs_dir).join(REWARD_JSON).display().to_string();
        Self {
            tests_dir: place(&settings.tests_dir),
            reward_file,
            reward_json,
            logs_dir,
        }
    }

    /// The command line run: the places as environment variables, then the verifier's command.
    fn script(&self, command: &str) -> String {
        format!(
            "export TESTS_DIR={} REWARD_FILE={} LOGS_DIR={}\n{command}",
            shell_quoted(&self.tests_dir),
            shell_quoted(&self.reward_file),
            shell_quoted(&self.logs_dir),
        )
    }
}

/// Runs `verifier` in the environment a conversation left: its workspace `workspace`, or the task
/// container of `sandbox`. Nothing of the conversation may be running any more.
pub async fn verify(
    sandbox: &Sandbox,
    workspace: &Path,
    verifier: &Verifier,
    settings: &VerifierSpec,
) -> Verification {
    let started = Instant::now();
    let places = Places::new(sandbox.task.is_some(), workspace, settings);
    let prepare = VerifierStep::Prepare {
        fresh: vec![places.tests_dir.clone(), places.logs_dir.clone()],
        tests_dir: places.tests_dir.clone(),
        tests_tar: verifier.tests_tar.clone(),
        test_sh: verifier.test_sh.clone(),
    };
    match sandbox.verifier_step(workspace, prepare).await {
        Ok(Ok(_)) => {}
        Ok(Err(refused)) => {
            return Verification::failed(
                format!("the tests could not be put in place: {refused}"),
                started,
            );
        }
        Err(err) => {
            return Verification::failed(format!("the sandbox failed: {err}"), started);
        }
    }
    let timeout = verifier
        .timeout
        .unwrap_or(Duration::from_secs(settings.timeout_seconds));
    let run = match sandbox
        .run_once(
            workspace,
            &places.script(&verifier.command),
            timeout,
            OUTPUT_TAIL_BYTES,
        )
        .await
    {
        Ok(run) => run,
        Err(err) => return Verification::failed(format!("the sandbox failed: {err}"), started),
    };
    let output = String::from_utf8_lossy(&run.output_tail).into_owned();
    let reward_text = match run.exit_code {
        // A verifier stopped midway may have written anything: its reward file is not read.
        None => None,
        // Harbor's named rewards, beside the reward file, win over it (as Harbor reads them).
        Some(_) => match read_reward(sandbox, workspace, &places.reward_json).await {
            None => read_reward(sandbox, workspace, &places.reward_file).await,
            Some(Ok(json)) => {
                Some(reward_of_json(&json, &places.reward_json).map(|r| r.to_string()))
            }
            Some(Err(error)) => Some(Err(error)),
        },
    };
    let (reward, error) = reward_of(run.exit_code, reward_text, timeout, &places.reward_file);
    Verification {
        reward,
        passed: error.is_none() && reward >= settings.passing_reward,
        exit_code: run.exit_code,
        duration: started.elapsed(),
        output,
        error,
    }
}

/// What the file at `path` holds (at most 4 KiB); `None` when there is no such file.
async fn read_reward(
    sandbox: &Sandbox,
    workspace: &Path,
    path: &str,
) -> Option<Result<String, String>> {
    let step = VerifierStep::ReadReward {
        path: path.to_owned(),
    };
    match sandbox.verifier_step(workspace, step).await {
        Ok(Ok(Value::String(text))) => Some(Ok(text)),
        Ok(Ok(_)) => None,
        Ok(Err(refused)) => Some(Err(format!("the reward file could not be read: {refused}"))),
        Err(err) => Some(Err(format!("the sandbox failed: {err}"))),
    }
}

/// The reward of Harbor's `reward.json`, a flat object of named rewards: its `reward`, else its
/// only one; several without a `reward`, or a value that is not a finite number, is an error
/// naming the file.
fn reward_of_json(text: &str, path: &str) -> Result<f64, String> {
    let rewards: Map<String, Value> = serde_json::from_str(text)
        .map_err(|err| format!("{path} is not a JSON object of named rewards: {err}"))?;
    let value = match (rewards.get("reward"), rewards.len()) {
        (Some(reward), _) => reward,
        (None, 1) => rewards.values().next().expect("one value"),
        (None, _) => {
            let names: Vec<&str> = rewards.keys().map(String::as_str).collect();
            return Err(format!(
                "{path} names no `reward` among its rewards ({})",
                names.join(", ")
            ));
        }
    };
    value
        .as_f64()
        .filter(|reward| reward.is_finite())
        .ok_or_else(|| format!("{path} holds {value} as its reward, not a finite number"))
}

/// The reward and, when the verifier gave none of its own, why: from the exit code (`None`:
/// stopped at `timeout`) and what the reward file held (`None`: no such file).
fn reward_of(
    exit_code: Option<i32>,
    reward_file: Option<Result<String, String>>,
    timeout: Duration,
    reward_path: &str,
) -> (f64, Option<String>) {
    let Some(code) = exit_code else {
        return (
            0.0,
            Some(format!(
                "the verifier did not finish within {} s and was stopped",
                timeout.as_secs()
            )),
        );
    };
    match reward_file {
        Some(Err(error)) => (0.0, Some(error)),
        Some(Ok(text)) => match text.trim().parse::<f64>() {
            Ok(reward) if reward.is_finite() => (reward, None),
            _ => (
                0.0,
                Some(format!(
                    "{reward_path} holds {:?}, not a number",
                    text.trim().chars().take(80).collect::<String>()
                )),
            ),
        },
        None => match code {
            0 => (1.0, None),
            trajectory_sandbox::REFUSED_EXIT => (
                0.0,
                Some("the sandbox refused to run the verifier".to_owned()),
            ),
            126 | 127 => (
                0.0,
                Some(format!(
                    "the verifier's command could not be run (exit {code}: {})",
                    if code == 127 {
                        "command or file not found"
                    } else {
                        "not executable"
                    }
                )),
            ),
            _ => (0.0, None),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_rows_own_command_wins_then_its_tests_then_the_runs_default() {
        let settings = VerifierSpec {
            command: Some("make check".into()),
            ..VerifierSpec::default()
        };
        let plain = VerifierSpec::default();
        let of = |value: Value, settings: &VerifierSpec| {
            Verifier::of_row(&row(value), settings)
                .unwrap()
                .map(|verifier| verifier.command)
        };
        assert_eq!(
            of(
                serde_json::json!({"test": "pytest -q", "verify": "x"}),
                &settings
            )
            .as_deref(),
            Some("pytest -q")
        );
        assert_eq!(
            of(serde_json::json!({"verify": "x"}), &settings).as_deref(),
            Some("x")
        );
        assert_eq!(
            of(serde_json::json!({"test_sh": "exit 0"}), &settings).as_deref(),
            Some("bash \"$TESTS_DIR/test.sh\"")
        );
        assert_eq!(
            of(serde_json::json!({"prompt": "p"}), &settings).as_deref(),
            Some("make check")
        );
        assert_eq!(
            of(serde_json::json!({"prompt": "p", "test": ""}), &plain),
            None
        );
        let error = Verifier::of_row(&row(serde_json::json!({"test": ["a"]})), &plain).unwrap_err();
        assert_eq!(error, "the row's `test` must be a string, not a list");
    }

    #[test]
    fn places_are_the_specs_in_a_container_and_under_the_workspace_otherwise() {
        let settings = VerifierSpec::default();
        let container = Places::new(true, Path::new("/ignored"), &settings);
        assert_eq!(container.tests_dir, "/tests");
        assert_eq!(container.reward_file, "/logs/verifier/reward.txt");
        assert_eq!(container.logs_dir, "/logs/verifier");
        assert_eq!(container.reward_json, "/logs/verifier/reward.json");
        let workspace = Places::new(false, Path::new("/w/c1"), &settings);
        assert_eq!(workspace.tests_dir, "/w/c1/.verifier/tests");
        assert_eq!(workspace.logs_dir, "/w/c1/.verifier/logs/verifier");
        assert_eq!(
            Places {
                tests_dir: "/it's".into(),
                ..workspace
            }
            .script("true")
            .lines()
            .next(),
            Some(
                r"export TESTS_DIR='/it'\''s' REWARD_FILE='/w/c1/.verifier/logs/verifier/reward.txt' LOGS_DIR='/w/c1/.verifier/logs/verifier'"
            )
        );
    }

    #[test]
    fn harbors_named_rewards_give_their_reward_else_their_only_one() {
        let path = "/logs/verifier/reward.json";
        assert_eq!(
            reward_of_json(r#"{"reward": 0.5, "tests": 3}"#, path),
            Ok(0.5)
        );
        assert_eq!(reward_of_json(r#"{"accuracy": 1}"#, path), Ok(1.0));
        for (text, says) in [
            (
                r#"{"a": 1, "b": 0}"#,
                "names no `reward` among its rewards (a, b)",
            ),
            (r#"{"reward": "yes"}"#, "holds \"yes\" as its reward"),
            ("[1]", "is not a JSON object"),
        ] {
            let error = reward_of_json(text, path).unwrap_err();
            assert!(error.contains(says) && error.contains(path), "{error}");
        }
    }

    #[test]
    fn the_reward_is_the_files_number_else_the_exit_code_and_failures_say_why() {
        let timeout = Duration::from_secs(9);
        let reward = |code, file: Option<&str>| {
            reward_of(code, file.map(|text| Ok(text.to_owned())), timeout, "/r")
        };
        assert_eq!(reward(Some(1), Some(" 0.5\n")), (0.5, None));
        assert_eq!(reward(Some(0), None), (1.0, None));
        assert_eq!(reward(Some(1), None), (0.0, None));
        assert_eq!(
            reward(None, None),
            (
                0.0,
                Some("the verifier did not finish within 9 s and was stopped".to_owned())
            )
        );
        let (value, error) = reward(Some(0), Some("passed"));
        assert_eq!(
            (value, error.as_deref()),
            (0.0, Some("/r holds \"passed\", not a number"))
        );
        let (_, error) = reward(Some(127), None);
        assert!(error.unwrap().contains("not found"));
        let (_, error) = reward(Some(0), Some("inf"));
        assert!(error.is_some());
    }
}
