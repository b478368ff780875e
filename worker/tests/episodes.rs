//! Episodes (issue 43): a row's `turns` are answered in order in one environment. Turn 1 writes
//! a file and starts an HTTP server in the background; turn 2 reads the file; turn 3 fetches it
//! from the server turn 1 started. The record keeps Hermes' `conversations`, says who wrote each
//! turn (`turn_origin`) and where each user turn's segment lies (`episode`); a kill after turn 2
//! costs only the turn in flight: the successor takes the episode up from the turn log (the
//! server started again by the replay) and asks the model for turn 3 alone.
//!
//! The model is scripted (a test double): it answers by the user turn a request ends in and the
//! replies since, so a turn repeated, lost or sent out of order shifts what it says.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{RunFixture, spawn_worker, worker};
use serde_json::{Value, json};
use trajectory_testkit::free_port;
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_call_reply};

const NOTE: &str = "the episode's note";

/// The user turns of the row: the prompt, then two more.
const TURNS: [&str; 3] = [
    "Write the note and serve this directory.",
    "What does the note say?",
    "Fetch the note from the server you started.",
];

/// What the scripted model answers to `body`: by the user turn it ends in (the last dataset
/// message) and the replies since that turn.
fn respond(body: &Value, port: u16, slow_turn_3: bool) -> Step {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let last_user = messages
        .iter()
        .rposition(|message| message["role"] == "user")
        .expect("a request holds a user message");
    let turn = TURNS
        .iter()
        .position(|text| messages[last_user]["content"] == *text)
        .expect("the last user message is one of the row's turns");
    let replies = messages[last_user..]
        .iter()
        .filter(|message| message["role"] == "assistant")
        .count();
    let call = |name: &str, arguments: Value| Step::ok(tool_call_reply(name, &arguments));
    match (turn, replies) {
        (0, 0) => call("write_file", json!({"path": "note.txt", "content": NOTE})),
        (0, 1) => call(
            "terminal",
            json!({
                "command": format!("python3 -m http.server {port} --bind 127.0.0.1"),
                "background": true,
            }),
        ),
        (0, _) => Step::ok(text_reply("written and served")),
        (1, 0) => call("read_file", json!({"path": "note.txt"})),
        (1, _) => Step::ok(text_reply("it says the episode's note")),
        (2, 0) => {
            let fetch = call(
                "terminal",
                json!({"command": format!(
                    "for i in $(seq 50); do curl -sf http://127.0.0.1:{port}/note.txt && break; sleep 0.1; done"
                )}),
            );
            // Slow enough for the kill test to kill the worker while it waits.
            if slow_turn_3 {
                Step::Delay(Duration::from_secs(2), Box::new(fetch))
            } else {
                fetch
            }
        }
        (_, _) => Step::ok(text_reply("fetched it")),
    }
}

async fn scripted_model(port: u16, slow_turn_3: bool) -> (ScriptedServer, Arc<Mutex<u64>>) {
    let requests = Arc::new(Mutex::new(0_u64));
    let counted = Arc::clone(&requests);
    let server = ScriptedServer::start_responding(move |body| {
        *counted.lock().unwrap() += 1;
        respond(body, port, slow_turn_3)
    })
    .await;
    (server, requests)
}

fn fixture(server: &ScriptedServer) -> RunFixture {
    let row = json!({"prompt": TURNS[0], "turns": &TURNS[1..], "task": "episode"});
    RunFixture::with_lines(&server.base_url(), &[row.to_string()])
        .with("/batchSize", json!(1))
        .with("/agent/maxTurns", json!(4))
}

/// The texts of a record's turns from `from`, in order.
fn texts<'a>(record: &'a Value, from: &str) -> Vec<&'a str> {
    record["conversations"]
        .as_array()
        .expect("conversations")
        .iter()
        .filter(|turn| turn["from"] == from)
        .map(|turn| turn["value"].as_str().expect("a turn's text"))
        .collect()
}

/// The record of the three turns, whole: every user turn once and in order at its segment's
/// start, each answered; the file turn 1 wrote read in turn 2 and served in turn 3 by the
/// server turn 1 started.
fn assert_whole_episode(record: &Value) {
    assert_eq!(texts(record, "human"), TURNS, "{record}");
    let tools = texts(record, "tool");
    assert_eq!(tools.len(), 4, "{record}");
    assert!(
        tools[2].contains(NOTE),
        "turn 2 read the file: {}",
        tools[2]
    );
    assert!(
        tools[3].contains(NOTE),
        "turn 3 fetched it from the server: {}",
        tools[3]
    );
    assert_eq!(
        record["turn_origin"],
        json!([
            "system", "dataset", "model", "tool", "model", "tool", "model", "dataset", "model",
            "tool", "model", "dataset", "model", "tool", "model"
        ]),
        "{record}"
    );
    assert_eq!(
        record["turn_origin"].as_array().map(Vec::len),
        record["conversations"].as_array().map(Vec::len)
    );
    assert_eq!(
        record["episode"],
        json!({
            "turns": 3, "answered": 3, "termination_reason": "all_turns_answered",
            "segments": [
                {"turn": 0, "start": 1, "end": 7, "completed": true},
                {"turn": 1, "start": 7, "end": 11, "completed": true},
                {"turn": 2, "start": 11, "end": 15, "completed": true},
            ],
        }),
        "{record}"
    );
    assert_eq!(record["completed"], true, "{record}");
    // Every call, answers given within `maxTurns` included: turn 1's three, then two and two.
    assert_eq!(record["api_calls"], 7, "{record}");
    assert!(record.get("turns").is_none(), "{record}");
    assert_eq!(record["source"]["task"], "episode", "{record}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_user_turns_are_answered_in_order_in_one_workspace_with_one_shell() {
    let port = free_port();
    let (server, requests) = scripted_model(port, false).await;
    let fixture = fixture(&server);
    assert!(worker(&fixture, &["plan"]).await.success());
    assert!(worker(&fixture, &["batch", "0"]).await.success());

    let records = fixture.batch_lines(0);
    assert_eq!(records.len(), 1, "{records:?}");
    assert_whole_episode(&records[0]);
    assert_eq!(*requests.lock().unwrap(), 7, "one request per model call");
    // The server lived as long as the episode, no longer.
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the episode's server outlived it"
    );

    // Merged: the statistics and the report count the episode's turns and how it ended.
    assert!(worker(&fixture, &["merge"]).await.success());
    let merged = fixture.lines("trajectories.jsonl");
    assert_eq!(merged.len(), 1);
    assert_eq!(merged[0]["episode"], records[0]["episode"]);
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(
        statistics["episodes"],
        json!({
            "records": 1, "user_turns": 3, "answered": 3, "answered_rate": 100.0,
            "by_termination_reason": {"all_turns_answered": 1},
        }),
        "{statistics}"
    );
    let report = std::fs::read_to_string(fixture.out().join("report.html")).unwrap();
    assert!(
        report.contains(r#""episodes":{"#),
        "the report's data holds the episodes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_in_the_third_turn_costs_that_turn_and_not_the_episode() {
    let port = free_port();
    let (server, requests) = scripted_model(port, true).await;
    let fixture = fixture(&server);
    assert!(worker(&fixture, &["plan"]).await.success());

    let mut child = spawn_worker(&fixture, &["batch", "0"]);
    // Turn 1's two tool turns and answer, turn 2's tool turn and answer: five lines; the kill
    // comes while turn 3's first call waits.
    let deadline = Instant::now() + Duration::from_secs(30);
    while common::logged_turns(&fixture) < 5 || *requests.lock().unwrap() < 6 {
        assert!(
            Instant::now() < deadline,
            "five turns never logged, or turn 3 never asked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let asked_before = *requests.lock().unwrap();
    assert_eq!(asked_before, 6, "five answered, turn 3's first in flight");
    assert!(worker(&fixture, &["batch", "0"]).await.success());

    let records = fixture.batch_lines(0);
    assert_eq!(records.len(), 1, "{records:?}");
    let record = &records[0];
    assert_whole_episode(record);
    assert_eq!(record["resumed_from_turn"], 5, "{record}");
    // The write and the server's start replayed (the read only reads).
    assert_eq!(record["resume"]["replayed_calls"], 2, "{record}");
    assert_eq!(
        *requests.lock().unwrap() - asked_before,
        2,
        "the successor asked for turn 3's two calls only: {record}"
    );
}

/// A user turn that spends its `maxTurns` is asked for its final answer (a turn of the loop's,
/// `harness`, not the row's), and the next user turn still comes, with `maxTurns` of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_out_of_tool_turns_is_asked_to_answer_and_the_next_turn_comes() {
    let server = ScriptedServer::start_responding(|body| {
        let tools_offered = body.get("tools").is_some();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let last = messages.last().cloned().unwrap_or_default();
        if !tools_offered {
            return Step::ok(text_reply("my answer, asked for"));
        }
        if last["content"] == TURNS[1] {
            return Step::ok(text_reply("a second answer"));
        }
        Step::ok(tool_call_reply(
            "terminal",
            &json!({"command": "echo again"}),
        ))
    })
    .await;
    let row = json!({"prompt": TURNS[0], "turns": [TURNS[1]]});
    let fixture = RunFixture::with_lines(&server.base_url(), &[row.to_string()])
        .with("/batchSize", json!(1))
        .with("/agent/maxTurns", json!(2));
    assert!(worker(&fixture, &["plan"]).await.success());
    assert!(worker(&fixture, &["batch", "0"]).await.success());

    let records = fixture.batch_lines(0);
    let record = &records[0];
    assert_eq!(
        record["turn_origin"],
        json!([
            "system", "dataset", "model", "tool", "model", "tool", "harness", "model", "dataset",
            "model"
        ]),
        "{record}"
    );
    assert_eq!(
        record["episode"]["segments"],
        json!([
            {"turn": 0, "start": 1, "end": 8, "completed": false},
            {"turn": 1, "start": 8, "end": 10, "completed": true},
        ]),
        "{record}"
    );
    assert_eq!(
        record["episode"]["termination_reason"],
        "all_turns_answered"
    );
    assert_eq!(
        record["completed"], false,
        "turn 1 ran out of tool turns: {record}"
    );
    // Two tool turns and the answer asked for, then the second turn's answer.
    assert_eq!(record["api_calls"], 4, "{record}");
    assert_eq!(server.request_count(), 4);
}

/// What the scripted simulated user says after `own` messages of its own (the row's prompt is
/// its first): two more, then its stop marker.
fn simulated_user(body: &Value) -> Step {
    let own = body["messages"].as_array().map_or(0, |messages| {
        messages.iter().filter(|m| m["role"] == "assistant").count()
    });
    match own {
        1 => Step::ok(text_reply("Then book it for Friday.")),
        2 => Step::ok(text_reply("And for four people.")),
        _ => Step::ok(text_reply("Thanks, that is all. ###STOP###")),
    }
}

/// The agent answers each user message by its number; the answer to the user's third message
/// is slow when `slow_third` (for the kill test).
fn agent_answers(body: &Value, slow_third: bool) -> Step {
    let users = body["messages"].as_array().map_or(0, |messages| {
        messages.iter().filter(|m| m["role"] == "user").count()
    });
    let answer = Step::ok(text_reply(&format!("answer {users}")));
    if slow_third && users == 3 {
        Step::Delay(Duration::from_secs(2), Box::new(answer))
    } else {
        answer
    }
}

const SCENARIO_PROMPT: &str = "Find me a restaurant.";

fn simulated_fixture(agent: &ScriptedServer, simulator: &ScriptedServer, turns: u32) -> RunFixture {
    let rows = [
        json!({"prompt": SCENARIO_PROMPT,
               "user_scenario": {"persona": "a busy chef", "instructions": {"task": "a table"}}})
        .to_string(),
        json!({"prompt": "no scenario here"}).to_string(),
    ];
    RunFixture::with_lines(&agent.base_url(), &rows)
        .with("/batchSize", json!(2))
        .with(
            "/userSimulator",
            json!({"model": {"baseUrl": simulator.base_url(), "name": "user-sim"}, "maxTurns": turns}),
        )
}

/// The agent and the simulated user (both scripted) and a planned run of the scenario row and a
/// plain one, the simulator allowed `turns` messages.
async fn simulated_run(
    slow_third: bool,
    turns: u32,
) -> (ScriptedServer, ScriptedServer, RunFixture) {
    let agent = ScriptedServer::start_responding(move |body| agent_answers(body, slow_third)).await;
    let simulator = ScriptedServer::start_responding(simulated_user).await;
    let fixture = simulated_fixture(&agent, &simulator, turns);
    assert!(worker(&fixture, &["plan"]).await.success());
    (agent, simulator, fixture)
}

/// The record of the scenario's row in batch 0.
fn scenario_record(fixture: &RunFixture) -> Value {
    fixture
        .batch_lines(0)
        .into_iter()
        .find(|record| record["prompt_index"] == 0)
        .expect("the scenario's record")
}

/// A simulated user (a scripted one: its termination is exact) writes two messages, then its
/// stop marker ends the episode. Its messages are `user_simulator` turns, its usage is its own
/// (three calls, the stop included) and the agent's stays the agent's (three answers); it sees
/// the conversation as the user would, its persona in its instructions. A row without a
/// scenario is one prompt, as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_user_talks_until_it_says_stop_and_its_turns_are_not_the_models() {
    let (agent, simulator, fixture) = simulated_run(false, 5).await;
    assert!(worker(&fixture, &["batch", "0"]).await.success());

    let records = fixture.batch_lines(0);
    let record = records
        .iter()
        .find(|record| record["prompt_index"] == 0)
        .expect("the scenario's record");
    assert_eq!(
        texts(record, "human"),
        [
            SCENARIO_PROMPT,
            "Then book it for Friday.",
            "And for four people."
        ],
        "{record}"
    );
    let answers: Vec<&str> = texts(record, "gpt")
        .into_iter()
        .map(|text| text.trim_start_matches("<think>\n</think>\n"))
        .collect();
    assert_eq!(answers, ["answer 1", "answer 2", "answer 3"]);
    assert_eq!(
        record["turn_origin"],
        json!([
            "system",
            "dataset",
            "model",
            "user_simulator",
            "model",
            "user_simulator",
            "model"
        ]),
        "{record}"
    );
    assert_eq!(
        record["episode"]["termination_reason"], "user_stop",
        "{record}"
    );
    assert_eq!(record["episode"]["turns"], 3, "{record}");
    assert_eq!(
        record["user_simulator"],
        json!({"turns": 2, "stopped": true,
               "usage": {"prompt_tokens": 30, "completion_tokens": 15, "reasoning_tokens": 0,
                         "total_tokens": 45}}),
        "{record}"
    );
    assert_eq!(
        record["usage"]["prompt_tokens"], 30,
        "the agent's three calls alone: {record}"
    );
    assert_eq!(simulator.request_count(), 3);

    // The simulator's view: its instructions, its own words as the assistant's, the agent's
    // answers as the user's.
    let first = &simulator.requests()[0].body;
    let system = first["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("Persona:\na busy chef") && system.contains("###STOP###"),
        "{system}"
    );
    assert_eq!(
        first["messages"].as_array().unwrap()[1..],
        [
            json!({"role": "assistant", "content": SCENARIO_PROMPT}),
            json!({"role": "user", "content": "answer 1"}),
        ],
        "{first}"
    );
    assert_eq!(first["model"], "user-sim");

    let plain = records
        .iter()
        .find(|record| record["prompt_index"] == 1)
        .expect("the plain row's record");
    assert!(
        plain.get("episode").is_none() && plain.get("user_simulator").is_none(),
        "{plain}"
    );
    assert_eq!(agent.request_count(), 4);
}

/// A simulated user with one message to write writes it, and the episode ends there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_user_out_of_turns_ends_the_episode() {
    let (_agent, simulator, fixture) = simulated_run(false, 1).await;
    assert!(worker(&fixture, &["batch", "0"]).await.success());
    let record = scenario_record(&fixture);
    assert_eq!(
        record["episode"]["termination_reason"], "max_user_turns",
        "{record}"
    );
    assert_eq!(record["user_simulator"]["turns"], 1, "{record}");
    assert_eq!(record["user_simulator"]["stopped"], false, "{record}");
    assert_eq!(simulator.request_count(), 1);
}

/// Killed while the agent answers the simulated user's second message, the episode is taken up
/// with the first simulated message from the turn log: the successor asks the simulator again
/// only for the message in flight (and its stop), and the agent only for that answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_costs_a_simulated_episode_the_turn_in_flight() {
    let (agent, simulator, fixture) = simulated_run(true, 5).await;

    let mut child = spawn_worker(&fixture, &["batch", "0"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    // The two answers logged (more was to come after each), the third asked.
    while common::logged_turns(&fixture) < 2 || simulator.request_count() < 2 {
        assert!(
            Instant::now() < deadline,
            "the episode never reached its third turn"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.kill().unwrap();
    child.wait().unwrap();
    let (agent_before, simulator_before) = (agent.request_count(), simulator.request_count());
    assert!(worker(&fixture, &["batch", "0"]).await.success());

    let record = scenario_record(&fixture);
    assert_eq!(
        texts(&record, "human"),
        [
            SCENARIO_PROMPT,
            "Then book it for Friday.",
            "And for four people."
        ],
        "{record}"
    );
    assert_eq!(
        record["episode"]["termination_reason"], "user_stop",
        "{record}"
    );
    assert_eq!(record["resumed_from_turn"], 2, "{record}");
    assert_eq!(
        simulator.request_count() - simulator_before,
        2,
        "its second message again, and its stop"
    );
    // The third answer; the plain row's answer had been recorded before the kill or is asked now.
    let agent_after = agent.request_count() - agent_before;
    assert!(
        (1..=2).contains(&agent_after),
        "{agent_after} agent calls after the kill: {record}"
    );
}

/// A simulated user on a real model server: llama.cpp's `llama-server` (this project's `SmolLM2`)
/// plays both the agent, its token ids kept, and the user of a persona. The small model decides
/// when it stops, so the assertions are about structure: every simulated message is a
/// `user_simulator` turn, as many as the record counts, within `maxTurns`; the episode ends by
/// the simulator's stop or its limit; what the simulator spent is kept apart from the agent's;
/// and the agent's samples train only what the agent sampled: the simulated messages' ids lie in
/// their prompts, masked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_user_on_a_real_model_server_talks_with_the_agent_and_is_never_trained() {
    use trajectory_testkit::llama_cpp_server::LlamaCppServer;
    let state = tempfile::tempdir().unwrap();
    let server = LlamaCppServer::start(state.path(), 2, 2).await;
    let row = json!({
        "prompt": "Hello, I need help planning a trip.",
        "user_scenario": {
            "persona": "A traveller who answers briefly.",
            "instructions": "You want a one-day plan for Paris. Ask one question, then stop.",
        },
    });
    let model = |max_tokens: u32| {
        json!({"baseUrl": server.base_url, "name": server.model, "maxTokens": max_tokens,
               "temperature": 0.0, "requestTimeoutSeconds": 120})
    };
    let mut agent_model = model(64);
    agent_model["tokens"] = json!({"request": "LlamaServer"});
    let fixture = RunFixture::with_lines(&server.base_url, &[row.to_string()])
        .with("/concurrency", json!(1))
        .with("/model", agent_model)
        .with(
            "/agent",
            json!({"maxTurns": 1, "promptTimeoutSeconds": 600}),
        )
        .with("/userSimulator", json!({"model": model(48), "maxTurns": 2}));
    trajectory_worker::run::local::run_local(
        &common::local_options(&fixture),
        &common::no_shutdown(),
    )
    .await
    .expect("the run finishes");
    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 1, "{:?}", fixture.lines("failures.jsonl"));
    let record = &records[0];
    let origins = record["turn_origin"].as_array().expect("turn_origin");
    assert_eq!(
        origins.len(),
        record["conversations"].as_array().unwrap().len()
    );
    let simulated: Vec<&str> = origins
        .iter()
        .zip(record["conversations"].as_array().unwrap())
        .filter(|(origin, _)| *origin == "user_simulator")
        .map(|(_, turn)| turn["value"].as_str().unwrap())
        .collect();
    assert_eq!(
        record["user_simulator"]["turns"].as_u64(),
        Some(simulated.len() as u64),
        "{record}"
    );
    assert!(simulated.len() <= 2, "{record}");
    let reason = record["episode"]["termination_reason"].as_str().unwrap();
    assert!(
        matches!(reason, "user_stop" | "max_user_turns" | "cut_off"),
        "{record}"
    );
    assert_eq!(
        reason == "user_stop",
        record["user_simulator"]["stopped"] == true
    );
    let simulator_prompt = record["user_simulator"]["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    let agent_prompt = record["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(simulator_prompt > 0 && agent_prompt > 0, "{record}");
    assert_ne!(simulator_prompt, agent_prompt, "{record}");

    only_the_agent_is_trained(&fixture, &server, &simulated).await;
}

/// The run's `verl` samples train exactly the tokens the agent sampled; the simulated messages'
/// ids lie in them, masked.
async fn only_the_agent_is_trained(
    fixture: &RunFixture,
    server: &trajectory_testkit::llama_cpp_server::LlamaCppServer,
    simulated: &[&str],
) {
    use trajectory_worker::export::{ExportFormat, export};
    let tokens = fixture.lines("trajectories.tokens.jsonl");
    assert_eq!(
        tokens[0]["tokenization"]["source"], "server",
        "{}",
        tokens[0]
    );
    let agent_sampled: u64 = tokens[0]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|step| step["completion_tokens"].as_u64().unwrap())
        .sum();
    let mut out = Vec::new();
    export(&fixture.out(), ExportFormat::Verl, false, &mut out).unwrap();
    let samples: Vec<Value> = out
        .split(|byte| *byte == b'\n')
        .filter(|line| !line.is_empty())
        .map(|line| serde_json::from_slice(line).unwrap())
        .collect();
    let ids = |value: &Value| -> Vec<u64> {
        value
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_u64().unwrap())
            .collect()
    };
    let (mut trained, mut found) = (0, 0);
    for sample in &samples {
        let mut all = ids(&sample["prompt_ids"]);
        let mut mask = vec![0; all.len()];
        all.extend(ids(&sample["response_ids"]));
        mask.extend(ids(&sample["response_mask"]));
        trained += mask.iter().sum::<u64>();
        for text in simulated.iter().filter(|text| !text.trim().is_empty()) {
            let text_ids = server.tokenize(text).await;
            if let Some(at) = all
                .windows(text_ids.len())
                .position(|window| window == text_ids.as_slice())
            {
                found += 1;
                assert!(
                    mask[at..at + text_ids.len()].iter().all(|bit| *bit == 0),
                    "the simulated message {text:?} is trained"
                );
            }
        }
    }
    eprintln!(
        "{} simulated messages ({found} found masked in {} samples); {trained} tokens trained",
        simulated.len(),
        samples.len()
    );
    // A call whose prompt extends the call before keeps only its new ids and joins that
    // call's sample; one kept whole begins a sample.
    let whole_prompts = tokens[0]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|step| step.get("prompt_token_ids").is_some())
        .count();
    assert_eq!(samples.len(), whole_prompts, "{}", tokens[0]);
    assert_eq!(
        trained, agent_sampled,
        "the samples train the agent's tokens alone"
    );
    let spoken = simulated
        .iter()
        .filter(|text| !text.trim().is_empty())
        .count();
    assert!(
        spoken == 0 || found > 0,
        "the simulated messages are in the samples' ids: {simulated:?}"
    );
}
