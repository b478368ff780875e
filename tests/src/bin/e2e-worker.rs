//! The worker's command line (`trajectory-worker`), built with the tests: the test-kubelet runs a
//! pod's container as a process of it (`tests/src/e2e.rs`, `Kubelet::worker_binary`). Cargo
//! hands only a package's own binaries to its tests (`CARGO_BIN_EXE_<name>`), so this crate has
//! its own, always built from the same sources as the tests that run it.

fn main() {
    std::process::exit(trajectory_worker::cli::main());
}
