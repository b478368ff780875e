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
    let mut reply = if turn < TOOL_TURNS {
        let (name, arguments) = scripted_call(task, turn);
        tool_calls_reply(&[(name, Value::String(arguments.to_string()))])
    } else {
        text_reply("done")
    };
    add_token_ids(&mut reply, task, turn);
    Step::Delay(latency, Box::new(Step::ok(reply)))
}

/// Adds to a reply the ids vLLM adds when asked for `return_token_ids`, in its shape (the prompt's
/// at the top, the completion's in the choice), as many as the reply's usage counts (10 and 5).
/// The script has no tokenizer: the ids name the task and the turn instead, so that a test sees
/// which call each recorded step is ([`assert_tokens_once`]).
pub fn add_token_ids(reply: &mut Value, task: usize, turn: usize) {
    reply["prompt_token_ids"] = json!([task, turn, 0, 0, 0, 0, 0, 0, 0, 0]);
    reply["choices"][0]["token_ids"] = json!([completion_id(task, turn), 1, 2, 3, 4]);
}

fn completion_id(task: usize, turn: usize) -> usize {
    task * 100 + turn
}

/// Checks the tokens lines of a merged run of `tasks` conversations: one a task, in order, each
/// holding every call of its conversation once and in call order (a resumed conversation's
/// earlier calls taken from the turn log, not asked again), each step pointing at its reply.
pub fn assert_tokens_once(lines: &[Value], tasks: usize) {
    assert_eq!(lines.len(), tasks, "one tokens line a conversation");
    for (task, line) in lines.iter().enumerate() {
        assert_eq!(line["prompt_index"], task, "dataset order");
        assert_eq!(
            line["tokenization"]["source"], "server",
            "task {task}: {line}"
        );
        let steps = line["steps"].as_array().expect("steps");
        let calls: Vec<(u64, u64, u64)> = steps
            .iter()
            .map(|step| {
                (
                    step["prompt_token_ids"][1].as_u64().expect("a prompt id"),
                    step["completion_token_ids"][0]
                        .as_u64()
                        .expect("a completion id"),
                    step["conversation_index"].as_u64().expect("its reply"),
                )
            })
            .collect();
        let expected: Vec<(u64, u64, u64)> = (0..CALLS_PER_CONVERSATION)
            .map(|turn| {
                let id = completion_id(task, usize::try_from(turn).unwrap());
                (turn, u64::try_from(id).unwrap(), 2 + 2 * turn)
            })
            .collect();
        assert_eq!(calls, expected, "task {task}: every call once, in order");
    }
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
