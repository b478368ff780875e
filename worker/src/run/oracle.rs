//! The oracle pass (`spec.agent.oracle`): each row's solution runs where its conversation
//! would have run, instead of a model, and its verifier judges what the solution left, as
//! Harbor's `oracle` agent does. A dataset whose every row passes has environments and
//! verifiers that work; a row whose reward is not full names a task that is broken (or a
//! solution that is) before any model is paid.
//!
//! The solution is a row's `solution_tar` (a Harbor task's `solution/` directory, packed by the
//! plan): unpacked into a directory made afresh (`/solution` in a task container, the
//! workspace's `.verifier/solution` elsewhere), and its `solve.sh` run with `bash`, where the
//! conversation's commands start, under the same sandbox and limits as the model's commands,
//! within the task's agent timeout (`harbor.agent_timeout_sec`) or else the run's
//! `promptTimeoutSeconds`. The record shows it as one terminal call and its output; a row
//! without a solution gets a record saying so, and its verifier judges the untouched
//! environment.

use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use trajectory_sandbox::protocol::VerifierStep;

use crate::agent::Conversation;
use crate::dataset::Row;
use crate::harbor::task::{HARBOR_FIELD, SOLUTION_TAR_FIELD};
use crate::model::{AssistantMessage, Message, ToolCall, ToolMessage};
use crate::tools::ToolContext;
use crate::verify::{OUTPUT_TAIL_BYTES, WORKSPACE_VERIFIER_DIR};

/// Where the solution is unpacked in a task container.
const SOLUTION_DIR: &str = "/solution";

/// How a run's oracle pass runs solutions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oracle {
    /// A solution's time when its task names none (`promptTimeoutSeconds`).
    pub timeout: Duration,
}

impl Oracle {
    /// Runs `row`'s solution in the environment of `tool_context`: the conversation it makes.
    pub(super) async fn run_solution(&self, row: &Row, tool_context: &ToolContext) -> Conversation {
        run_solution(row, tool_context, self.timeout).await
    }
}

async fn run_solution(
    row: &Row,
    tool_context: &ToolContext,
    prompt_timeout: Duration,
) -> Conversation {
    let mut conversation = Conversation::episode(&row.prompt, Vec::new());
    let Some(solution) = row.source.get(SOLUTION_TAR_FIELD).and_then(Value::as_str) else {
        conversation
            .messages
            .push(Message::Assistant(AssistantMessage {
                content: format!("The row has no solution (`{SOLUTION_TAR_FIELD}`) to run."),
                ..AssistantMessage::default()
            }));
        conversation.completed = true;
        return conversation;
    };
    let sandbox = &tool_context.sandbox;
    let workspace = tool_context.workspace.root();
    let dir = if sandbox.task.is_some() {
        SOLUTION_DIR.to_owned()
    } else {
        workspace
            .join(WORKSPACE_VERIFIER_DIR)
            .join("solution")
            .display()
            .to_string()
    };
    let command = format!(
        "bash {}",
        crate::tools::sandbox::shell_quoted(&format!("{dir}/solve.sh"))
    );
    let timeout = agent_timeout(&row.source).unwrap_or(prompt_timeout);
    let started = Instant::now();
    let prepare = VerifierStep::Prepare {
        fresh: vec![dir.clone()],
        tests_dir: dir,
        tests_tar: Some(solution.to_owned()),
        test_sh: None,
    };
    let output = match sandbox.verifier_step(workspace, prepare).await {
        Ok(Ok(_)) => match sandbox
            .run_once(workspace, &command, timeout, OUTPUT_TAIL_BYTES)
            .await
        {
            Ok(run) => {
                let exit = run.exit_code.map_or_else(
                    || format!("stopped after {} s", timeout.as_secs()),
                    |code| format!("exit {code}"),
                );
                format!("{exit}\n{}", String::from_utf8_lossy(&run.output_tail))
            }
            Err(err) => format!("the sandbox failed: {err}"),
        },
        Ok(Err(refused)) => format!("the solution could not be put in place: {refused}"),
        Err(err) => format!("the sandbox failed: {err}"),
    };
    let mut arguments = Map::new();
    arguments.insert("command".into(), command.clone().into());
    let call = ToolCall {
        id: "oracle-0".into(),
        name: "terminal".into(),
        raw_arguments: Value::Object(arguments.clone()).to_string(),
        arguments: Ok(arguments),
    };
    conversation
        .messages
        .push(Message::Assistant(AssistantMessage {
            content: String::new(),
            reasoning: None,
            tool_calls: vec![call],
        }));
    conversation.messages.push(Message::Tool(ToolMessage {
        tool_call_id: "oracle-0".into(),
        name: "terminal".into(),
        content: output,
    }));
    conversation
        .messages
        .push(Message::Assistant(AssistantMessage {
            content: format!(
                "The oracle ran the row's solution in {} ms.",
                started.elapsed().as_millis()
            ),
            ..AssistantMessage::default()
        }));
    conversation.completed = true;
    conversation
}

/// A Harbor task's agent timeout (`harbor.agent_timeout_sec`), when it has one.
fn agent_timeout(source: &Map<String, Value>) -> Option<Duration> {
    source
        .get(HARBOR_FIELD)?
        .get("agent_timeout_sec")?
        .as_f64()
        .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
        .filter(|timeout| !timeout.is_zero())
}

/// The file beside an oracle run's records that says, record by record, whether the row's
/// solution earned the full reward.
pub const ORACLE_REPORT: &str = "oracle.jsonl";

/// The reward that proves a task: Harbor's oracle passes a task when its solution earns 1.
const FULL_REWARD: f64 = 1.0;

/// One record of an oracle run, as [`ORACLE_REPORT`] keeps it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OracleOutcome {
    pub prompt_index: u64,
    #[serde(default)]
    pub sample: u32,
    /// The Harbor task's directory name (`harbor.task` of the row), by which a later run
    /// leaves it out.
    #[serde(default)]
    pub task: Option<String>,
    /// What its `task.toml` names it, when it does.
    #[serde(default)]
    pub name: Option<String>,
    /// The verifier's reward; none when the row never reached its verifier.
    #[serde(default)]
    pub reward: Option<f64>,
    /// The reward is full.
    pub passed: bool,
    /// Why a record failed before its verifier (`image_unavailable`, ...).
    #[serde(default)]
    pub error_class: Option<String>,
}

impl OracleOutcome {
    pub fn new(
        prompt_index: u64,
        sample: u32,
        (task, name): (Option<&str>, Option<&str>),
        reward: Option<f64>,
        error_class: Option<&str>,
    ) -> Self {
        Self {
            prompt_index,
            sample,
            task: task.map(str::to_owned),
            name: name.map(str::to_owned),
            reward,
            passed: reward.is_some_and(|reward| reward >= FULL_REWARD),
            error_class: error_class.map(str::to_owned),
        }
    }

    /// How the report and the statistics name the row: its task, else its prompt number.
    fn label(&self) -> String {
        self.task
            .clone()
            .unwrap_or_else(|| format!("row {}", self.prompt_index))
    }
}

/// How many failed rows `statistics.json` names; the report names them all.
const NAMED_FAILURES: usize = 50;

/// What merge writes of an oracle run's records: [`ORACLE_REPORT`]'s lines, in dataset order,
/// and `statistics.json`'s `oracle` summary.
pub(super) fn report(mut outcomes: Vec<OracleOutcome>) -> (Vec<u8>, Value) {
    outcomes.sort_by_key(|outcome| (outcome.prompt_index, outcome.sample));
    let mut jsonl = Vec::new();
    for outcome in &outcomes {
        serde_json::to_writer(&mut jsonl, outcome).expect("an outcome serialises");
        jsonl.push(b'\n');
    }
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|outcome| !outcome.passed)
        .map(OracleOutcome::label)
        .collect();
    let summary = serde_json::json!({
        "records": outcomes.len(),
        "passed": outcomes.len() - failed.len(),
        "failed": failed.len(),
        "failed_rows": failed.iter().take(NAMED_FAILURES).collect::<Vec<_>>(),
        "report": ORACLE_REPORT,
    });
    (jsonl, summary)
}

/// The tasks an oracle report shows failing (any of their records without the full reward),
/// each with why: what `spec.dataset.excludeOracleFailures` leaves out. `path` names the report
/// in errors, with the line.
pub fn failed_tasks(
    report: &[u8],
    path: &std::path::Path,
) -> Result<std::collections::BTreeMap<String, String>, super::RunError> {
    let mut failed = std::collections::BTreeMap::new();
    for (number, line) in report.split(|byte| *byte == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let outcome: OracleOutcome = serde_json::from_slice(line).map_err(|err| {
            super::RunError::InvalidDataset(format!(
                "spec.dataset.excludeOracleFailures: {}:{}: not an oracle report's line: {err}",
                path.display(),
                number + 1
            ))
        })?;
        if outcome.passed {
            continue;
        }
        let Some(task) = outcome.task.clone() else {
            continue;
        };
        let why = match (outcome.reward, &outcome.error_class) {
            (_, Some(class)) => format!("failed the oracle in {} ({class})", path.display()),
            (Some(reward), None) => format!(
                "failed the oracle in {} (reward {reward}, not {FULL_REWARD})",
                path.display()
            ),
            (None, None) => format!("failed the oracle in {} (no reward)", path.display()),
        };
        failed.entry(task).or_insert(why);
    }
    Ok(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_the_rows_without_the_full_reward_and_reads_back_as_failed_tasks() {
        let outcomes = vec![
            OracleOutcome::new(2, 0, (Some("wrong"), None), Some(0.0), None),
            OracleOutcome::new(0, 0, (Some("right"), Some("x/right")), Some(1.0), None),
            OracleOutcome::new(
                1,
                0,
                (Some("unpulled"), None),
                None,
                Some("image_unavailable"),
            ),
            OracleOutcome::new(3, 0, (None, None), Some(0.5), None),
        ];
        let (jsonl, summary) = report(outcomes);
        assert_eq!(summary["records"], 4);
        assert_eq!(summary["passed"], 1);
        assert_eq!(
            summary["failed_rows"],
            serde_json::json!(["unpulled", "wrong", "row 3"])
        );
        let path = std::path::Path::new("runs/oracle/oracle.jsonl");
        let failed = failed_tasks(&jsonl, path).unwrap();
        assert_eq!(
            failed.keys().collect::<Vec<_>>(),
            ["unpulled", "wrong"],
            "{failed:?}"
        );
        assert_eq!(
            failed["wrong"],
            "failed the oracle in runs/oracle/oracle.jsonl (reward 0, not 1)"
        );
        assert!(failed["unpulled"].contains("image_unavailable"));
    }

    #[test]
    fn a_line_that_is_not_an_outcome_is_named_by_file_and_line() {
        let error = failed_tasks(
            b"{\"prompt_index\": 0, \"passed\": true}\n{\"prompt_index\": \"x\"}\n",
            std::path::Path::new("r/oracle.jsonl"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("spec.dataset.excludeOracleFailures: r/oracle.jsonl:2:"),
            "{error}"
        );
    }
}
