//! searx for the web tool tests, started by the test and stopped when dropped: Debian's `searx`
//! (the project `SearXNG` forked from) with one offline engine, its `sqlite` engine over a
//! full-text index of Debian's `python3-doc` HTML pages, so a search returns real results without
//! the internet; each result's URL points at a [`DocsServer`] (`local_servers`).
//!
//! Installed by `scripts/web/install.sh`; a server that cannot start fails the test loudly.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::local_servers::{DocsServer, PYTHON_DOCS, Process, answers_ok, free_port};

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

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
