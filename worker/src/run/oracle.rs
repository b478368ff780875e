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
        "bash {}/solve.sh",
        crate::tools::sandbox::shell_quoted(&dir)
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
