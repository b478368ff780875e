//! Headless Chromium for tests and benchmarks that open a page the worker wrote (the run report):
//! Debian's, which `scripts/browser/install.sh` installs for the test suite.

use std::path::Path;
use std::process::Command;

/// Where the test suite installs Chromium.
pub const CHROMIUM: &str = "/usr/bin/chromium";

/// A headless Chromium with its own profile in `profile`, none of the browser's own background
/// traffic (updates, sync, components), and its log on standard error (a page's console messages
/// are logged there as `CONSOLE(...)` lines). Add the page and what to do with it
/// (`--dump-dom`, `--screenshot=...`).
pub fn headless(profile: &Path) -> Command {
    let mut command = Command::new(CHROMIUM);
    command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-default-apps",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.display()));
    command
}
