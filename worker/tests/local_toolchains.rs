//! A local run on a researcher's workstation, through the real `trajectory-worker local` binary:
//! a `PATH` whose first entries are under the home directory (a pyenv shim, as most such
//! machines have), and toolchains named on purpose (`spec.sandbox.toolDirs`, `--tool-dir`).
//! The home directory is a fake one the test makes, under a directory the sandbox does not open,
//! as a real home is not.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{RunFixture, WORKER, wait};
use serde_json::{Value, json};
use trajectory_testkit::free_port;
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_call_reply};

/// A fake home directory with pyenv's layout: `~/.pyenv/shims/python3`, a shim that runs the
/// system's Python as pyenv's runs the selected version.
struct FakeHome {
    dir: tempfile::TempDir,
}

impl FakeHome {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let home = Self { dir };
        home.script(
            ".pyenv/shims/python3",
            "#!/bin/sh\nexec /usr/bin/python3 \"$@\"\n",
        );
        home
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes an executable script at `relative` under the home directory.
    fn script(&self, relative: &str, text: &str) -> PathBuf {
        let path = self.path().join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// The user's `PATH` on such a machine: the shims first, then the system's.
    fn user_path(&self) -> String {
        format!(
            "{}:/usr/local/bin:/usr/bin:/bin",
            self.path().join(".pyenv/shims").display()
        )
    }

    /// `trajectory-worker local` of `fixture`'s run as this home's user, with `extra` arguments.
    async fn run_local(&self, fixture: &RunFixture, extra: &[&str]) -> Output {
        let child = Command::new(WORKER)
            .arg("local")
            .arg(fixture.run_file())
            .arg("--no-progress-bar")
            .arg("--workspace-root")
            .arg(fixture.workspaces())
            .arg("--landlock")
            .arg("required")
            .args(extra)
            .env("HOME", self.path())
            .env("PATH", self.user_path())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the worker binary starts");
        wait(child).await
    }
}

/// The `output` of each tool result the model was sent last, in call order.
fn tool_outputs(server: &ScriptedServer) -> Vec<String> {
    let requests = server.requests();
    requests.last().expect("the model was called").body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|message| message["role"] == "tool")
        .map(|message| {
            let result: Value = serde_json::from_str(message["content"].as_str().unwrap()).unwrap();
            result["output"].as_str().unwrap_or_default().to_owned()
        })
        .collect()
}

fn both(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The model's `python3` is the system's, not the shim under the home directory that the
/// sandbox refuses; a server it starts in the background answers a later call; the run says once
/// at its start, and again in its summary, which `PATH` entry the commands do not get. Running
/// the shim by its path is refused with a note naming the system's Python, and the refusal is
/// counted in the record, `statistics.json` and the summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shim_under_home_first_on_path_leaves_the_model_the_systems_python() {
    let home = FakeHome::new();
    let port = free_port();
    let server = ScriptedServer::start_with_default(
        [
            Step::ok(tool_call_reply(
                "terminal",
                &json!({"command": "command -v python3; python3 -c 'print(6 * 7)'"}),
            )),
            Step::ok(tool_call_reply(
                "terminal",
                &json!({
                    "command": format!("python3 -m http.server {port} --bind 127.0.0.1"),
                    "background": true
                }),
            )),
            Step::ok(tool_call_reply(
                "terminal",
                &json!({"command": format!(
                    "for i in $(seq 50); do curl -sf http://127.0.0.1:{port}/ && break; sleep 0.1; done"
                )}),
            )),
            // The shim itself, by its path: refused, and the model is told why and what to use.
            Step::ok(tool_call_reply(
                "terminal",
                &json!({"command": format!("{} -V", home.path().join(".pyenv/shims/python3").display())}),
            )),
        ],
        Step::ok(text_reply("done")),
    )
    .await;
    let fixture = RunFixture::new(&server.base_url(), 1).with("/agent/maxTurns", json!(6));
    let output = home.run_local(&fixture, &[]).await;
    let said = both(&output);
    assert!(output.status.success(), "{said}");
    assert_eq!(server.request_count(), 5, "{said}");

    let outputs = tool_outputs(&server);
    assert_eq!(outputs.len(), 4, "{outputs:?}");
    assert_eq!(outputs[0], "/usr/bin/python3\n42", "{outputs:?}");
    assert!(
        outputs[2].contains("Directory listing for /"),
        "the background server did not answer: {outputs:?}"
    );
    let at_start = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        at_start.matches("PATH leaves out ~/.pyenv/shims").count(),
        1,
        "{said}"
    );
    let summary = String::from_utf8_lossy(&output.stdout);
    assert!(
        summary.contains("the commands' PATH left out ~/.pyenv/shims"),
        "{summary}"
    );

    assert!(outputs[3].contains("Permission denied"), "{outputs:?}");
    assert!(
        outputs[3].contains("[The sandbox refused ") && outputs[3].contains("/usr/bin/python3]"),
        "{outputs:?}"
    );
    let record = &fixture.lines("trajectories.jsonl")[0];
    assert_eq!(
        record["sandbox_refusals"],
        json!({"~/.pyenv": 1}),
        "{record}"
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["sandbox_refusals"], json!({"~/.pyenv": 1}));
    assert!(
        summary
            .lines()
            .any(|line| line.split_whitespace().eq(["~/.pyenv", "1"])),
        "{summary}"
    );
}

/// A toolchain under the home directory named with `--tool-dir` (a script tool) and in
/// `spec.sandbox.toolDirs` (a second one) runs, its `bin` first on the commands' `PATH`; the home
/// directory itself, the run's storage, a directory holding them, and a Python that cannot run in
/// the sandbox are refused at start with the place that named them, before any model request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_tool_dirs_run_and_ones_that_would_open_too_much_are_refused_at_start() {
    let home = FakeHome::new();
    home.script(
        "tools/greeter/bin/greet",
        "#!/bin/sh\necho hello from greeter\n",
    );
    home.script("tools/counter/bin/count", "#!/bin/sh\necho 1 2 3\n");
    let notes = home.path().join("tools/notes.txt");
    std::fs::write(&notes, "private\n").unwrap();
    let server = ScriptedServer::start_with_default(
        [Step::ok(tool_call_reply(
            "terminal",
            &json!({"command": format!("greet && count && cat {}", notes.display())}),
        ))],
        Step::ok(text_reply("done")),
    )
    .await;
    let fixture = RunFixture::new(&server.base_url(), 1)
        .with("/agent/maxTurns", json!(4))
        .with("/sandbox", json!({"toolDirs": ["~/tools/counter"]}));
    let output = home
        .run_local(&fixture, &["--tool-dir", "~/tools/greeter"])
        .await;
    let said = both(&output);
    assert!(output.status.success(), "{said}");
    let outputs = tool_outputs(&server);
    assert!(
        outputs[0].starts_with("hello from greeter\n1 2 3\n"),
        "{outputs:?}"
    );
    // The rest of the home directory stays closed, even beside the named directories.
    assert!(outputs[0].contains("Permission denied"), "{outputs:?}");
    assert!(!outputs[0].contains("private"), "{outputs:?}");

    // A virtual environment whose interpreter is a link to a base installation that was not
    // named: its Python cannot start in the sandbox.
    let base = home.script(
        ".pyenv/versions/3.12.7/bin/python3",
        "#!/bin/sh\nexec /usr/bin/python3 \"$@\"\n",
    );
    std::fs::create_dir_all(home.path().join("venv/bin")).unwrap();
    std::os::unix::fs::symlink(&base, home.path().join("venv/bin/python3")).unwrap();

    let requests = server.request_count();
    let parent = home.path().parent().unwrap().display().to_string();
    for (extra, storage_named, says) in [
        (vec!["--tool-dir", "~/tools/../"], false, "--tool-dir"),
        (vec![], true, "spec.sandbox.toolDirs[0]"),
        (
            vec!["--tool-dir", parent.as_str()],
            false,
            "holds the home directory",
        ),
        (vec!["--tool-dir", "~/venv"], false, "sys.base_prefix"),
    ] {
        let mut fixture = RunFixture::new(&server.base_url(), 1);
        if storage_named {
            let storage = fixture.root().display().to_string();
            fixture = fixture.with("/sandbox", json!({"toolDirs": [storage]}));
        }
        let output = home.run_local(&fixture, &extra).await;
        let said = both(&output);
        assert!(!output.status.success(), "{extra:?}: {said}");
        assert!(said.contains(says), "{extra:?}: {said}");
        assert!(!fixture.out().join("trajectories.jsonl").exists());
    }
    assert_eq!(server.request_count(), requests, "no model request");
}
