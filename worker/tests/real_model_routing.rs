//! A run's conversations over several real model servers (issue 25, `spec.model.endpoints`):
//! three llama.cpp servers (`trajectory_testkit::llama_servers`, one thread each), each with a
//! prompt cache that starts a request from the longest prefix it has seen, the way a replica's
//! prefix cache keeps the histories of the conversations it served.
//!
//! The model is made to call the terminal on every turn (`tool_choice`, a grammar in llama.cpp),
//! so every conversation runs exactly `maxTurns` tool-calling turns and a last answer, whichever
//! strategy routes it: the two runs send the same conversations to fresh servers, and what
//! differs is only what the servers had to compute, counted from their own logs.
//!
//! Every conversation starts with one long system prompt that they all share, as agents' do, and
//! the servers write prompts with the model's own chat template (as vLLM and llama-server do), so
//! a conversation's prompt grows with each tool result. The shared prompt costs each server the
//! same under either strategy, once, and in a run of thousands of conversations nothing; the
//! servers compute it before the six conversations here (where it would otherwise be a fifth of
//! all that sticky routing computes), so that what is counted is what routing changes: whether a
//! conversation's own history is found where its next turn goes. (With llama-cpp-python's `chatml-function-calling` format
//! instead, tool results are left out of the prompts of tool-calling turns and the histories stay
//! too short to tell the strategies apart: `docs/benchmarks.md` has both.)
//!
//! The tests take turns (one set of servers at a time): the machine has two cores.

mod common;

use serde_json::{Value, json};
use trajectory_testkit::llama_servers::{
    ChatFormat, LlamaServer, LogMark, SYSTEM_PROMPT, TERMINAL_TASKS,
};
use trajectory_worker::run::local::run_local;

/// Each server's prompt cache: room for the states of every turn of the runs here (a state is
/// the KV cache of its prompt, about 23 KB a token for this model).
const CACHE_BYTES: Option<u64> = Some(1 << 30);

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Servers {
    servers: Vec<LlamaServer>,
    _state: tempfile::TempDir,
}

impl Servers {
    fn start(count: usize) -> Self {
        let state = tempfile::tempdir().expect("temp dir");
        let servers = (0..count)
            .map(|index| {
                LlamaServer::start(
                    &state.path().join(index.to_string()),
                    1,
                    CACHE_BYTES,
                    ChatFormat::ModelTemplate,
                )
            })
            .collect();
        Self {
            servers,
            _state: state,
        }
    }

    fn marks(&self) -> Vec<LogMark> {
        self.servers.iter().map(LlamaServer::mark).collect()
    }

    /// Prompt tokens each server computed since `marks`.
    fn computed(&self, marks: &[LogMark]) -> Vec<u64> {
        self.servers
            .iter()
            .zip(marks)
            .map(|(server, mark)| server.prompt_tokens_computed(*mark))
            .collect()
    }
}

/// A run of `prompts` over `servers` with `strategy`, `concurrency` conversations at a time, a
/// server holding at most `load_bound` times its share of them, each `max_turns` terminal calls
/// long, all under [`SYSTEM_PROMPT`].
fn fixture(
    servers: &Servers,
    prompts: &[&str],
    strategy: &str,
    (concurrency, load_bound): (u32, f64),
    max_turns: u32,
) -> common::RunFixture {
    let lines: Vec<String> = prompts
        .iter()
        .map(|prompt| json!({ "prompt": prompt }).to_string())
        .collect();
    let endpoints: Vec<Value> = servers
        .servers
        .iter()
        .map(|server| json!({ "baseUrl": server.base_url }))
        .collect();
    common::RunFixture::with_lines(&servers.servers[0].base_url, &lines)
        .with("/batchSize", json!(prompts.len()))
        .with("/workers", json!(1))
        .with("/concurrency", json!(concurrency))
        .with(
            "/model",
            json!({
                "endpoints": endpoints,
                "routing": {"strategy": strategy, "loadBound": load_bound},
                "name": servers.servers[0].model, "maxTokens": 48, "temperature": 0.0,
                "requestTimeoutSeconds": 300, "maxAttempts": 3,
                "extraBody": {"tool_choice": {"type": "function", "function": {"name": "terminal"}}},
            }),
        )
        .with(
            "/agent",
            json!({
                "maxTurns": max_turns, "promptTimeoutSeconds": 900,
                "ephemeralSystemPrompt": SYSTEM_PROMPT,
            }),
        )
        .with("/tools", json!({"terminal": {"timeoutSeconds": 10}}))
}

/// Runs `fixture` to its end; every prompt has a record with all its turns, none failed.
async fn run_all_turns(fixture: &common::RunFixture, prompts: u64, max_turns: u32) {
    let report = run_local(&common::local_options(fixture), &common::no_shutdown())
        .await
        .expect("the run finishes");
    assert_eq!(
        report.merge.trajectories,
        prompts,
        "every conversation is recorded: {:?}",
        fixture.lines("failures.jsonl")
    );
    for record in fixture.lines("trajectories.jsonl") {
        assert_eq!(
            record["api_calls"],
            json!(max_turns),
            "every turn was asked and answered: {}",
            record["id"]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_under_one_long_system_prompt_kept_on_one_of_three_real_servers_compute_half_the_prompt_tokens()
 {
    let _turn = ONE_AT_A_TIME.lock().await;
    let max_turns = 8;
    let mut computed = Vec::new();
    for strategy in ["ConversationHash", "RoundRobin"] {
        let servers = Servers::start(3);
        for server in &servers.servers {
            server.warm(SYSTEM_PROMPT).await;
        }
        // Four at a time over three servers: round robin does not happen to keep a conversation
        // on one server, and the default load bound (1.25) lets a server hold two.
        let fixture = fixture(&servers, &TERMINAL_TASKS, strategy, (4, 1.25), max_turns);
        let marks = servers.marks();
        run_all_turns(&fixture, TERMINAL_TASKS.len() as u64, max_turns).await;
        let per_server = servers.computed(&marks);
        eprintln!("{strategy}: prompt tokens computed per server {per_server:?}");
        // Round robin uses every server. Six conversations hashed over three servers leave one
        // without a conversation about a quarter of the time (record ids carry the run's spec,
        // whose endpoints' ports change every run); the load bound (at most two of the four in
        // flight on one server) has them on two at least.
        let serving = per_server.iter().filter(|tokens| **tokens > 0).count();
        let least = if strategy == "RoundRobin" { 3 } else { 2 };
        assert!(
            serving >= least,
            "{strategy}: {least} servers at least served the run: {per_server:?}"
        );
        computed.push(per_server.iter().sum::<u64>());
    }
    let (sticky, round_robin) = (computed[0], computed[1]);
    assert!(sticky > 0, "the servers' logs count what they computed");
    assert!(
        round_robin >= 2 * sticky,
        "one server a conversation computes at most half the prompt tokens of round robin: \
         sticky {sticky}, round robin {round_robin}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conversations_of_a_real_server_killed_mid_run_finish_on_the_others() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start(3);
    let prompts = &TERMINAL_TASKS[..3];
    let max_turns = 4;
    let fixture = fixture(&servers, prompts, "ConversationHash", (3, 1.0), max_turns);
    let marks = servers.marks();
    let victim = &servers.servers[1];
    let run = async {
        run_all_turns(&fixture, prompts.len() as u64, max_turns).await;
    };
    // Killed once it has answered a turn: with three conversations and a load bound of 1, one of
    // them is on it, and has turns left.
    let kill = async {
        while victim.completions(marks[1]) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        victim.kill();
        victim.completions(marks[1])
    };
    let ((), answered_by_victim) = tokio::join!(run, kill);
    assert!(answered_by_victim >= 1);
    let answered: usize = servers
        .servers
        .iter()
        .zip(&marks)
        .map(|(server, mark)| server.completions(*mark))
        .sum();
    assert_eq!(
        answered,
        prompts.len() * (max_turns as usize + 1),
        "every turn was answered once by some server (a turn cut off by the kill is asked \
         again elsewhere, and the dead server answered nothing more)"
    );
}
