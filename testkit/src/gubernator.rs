//! A real Gubernator, the distributed rate limiter a run's pods share their model's limits
//! through (`spec.model.limits.gubernator`): one node, its peer list itself, built by
//! `scripts/gubernator/build.sh` (or the binary `TRAJ_GUBERNATOR` names). Killed when dropped.

use std::process::{Child, Command, Stdio};

/// A running Gubernator.
#[derive(Debug)]
pub struct Gubernator {
    child: Child,
    /// Its HTTP address (`http://<host>:<port>`), as `spec.model.limits.gubernator.url` takes it.
    pub url: String,
    /// Its configuration and log, removed when it is dropped.
    _dir: tempfile::TempDir,
}

impl Gubernator {
    /// Starts one listening on `host` (`127.0.0.1`, or `0.0.0.0` for pods). Panics when it
    /// cannot: a test that needs it must fail loudly.
    pub fn start(host: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let [http, grpc, members] = [crate::free_port(), crate::free_port(), crate::free_port()];
        let config = dir.path().join("gubernator.env");
        std::fs::write(
            &config,
            format!(
                "GUBER_HTTP_ADDRESS={host}:{http}\n\
                 GUBER_GRPC_ADDRESS=127.0.0.1:{grpc}\n\
                 GUBER_ADVERTISE_ADDRESS=127.0.0.1:{grpc}\n\
                 GUBER_PEER_DISCOVERY_TYPE=member-list\n\
                 GUBER_MEMBERLIST_ADDRESS=127.0.0.1:{members}\n\
                 GUBER_MEMBERLIST_BIND_ADDRESS=127.0.0.1:{members}\n\
                 GUBER_MEMBERLIST_KNOWN_NODES=127.0.0.1:{members}\n"
            ),
        )
        .expect("write gubernator.env");
        let binary = crate::installed_binary("TRAJ_GUBERNATOR", "gubernator/build.sh");
        let mut child = Command::new(&binary)
            .arg("-config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("gubernator.log")).expect("log"))
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {}: {err}", binary.display()));
        let reach = if host == "0.0.0.0" { "127.0.0.1" } else { host };
        let url = format!("http://{reach}:{http}");
        crate::wait_until_serving(
            &mut child,
            "gubernator",
            || healthy(&url),
            || std::fs::read_to_string(dir.path().join("gubernator.log")).unwrap_or_default(),
        );
        Self {
            child,
            url,
            _dir: dir,
        }
    }
}

fn healthy(url: &str) -> bool {
    Command::new("curl")
        .args(["-fsS", "--max-time", "2"])
        .arg(format!("{url}/v1/HealthCheck"))
        .output()
        .is_ok_and(|output| {
            output.status.success()
                && String::from_utf8_lossy(&output.stdout).contains("\"healthy\"")
        })
}

impl Drop for Gubernator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
