//! Real servers for the web tool tests, started by the test and stopped when dropped:
//! - [`Searx`]: Debian's `searx` (the project `SearXNG` forked from) with one offline engine, its
//!   `sqlite` engine over a full-text index of Debian's `python3-doc` HTML pages, so a search
//!   returns real results without the internet; each result's URL points at a [`DocsServer`];
//! - [`DocsServer`]: Python's `http.server` serving a directory (those pages, or a test's files);
//! - [`RedirectLoop`]: a test double for the one exact edge case no real server does on purpose,
//!   a redirect loop (`/a` → `/b` → `/a`).
//!
//! Installed by `scripts/web/install.sh`; a server that cannot start fails the test loudly.

// Shared by several test binaries, each using a part (as `common` is).
#![allow(dead_code)]

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// Debian's `python3-doc` pages (scripts/web/install.sh installs them).
pub const PYTHON_DOCS: &str = "/usr/share/doc/python3-doc/html";

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// A port free right now on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// A child process killed on drop, with its output in a file shown when it fails to start.
struct Process {
    child: Child,
    log: PathBuf,
    what: &'static str,
}

impl Process {
    fn spawn(what: &'static str, command: &mut Command, log: PathBuf) -> Self {
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|err| {
                panic!("cannot start {what} ({err}); run scripts/web/install.sh")
            });
        Self { child, log, what }
    }

    /// Waits until `ready` holds, failing loudly when the process exits or 60 s pass.
    fn wait_until(&mut self, mut ready: impl FnMut() -> bool) {
        let started = Instant::now();
        loop {
            if ready() {
                return;
            }
            if let Some(status) = self.child.try_wait().expect("process status") {
                panic!(
                    "{} exited with {status} before it was ready:\n{}",
                    self.what,
                    self.log_text()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{} was not ready after 60 s:\n{}",
                self.what,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `GET path` on 127.0.0.1:`port` answers 200.
fn answers_ok(port: u16, path: &str) -> bool {
    use std::io::Write;
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    if write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).is_ok() && head.ends_with(b"200")
}

/// Python's `http.server` over a directory.
pub struct DocsServer {
    _process: Process,
    pub port: u16,
    _log_dir: tempfile::TempDir,
}

impl DocsServer {
    pub fn start(dir: &Path) -> Self {
        let port = free_port();
        let log_dir = tempfile::tempdir().unwrap();
        let mut process = Process::spawn(
            "python3 -m http.server",
            Command::new("python3")
                .args(["-m", "http.server", "--bind", "127.0.0.1"])
                .arg(port.to_string())
                .arg("--directory")
                .arg(dir),
            log_dir.path().join("http.log"),
        );
        process.wait_until(|| answers_ok(port, "/"));
        Self {
            _process: process,
            port,
            _log_dir: log_dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!(
            "http://127.0.0.1:{}/{}",
            self.port,
            path.trim_start_matches('/')
        )
    }
}

/// searx with its `sqlite` engine over the index of `python3-doc`.
pub struct Searx {
    _process: Process,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Searx {
    /// Starts searx; its results link to pages on `docs` (a [`DocsServer`] of [`PYTHON_DOCS`]).
    pub fn start(docs: &DocsServer) -> Self {
        let index = python_docs_index();
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let settings = dir.path().join("settings.yml");
        std::fs::write(&settings, settings_yml(port, &index, docs.port)).unwrap();
        let mut process = Process::spawn(
            "searx-run",
            Command::new("searx-run").env("SEARX_SETTINGS_PATH", &settings),
            dir.path().join("searx.log"),
        );
        process.wait_until(|| answers_ok(port, "/search?q=tutorial&format=json"));
        Self {
            _process: process,
            port,
            _dir: dir,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// searx's whole configuration: no default engines, one offline engine, the JSON format on.
fn settings_yml(port: u16, index: &Path, docs_port: u16) -> String {
    format!(
        r#"use_default_settings: false
general:
  debug: false
  instance_name: "trajectory-test"
search:
  safe_search: 0
  autocomplete: ""
  formats: [html, json]
server:
  port: {port}
  bind_address: "127.0.0.1"
  secret_key: "test-only-secret"
  base_url: false
  image_proxy: false
  http_protocol_version: "1.0"
  method: "GET"
ui:
  static_path: "/usr/share/python3-searx/static"
  templates_path: "/usr/share/python3-searx/templates"
  default_theme: oscar
outgoing:
  request_timeout: 3.0
doi_resolvers:
  oadoi.org: "https://oadoi.org/"
default_doi_resolver: "oadoi.org"
locales:
  en: English
engines:
  - name: python docs
    engine: sqlite
    shortcut: pd
    categories: general
    database: "{index}"
    query_str: "SELECT title, 'http://127.0.0.1:{docs_port}/' || path AS url, snippet(pages, 2, '', '', ' … ', 24) AS content FROM pages WHERE pages MATCH :query ORDER BY rank"
    limit: 10
    disabled: false
"#,
        index = index.display(),
    )
}

/// Tests of one binary run on threads of one process: one builds the index, the others wait.
static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The full-text index of [`PYTHON_DOCS`], built once by `scripts/web/build-index.py` into the
/// cache, keyed by the script and the docs package's version.
fn python_docs_index() -> PathBuf {
    let script = Path::new(REPO).join("scripts/web/build-index.py");
    let version = Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", "python3-doc"])
        .output()
        .expect("dpkg-query runs");
    assert!(
        version.status.success(),
        "python3-doc is not installed; run scripts/web/install.sh"
    );
    let mut hash = Sha256::new();
    hash.update(std::fs::read(&script).expect("build-index.py"));
    hash.update(&version.stdout);
    let key = hash.finalize()[..8]
        .iter()
        .fold(String::new(), |key, byte| key + &format!("{byte:02x}"));
    let cache = std::env::var_os("TRAJ_CACHE_DIR")
        .map_or_else(
            || {
                PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                    .join(".cache/trajectory-operator")
            },
            PathBuf::from,
        )
        .join("web");
    let index = cache.join(format!("python3-doc-{key}.sqlite"));
    let _building = BUILDING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !index.exists() {
        std::fs::create_dir_all(&cache).unwrap();
        // Built under a name of this process, so two test binaries building at once do not
        // write one file; the script renames its output into place when done.
        let partial = cache.join(format!("python3-doc-{key}.{}.sqlite", std::process::id()));
        let status = Command::new("python3")
            .arg(&script)
            .arg(PYTHON_DOCS)
            .arg(&partial)
            .status()
            .expect("python3 runs");
        assert!(status.success(), "build-index.py failed");
        std::fs::rename(&partial, &index).unwrap();
    }
    index
}

/// A test double: answers every request with a redirect, `/a` to `/b` and anything else to `/a`.
pub struct RedirectLoop {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl RedirectLoop {
    pub async fn start() -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = stream.read(&mut buf).await.unwrap_or(0);
                    let request = String::from_utf8_lossy(&buf[..n]);
                    let next = if request.starts_with("GET /a ") {
                        "/b"
                    } else {
                        "/a"
                    };
                    let answer = format!(
                        "HTTP/1.1 302 Found\r\nLocation: {next}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        });
        Self { port, task }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/start", self.port)
    }
}

impl Drop for RedirectLoop {
    fn drop(&mut self) {
        self.task.abort();
    }
}
