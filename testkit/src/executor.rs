//! The tool executor the worker's tests run commands under, built where the worker looks for it.
//!
//! The worker finds `trajectory-executor` beside its own program, which for a test binary
//! (`<target>/<profile>/deps/…`) is `<target>/<profile>/`. `cargo test --workspace` builds it there
//! with the other packages' binaries; `cargo test -p trajectory-worker` builds only the worker's
//! own, so without this a fresh target directory runs the tests against no executor (or a stale
//! one after the sandbox changed). [`built`] asks cargo to build it into the test's own target
//! directory and profile: cargo's freshness check when it is up to date.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

/// Builds `trajectory-executor` for this test binary's target directory and profile, once per
/// test binary. Panics with cargo's message when it cannot be built: every test that runs a
/// command needs it.
pub fn built() {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    if let Err(message) = BUILT.get_or_init(build) {
        panic!("{message}");
    }
}

fn build() -> Result<(), String> {
    let this = std::env::current_exe().map_err(|err| format!("this test's path: {err}"))?;
    // <target>/<profile>/deps/<test binary>
    let profile_dir = this
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| format!("{} is not in a cargo target directory", this.display()))?;
    let target_dir = profile_dir
        .parent()
        .ok_or_else(|| format!("{} has no parent", profile_dir.display()))?;
    let profile = match profile_dir.file_name().and_then(|name| name.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    let output = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--package", "trajectory-sandbox"])
        .args(["--bin", "trajectory-executor", "--profile", profile])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .map_err(|err| format!("running cargo to build trajectory-executor: {err}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "cargo could not build trajectory-executor ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}
