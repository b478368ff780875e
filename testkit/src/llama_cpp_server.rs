//! llama.cpp's own server, `llama-server` (built by `scripts/llama-server/install.sh`, cached),
//! serving the suite's `SmolLM2` GGUF with the model's own chat template (jinja). Not a double: it
//! is the server whose token ids the token tests record, the one that gives each sampled
//! token's id with its logprob and tokenizes prompts the way it evaluates them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One running `llama-server`, stopped when dropped.
#[derive(Debug)]
pub struct LlamaCppServer {
    child: Child,
    /// Its OpenAI-compatible base URL (`http://127.0.0.1:<port>/v1`).
    pub base_url: String,
    /// Its own API's root (`http://127.0.0.1:<port>`: `/completion`, `/tokenize`, …).
    pub root: String,
    /// The model id it serves.
    pub model: String,
    log: PathBuf,
}

/// The model id the server reports (`--alias`).
const MODEL: &str = "smollm2-135m-instruct-q4_1";

impl LlamaCppServer {
    /// Starts a server with `threads` threads and `slots` conversations at once, its log under
    /// `state`, and waits until it answers. Panics, saying why, when it cannot start: a test
    /// that needs it must fail loudly.
    pub async fn start(state: &Path, threads: u32, slots: u32) -> Self {
        std::fs::create_dir_all(state).expect("the server's state directory");
        let binary = crate::installed_binary("TRAJ_LLAMA_SERVER", "llama-server/install.sh");
        let venv = crate::installed(
            "TRAJ_MODEL_SERVER_VENV",
            "model-server/install.sh",
            "--print-venv",
        );
        let model_path = venv.join(
            std::fs::read_to_string(venv.join("model-path"))
                .expect("the model server's install names its model")
                .trim(),
        );
        let port = crate::free_port();
        let log = state.join("llama-server.log");
        let log_file = std::fs::File::create(&log).expect("the server's log");
        let child = Command::new(&binary)
            .args(["--model"])
            .arg(&model_path)
            .args(["--alias", MODEL, "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--ctx-size", "8192", "--threads"])
            .arg(threads.to_string())
            .args(["--parallel"])
            .arg(slots.to_string())
            .args(["--jinja", "--no-ui"])
            // Threads waiting for work sleep instead of spinning: several servers and test
            // binaries share two cores in CI, where a spinning barrier whose partner thread is
            // descheduled burns its time slice (a call took minutes, past its timeout).
            .args(["--poll", "0"])
            .stdout(Stdio::from(log_file.try_clone().expect("the log")))
            .stderr(Stdio::from(log_file))
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {}: {err}", binary.display()));
        let root = format!("http://127.0.0.1:{port}");
        let mut server = Self {
            child,
            base_url: format!("{root}/v1"),
            root,
            model: MODEL.to_owned(),
            log,
        };
        server.wait_ready().await;
        server
    }

    async fn wait_ready(&mut self) {
        let started = Instant::now();
        let http = reqwest::Client::new();
        loop {
            if let Ok(response) = http.get(format!("{}/health", self.root)).send().await
                && response.status().is_success()
            {
                return;
            }
            if let Some(status) = self.child.try_wait().expect("the server's status") {
                panic!(
                    "llama-server exited ({status}) before answering: {}",
                    self.log_text()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "llama-server did not answer within 120 s: {}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// What its own API at `path` (`/tokenize`, `/completion`, …) answers to `body`.
    pub async fn post(&self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        reqwest::Client::new()
            .post(format!("{}{path}", self.root))
            .json(body)
            .send()
            .await
            .unwrap_or_else(|err| panic!("{path}: {err}"))
            .json()
            .await
            .unwrap_or_else(|err| panic!("{path}: {err}"))
    }

    /// `text`'s ids by its tokenizer, no special tokens added.
    pub async fn tokenize(&self, text: &str) -> Vec<u64> {
        let answer = self
            .post(
                "/tokenize",
                &serde_json::json!({"content": text, "add_special": false}),
            )
            .await;
        answer["tokens"]
            .as_array()
            .unwrap_or_else(|| panic!("{answer}"))
            .iter()
            .map(|id| id.as_u64().expect("an id"))
            .collect()
    }

    /// The text its tokenizer makes of `ids`.
    pub async fn detokenize(&self, ids: &[u64]) -> String {
        let answer = self
            .post("/detokenize", &serde_json::json!({"tokens": ids}))
            .await;
        answer["content"]
            .as_str()
            .unwrap_or_else(|| panic!("{answer}"))
            .to_owned()
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LlamaCppServer {
    fn drop(&mut self) {
        // A test failing with the server up: what the server saw says whether it was slow,
        // stuck or refusing.
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: String = log
                .lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            eprintln!(
                "llama-server's log ({}), its last 40 lines:\n{tail}",
                self.log.display()
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
