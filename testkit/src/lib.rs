//! Test doubles shared by the worker's integration tests and benchmarks and by the end-to-end
//! tests: kept out of the worker so that its production build carries no test server (nor axum).
//!
//! - [`scripted_server`]: an OpenAI-compatible model server that answers from a script, or with a
//!   fixed latency for benchmarks.
//! - [`chromium`]: headless Chromium, as the tests and benchmarks that open the run report start it.
//! - [`executor`]: the tool executor, built where the worker's tests look for it.
//! - [`envoy`]: not a double: Envoy shedding what exceeds a real model server's capacity.
//! - [`gubernator`]: not a double: the rate limiter a run's pods share their limits through.
//! - [`llama_servers`]: not a double: real llama.cpp servers, several at once, with what each
//!   computed, for the tests and benchmarks of routing over several endpoints.
//! - [`versitygw`]: not a double: a real S3 server, for runs on object storage.
//! - [`long_conversation`]: the scripted long conversations the kill tests run and check.
//! - [`s3_faults`]: a proxy in front of it that throttles, cuts or stalls chosen requests.
//! - [`batch_server`]: a provider's Batch API (`OpenAI`'s files and batches) that runs each line
//!   against a real model server, with turnaround, expiry and refusals on demand.
//! - [`side_by_side`]: the task directory and CPU reading of the benchmark beside Harbor itself.
//! - [`tier_gate`]: a provider's flex tier (refused for no capacity, then served) in front of a
//!   real model server.

pub mod batch_server;
pub mod chromium;
pub mod envoy;
pub mod executor;
pub mod gubernator;
pub mod llama_cpp_server;
pub mod llama_servers;
pub mod long_conversation;
pub mod s3_faults;
pub mod scripted_server;
pub mod side_by_side;
pub mod tier_gate;
pub mod versitygw;

/// A benchmark's setting: the environment variable `name` parsed, else `default` (unset or not
/// a `T`).
pub fn knob<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// An axum app served on `127.0.0.1` (a free port) on the caller's tokio runtime; it stops
/// accepting connections when dropped.
#[derive(Debug)]
pub(crate) struct Served {
    pub(crate) address: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Served {
    pub(crate) async fn start(app: axum::Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a test server can bind a port");
        let address = listener
            .local_addr()
            .expect("a bound socket has an address");
        let task = tokio::spawn(async move {
            // Serving only fails when accepting fails for good; the test then sees refused
            // connections.
            let _ = axum::serve(listener, app).await;
        });
        Self { address, task }
    }

    /// The base URL of an OpenAI-compatible API served so: `http://127.0.0.1:PORT/v1`.
    pub(crate) fn base_url(&self) -> String {
        format!("http://{}/v1", self.address)
    }
}

/// `record` without what differs between two runs of the same conversations: when they ran and
/// how long (keys ending `_ms` or `_at`, `timestamp`, `seconds`), at any depth.
pub fn without_timing(mut record: serde_json::Value) -> serde_json::Value {
    fn strip(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                map.retain(|key, _| {
                    !(key.ends_with("_ms")
                        || key.ends_with("_at")
                        || key == "timestamp"
                        || key == "seconds")
                });
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut record);
    record
}

/// The binary the environment variable `env` names, else the one `script` (under the
/// repository's `scripts/`, run with `--print-path`) installs or finds cached. Panics with the
/// script's message when it cannot.
pub(crate) fn installed_binary(env: &str, script: &str) -> std::path::PathBuf {
    installed(env, script, "--print-path")
}

/// The path the environment variable `env` names (checked to exist), else the one `script`
/// (under the repository's `scripts/`) prints when run with `flag`, building or installing what
/// it names if needed. Panics with the script's message when it cannot: a test that needs the
/// component must fail loudly.
pub fn installed(env: &str, script: &str, flag: &str) -> std::path::PathBuf {
    if let Some(path) = std::env::var_os(env) {
        let path = std::path::PathBuf::from(path);
        assert!(
            path.exists(),
            "{env}={} does not exist: unset it, or run scripts/{script} {flag}",
            path.display()
        );
        return path;
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(script);
    let output = std::process::Command::new(&script)
        .arg(flag)
        .output()
        .unwrap_or_else(|err| panic!("cannot run {}: {err}", script.display()));
    assert!(
        output.status.success(),
        "{} {flag} failed, and {env} is unset: {}",
        script.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    std::path::PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

/// A port free on loopback a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// Waits up to 30 s for a server just started as `child` until `serves` says it does. Panics
/// with its log when it exits first or takes longer: a test that needs it must fail loudly.
pub(crate) fn wait_until_serving(
    child: &mut std::process::Child,
    name: &str,
    serves: impl Fn() -> bool,
    log: impl Fn() -> String,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !serves() {
        if let Some(status) = child.try_wait().expect("wait on the server") {
            panic!("{name} exited ({status}): {}", log());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} did not answer within 30 s: {}",
            log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
