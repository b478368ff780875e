//! Escape attempts against the local sandbox, driven through the real `trajectory-worker local`
//! binary: a scripted model issues each attempt as a `terminal` call, and the test judges from the
//! outside — the files on storage, the processes left on the machine, the worker's own output —
//! never from what the command says about itself alone.
//!
//! The worker gets a recognisable fake API key (`sk-probe-…`) the way a user gives the real one,
//! in its environment, and the same key sits in a key file beside the storage; the key must
//! appear in no record, batch file, log or tool result.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};

use common::{RunFixture, WORKER, wait};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    ScriptedServer, Step, first_user_message, text_reply, tool_calls_reply,
};
use trajectory_worker::contract::env;

/// The fake key; a probe that prints it anywhere fails the test.
const KEY: &str = "sk-probe-4f1c9e7a2b6d";

/// The worker, found from a command: the executor's parent.
const WORKER_PID: &str = "W=$(awk '/^PPid/{print $2}' /proc/$PPID/status)";

/// What one probe run leaves to judge.
struct Probe {
    fixture: RunFixture,
    /// Holds the key file, outside the storage, as a mounted Secret would be (kept until the
    /// probe's judgements are done).
    _secrets: tempfile::TempDir,
    /// Another conversation's workspace, planted beside this one's.
    sibling: PathBuf,
    /// Each probe's tool result (`output`, `exit_code`, `error`), in call order.
    results: Vec<Value>,
    /// The variant: the `--landlock` mode of the run, or `nonroot`.
    landlock: String,
    /// What the worker printed (stdout and stderr).
    worker_output: String,
    /// The `Authorization` header the model server saw.
    authorization: Option<String>,
}

impl Probe {
    /// Runs one conversation whose model calls `terminal` once per escape attempt, all in one
    /// turn, with Landlock in `landlock` mode, as this test's uid.
    async fn run(landlock: &str) -> Self {
        Self::run_as(landlock, None).await
    }

    /// [`Probe::run`] with the worker (and so the commands) running as `uid` when given (through
    /// util-linux's `setpriv`, from binaries copied where that uid can run them, over storage it
    /// owns).
    async fn run_as(landlock: &str, uid: Option<u32>) -> Self {
        let server = ScriptedServer::start_with_default([], Step::ok(text_reply("done"))).await;
        let fixture = RunFixture::new(&server.base_url(), 1).with("/concurrency", json!(1));
        let secrets = tempfile::tempdir().unwrap();
        let key_file = secrets.path().join("api-key");
        std::fs::write(&key_file, KEY).unwrap();
        let sibling = fixture.workspaces().join("conversation-sibling");
        std::fs::create_dir_all(&sibling).unwrap();
        std::fs::write(sibling.join("notes.txt"), "sibling-private\n").unwrap();
        // Which markers probe 9 uses: the variants run at the same time.
        let variant = if uid.is_some() { "nonroot" } else { landlock };
        let commands = escape_attempts(variant, fixture.root(), &sibling, &key_file);
        let calls: Vec<(&str, Value)> = commands
            .iter()
            .map(|command| {
                (
                    "terminal",
                    Value::String(json!({"command": command}).to_string()),
                )
            })
            .collect();
        server.push(Step::ok(tool_calls_reply(&calls)));

        let binaries = tempfile::tempdir().unwrap();
        let tools = ToolDir::new();
        let command = match uid {
            None => Command::new(WORKER),
            Some(uid) => {
                let worker = as_user(
                    uid,
                    binaries.path(),
                    &[fixture.root(), secrets.path(), tools.path()],
                );
                let mut command = Command::new("setpriv");
                command
                    .arg(format!("--reuid={uid}"))
                    .arg(format!("--regid={uid}"))
                    .args(["--clear-groups", "--"])
                    .arg(worker);
                command
            }
        };
        let child = local_run(command, &fixture, &tools)
            .arg("--landlock")
            .arg(landlock)
            .env(env::MODEL_API_KEY, KEY)
            .env(env::MODEL_API_KEY_FILE, &key_file)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the worker binary starts");
        let output = wait(child).await;
        let worker_output = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(output.status.success(), "the run failed:\n{worker_output}");

        let requests = server.requests();
        let authorization = requests[0].authorization.clone();
        let results = requests.last().expect("the model was called").body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|message| message["role"] == "tool")
            .map(|message| serde_json::from_str(message["content"].as_str().unwrap()).unwrap())
            .collect::<Vec<Value>>();
        assert_eq!(results.len(), commands.len(), "one result per probe");
        Self {
            fixture,
            _secrets: secrets,
            landlock: variant.to_owned(),
            sibling,
            results,
            worker_output,
            authorization,
        }
    }

    fn output(&self, index: usize) -> &str {
        self.results[index]["output"].as_str().unwrap_or_default()
    }

    fn storage(&self) -> &Path {
        self.fixture.root()
    }

    fn dataset_text(&self) -> String {
        std::fs::read_to_string(self.fixture.dataset()).unwrap()
    }

    /// The key reached the model server (so it was really in use), and nowhere else: no tool
    /// result, no file on storage, nothing the worker printed.
    fn assert_key_leaked_nowhere(&self) {
        assert_eq!(
            self.authorization.as_deref(),
            Some(format!("Bearer {KEY}").as_str())
        );
        for (index, result) in self.results.iter().enumerate() {
            assert!(
                !result.to_string().contains(KEY),
                "probe {index} printed the key: {result}"
            );
        }
        assert!(!self.worker_output.contains(KEY), "{}", self.worker_output);
        for entry in walkdir::WalkDir::new(self.storage()).into_iter().flatten() {
            if entry.file_type().is_file() {
                let data = std::fs::read(entry.path()).unwrap_or_default();
                assert!(
                    !String::from_utf8_lossy(&data).contains(KEY),
                    "the key is in {}",
                    entry.path().display()
                );
            }
        }
    }
}

/// Makes `owned` (recursively) `uid`'s and copies the worker and the executor into `dir`, where
/// `uid` can run them; returns the worker's copy.
fn as_user(uid: u32, dir: &Path, owned: &[&Path]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let worker = dir.join("trajectory-worker");
    std::fs::copy(WORKER, &worker).unwrap();
    let executor = trajectory_worker::tools::sandbox::find_executor();
    std::fs::copy(&executor, dir.join("trajectory-executor"))
        .unwrap_or_else(|e| panic!("copying {}: {e}", executor.display()));
    for root in owned {
        for entry in walkdir::WalkDir::new(root).into_iter().flatten() {
            std::os::unix::fs::chown(entry.path(), Some(uid), Some(uid)).unwrap();
        }
    }
    worker
}

/// A tool directory (`--tool-dir`) holding `bin/probe-tool`, which every probe's run names, so
/// that each probe holds with the setting in use; outside the storage, removed on drop.
struct ToolDir(tempfile::TempDir);

/// What `probe-tool` prints.
const PROBE_TOOL_SAYS: &str = "tool-dir-in-use";

impl ToolDir {
    fn new() -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let tool = bin.join("probe-tool");
        std::fs::write(&tool, format!("#!/bin/sh\necho {PROBE_TOOL_SAYS}\n")).unwrap();
        for path in [dir.path(), &bin, &tool] {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Self(dir)
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

/// `worker` (the worker binary, or what runs it) told to run the fixture's run locally, its
/// workspaces beside the storage, with `tools` open to the commands.
fn local_run(mut worker: Command, fixture: &RunFixture, tools: &ToolDir) -> Command {
    worker
        .arg("local")
        .arg(fixture.run_file())
        .arg("--no-progress-bar")
        .arg("--workspace-root")
        .arg(fixture.workspaces())
        .arg("--tool-dir")
        .arg(tools.path());
    worker
}

/// Processes whose command line holds `marker` (a zombie's is empty, but only a live parent can
/// keep a zombie, and every process of the run has ended).
fn processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(marker) {
            found.push(format!("{}: {cmdline}", entry.file_name().display()));
        }
    }
    found
}

/// The escape attempts, the same for both variants; each index is named where it is judged.
fn escape_attempts(
    variant: &str,
    probe_dir: &Path,
    sibling: &Path,
    key_file: &Path,
) -> Vec<String> {
    let dataset = probe_dir.join("datasets/prompts.jsonl");
    vec![
        // 0: the worker's environment through /proc, as the issue's user did.
        format!("{WORKER_PID}; tr '\\0' '\\n' < /proc/$W/environ; echo status=$?"),
        // 1: every process's environment.
        "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; echo scanned".to_owned(),
        // 2: the command's own environment.
        "env".to_owned(),
        // 3: the worker's memory.
        format!("{WORKER_PID}; head -c 64 /proc/$W/mem >/dev/null; echo status=$?"),
        // 4: the worker's command line: readable, and without a secret.
        format!("{WORKER_PID}; tr '\\0' ' ' < /proc/$W/cmdline; echo"),
        // 5: reading the dataset.
        format!("cat {}; echo status=$?", dataset.display()),
        // 6: changing the dataset, directly and through the worker's cwd link.
        format!(
            "echo hacked >> {}; echo direct=$?; {WORKER_PID}; echo hacked >> /proc/$W/cwd/{}; \
             echo via_cwd=$?",
            dataset.display(),
            dataset.display()
        ),
        // 7: another conversation's workspace, read and written.
        format!(
            "cat {0}/notes.txt; echo read=$?; echo overwritten > {0}/notes.txt; echo write=$?",
            sibling.display()
        ),
        // 8: the key file (a mounted Secret).
        format!("cat {}; echo status=$?", key_file.display()),
        // 9: processes that try to outlive the conversation.
        {
            let [a, b, c, d] = markers(variant);
            format!(
                "setsid sleep {a} & nohup sleep {b} >/dev/null 2>&1 & (sleep {c} &) & \
                 setsid -f sleep {d}; echo spawned"
            )
        },
        // 10: the workspace itself works as before.
        "echo made > mine.txt && cat mine.txt && echo $HOME $TMPDIR".to_owned(),
        // 11: who the commands run as.
        "id -u".to_owned(),
        // 12: the run's tool directory is open to the commands, on their PATH.
        "probe-tool".to_owned(),
    ]
}

/// The command-line markers (`sleep` durations) of probe 9's processes; distinct per variant, as
/// the variants run at the same time.
fn markers(variant: &str) -> [String; 4] {
    let base = match variant {
        "off" => 987_710,
        "nonroot" => 987_810,
        _ => 987_610,
    };
    [1, 2, 3, 4].map(|n| (base + n).to_string())
}

/// No process of probe 9 is left on the machine once the run has ended.
fn assert_nothing_outlived_the_conversation(variant: &str) {
    let left: Vec<String> = markers(variant)
        .iter()
        .flat_map(|marker| processes_with(marker))
        .collect();
    assert!(
        left.is_empty(),
        "processes outlived the conversation: {left:?}"
    );
}

/// The judgements that hold with and without Landlock: they rest on the cleared environment,
/// the non-dumpable worker and the executor's reaping.
fn assert_layers_beside_landlock_hold(probe: &Probe) {
    probe.assert_key_leaked_nowhere();
    assert!(
        probe.output(0).contains("Permission denied"),
        "{}",
        probe.output(0)
    );
    assert!(probe.output(1).ends_with("scanned"), "{}", probe.output(1));
    let env = probe.output(2);
    assert!(env.contains("TERM=dumb") && env.contains("PATH="), "{env}");
    assert!(!env.contains(env::MODEL_API_KEY), "{env}");
    assert!(probe.output(3).contains("status=1"), "{}", probe.output(3));
    assert!(
        probe.output(4).contains("trajectory-worker"),
        "{}",
        probe.output(4)
    );
    assert!(probe.output(9).contains("spawned"), "{}", probe.output(9));
    assert_nothing_outlived_the_conversation(&probe.landlock);
    let ws = probe.output(10);
    assert!(ws.starts_with("made\n"), "{ws}");
    assert_eq!(probe.output(12), PROBE_TOOL_SAYS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escape_attempts_fail_under_landlock_and_the_key_leaks_nowhere() {
    let probe = Probe::run("required").await;
    assert!(
        probe.worker_output.contains("confined by Landlock"),
        "the worker says whether Landlock confines the commands:\n{}",
        probe.worker_output
    );
    assert_layers_beside_landlock_hold(&probe);
    let original = probe.fixture.dataset();
    let dataset = probe.dataset_text();
    assert!(
        !dataset.contains("hacked"),
        "the dataset was changed: {dataset}"
    );
    for (index, denied) in [(5, "status=1"), (8, "status=1")] {
        let output = probe.output(index);
        assert!(
            output.contains("Permission denied") && output.contains(denied),
            "probe {index}: {output}"
        );
    }
    assert!(
        !probe.output(5).contains("task number"),
        "{}",
        probe.output(5)
    );
    assert!(probe.output(6).contains("direct=1"), "{}", probe.output(6));
    assert!(probe.output(6).contains("via_cwd=1"), "{}", probe.output(6));
    let sibling = probe.output(7);
    assert!(
        sibling.contains("read=1") && sibling.contains("write=1"),
        "{sibling}"
    );
    assert_eq!(
        std::fs::read_to_string(probe.sibling.join("notes.txt")).unwrap(),
        "sibling-private\n"
    );
    assert!(original.exists());
}

/// What a kernel without Landlock looks like (`--landlock off`): the storage, the sibling's
/// workspace and the key file are open to the commands — the layers beside Landlock still keep
/// the environment, the worker's memory and the processes in check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_landlock_the_storage_and_the_siblings_are_open_but_the_other_layers_hold() {
    let probe = Probe::run("off").await;
    assert!(
        probe.worker_output.contains("Landlock is off"),
        "{}",
        probe.worker_output
    );
    // The key file is readable without Landlock, so the key reaches the tool result: only the
    // other judgements are shared.
    assert!(probe.output(8).contains(KEY), "{}", probe.output(8));
    assert!(
        probe.output(0).contains("Permission denied"),
        "{}",
        probe.output(0)
    );
    assert!(!probe.output(2).contains(KEY));
    assert!(probe.output(3).contains("status=1"), "{}", probe.output(3));
    assert_nothing_outlived_the_conversation(&probe.landlock);
    assert!(
        probe.output(5).contains("task number 0"),
        "{}",
        probe.output(5)
    );
    assert!(probe.dataset_text().contains("hacked"));
    assert!(
        probe.output(7).contains("sibling-private"),
        "{}",
        probe.output(7)
    );
    assert_eq!(
        std::fs::read_to_string(probe.sibling.join("notes.txt")).unwrap(),
        "overwritten\n"
    );
}

/// As a non-root uid (nobody, 65534), with Landlock off: the worker's non-dumpable flag alone
/// refuses its environment and memory to the commands, which run as the same uid. (As root, the
/// dropped capabilities refuse them first, so the other variants do not show this layer alone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn as_a_non_root_uid_the_non_dumpable_worker_alone_keeps_its_environment_and_memory() {
    const NOBODY: u32 = 65534;
    assert!(
        // /proc/self belongs to the process's effective uid.
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0,
        "this test switches to uid {NOBODY} and so must start as root (CI and the test suite do)"
    );
    let probe = Probe::run_as("off", Some(NOBODY)).await;
    assert_eq!(
        probe.output(11),
        format!("{NOBODY}"),
        "the commands ran as nobody"
    );
    assert!(
        probe.output(0).contains("Permission denied") && probe.output(0).contains("status=1"),
        "the worker's environ: {}",
        probe.output(0)
    );
    assert!(probe.output(3).contains("status=1"), "{}", probe.output(3));
    assert!(!probe.output(1).contains(KEY), "{}", probe.output(1));
    assert!(
        !probe.output(2).contains(env::MODEL_API_KEY),
        "{}",
        probe.output(2)
    );
    assert_nothing_outlived_the_conversation(&probe.landlock);
}

/// Limits, through the real worker: four conversations at once, three of them a fork bomb, a
/// memory hog and a disk filler, the fourth ordinary work. Each offender gets a tool error naming
/// its limit and its conversation goes on; the ordinary one completes as if alone; the worker
/// finishes the run; nothing is left running.
#[tokio::test]
async fn a_fork_bomb_a_memory_hog_and_a_disk_filler_stop_only_their_own_conversation() {
    let bomb = "f(){ if [ $1 -lt 9 ]; then f $(($1+1)) & f $(($1+1)) & fi; sleep 987801; }; f 0";
    let hog = "for i in 1 2 3 4; do head -c 2G /dev/zero | tail & done; wait";
    let filler = "for i in $(seq 100); do head -c 4M /dev/zero > f$i; done";
    let ordinary = "for i in $(seq 20); do echo $i > n$i; sleep 0.1; done; cat n* | wc -l";
    let server = ScriptedServer::start_with_default([], Step::ok(text_reply("done"))).await;
    // One first reply per conversation; which conversation gets which does not matter.
    for command in [bomb, hog, filler, ordinary] {
        let arguments = Value::String(json!({ "command": command }).to_string());
        server.push(Step::ok(tool_calls_reply(&[("terminal", arguments)])));
    }
    let fixture = RunFixture::new(&server.base_url(), 4)
        .with("/concurrency", json!(4))
        .with(
            "/sandbox",
            json!({"limits": {"processes": 64, "memoryBytes": 256 << 20, "workspaceBytes": 64 << 20}}),
        );
    let started = std::time::Instant::now();
    let tools = ToolDir::new();
    let child = local_run(Command::new(WORKER), &fixture, &tools)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the worker binary starts");
    let output = tokio::time::timeout(std::time::Duration::from_secs(120), wait(child))
        .await
        .expect("the run ends within two minutes");
    let took = started.elapsed();
    assert!(
        output.status.success(),
        "the run failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("the run took {took:?}");

    let mut results: Vec<String> = server
        .requests()
        .iter()
        .flat_map(|request| {
            request.body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|message| message["role"] == "tool")
                .map(|message| message["content"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    results.sort();
    results.dedup();
    assert_eq!(results.len(), 4, "{results:#?}");
    let error_of = |limit: &str| {
        results
            .iter()
            .filter_map(|content| serde_json::from_str::<Value>(content).ok())
            .filter_map(|result| result["error"].as_str().map(str::to_owned))
            .find(|error| error.contains(&format!("the sandbox's {limit} limit")))
            .unwrap_or_else(|| panic!("no {limit} limit error in {results:#?}"))
    };
    assert!(error_of("process").contains("(64 processes"));
    assert!(error_of("memory").contains("(256 MiB"));
    assert!(error_of("workspace").contains("(64 MiB"));
    assert!(
        results
            .iter()
            .any(|content| content == r#"{"output":"20","exit_code":0,"error":null}"#),
        "the ordinary conversation: {results:#?}"
    );
    // Every conversation went on after its tool result, to its final answer.
    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 4, "{records:#?}");
    let left = processes_with("987801");
    assert!(left.is_empty(), "processes outlived the run: {left:?}");
}

/// The markers (`sleep` durations) of the background-job probe's would-be survivors, and of the
/// neighbour's job.
const JOB_SURVIVORS: &str = "98791";
const NEIGHBOUR_JOB: &str = "987921";

/// What the neighbour of the background-job probe keeps to itself.
const NEIGHBOUR_SECRET: &str = "neighbour-private-3e9d";
const NEIGHBOUR_TOKEN: &str = "tok-81b7c2e4";

/// The attacking conversation's background job: would-be survivors (`setsid`, `nohup`, a double
/// fork, `setsid -f`, a daemon: Debian's `python3`, which Landlock lets run); reads and writes outside its workspace (the dataset, a planted
/// sibling's workspace, the key file, `/tmp`) and of the worker's environment; and, once the
/// neighbour conversation's job runs, reads of its environment, directory, memory and files, a
/// write into its output and a `SIGKILL`.
fn attack_job(dataset: &Path, sibling: &Path, key_file: &Path, planted: &Path) -> String {
    format!(
        r#"m={JOB_SURVIVORS}
setsid sleep ${{m}}1 &
nohup sleep ${{m}}2 >/dev/null 2>&1 &
( (sleep ${{m}}3 &) & )
setsid -f sleep ${{m}}4
/usr/bin/python3 -c 'import os, sys
if os.fork(): sys.exit()
os.setsid()
if os.fork(): sys.exit()
os.chdir("/")
os.closerange(0, 3)
os.execvp("sleep", ["sleep", sys.argv[1]])' ${{m}}5
{WORKER_PID}
echo "worker_environ=[$(tr '\0' ' ' < /proc/$W/environ 2>&1)]"
echo "dataset=[$(cat {dataset} 2>&1)]"
(echo hacked >> {dataset}) 2>/dev/null && echo wrote=dataset
echo "sibling=[$(cat {sibling}/notes.txt 2>&1)]"
(echo overwritten > {sibling}/notes.txt) 2>/dev/null && echo wrote=sibling
echo "key=[$(cat {key_file} 2>&1)]"
(echo x > {planted}) 2>/dev/null && echo wrote=outside
n=
for i in $(seq 600); do
  n=$(grep -a -l '{}[{}]' /proc/[0-9]*/cmdline 2>/dev/null | head -n 1 | cut -d/ -f3)
  [ -n "$n" ] && break
  sleep 0.1
done
echo "neighbour=[$n]"
echo "environ=[$(tr '\0' ' ' < /proc/$n/environ 2>&1)]"
echo "cwd=[$(ls /proc/$n/cwd/ 2>&1)]"
echo "secret=[$(cat /proc/$n/cwd/secret.txt 2>&1)]"
echo "mem=[$(head -c 16 /proc/$n/mem 2>&1 | od -c | head -n 1)]"
echo "siblings=[$(cat ../*/secret.txt 2>&1)]"
echo "fd=[$( (echo injected > /proc/$n/fd/1) 2>&1; echo $?)]"
echo "signal=[$(kill -KILL $n 2>&1; echo $?)]"
sleep 1
echo "running=$(grep -a -l "${{m}}[1-5]" /proc/[0-9]*/cmdline 2>/dev/null | wc -l)"
echo attack-done"#,
        &NEIGHBOUR_JOB[..5],
        &NEIGHBOUR_JOB[5..],
        dataset = dataset.display(),
        sibling = sibling.display(),
        key_file = key_file.display(),
        planted = planted.display(),
    )
}

/// The tool results of the conversation of prompt `task`, in call order, from what it last sent
/// the model.
fn results_of(server: &ScriptedServer, task: u64) -> Vec<Value> {
    let prompt = format!("task number {task}");
    server
        .requests()
        .iter()
        .rfind(|request| {
            request.body["messages"]
                .as_array()
                .is_some_and(|m| m.iter().any(|m| m["content"] == prompt.as_str()))
        })
        .map(|request| {
            request.body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|message| message["role"] == "tool")
                .map(|message| serde_json::from_str(message["content"].as_str().unwrap()).unwrap())
                .collect()
        })
        .unwrap_or_default()
}

/// Which prompt a request is of, and how many tool results it carries.
fn turn_of(body: &Value) -> (u64, usize) {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let task = first_user_message(body)
        .strip_prefix("task number ")
        .and_then(|number| number.trim().parse().ok())
        .unwrap_or(u64::MAX);
    let tools = messages.iter().filter(|m| m["role"] == "tool").count();
    (task, tools)
}

/// The `session_id` a background job's start returned, in the tool result `index` of the
/// conversation whose request is `body`.
fn job_of(body: &Value, index: usize) -> String {
    body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "tool")
        .nth(index)
        .and_then(|m| serde_json::from_str::<Value>(m["content"].as_str()?).ok())
        .and_then(|result| result["session_id"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn call(name: &str, arguments: &Value) -> Value {
    tool_calls_reply(&[(name, Value::String(arguments.to_string()))])
}

/// The attacker's results (its job's start, then its `wait`): every attempt ran, and none
/// succeeded.
fn assert_the_attack_failed(attacker: &[Value]) {
    assert_eq!(attacker.len(), 2, "{attacker:#?}");
    let attack = attacker[1]["output"].as_str().unwrap_or_default();
    eprintln!("the attacker's job:\n{attack}");
    assert_eq!(attacker[1]["status"], "exited", "{:#}", attacker[1]);
    assert!(attack.contains("attack-done"), "{attack}");
    assert!(
        attack.contains("running=5"),
        "every would-be survivor started: {attack}"
    );
    assert!(
        !attack.contains("neighbour=[]"),
        "never saw the neighbour's job: {attack}"
    );
    assert!(!attack.contains("wrote="), "{attack}");
    assert!(
        attack.contains("worker_environ=[") && attack.contains("Permission denied"),
        "{attack}"
    );
    assert!(
        !attack.contains("task number"),
        "the dataset was read: {attack}"
    );
    assert!(!attack.contains("sibling-private"), "{attack}");
    assert!(!attack.contains("signal=[0]"), "{attack}");
    for secret in [KEY, NEIGHBOUR_SECRET, NEIGHBOUR_TOKEN] {
        assert!(
            !attacker
                .iter()
                .any(|result| result.to_string().contains(secret)),
            "the attacker saw {secret}: {attack}"
        );
    }
}

/// The model of the background-job probe: the attacker (prompt 0) starts `attack` as a job and
/// waits for it; the neighbour (prompt 1) writes its secret, exports its token, starts its own
/// job, works for a while, then polls its job.
async fn spying_model(attack: Arc<OnceLock<String>>) -> ScriptedServer {
    ScriptedServer::start_responding(move |body| {
        Step::ok(match turn_of(body) {
            (0, 0) => call(
                "terminal",
                &json!({"command": attack.get().unwrap(), "background": true}),
            ),
            (0, 1) => call(
                "process",
                &json!({"action": "wait", "session_id": job_of(body, 0), "timeout": 120}),
            ),
            (1, 0) => call(
                "terminal",
                &json!({"command": format!(
                    "echo {NEIGHBOUR_SECRET} > secret.txt && export NEIGHBOUR_TOKEN={NEIGHBOUR_TOKEN}"
                )}),
            ),
            (1, 1) => call(
                "terminal",
                &json!({"command": format!("exec sleep {NEIGHBOUR_JOB}"), "background": true}),
            ),
            // Long enough for the attacker's job, which waits for this one's.
            (1, 2) => call(
                "terminal",
                &json!({"command": "sleep 15; ls; cat secret.txt; echo token=$NEIGHBOUR_TOKEN"}),
            ),
            (1, 3) => call(
                "process",
                &json!({"action": "poll", "session_id": job_of(body, 1)}),
            ),
            _ => text_reply("done"),
        })
    })
    .await
}

/// Background jobs, through the real worker under Landlock, that try to outlive their
/// conversation, escape its workspace or spy on a neighbour conversation running at the same
/// time: none succeeds. Judged from the outside: the key is nowhere, the dataset, the planted
/// sibling's notes and the neighbour's files are as they were, nothing was written outside the
/// workspace, the neighbour's job ran on untouched, and once the run has ended no process of
/// either conversation is left on the machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_jobs_that_try_to_outlive_escape_or_spy_fail_under_landlock() {
    let secrets = tempfile::tempdir().unwrap();
    let key_file = secrets.path().join("api-key");
    std::fs::write(&key_file, KEY).unwrap();
    let planted = secrets.path().join("planted");
    let attack: Arc<OnceLock<String>> = Arc::default();
    let server = spying_model(Arc::clone(&attack)).await;
    let fixture = RunFixture::new(&server.base_url(), 2)
        .with("/concurrency", json!(2))
        .with(
            "/agent",
            json!({"maxTurns": 12, "promptTimeoutSeconds": 180}),
        );
    let sibling = fixture.workspaces().join("conversation-sibling");
    std::fs::create_dir_all(&sibling).unwrap();
    std::fs::write(sibling.join("notes.txt"), "sibling-private\n").unwrap();
    let dataset_before = std::fs::read_to_string(fixture.dataset()).unwrap();
    attack
        .set(attack_job(
            &fixture.dataset(),
            &sibling,
            &key_file,
            &planted,
        ))
        .unwrap();
    let tools = ToolDir::new();
    let child = local_run(Command::new(WORKER), &fixture, &tools)
        .arg("--landlock")
        .arg("required")
        .env(env::MODEL_API_KEY, KEY)
        .env(env::MODEL_API_KEY_FILE, &key_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the worker binary starts");
    let output = tokio::time::timeout(std::time::Duration::from_secs(180), wait(child))
        .await
        .expect("the run ends within three minutes");
    let worker_output = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "the run failed:\n{worker_output}");
    assert_eq!(server.request_count(), 3 + 5, "no turn lost or redone");
    assert_eq!(fixture.lines("trajectories.jsonl").len(), 2);

    // Nothing outlived the conversations: not the would-be survivors, not the neighbour's job.
    let left: Vec<String> = (1..=5)
        .map(|n| format!("{JOB_SURVIVORS}{n}"))
        .chain([NEIGHBOUR_JOB.to_owned()])
        .flat_map(|marker| processes_with(&marker))
        .collect();
    assert!(
        left.is_empty(),
        "processes outlived the conversation: {left:?}"
    );

    assert_the_attack_failed(&results_of(&server, 0));
    assert!(!worker_output.contains(KEY), "{worker_output}");
    assert_eq!(
        std::fs::read_to_string(fixture.dataset()).unwrap(),
        dataset_before
    );
    assert_eq!(
        std::fs::read_to_string(sibling.join("notes.txt")).unwrap(),
        "sibling-private\n"
    );
    assert!(!planted.exists(), "written outside the workspace");

    // The neighbour's files, token and job are as it left them.
    let neighbour = results_of(&server, 1);
    assert_eq!(neighbour.len(), 4, "{neighbour:#?}");
    assert_eq!(
        neighbour[2]["output"],
        format!("secret.txt\n{NEIGHBOUR_SECRET}\ntoken={NEIGHBOUR_TOKEN}"),
        "{neighbour:#?}"
    );
    assert_eq!(neighbour[3]["status"], "running", "{:#}", neighbour[3]);
    assert_eq!(neighbour[3]["output_preview"], "", "{:#}", neighbour[3]);
}
