//! Real local servers for the tests of tools that fetch over HTTP (web, vision, `image_gen`),
//! started by the test and stopped when dropped:
//! - [`DocsServer`]: Python's `http.server` serving a directory (Debian's `python3-doc` pages and
//!   images, or a test's files);
//! - [`RedirectLoop`]: a test double for the one exact edge case no real server does on purpose,
//!   a redirect loop (`/a` → `/b` → `/a`).
//!
//! `python3-doc` is installed by `scripts/web/install.sh`; a server that cannot start fails the
//! test loudly.

// Shared by several test binaries, each using a part (as `common` is).
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Debian's `python3-doc` pages (scripts/web/install.sh installs them).
pub const PYTHON_DOCS: &str = "/usr/share/doc/python3-doc/html";

pub use trajectory_testkit::free_port;

/// A child process killed on drop, with its output in a file shown when it fails to start.
pub struct Process {
    child: Child,
    log: PathBuf,
    what: &'static str,
}

impl Process {
    pub fn spawn(what: &'static str, command: &mut Command, log: PathBuf) -> Self {
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
    pub fn wait_until(&mut self, mut ready: impl FnMut() -> bool) {
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
pub fn answers_ok(port: u16, path: &str) -> bool {
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

/// A temporary directory of `files` (name, bytes), served by a [`DocsServer`].
pub fn served_files(files: &[(&str, &[u8])]) -> (tempfile::TempDir, DocsServer) {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    let server = DocsServer::start(dir.path());
    (dir, server)
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
