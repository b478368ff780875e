//! A real Gubernator, the distributed rate limiter a run's pods share their model's limits
//! through (`spec.model.limits.gubernator`): one node, its peer list itself, built by
//! `scripts/gubernator/build.sh` (or the binary `TRAJ_GUBERNATOR` names). Killed when dropped.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running Gubernator.
#[derive(Debug)]
pub struct Gubernator {
    child: Child,
    /// Its HTTP address (`http://<host>:<port>`), as `spec.model.limits.gubernator.url` takes it.
    pub url: String,
    /// Its configuration and log.
    dir: tempfile::TempDir,
}

impl Gubernator {
    /// Starts one listening on `host` (`127.0.0.1`, or `0.0.0.0` for pods). Panics when it
    /// cannot: a test that needs it must fail loudly.
    pub fn start(host: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let [http, grpc, members] = [free_port(), free_port(), free_port()];
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
        let child = Command::new(&binary)
            .arg("-config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("gubernator.log")).expect("log"))
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {}: {err}", binary.display()));
        let reach = if host == "0.0.0.0" { "127.0.0.1" } else { host };
        let mut gubernator = Self {
            child,
            url: format!("http://{reach}:{http}"),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !gubernator.healthy() {
            if let Some(status) = gubernator.child.try_wait().expect("wait on gubernator") {
                panic!("gubernator exited ({status}): {}", gubernator.log());
            }
            assert!(
                Instant::now() < deadline,
                "gubernator did not become healthy within 30 s: {}",
                gubernator.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        gubernator
    }

    fn healthy(&self) -> bool {
        Command::new("curl")
            .args(["-fsS", "--max-time", "2"])
            .arg(format!("{}/v1/HealthCheck", self.url))
            .output()
            .is_ok_and(|output| {
                output.status.success()
                    && String::from_utf8_lossy(&output.stdout).contains("\"healthy\"")
            })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gubernator.log")).unwrap_or_default()
    }
}

impl Drop for Gubernator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port free on loopback a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}
