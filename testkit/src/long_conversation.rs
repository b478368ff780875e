//! The long conversations of the kill tests (issue 42), scripted: each task's conversation makes
//! [`TOOL_TURNS`] tool calls (terminal and file tools changing its workspace or task container, a
//! background job started in the first turn and checked in the last), then answers. The worker's
//! kill test (`worker/tests/turn_resume.rs`) runs them in the worker binary, the real-pods one
//! (`tests/tests/real_pods.rs`) in generation pods on a real node.
//!
//! The script answers by how many replies a request holds, so a turn repeated or lost shifts every
//! later one; [`assert_whole_conversation`] checks a record holds each turn once, in order, with
//! the answers of a workspace that went through every earlier turn, and [`verifier`] is the row's
//! check that the files and the log are where the transcript says.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use crate::scripted_server::{Step, first_user_message, text_reply, tool_calls_reply};

/// Tool turns of each conversation; then one more call for the answer.
pub const TOOL_TURNS: usize = 24;
/// Model calls of each conversation.
pub const CALLS_PER_CONVERSATION: u64 = TOOL_TURNS as u64 + 1;

/// The call of turn `turn` of the task numbered `task`.
pub fn scripted_call(task: usize, turn: usize) -> (&'static str, Value) {
    match turn {
        // A background job that keeps a heartbeat file fresh while it lives.
        0 => (
            "terminal",
            json!({
                "command": "while :; do date +%s > beat.new && mv beat.new beat; sleep 0.2; done",
                "background": true,
            }),
        ),
        // The job must be alive in the last turn, whichever attempt started it.
        last if last == TOOL_TURNS - 1 => (
            "terminal",
            // Within 3 s: a replay may have started the job again moments before.
            json!({"command": "( for i in $(seq 30); do test -s beat && \
                test $(( $(date +%s) - $(cat beat) )) -le 2 && { echo alive; exit 0; }; \
                sleep 0.1; done; echo dead )"}),
        ),
        odd if odd % 2 == 1 => (
            "write_file",
            json!({"path": format!("notes/step-{odd}.txt"), "content": format!("task {task} step {odd}\n")}),
        ),
        // Each answer depends on every earlier append: a replay that missed one, or ran one
        // twice, answers otherwise.
        even => (
            "terminal",
            json!({"command": format!("echo {even} >> log.txt && wc -l < log.txt")}),
        ),
    }
}

/// The dataset row of task `task`: its prompt and its verifier.
pub fn row(task: usize) -> Value {
    json!({"prompt": prompt(task), "test": verifier(task)})
}

/// Checks `records` hold each of tasks `0..tasks` once and whole
/// ([`assert_whole_conversation`]), and that some were taken up from their turns; returns the
/// turns those were taken up from.
pub fn assert_every_task_once(records: &[Value], tasks: usize) -> Vec<u64> {
    let mut seen = std::collections::HashSet::new();
    for record in records {
        let task = record["prompt_index"]
            .as_u64()
            .and_then(|index| usize::try_from(index).ok())
            .expect("a record's prompt_index");
        assert!(seen.insert(task), "task {task} has two records");
        assert_whole_conversation(record, task);
    }
    assert_eq!(seen.len(), tasks, "{records:#?}");
    let resumed: Vec<u64> = records
        .iter()
        .filter_map(|record| record["resumed_from_turn"].as_u64())
        .filter(|turn| *turn > 0)
        .collect();
    assert!(
        !resumed.is_empty(),
        "no conversation was taken up from its turns"
    );
    resumed
}

/// The prompt of task `task`.
pub fn prompt(task: usize) -> String {
    format!("task number {task}")
}

/// The task number of a prompt ([`prompt`]).
pub fn task_of(prompt: &str) -> usize {
    prompt
        .rsplit(' ')
        .next()
        .and_then(|number| number.parse().ok())
        .expect("a long conversation's prompt ends in its number")
}

/// The verifier of task `task`: the log the even turns appended and every file the odd turns
/// wrote, as the transcript says.
pub fn verifier(task: usize) -> String {
    let appends = (2..TOOL_TURNS - 1).filter(|turn| turn % 2 == 0).count();
    let files: Vec<String> = (1..TOOL_TURNS - 1)
        .filter(|turn| turn % 2 == 1)
        .map(|turn| format!("grep -qx 'task {task} step {turn}' notes/step-{turn}.txt"))
        .collect();
    format!(
        "test \"$(wc -l < log.txt)\" -eq {appends} && {}",
        files.join(" && ")
    )
}

/// Model requests so far, by task.
pub type Requests = Arc<Mutex<HashMap<usize, u64>>>;

/// The scripted model's answer to `body`, after `latency`; counts the request in `requests`.
pub fn respond(requests: &Requests, latency: Duration, body: &Value) -> Step {
    let task = task_of(first_user_message(body));
    *requests
        .lock()
        .expect("the request counts")
        .entry(task)
        .or_default() += 1;
    let turn = body["messages"].as_array().map_or(0, |messages| {
        messages
            .iter()
            .filter(|message| message["role"] == "assistant")
            .count()
    });
    let step = if turn < TOOL_TURNS {
        let (name, arguments) = scripted_call(task, turn);
        Step::ok(tool_calls_reply(&[(
            name,
            Value::String(arguments.to_string()),
        )]))
    } else {
        Step::ok(text_reply("done"))
    };
    Step::Delay(latency, Box::new(step))
}

/// The tool responses of a record's transcript, parsed (each `<tool_response>` holds the call's
/// id, name and content).
pub fn tool_responses(record: &Value) -> Vec<Value> {
    record["conversations"]
        .as_array()
        .expect("a record's conversations")
        .iter()
        .filter(|turn| turn["from"] == "tool")
        .map(|turn| {
            let text = turn["value"].as_str().expect("a tool turn's text");
            let payload = text
                .strip_prefix("<tool_response>\n")
                .and_then(|rest| rest.strip_suffix("\n</tool_response>"))
                .unwrap_or_else(|| panic!("one tool response: {text}"));
            serde_json::from_str(payload).expect("a tool response is JSON")
        })
        .collect()
}

/// A record holds each of its task's turns once, in order, with the answers a workspace that
/// went through every earlier turn gives, and its verifier passed.
pub fn assert_whole_conversation(record: &Value, task: usize) {
    assert_eq!(record["api_calls"], CALLS_PER_CONVERSATION, "{record}");
    assert_eq!(record["verification"]["passed"], true, "{record}");
    let responses = tool_responses(record);
    assert_eq!(responses.len(), TOOL_TURNS, "{record}");
    for (turn, response) in responses.iter().enumerate() {
        let (name, _) = scripted_call(task, turn);
        assert_eq!(response["name"], name, "turn {turn} of {record}");
        if turn > 0 && turn < TOOL_TURNS - 1 && turn % 2 == 0 {
            let lines = format!("{}\n", turn / 2);
            assert_eq!(response["content"]["output"], lines.trim_end(), "{record}");
        }
    }
    let last = &responses[TOOL_TURNS - 1]["content"];
    assert_eq!(last["output"], "alive", "{record}");
    // Only the job's start (its process id) and its check may answer otherwise when replayed
    // (the check's timing differs). Every append and file write answers as it did.
    for divergence in record["resume"]["divergences"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let turn = divergence["turn"].as_u64().expect("a divergence's turn");
        assert!(turn == 0 || turn == TOOL_TURNS as u64 - 1, "{record}");
    }
}
