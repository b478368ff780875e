//! The worker's one Chromium process, started on the first browser call and shared by every
//! conversation of the worker (each in its own browser context, see `session.rs`).
//!
//! Where it runs:
//! - **in a pod, in the sandbox container** (the pool has the pod's sandbox): started through a
//!   session of the container's executor ([`Sandbox::start_session`]), confined like a command,
//!   its profile in the session's private directory (its `HOME`, in the container's `/tmp`),
//!   speaking `DevTools` over `--remote-debugging-pipe` (never a port there: anything listening
//!   in the pod's network namespace is reachable by the model's commands), which the worker
//!   drives through an in-worker WebSocket bridge (`bridge.rs`);
//! - **locally**, as the worker's child with an empty environment (the worker's holds the
//!   model's API key), its profile in a temporary directory removed with the process, listening
//!   for `DevTools` on an ephemeral port of the loopback interface, which it writes into the
//!   profile's `DevToolsActivePort` file (read instead of parsing its log).
//!
//! If the process dies, the next call starts a new one.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chromiumoxide::Browser;
use chromiumoxide::handler::HandlerConfig;
use futures::StreamExt;
use tempfile::TempDir;

use super::bridge::Bridge;
use super::{BrowserError, Settings};
use crate::tools::sandbox::{Limits, Sandbox, SessionEnd};

/// The running Chromium (or none yet), started on demand.
#[derive(Debug)]
pub(super) struct Pool {
    settings: Settings,
    /// The pod's sandbox, where Chromium then runs; none: the worker's child.
    sandbox: Option<Sandbox>,
    running: tokio::sync::Mutex<Option<Arc<Chromium>>>,
}

impl Pool {
    pub(super) fn new(settings: Settings, sandbox: Option<Sandbox>) -> Self {
        Self {
            settings,
            sandbox,
            running: tokio::sync::Mutex::new(None),
        }
    }

    pub(super) fn settings(&self) -> &Settings {
        &self.settings
    }

    #[cfg(test)]
    pub(super) async fn started(&self) -> bool {
        self.running.lock().await.is_some()
    }

    /// The running Chromium, started if there is none or the last one died.
    pub(super) async fn chromium(&self) -> Result<Arc<Chromium>, BrowserError> {
        let mut running = self.running.lock().await;
        if let Some(chromium) = running.as_ref().filter(|chromium| chromium.is_alive()) {
            return Ok(Arc::clone(chromium));
        }
        let started = Instant::now();
        let chromium = Arc::new(match &self.sandbox {
            Some(sandbox) => Chromium::launch_in(sandbox, &self.settings).await?,
            None => Chromium::launch(&self.settings).await?,
        });
        tracing::info!(
            elapsed_ms = started.elapsed().as_millis(),
            "started Chromium for the browser toolset"
        );
        *running = Some(Arc::clone(&chromium));
        Ok(chromium)
    }
}

/// One Chromium process and its `DevTools` connection.
#[derive(Debug)]
pub(super) struct Chromium {
    pub(super) browser: Browser,
    process: Process,
    connected: Arc<AtomicBool>,
    handler: tokio::task::JoinHandle<()>,
}

/// Where the process is.
#[derive(Debug)]
enum Process {
    /// The worker's child, and its profile directory: dropped after the process is killed (see
    /// `Drop`), so Chromium cannot write into it again.
    Child {
        child: std::sync::Mutex<Child>,
        profile: Option<TempDir>,
    },
    /// A session in the sandbox container, and the bridge to its pipe (dropping the bridge ends
    /// the session, and the executor kills Chromium with everything it started).
    Session { end: SessionEnd, _bridge: Bridge },
}

impl Chromium {
    /// Starts Chromium in `sandbox` on a `DevTools` pipe, and connects through a bridge.
    async fn launch_in(sandbox: &Sandbox, settings: &Settings) -> Result<Self, BrowserError> {
        let launch = |reason: String| BrowserError::Launch(reason);
        let argv = std::iter::once(settings.chromium_path.display().to_string())
            .chain(chromium_flags(&Debugging::Pipe))
            .collect();
        let mut request = sandbox.session_request(argv, BTreeMap::new());
        request.cdp_pipe = true;
        // Its processes and threads grow with the conversations, and its memory with their pages;
        // the sandbox container's resources (spec.sandbox.resources) are its bound.
        request.limits = Limits {
            workspace_bytes: sandbox.limits.workspace_bytes,
            ..Limits::NONE
        };
        let session = sandbox
            .start_session(&request)
            .await
            .map_err(|err| launch(format!("cannot start it in the sandbox: {err}")))?;
        let end = session.end.clone();
        let failed = |reason: String| {
            let stderr = end.stderr_tail();
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            launch(if tail.is_empty() {
                reason
            } else {
                format!("{reason}; its output ends with:\n{}", tail.join("\n"))
            })
        };
        let pipe = session
            .cdp
            .ok_or_else(|| launch("the session has no DevTools pipe".to_owned()))?;
        let bridge = Bridge::open(pipe)
            .await
            .map_err(|err| launch(format!("cannot open the DevTools bridge: {err}")))?;
        let (browser, connected, handler) =
            connect(bridge.url(), settings).await.map_err(failed)?;
        // Chromium answers on the pipe once it runs: a browser that did not start (a missing
        // binary, a crash) fails here, with what it wrote.
        if tokio::time::timeout(settings.launch_timeout, browser.version())
            .await
            .map_or(true, |answer| answer.is_err())
        {
            handler.abort();
            return Err(failed(format!(
                "Chromium did not answer on its DevTools pipe within {} s \
                 (tools.browser.launchTimeoutSeconds)",
                settings.launch_timeout.as_secs()
            )));
        }
        Ok(Self {
            browser,
            process: Process::Session {
                end,
                _bridge: bridge,
            },
            connected,
            handler,
        })
    }

    async fn launch(settings: &Settings) -> Result<Self, BrowserError> {
        let launch = |reason: String| BrowserError::Launch(reason);
        let profile = tempfile::Builder::new()
            .prefix("trajectory-chromium-")
            .tempdir()
            .map_err(|err| launch(format!("cannot create a profile directory: {err}")))?;
        let log_path = profile.path().join("chromium.log");
        let log = File::create(&log_path)
            .map_err(|err| launch(format!("cannot create {}: {err}", log_path.display())))?;
        let user_data = profile.path().join("profile");
        let mut command = Command::new(&settings.chromium_path);
        command
            .env_clear()
            // Debian's /usr/bin/chromium is a shell script; it needs a PATH for its helpers.
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", profile.path())
            // Nor the worker's working directory (the wrapper script exports it as PWD).
            .current_dir(profile.path())
            .args(chromium_flags(&Debugging::Port {
                user_data: user_data.clone(),
            }))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            // Its own process group, so that the renderers and the zygote die with it.
            .process_group(0);
        let mut child = command.spawn().map_err(|err| {
            launch(format!(
                "cannot start {}: {err}",
                settings.chromium_path.display()
            ))
        })?;
        let url = match wait_for_endpoint(&mut child, &user_data, settings.launch_timeout).await {
            Ok(url) => url,
            Err(reason) => {
                kill_group(&mut child);
                return Err(launch(format!("{reason}{}", log_tail(&log_path))));
            }
        };
        let (browser, connected, handler) = match connect(&url, settings).await {
            Ok(connected) => connected,
            Err(reason) => {
                kill_group(&mut child);
                return Err(launch(reason));
            }
        };
        Ok(Self {
            browser,
            process: Process::Child {
                child: std::sync::Mutex::new(child),
                profile: Some(profile),
            },
            connected,
            handler,
        })
    }

    /// The pid of a Chromium that is the worker's child (0 in the sandbox).
    #[cfg(test)]
    pub(super) fn pid(&self) -> u32 {
        match &self.process {
            Process::Child { child, .. } => child.lock().map_or(0, |child| child.id()),
            Process::Session { .. } => 0,
        }
    }

    #[cfg(test)]
    pub(super) fn profile_dir(&self) -> Option<std::path::PathBuf> {
        match &self.process {
            Process::Child { profile, .. } => profile.as_ref().map(|dir| dir.path().to_owned()),
            Process::Session { .. } => None,
        }
    }

    pub(super) fn is_alive(&self) -> bool {
        self.connected.load(Ordering::Acquire)
            && match &self.process {
                Process::Child { child, .. } => child
                    .lock()
                    .is_ok_and(|mut child| matches!(child.try_wait(), Ok(None))),
                Process::Session { end, .. } => end.ended().is_none(),
            }
    }
}

/// Connects chromiumoxide to the `DevTools` WebSocket at `url`; returns the browser, whether the
/// connection is still up, and the task driving it.
async fn connect(
    url: &str,
    settings: &Settings,
) -> Result<(Browser, Arc<AtomicBool>, tokio::task::JoinHandle<()>), String> {
    let config = HandlerConfig {
        // The handler's own limit stays above ours, so that ours is the one that fires.
        request_timeout: settings.navigation_timeout + Duration::from_secs(10),
        ignore_https_errors: false,
        ..HandlerConfig::default()
    };
    let (browser, mut handler) = Browser::connect_with_config(url, config)
        .await
        .map_err(|err| format!("cannot connect to its DevTools endpoint: {err}"))?;
    let connected = Arc::new(AtomicBool::new(true));
    let alive = Arc::clone(&connected);
    let handler = tokio::spawn(async move {
        // The handler yields an error per message it cannot route; only the end of the
        // stream (the connection closed) means the browser is gone.
        while handler.next().await.is_some() {}
        alive.store(false, Ordering::Release);
    });
    Ok((browser, connected, handler))
}

impl Drop for Chromium {
    fn drop(&mut self) {
        self.handler.abort();
        if let Process::Child { child, profile } = &mut self.process {
            if let Ok(child) = child.get_mut() {
                kill_group(child);
            }
            if let Some(profile) = profile.take()
                && let Err(err) = profile.close()
            {
                tracing::warn!(%err, "cannot remove Chromium's profile directory");
            }
        }
    }
}

/// How the worker speaks `DevTools` with Chromium.
enum Debugging {
    /// An ephemeral loopback port, with the profile in `user_data` (the worker's child).
    Port { user_data: std::path::PathBuf },
    /// The pipe on fds 3 and 4 (in the sandbox), with the profile in `HOME`, the session's
    /// private directory (Chromium's default place, `~/.config/chromium`).
    Pipe,
}

/// Chromium's command line. `--no-sandbox` as root, and always in the sandbox container:
/// Chromium refuses to start as root with its sandbox, and its zygote needs user namespaces (or
/// a setuid helper), which root in a container and the restricted pod (no capabilities,
/// `no_new_privs`, `RuntimeDefault` seccomp) deny; there the executor's confinement is the
/// browser's. A non-root local worker keeps Chromium's sandbox. The rest keeps a headless
/// browser in a container quiet: no GPU, no first-run or background network traffic, no
/// updates, no back-forward cache (a page restored from it fires no load event, so
/// `browser_back` could not tell when it is done).
fn chromium_flags(debugging: &Debugging) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--headless",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-extensions",
        "--disable-sync",
        "--disable-breakpad",
        "--metrics-recording-only",
        "--mute-audio",
        "--password-store=basic",
        "--use-mock-keychain",
        "--disable-features=BackForwardCache,Translate,MediaRouter,OptimizationHints",
        "--window-size=1280,800",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    match debugging {
        Debugging::Port { user_data } => {
            flags.push("--remote-debugging-port=0".to_owned());
            flags.push("--remote-debugging-address=127.0.0.1".to_owned());
            flags.push(format!("--user-data-dir={}", user_data.display()));
            if running_as_root() {
                flags.push("--no-sandbox".to_owned());
            }
        }
        Debugging::Pipe => {
            flags.push("--remote-debugging-pipe".to_owned());
            flags.push("--no-sandbox".to_owned());
        }
    }
    flags.push("about:blank".to_owned());
    flags
}

/// `/proc/self` belongs to the process's effective user.
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0)
}

/// Waits until Chromium has written its `DevTools` port, and returns the browser's WebSocket URL.
async fn wait_for_endpoint(
    child: &mut Child,
    user_data: &Path,
    timeout: Duration,
) -> Result<String, String> {
    let port_file = user_data.join("DevToolsActivePort");
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(&port_file) {
            let mut lines = text.lines();
            if let (Some(port), Some(path)) = (lines.next(), lines.next())
                && port.parse::<u16>().is_ok()
            {
                return Ok(format!("ws://127.0.0.1:{port}{path}"));
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "Chromium exited ({status}) before it opened its DevTools port"
            ));
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "Chromium did not open its DevTools port within {} s (tools.browser.launchTimeoutSeconds)",
                timeout.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn kill_group(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The end of Chromium's log, for a launch error.
fn log_tail(path: &Path) -> String {
    let mut text = String::new();
    if File::open(path)
        .and_then(|mut file| file.read_to_string(&mut text))
        .is_err()
        || text.trim().is_empty()
    {
        return String::new();
    }
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(5)..].join("\n");
    format!("; Chromium's log ends with:\n{tail}")
}
