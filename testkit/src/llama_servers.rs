//! Real llama.cpp model servers, several at once: each started by `scripts/model-server/start.sh`
//! in a state directory of its own (the install is the suite's, cached), and stopped by `stop.sh`
//! when dropped. Not a double: the tests and benchmarks that compare how requests are spread over
//! endpoints need servers whose cache is real, and read what they computed from the servers' own
//! accounting.
//!
//! llama-cpp-python keeps the prompt of its last request in its context, and with a cache
//! (`cache_bytes`) the states of earlier prompts too, each request starting from the longest
//! prefix it holds, as a replica's prefix cache does. For each request it logs how many prompt
//! tokens it evaluated (`llama_perf_context_print: prompt eval time = … / N tokens`): the tokens
//! it could not take from its cache. [`LlamaServer::prompt_tokens_computed`] sums those lines.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Short shell tasks for the runs on these servers, which make the small model call the
/// terminal (with `tool_choice` forcing it, every turn).
pub const TERMINAL_TASKS: [&str; 6] = [
    "Make a directory named work and list the files in it.",
    "Print the current date and the name of the machine.",
    "Count the lines of /etc/passwd.",
    "Create a file named notes.txt with three lines and show it.",
    "Show the disk usage of the current directory.",
    "Write hello to a file and count its characters.",
];

/// The long system prompt of runs that share one: an agent's instructions, some 250 tokens.
pub const SYSTEM_PROMPT: &str = "You are a careful command-line assistant working in a fresh \
    Linux workspace. You solve the user's task by running shell commands with the terminal \
    tool, one command per call, and you read each command's output before you decide on the \
    next one. Prefer small, safe, reversible steps: inspect before you change anything, never \
    delete files you did not create, and never run commands that need the network or elevated \
    privileges. When a command fails, read its error message, think about the cause, and try a \
    corrected command instead of repeating the same one. Keep the working directory and any \
    files you create inside the workspace. When you create a file, show its contents afterwards \
    so that the result can be checked. When you count or measure something, print the number \
    together with a short label. Use standard tools that every Linux system has. Do not install \
    packages, do not start servers, and do not leave background jobs running. Answer in plain \
    English, briefly, once the task is done, and say what you ran and what it printed.";

/// How a server writes a conversation into the model's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFormat {
    /// llama-cpp-python's `chatml-function-calling`: the tools' schemas in the system message
    /// (when there is one), tool calls parsed from what the model writes, tool results left out
    /// of the prompts of tool-calling turns. The suite's default server.
    FunctionCalling,
    /// The model's own chat template from its GGUF, as vLLM and llama-server use it: every
    /// message as it is, tool results included, so a conversation's prompt grows with each
    /// result; a tool call only when the request's `tool_choice` names the function.
    ModelTemplate,
}

impl ChatFormat {
    /// `scripts/model-server/start.sh`'s `MODEL_SERVER_CHAT_FORMAT`.
    fn start_sh_value(self) -> &'static str {
        match self {
            Self::FunctionCalling => "chatml-function-calling",
            Self::ModelTemplate => "model",
        }
    }
}

/// One running server.
#[derive(Debug)]
pub struct LlamaServer {
    state: PathBuf,
    /// Its OpenAI-compatible base URL (`http://127.0.0.1:<port>/v1`).
    pub base_url: String,
    /// The model id it serves.
    pub model: String,
    pid: u32,
}

/// Where the server's log has got to: what [`LlamaServer::prompt_tokens_computed`] counts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogMark(usize);

impl LlamaServer {
    /// Starts a server with `threads` threads, a prompt cache of `cache_bytes` (none: only its
    /// last prompt) and `chat_format`, its state under `state` (created). Panics, with the
    /// script's output, when it cannot start: a test that needs it must fail loudly.
    pub fn start(
        state: &Path,
        threads: u32,
        cache_bytes: Option<u64>,
        chat_format: ChatFormat,
    ) -> Self {
        std::fs::create_dir_all(state).expect("the server's state directory");
        let script = scripts_dir().join("start.sh");
        let output = Command::new(&script)
            .env("TRAJ_MODEL_SERVER_DIR", state)
            .env("MODEL_SERVER_THREADS", threads.to_string())
            // Each server on a port of its own, on loopback only.
            .env_remove("MODEL_SERVER_PORT")
            .env("MODEL_SERVER_HOST", "127.0.0.1")
            .env(
                "MODEL_SERVER_CACHE_BYTES",
                cache_bytes
                    .map(|bytes| bytes.to_string())
                    .unwrap_or_default(),
            )
            .env("MODEL_SERVER_CHAT_FORMAT", chat_format.start_sh_value())
            .output()
            .unwrap_or_else(|err| panic!("cannot run {}: {err}", script.display()));
        assert!(
            output.status.success(),
            "{} failed ({}): {}{}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
        let env = std::fs::read_to_string(state.join("env")).expect("start.sh wrote its env file");
        let value = |name: &str| {
            env.lines()
                .find_map(|line| line.strip_prefix(&format!("export {name}=")))
                .unwrap_or_else(|| panic!("{name} missing from start.sh's env file: {env}"))
                .trim_matches('\'')
                .to_owned()
        };
        let pid = std::fs::read_to_string(state.join("server.pid"))
            .expect("start.sh wrote the server's pid")
            .trim()
            .parse()
            .expect("a pid");
        Self {
            state: state.to_owned(),
            base_url: value("MODEL_BASE_URL"),
            model: value("MODEL_NAME"),
            pid,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.state.join("server.log")).unwrap_or_default()
    }

    /// The log's end now.
    pub fn mark(&self) -> LogMark {
        LogMark(self.log().len())
    }

    /// Prompt tokens the server evaluated (did not find in its cache) since `mark`.
    pub fn prompt_tokens_computed(&self, since: LogMark) -> u64 {
        self.log()
            .get(since.0..)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let rest = line.split_once("prompt eval time =")?.1;
                let tokens = rest.split_once('/')?.1.split_whitespace().next()?;
                tokens.parse::<u64>().ok()
            })
            .sum()
    }

    /// Chat completions the server answered since `mark`.
    pub fn completions(&self, since: LogMark) -> usize {
        self.log()
            .get(since.0..)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains("\"POST /v1/chat/completions HTTP/1.1\" 200"))
            .count()
    }

    /// Has the server compute `system_prompt` once, as the server of a long run has long before
    /// any one conversation: one completion of a token after it. A request that starts with the
    /// same system message then finds it in the cache, whichever conversation it belongs to.
    /// Panics when the server does not answer.
    pub async fn warm(&self, system_prompt: &str) {
        let response = reqwest::Client::new()
            .post(format!("{}/chat/completions", self.base_url))
            .json(&serde_json::json!({
                "model": self.model,
                "messages": [
                    {"role": "system", "content": system_prompt},
                    {"role": "user", "content": "Hello."},
                ],
                "max_tokens": 1,
            }))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .unwrap_or_else(|err| panic!("warming {}: {err}", self.base_url));
        drop(response);
    }

    /// Kills the server at once (SIGKILL): a server that dies, not one that shuts down.
    pub fn kill(&self) {
        let status = Command::new("kill")
            .args(["-KILL", &self.pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -KILL {} failed", self.pid);
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        // Also after `kill`: stop.sh then cleans up the state files.
        let _ = Command::new(scripts_dir().join("stop.sh"))
            .env("TRAJ_MODEL_SERVER_DIR", &self.state)
            .output();
    }
}

fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/model-server")
}
