//! Golden tests of the Hermes conversion: records in the reference's exact shape (reference
//! sections 7.2 and 11), compared byte for byte.

use std::time::Duration;

use chrono::TimeZone;
use serde_json::{Map, Value, json};
use trajectory_worker::agent::{Conversation, Spent};
use trajectory_worker::hermes::{
    Failure, RecordContext, RecordIdentity, system_turn, trajectory_record, write_discarded_record,
    write_failed_record, write_trajectory_record,
};
use trajectory_worker::model::types::{parse_arguments, tool_call};
use trajectory_worker::model::{
    AssistantMessage, Message, Reasoning, ReasoningShape, ToolMessage, Usage,
};
use trajectory_worker::pricing::Cost;
use trajectory_worker::tools::ToolSpec;

fn terminal_spec() -> ToolSpec {
    ToolSpec {
        name: "terminal".into(),
        description: "Run a shell command".into(),
        parameters: json!({"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}),
    }
}

fn read_file_spec() -> ToolSpec {
    ToolSpec {
        name: "read_file".into(),
        description: "Read a file".into(),
        parameters: json!({"type": "object"}),
    }
}

fn call(id: &str, name: &str, arguments: &str) -> trajectory_worker::model::ToolCall {
    let mut call = tool_call(
        id.into(),
        name.into(),
        Some(&Value::String(arguments.into())),
    );
    call.arguments = parse_arguments(arguments);
    call
}

fn conversation() -> Conversation {
    Conversation {
        messages: vec![
            Message::User("Which Python is installed? Also show notes.txt.".into()),
            // A multi-tool turn with reasoning returned separately.
            Message::Assistant(AssistantMessage {
                content: "Checking both.".into(),
                reasoning: Some(Reasoning {
                    text: "I should run python3 and read the file.".into(),
                    shape: ReasoningShape::ReasoningContent,
                }),
                tool_calls: vec![
                    call("call_1", "terminal", r#"{"command": "python3 --version"}"#),
                    call("call_2", "read_file", r#"{"path": "notes.txt"}"#),
                ],
            }),
            Message::Tool(ToolMessage {
                tool_call_id: "call_1".into(),
                name: "terminal".into(),
                content: r#"{"output": "Python 3.11.6", "exit_code": 0, "error": null}"#.into(),
            }),
            Message::Tool(ToolMessage {
                tool_call_id: "call_2".into(),
                name: "read_file".into(),
                content: r#"{"error": "file not found: notes.txt"}"#.into(),
            }),
            // An empty-reasoning final turn, with non-ASCII text.
            Message::Assistant(AssistantMessage {
                content: "Python 3.11.6 — no notes.".into(),
                reasoning: None,
                tool_calls: vec![],
            }),
        ],
        api_calls: 2,
        completed: true,
        partial: false,
        usage: Usage {
            prompt_tokens: 100,
            completion_tokens: 20,
            reasoning_tokens: 5,
            ..Usage::default()
        },
        cost: None,
        model_time: Duration::from_millis(900),
        resume: None,
        replayed: None,
        steps: Vec::new(),
        ..Conversation::new("the prompt is in messages")
    }
}

#[test]
fn system_turn_is_the_hermes_template_with_python_json() {
    let system = system_turn(&[terminal_spec()]);
    let expected_tools = r#"[{"name": "terminal", "description": "Run a shell command", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}, "required": null}]"#;
    assert!(system.starts_with("You are a function calling AI model. You are provided with function signatures within <tools> </tools> XML tags."));
    assert!(system.contains(&format!("Here are the available tools:\n<tools>\n{expected_tools}\n</tools>\nFor each function call return a JSON object")));
    assert!(system.ends_with(
        "Example:\n<tool_call>\n{'name': <function-name>,'arguments': <args-dict>}\n</tool_call>"
    ));
    assert!(system_turn(&[]).contains("<tools>\n[]\n</tools>"));
}

#[test]
fn a_conversation_becomes_the_reference_record_byte_for_byte() {
    let source: Map<String, Value> = json!({"id": "q1"}).as_object().unwrap().clone();
    let tools = [terminal_spec(), read_file_spec()];
    let catalog = [
        "terminal".to_owned(),
        "read_file".to_owned(),
        "write_file".to_owned(),
    ];
    let toolsets = ["terminal".to_owned(), "file".to_owned()];
    let started = chrono::Utc.with_ymd_and_hms(2026, 3, 5, 14, 2, 10).unwrap();
    let context = RecordContext {
        id: "abc-42-0",
        prompt_index: 42,
        sample: 0,
        batch: 4,
        model: "hermes-test",
        toolsets_used: &toolsets,
        tools_offered: &tools,
        system_turn: None,
        catalog: &catalog,
        started_at: started,
        finished_at: started + chrono::Duration::milliseconds(1532),
        source: &source,
        verification: None,
        discarded_by: None,
    };
    let record = trajectory_record(&conversation(), &context);
    let line = trajectory_worker::pyjson::to_string(&Value::Object(record.clone()));

    let turns = record["conversations"].as_array().unwrap();
    assert_eq!(
        turns[1],
        json!({"from": "human", "value": "Which Python is installed? Also show notes.txt."})
    );
    assert_eq!(
        turns[2]["value"],
        "<think>\nI should run python3 and read the file.\n</think>\nChecking both.\n<tool_call>\n{\"name\": \"terminal\", \"arguments\": {\"command\": \"python3 --version\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"notes.txt\"}}\n</tool_call>"
    );
    assert_eq!(turns[3]["from"], "tool");
    assert_eq!(
        turns[3]["value"],
        "<tool_response>\n{\"tool_call_id\": \"call_1\", \"name\": \"terminal\", \"content\": {\"output\": \"Python 3.11.6\", \"exit_code\": 0, \"error\": null}}\n</tool_response>\n<tool_response>\n{\"tool_call_id\": \"call_2\", \"name\": \"read_file\", \"content\": {\"error\": \"file not found: notes.txt\"}}\n</tool_response>"
    );
    assert_eq!(
        turns[4],
        json!({"from": "gpt", "value": "<think>\n</think>\nPython 3.11.6 — no notes."})
    );
    assert_eq!(turns.len(), 5);

    // The line after the conversations, exactly as Python's json.dumps writes it.
    let tail = &line[line.find("], \"metadata\"").unwrap() + 3..];
    assert_eq!(
        tail,
        concat!(
            r#""metadata": {"batch_num": 4, "timestamp": "2026-03-05T14:02:11.532000Z", "model": "hermes-test"}, "#,
            r#""completed": true, "partial": false, "api_calls": 2, "toolsets_used": ["terminal", "file"], "#,
            r#""tool_stats": {"terminal": {"count": 1, "success": 1, "failure": 0}, "read_file": {"count": 1, "success": 0, "failure": 1}, "write_file": {"count": 0, "success": 0, "failure": 0}}, "#,
            r#""tool_error_counts": {"terminal": 0, "read_file": 1, "write_file": 0}, "#,
            r#""id": "abc-42-0", "sample": 0, "tools_offered": ["terminal", "read_file"], "#,
            r#""usage": {"prompt_tokens": 100, "completion_tokens": 20, "reasoning_tokens": 5, "total_tokens": 120}, "#,
            r#""reasoning_stats": {"total_assistant_turns": 2, "turns_with_reasoning": 1, "turns_without_reasoning": 1}, "#,
            r#""duration_ms": 1532, "model_time_ms": 900, "started_at": "2026-03-05T14:02:10.000000Z", "#,
            r#""finished_at": "2026-03-05T14:02:11.532000Z", "source": {"id": "q1"}}"#
        )
    );
    assert!(line.starts_with(r#"{"prompt_index": 42, "conversations": [{"from": "system", "value": "You are a function calling AI model."#));
    assert!(line.contains("— no notes."), "non-ASCII stays UTF-8");

    // The batch writes the same line straight from the conversation, with the system turn it
    // rendered once for these tools.
    let mut streamed = Vec::new();
    write_trajectory_record(&mut streamed, &conversation(), &context);
    assert_eq!(String::from_utf8(streamed).unwrap(), line);
    let system = system_turn(&tools);
    let mut with_system = Vec::new();
    write_trajectory_record(
        &mut with_system,
        &conversation(),
        &RecordContext {
            system_turn: Some(&system),
            ..context.clone()
        },
    );
    assert_eq!(String::from_utf8(with_system).unwrap(), line);
}

#[test]
fn inline_think_and_scratchpads_are_kept_and_unparsable_arguments_become_empty_objects() {
    let conversation = Conversation {
        messages: vec![
            Message::User("q".into()),
            Message::Assistant(AssistantMessage {
                content: "<REASONING_SCRATCHPAD>plan</REASONING_SCRATCHPAD>".into(),
                reasoning: None,
                tool_calls: vec![call("c", "terminal", "{not json")],
            }),
            Message::Tool(ToolMessage {
                tool_call_id: "c".into(),
                name: "terminal".into(),
                content: "Error: invalid arguments".into(),
            }),
            Message::Assistant(AssistantMessage {
                content: "<think>inline</think>\nanswer ".into(),
                reasoning: None,
                tool_calls: vec![],
            }),
        ],
        api_calls: 2,
        completed: true,
        partial: false,
        usage: Usage::default(),
        cost: None,
        model_time: Duration::ZERO,
        resume: None,
        replayed: None,
        steps: Vec::new(),
        ..Conversation::new("the prompt is in messages")
    };
    let turns = trajectory_worker::hermes::sharegpt(&conversation, &[terminal_spec()]);
    assert_eq!(
        turns[2]["value"],
        "<think>plan</think>\n<tool_call>\n{\"name\": \"terminal\", \"arguments\": {}}\n</tool_call>"
    );
    assert_eq!(
        turns[3]["value"],
        "<tool_response>\n{\"tool_call_id\": \"c\", \"name\": \"terminal\", \"content\": \"Error: invalid arguments\"}\n</tool_response>"
    );
    assert_eq!(turns[4]["value"], "<think>inline</think>\nanswer");
    let stats = trajectory_worker::hermes::reasoning_stats(&conversation.messages);
    assert_eq!(
        (stats.total_assistant_turns, stats.turns_with_reasoning),
        (2, 2)
    );
}

#[test]
fn tool_failures_are_classified_by_the_reference_rules() {
    use trajectory_worker::hermes::is_tool_failure;
    assert!(is_tool_failure(r#"{"error": "x"}"#));
    assert!(!is_tool_failure(r#"{"error": null, "output": "ok"}"#));
    assert!(is_tool_failure(r#"{"content": {"error": "inner"}}"#));
    assert!(is_tool_failure(r#"{"success": false}"#));
    assert!(
        !is_tool_failure(r#"{"exit_code": 1, "error": null}"#),
        "non-zero exit is not a failure"
    );
    assert!(!is_tool_failure("[1, 2]"));
    assert!(is_tool_failure(""));
    assert!(is_tool_failure("  Error: nope"));
    assert!(
        !is_tool_failure("an error occurred somewhere"),
        "no substring matching"
    );
}

#[test]
fn discarded_and_failed_records_are_python_json_lines_in_their_key_order() {
    let identity = RecordIdentity {
        id: "abc-7-1",
        prompt_index: 7,
        sample: 1,
        batch: 2,
    };
    let started = chrono::Utc.with_ymd_and_hms(2026, 3, 5, 14, 2, 10).unwrap();
    let finished = started + chrono::Duration::milliseconds(250);

    let mut discarded = Vec::new();
    write_discarded_record(&mut discarded, &identity, "require_reasoning", 3, finished);
    assert_eq!(
        String::from_utf8(discarded).unwrap(),
        concat!(
            r#"{"prompt_index": 7, "sample": 1, "id": "abc-7-1", "status": "discarded", "#,
            r#""filter": "require_reasoning", "batch_num": 2, "api_calls": 3, "#,
            r#""timestamp": "2026-03-05T14:02:10.250000Z"}"#
        )
    );

    let failure = Failure {
        class: "context_length",
        message: "prompt too long — \"x\"",
    };
    let mut failed = Vec::new();
    let nothing = (None, None);
    write_failed_record(
        &mut failed,
        &identity,
        failure,
        nothing,
        (started, finished),
    );
    assert_eq!(
        String::from_utf8(failed).unwrap(),
        concat!(
            r#"{"prompt_index": 7, "sample": 1, "id": "abc-7-1", "status": "failed", "#,
            r#""error_class": "context_length", "error": "prompt too long — \"x\"", "#,
            r#""batch_num": 2, "duration_ms": 250, "timestamp": "2026-03-05T14:02:10.250000Z"}"#
        )
    );

    // A conversation cut off after a paid reply keeps what it spent.
    let spent = Spent {
        usage: Usage {
            prompt_tokens: 30,
            completion_tokens: 4,
            ..Usage::default()
        },
        cost: Some(Cost::reported(0.5)),
    };
    let mut cut_off = Vec::new();
    let details = (Some(&spent), None);
    write_failed_record(
        &mut cut_off,
        &identity,
        failure,
        details,
        (started, finished),
    );
    assert!(String::from_utf8(cut_off).unwrap().ends_with(concat!(
        r#""timestamp": "2026-03-05T14:02:10.250000Z", "usage": {"prompt_tokens": 30, "#,
        r#""completion_tokens": 4, "reasoning_tokens": 0, "total_tokens": 34}, "cost": "#,
        r#"{"input": 0.0, "cached_input": 0.0, "cache_write": 0.0, "output": 0.0, "#,
        r#""total": 0.5, "currency": "USD", "source": "reported"}}"#
    )));

    // A clock that stepped back gives a zero duration, never a negative one.
    let mut stepped_back = Vec::new();
    write_failed_record(
        &mut stepped_back,
        &identity,
        failure,
        nothing,
        (finished, started),
    );
    assert!(
        String::from_utf8(stepped_back)
            .unwrap()
            .contains(r#""duration_ms": 0, "#)
    );
}

#[test]
fn the_paths_the_sandbox_refused_are_counted_by_prefix_after_the_source() {
    let refused = "[The sandbox refused /var/cache/x, /tmp/a \"b\": this conversation's commands \
                   may read and run programs only in its workspace and the system's directories \
                   (/usr, /bin, /etc, /opt, ...). Use programs and files from those instead]";
    let mut refusing = conversation();
    refusing.messages.insert(
        3,
        Message::Tool(ToolMessage {
            tool_call_id: "call_1".into(),
            name: "terminal".into(),
            content:
                json!({"output": format!("cat: ...\n{refused}"), "exit_code": 1, "error": null})
                    .to_string(),
        }),
    );
    let source = Map::new();
    let started = chrono::Utc.with_ymd_and_hms(2026, 3, 5, 14, 2, 10).unwrap();
    let context = RecordContext {
        id: "abc-1-0",
        prompt_index: 1,
        sample: 0,
        batch: 0,
        model: "hermes-test",
        toolsets_used: &[],
        tools_offered: &[],
        system_turn: None,
        catalog: &[],
        started_at: started,
        finished_at: started,
        source: &source,
        verification: None,
        discarded_by: None,
    };
    let mut line = Vec::new();
    write_trajectory_record(&mut line, &refusing, &context);
    let line = String::from_utf8(line).unwrap();
    assert!(
        line.ends_with(r#""source": {}, "sandbox_refusals": {"/tmp": 1, "/var": 1}}"#),
        "{line}"
    );
    let mut plain = Vec::new();
    write_trajectory_record(&mut plain, &conversation(), &context);
    assert!(
        !String::from_utf8(plain)
            .unwrap()
            .contains("sandbox_refusals")
    );
}
