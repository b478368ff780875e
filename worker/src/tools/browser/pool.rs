//! The worker's one Chromium process, started on the first browser call and shared by every
//! conversation of the worker (each in its own browser context, see `session.rs`).
//!
//! Chromium starts with an empty environment: the worker's holds the model's API key, and
//! nothing a page runs should be able to reach it. Its profile lives in a temporary directory
//! that is removed with the process. It listens for `DevTools` on an ephemeral port of the
//! loopback interface and writes the port into the profile's `DevToolsActivePort` file, which
//! is read instead of parsing its log. If the process dies, the next call starts a new one.

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

use super::{BrowserError, Settings};

/// The running Chromium (or none yet), started on demand.
#[derive(Debug)]
pub(super) struct Pool {
    settings: Settings,
    running: tokio::sync::Mutex<Option<Arc<Chromium>>>,
}

impl Pool {
    pub(super) fn new(settings: Settings) -> Self {
        Self {
            settings,
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
        let chromium = Arc::new(Chromium::launch(&self.settings).await?);
        tracing::info!(
            elapsed_ms = started.elapsed().as_millis(),
            "started Chromium for the browser toolset"
        );
        *running = Some(Arc::clone(&chromium));
        Ok(chromium)
    }
}

/// One Chromium process, its `DevTools` connection and its profile directory.
#[derive(Debug)]
pub(super) struct Chromium {
    pub(super) browser: Browser,
    child: std::sync::Mutex<Child>,
    connected: Arc<AtomicBool>,
    handler: tokio::task::JoinHandle<()>,
    // Dropped after the process is killed (see `Drop`), so Chromium cannot write into it again.
    profile: Option<TempDir>,
}

impl Chromium {
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
            .args(chromium_flags(&user_data))
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
        let config = HandlerConfig {
            // The handler's own limit stays above ours, so that ours is the one that fires.
            request_timeout: settings.navigation_timeout + Duration::from_secs(10),
            ignore_https_errors: false,
            ..HandlerConfig::default()
        };
        let (browser, mut handler) = match Browser::connect_with_config(url, config).await {
            Ok(connected) => connected,
            Err(err) => {
                kill_group(&mut child);
                return Err(launch(format!(
                    "cannot connect to its DevTools endpoint: {err}"
                )));
            }
        };
        let connected = Arc::new(AtomicBool::new(true));
        let alive = Arc::clone(&connected);
        let handler = tokio::spawn(async move {
            // The handler yields an error per message it cannot route; only the end of the
            // stream (the connection closed) means the browser is gone.
            while handler.next().await.is_some() {}
            alive.store(false, Ordering::Release);
        });
        Ok(Self {
            browser,
            child: std::sync::Mutex::new(child),
            connected,
            handler,
            profile: Some(profile),
        })
    }

    #[cfg(test)]
    pub(super) fn pid(&self) -> u32 {
        self.child.lock().map_or(0, |child| child.id())
    }

    #[cfg(test)]
    pub(super) fn profile_dir(&self) -> Option<std::path::PathBuf> {
        self.profile.as_ref().map(|dir| dir.path().to_owned())
    }

    pub(super) fn is_alive(&self) -> bool {
        self.connected.load(Ordering::Acquire)
            && self
                .child
                .lock()
                .is_ok_and(|mut child| matches!(child.try_wait(), Ok(None)))
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        self.handler.abort();
        if let Ok(mut child) = self.child.lock() {
            kill_group(&mut child);
        }
        if let Some(profile) = self.profile.take()
            && let Err(err) = profile.close()
        {
            tracing::warn!(%err, "cannot remove Chromium's profile directory");
        }
    }
}

/// Chromium's command line. `--no-sandbox` only as root: Chromium refuses to start as root
/// with its sandbox (its zygote would need user namespaces that root in a container is usually
/// denied); a non-root worker keeps the sandbox. The rest keeps a headless browser in a
/// container quiet: no GPU, no first-run or background network traffic, no updates, no
/// back-forward cache (a page restored from it fires no load event, so `browser_back` could not
/// tell when it is done).
fn chromium_flags(user_data: &Path) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--headless",
        "--remote-debugging-port=0",
        "--remote-debugging-address=127.0.0.1",
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
    flags.push(format!("--user-data-dir={}", user_data.display()));
    if running_as_root() {
        flags.push("--no-sandbox".to_owned());
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
