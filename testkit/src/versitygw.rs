//! A real S3 server: versitygw with its POSIX backend (every directory under its root is a
//! bucket), built by `scripts/versitygw/build.sh` (or the binary `TRAJ_VERSITYGW` names). The
//! object-storage tests run the worker against it exactly as against a cloud bucket: signed
//! requests, conditional puts, ranged reads, multipart uploads. Killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The root account's access key id.
pub const ACCESS_KEY: &str = "trajectory-test";
/// The root account's secret key.
pub const SECRET_KEY: &str = "trajectory-test-secret";

/// A running versitygw.
#[derive(Debug)]
pub struct Versitygw {
    child: Child,
    /// Its S3 endpoint (`http://<host>:<port>`).
    pub endpoint: String,
    /// The buckets' directories and the log.
    dir: tempfile::TempDir,
}

impl Versitygw {
    /// Starts one listening on `host` (`127.0.0.1`, or `0.0.0.0` for pods). Panics when it
    /// cannot: a test that needs it must fail loudly.
    pub fn start(host: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(dir.path().join("buckets")).expect("the buckets' root");
        let port = crate::free_port();
        let binary = crate::installed_binary("TRAJ_VERSITYGW", "versitygw/build.sh");
        let mut child = Command::new(&binary)
            .args(["--access", ACCESS_KEY, "--secret", SECRET_KEY, "--quiet"])
            .arg("--port")
            .arg(format!("{host}:{port}"))
            .arg("posix")
            .arg(dir.path().join("buckets"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("versitygw.log")).expect("log"))
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {}: {err}", binary.display()));
        let reach = if host == "0.0.0.0" { "127.0.0.1" } else { host };
        let endpoint = format!("http://{reach}:{port}");
        crate::wait_until_serving(
            &mut child,
            "versitygw",
            || answers(&endpoint),
            || std::fs::read_to_string(dir.path().join("versitygw.log")).unwrap_or_default(),
        );
        Self {
            child,
            endpoint,
            dir,
        }
    }

    /// Creates the bucket `name` (a directory of the POSIX backend).
    pub fn create_bucket(&self, name: &str) {
        std::fs::create_dir_all(self.bucket_dir(name)).expect("create the bucket");
    }

    /// Where the bucket's objects are on this machine: object `a/b` is the file `a/b` under it.
    pub fn bucket_dir(&self, name: &str) -> PathBuf {
        self.dir.path().join("buckets").join(name)
    }

    /// The environment a client needs: the root account's keys (the endpoint is a flag).
    pub fn credentials(&self) -> [(&'static str, &'static str); 2] {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
        ]
    }

    /// The directory the server keeps its buckets in.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Versitygw {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Any HTTP answer (an anonymous request is refused with 403) means it serves.
fn answers(endpoint: &str) -> bool {
    Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "2",
        ])
        .arg(endpoint)
        .output()
        .is_ok_and(|output| {
            output.status.success() && String::from_utf8_lossy(&output.stdout) != "000"
        })
}
