//! Golden tests of the terminal toolset against hermes-agent 0.19.0: every scenario recorded from
//! the reference's `terminal` and `process` tools (`golden/hermes-0.19.0/`, see its README) is
//! replayed call for call against ours, under the real executor, and the results are compared as
//! JSON values: exactly where the reference's result does not depend on the run, by keys and value
//! types where it does (session ids, pids, uptimes, start times). Where we differ on purpose, the
//! difference is asserted as such, with the reason; `docs/tools/terminal.md` lists them
//! ("Differences from the reference").

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::tools::{Tool, ToolContext, file, terminal};

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/hermes-0.19.0");

/// Where the reference's commands ran (its `TERMINAL_CWD`); our workspace stands in for it.
const REFERENCE_WORK: &str = "/tmp/hermes-golden/work";

/// Lines the reference's background jobs print because it starts them as `bash -lic` without a
/// terminal (job control refused at the start, `logout` at the end). Ours start no login shell and
/// print neither; they are dropped from the reference's outputs before comparing.
const NOISE: [&str; 2] = ["bash: no job control in this shell", "logout"];

/// Keys whose values depend on the run: compared by type and form, not value.
const RUN_DEPENDENT: [&str; 3] = ["pid", "uptime_seconds", "started_at"];

/// One recorded call and the result the reference returned.
struct Step {
    tool: String,
    args: Value,
    result: Value,
}

/// The recorded calls of scenario `name`, in order.
fn scenario(name: &str) -> Vec<Step> {
    let path = format!("{GOLDEN}/{name}.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{path}: {err}"));
    let recorded: Value = serde_json::from_str(&text).unwrap();
    let calls = match recorded.get("steps") {
        Some(Value::Array(steps)) => steps.clone(),
        _ => vec![recorded],
    };
    calls
        .into_iter()
        .map(|step| Step {
            tool: step["call"]["tool"].as_str().unwrap().to_owned(),
            args: step["call"]["args"].clone(),
            result: serde_json::from_str(step["result"].as_str().unwrap())
                .expect("the recorded result is JSON"),
        })
        .collect()
}

/// Applies `change` to every string in `value`.
fn map_strings(value: &Value, change: &dyn Fn(&str) -> String) -> Value {
    match value {
        Value::String(text) => Value::String(change(text)),
        Value::Array(items) => Value::Array(items.iter().map(|v| map_strings(v, change)).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, v)| (key.clone(), map_strings(v, change)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// `text` without the reference's [`NOISE`] lines.
fn without_noise(text: &str) -> String {
    let kept: String = text
        .split_inclusive('\n')
        .filter(|line| !NOISE.contains(&line.trim_end_matches('\n')))
        .collect();
    if text.ends_with('\n') {
        kept
    } else {
        kept.strip_suffix('\n').unwrap_or(&kept).to_owned()
    }
}

/// The outputs in `value` (`output`, `output_preview`, in list entries too) without the noise.
fn drop_noise(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                match item {
                    Value::String(text) if key == "output" || key == "output_preview" => {
                        *text = without_noise(text);
                    }
                    _ => drop_noise(item),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(drop_noise),
        _ => {}
    }
}

fn is_session_id(id: &str) -> bool {
    id.strip_prefix("proc_").is_some_and(|hex| {
        hex.len() == 12 && hex.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f'))
    })
}

/// Checks a run-dependent value: the form the reference's has.
fn assert_run_value(key: &str, value: &Value, at: &str) {
    let good = match key {
        "pid" => value.as_i64().is_some_and(|pid| pid > 0),
        "uptime_seconds" => value.as_u64().is_some(),
        "started_at" => value.as_str().is_some_and(|text| {
            chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S").is_ok()
        }),
        _ => unreachable!("{key} is not run-dependent"),
    };
    assert!(good, "{at}.{key}: {value} is not of the reference's form");
}

/// Compares our result with the reference's (already mapped to our run): the same keys, the same
/// values, except run-dependent ones, which must have the same type and form.
fn assert_matches(ours: &Value, expected: &Value, at: &str) {
    match (ours, expected) {
        (Value::Object(our_map), Value::Object(their_map)) => {
            let mut our_keys: Vec<&String> = our_map.keys().collect();
            let mut their_keys: Vec<&String> = their_map.keys().collect();
            our_keys.sort();
            their_keys.sort();
            assert_eq!(
                our_keys, their_keys,
                "{at}: keys differ\nours:      {ours}\nreference: {expected}"
            );
            for (key, their_value) in their_map {
                let our_value = &our_map[key];
                if RUN_DEPENDENT.contains(&key.as_str()) {
                    assert_run_value(key, their_value, &format!("{at} (reference)"));
                    assert_run_value(key, our_value, at);
                } else {
                    assert_matches(our_value, their_value, &format!("{at}.{key}"));
                }
            }
        }
        (Value::Array(our_items), Value::Array(their_items)) => {
            assert_eq!(
                our_items.len(),
                their_items.len(),
                "{at}: lengths differ\nours:      {ours}\nreference: {expected}"
            );
            for (index, (our_item, their_item)) in our_items.iter().zip(their_items).enumerate() {
                assert_matches(our_item, their_item, &format!("{at}[{index}]"));
            }
        }
        _ => assert_eq!(ours, expected, "{at}"),
    }
}

/// One conversation replaying recorded calls: a fresh workspace, its tool context with the
/// default limits (180 s, 50,000 bytes, as the reference's defaults) and the real executor.
struct Replay {
    root: String,
    ctx: ToolContext,
    tools: Vec<Arc<dyn Tool>>,
    /// The reference's session id of each job, and ours for the same job.
    ids: HashMap<String, String>,
    /// Our pid of each of our session ids, as its start reported it.
    pids: HashMap<String, i64>,
    _dir: tempfile::TempDir,
}

impl Replay {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ctx = common::tool_context(dir.path());
        let root = ctx.workspace.root().display().to_string();
        let mut tools = terminal::tools(&ToolsSpec::default());
        tools.extend(file::tools(&ToolsSpec::default()));
        Self {
            root,
            ctx,
            tools,
            ids: HashMap::new(),
            pids: HashMap::new(),
            _dir: dir,
        }
    }

    /// A path of the reference's working directory as the same path in our workspace.
    fn local(&self, text: &str) -> String {
        text.replace(REFERENCE_WORK, &self.root)
    }

    /// Calls `tool` with `args` as the agent loop does; the result as the model receives it.
    async fn call(&self, tool: &str, args: &Value) -> Value {
        let tool = self
            .tools
            .iter()
            .find(|candidate| candidate.spec().name == tool)
            .unwrap_or_else(|| panic!("no tool {tool}"));
        let Value::Object(args) = args.clone() else {
            panic!("arguments must be an object")
        };
        let content = tool.call(args, &self.ctx).await.into_content();
        serde_json::from_str(&content).expect("a tool result is JSON")
    }

    /// The reference's strings in our run: its working directory ours, its session ids ours.
    fn mapped(&self, value: &Value) -> Value {
        map_strings(value, &|text| {
            self.ids
                .get(text)
                .cloned()
                .unwrap_or_else(|| self.local(text))
        })
    }

    /// Replays a recorded step; our result. A job's start teaches the session id map.
    async fn replay(&mut self, step: &Step) -> Value {
        let ours = self.call(&step.tool, &self.mapped(&step.args)).await;
        if let (Some(theirs), Some(id)) = (
            step.result.get("session_id").and_then(Value::as_str),
            ours.get("session_id").and_then(Value::as_str),
        ) && step.tool == "terminal"
        {
            assert!(is_session_id(theirs), "reference's {theirs}");
            assert!(is_session_id(id), "ours: {ours}");
            self.ids.insert(theirs.to_owned(), id.to_owned());
            let pid = ours["pid"].as_i64().expect("a started job has a pid");
            self.pids.insert(id.to_owned(), pid);
        }
        // A job's pid is the one its start reported, in every later result.
        if let (Some(id), Some(pid)) = (
            ours.get("session_id").and_then(Value::as_str),
            ours.get("pid").and_then(Value::as_i64),
        ) {
            assert_eq!(self.pids.get(id), Some(&pid), "{ours}");
        }
        ours
    }

    /// The reference's result of `step` as it reads in our run: paths and ids mapped, the
    /// login shell's noise dropped.
    fn expected(&self, step: &Step) -> Value {
        let mut expected = self.mapped(&step.result);
        drop_noise(&mut expected);
        expected
    }

    /// Replays scenario `name` and compares each result, after `adjust` has applied the
    /// deliberate differences of step `index` to the reference's; `pauses` are the recording
    /// harness's sleeps before a step (`_harness/`), so that jobs have run as far.
    async fn replay_scenario(
        &mut self,
        name: &str,
        pauses: &[(usize, f64)],
        mut adjust: impl FnMut(usize, &mut Value),
    ) {
        for (index, step) in scenario(name).iter().enumerate() {
            if let Some((_, seconds)) = pauses.iter().find(|(at, _)| *at == index) {
                tokio::time::sleep(Duration::from_secs_f64(*seconds)).await;
            }
            let ours = self.replay(step).await;
            let mut expected = self.expected(step);
            adjust(index, &mut expected);
            assert_matches(&ours, &expected, &format!("{name}[{index}] {}", step.args));
        }
    }

    /// Ends the conversation's shell and jobs.
    async fn close(self) {
        self.ctx.close().await;
    }
}

/// Replays a scenario whose results do not depend on the run and compares them exactly.
async fn exact(name: &str) {
    let mut replay = Replay::new();
    for (index, step) in scenario(name).iter().enumerate() {
        let ours = replay.replay(step).await;
        let expected = replay.expected(step);
        assert_eq!(ours, expected, "{name}[{index}] {}", step.args);
    }
    replay.close().await;
}

/// We offer no `notify_on_complete` and no `watch_patterns` (a batch conversation has no channel
/// to notify the model on), so a background start has no `hint` urging them.
fn without_hint(expected: &mut Value) {
    let hint = expected.as_object_mut().unwrap().remove("hint");
    assert!(
        hint.is_some(),
        "the reference's start has a hint: {expected}"
    );
}

macro_rules! exact_scenarios {
    ($($name:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                exact(stringify!($name)).await;
            }
        )*
    };
}

exact_scenarios!(
    echo_hello,
    exit_code_stderr,
    ansi_colour,
    grep_no_match,
    timeout_2s,
    timeout_2s_no_output,
    cd_persists,
    export_persists,
    workdir_is_sticky,
    workdir_blocked,
    output_without_trailing_newline,
    multiline_and_unicode,
    process_unknown_session,
    process_missing_session_id,
    process_unknown_action,
    // A fresh conversation has no jobs; the reference's empty list for another reason (its
    // filter, see `the_list_shows_the_conversations_jobs`) reads the same.
    process_list,
);

/// `workdir` names a directory the reference's earlier scenarios had made (`sub`).
#[tokio::test]
async fn workdir_arg() {
    let mut replay = Replay::new();
    std::fs::create_dir(format!("{}/sub", replay.root)).unwrap();
    replay.replay_scenario("workdir_arg", &[], |_, _| {}).await;
    replay.close().await;
}

/// A `chmod -R 777` of a directory of the workspace runs unasked, as in the reference's
/// non-interactive runs.
#[tokio::test]
async fn dangerous_command_noninteractive() {
    let mut replay = Replay::new();
    std::fs::create_dir(format!("{}/sub", replay.root)).unwrap();
    replay
        .replay_scenario("dangerous_command_noninteractive", &[], |_, _| {})
        .await;
    replay.close().await;
}

/// A `workdir` that does not exist: exit 126 and `cd`'s complaint, as the reference's. The
/// complaint's prefix names the shell and the line of the script the command ran in (the
/// reference's wrapper: `/usr/bin/bash: line 2: `), which is not ours to copy.
#[tokio::test]
async fn workdir_nonexistent() {
    let mut replay = Replay::new();
    let step = &scenario("workdir_nonexistent")[0];
    let ours = replay.replay(step).await;
    let expected = replay.expected(step);
    let complaint = "cd: /nonexistent/dir: No such file or directory";
    assert!(
        expected["output"].as_str().unwrap().ends_with(complaint),
        "{expected}"
    );
    assert!(
        ours["output"]
            .as_str()
            .is_some_and(|out| out.ends_with(complaint)),
        "{ours}"
    );
    let mut ours_without_prefix = ours.clone();
    ours_without_prefix["output"] = expected["output"].clone();
    assert_eq!(ours_without_prefix, expected, "ours: {ours}");
    replay.close().await;
}

/// Over the foreground maximum (600 s) is refused with the reference's error, less its advice to
/// add `notify_on_complete=true`, which we do not offer.
#[tokio::test]
async fn timeout_over_max() {
    let mut replay = Replay::new();
    let step = &scenario("timeout_over_max")[0];
    let ours = replay.replay(step).await;
    let mut expected = replay.expected(step);
    let message = expected["error"].as_str().unwrap().to_owned();
    assert!(
        message.contains(" with notify_on_complete=true"),
        "{message}"
    );
    expected["error"] = json!(message.replace(" with notify_on_complete=true", ""));
    assert_eq!(ours, expected);
    replay.close().await;
}

/// `seq 1 300000` (1,988,895 characters): the same head, the same notice, the whole within the
/// 50,000 budget. The reference's totals also count its own cwd marker line (79 characters,
/// cut from the tail after the notice was made); ours count exactly what the command printed.
#[tokio::test]
async fn truncation_seq_300000() {
    let mut replay = Replay::new();
    let step = &scenario("truncation_seq_300000")[0];
    let ours = replay.replay(step).await;
    let expected = replay.expected(step);
    assert_eq!(ours["exit_code"], 0, "{}", ours["error"]);
    assert_eq!(ours["error"], Value::Null);
    assert_eq!(
        ours.as_object().unwrap().len(),
        3,
        "output, exit_code, error"
    );
    let printed = (1..=300_000).fold(String::new(), |mut all, n| {
        all.push_str(&n.to_string());
        all.push('\n');
        all
    });
    let true_total = printed.chars().count();
    assert_eq!(true_total, 1_988_895);

    let notice = regex::Regex::new(
        r"\n\n\.\.\. \[OUTPUT TRUNCATED - ([0-9,]+) chars omitted out of ([0-9,]+) total\] \.\.\.\n\n",
    )
    .unwrap();
    let split = |output: &str| {
        let found = notice.captures(output).expect("a truncation notice");
        let whole = found.get(0).unwrap();
        let number = |at: usize| found[at].replace(',', "").parse::<usize>().unwrap();
        (
            output[..whole.start()].to_owned(),
            output[whole.end()..].to_owned(),
            number(1),
            number(2),
        )
    };
    let their_output = expected["output"].as_str().unwrap();
    let our_output = ours["output"].as_str().unwrap();
    let (their_head, their_tail, their_omitted, their_total) = split(their_output);
    let (our_head, our_tail, our_omitted, our_total) = split(our_output);

    assert_eq!(our_head, their_head, "the same head");
    assert_eq!(
        their_total,
        true_total + 79,
        "the reference counts its marker"
    );
    assert_eq!(
        our_total, true_total,
        "ours counts what the command printed"
    );
    assert_eq!(
        our_omitted,
        our_total - our_head.chars().count() - (our_tail.chars().count() + 1),
        "omitted = total - head - tail (the tail's final newline trimmed)"
    );
    assert_eq!(
        their_omitted,
        their_total - their_head.chars().count() - (their_tail.chars().count() + 80),
        "the reference's tail lost its marker line and final newline after counting"
    );
    assert!(printed.ends_with(&format!("{our_tail}\n")), "a true tail");
    assert!(printed.starts_with(&our_head), "a true head");
    assert!(
        our_output.len() <= 50_000,
        "{} bytes over the budget",
        our_output.len()
    );
    assert!(their_output.chars().count() <= 50_000);
    replay.close().await;
}

/// `sleep 5 &` in the foreground: the reference refuses it (its guard against `&` wrappers,
/// because its per-command `bash -c` would lose track of the job); our shell keeps a job started
/// with `&` until the conversation ends, so the command runs.
#[tokio::test]
async fn foreground_amp_guard() {
    let mut replay = Replay::new();
    let step = &scenario("foreground_amp_guard")[0];
    let started = Instant::now();
    let ours = replay.replay(step).await;
    assert_eq!(replay.expected(step)["status"], "error");
    assert_eq!(ours, json!({"output": "", "exit_code": 0, "error": null}));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the call does not wait for the job"
    );
    replay.close().await;
}

/// A server in the foreground: the reference refuses it by pattern; ours runs it as any command
/// (until its timeout: a `timeout` is added here, or the call would take the default 180 s).
#[tokio::test]
async fn foreground_server_guard() {
    let replay = Replay::new();
    let step = &scenario("foreground_server_guard")[0];
    assert_eq!(replay.expected(step)["status"], "error");
    let mut args = step.args.clone();
    args["timeout"] = json!(2);
    let ours = replay.call("terminal", &args).await;
    assert!(ours.get("status").is_none(), "not refused: {ours}");
    assert_eq!(ours["error"], Value::Null, "{ours}");
    assert_ne!(ours["exit_code"], -1, "{ours}");
    replay.close().await;
}

/// A background job: poll, log, wait until its timeout, list, kill, and the actions on a killed
/// job.
#[tokio::test]
async fn background_sleep_poll_log_wait_kill() {
    let mut replay = Replay::new();
    let root = replay.root.clone();
    let mut our_id = String::new();
    for (index, step) in scenario("background_sleep_poll_log_wait_kill")
        .iter()
        .enumerate()
    {
        match index {
            1 => tokio::time::sleep(Duration::from_secs(1)).await,
            6 => tokio::time::sleep(Duration::from_millis(500)).await,
            _ => {}
        }
        let ours = replay.replay(step).await;
        if index == 0 {
            our_id = replay.ids.values().next().cloned().unwrap();
        }
        let mut expected = replay.expected(step);
        match index {
            0 => without_hint(&mut expected),
            // The reference's log counted its noise line.
            2 => {
                assert_eq!(expected["total_lines"], 1);
                expected["total_lines"] = json!(0);
                expected["showing"] = json!("0 lines");
            }
            // The reference's `list` filters by a task id that batch runs never match (its note
            // in the recording): it returned []. Ours lists the conversation's jobs.
            4 => {
                assert_eq!(expected, json!({"processes": []}));
                expected = json!({"processes": [{
                    "session_id": our_id,
                    "command": "sleep 30",
                    "cwd": root,
                    "pid": 1,
                    "started_at": "2026-12-02T01:06:06",
                    "uptime_seconds": 0,
                    "status": "running",
                    "output_preview": "",
                }]});
            }
            _ => {}
        }
        assert_matches(&ours, &expected, &format!("step {index} {}", step.args));
    }
    replay.close().await;
}

/// A job that prints (with colour) and exits 7: poll, wait and log of a finished job.
#[tokio::test]
async fn background_finished_job() {
    let mut replay = Replay::new();
    replay
        .replay_scenario(
            "background_finished_job",
            &[(1, 1.5)],
            |index, expected| match index {
                // Started with `notify_on_complete: true`, which we do not offer (no channel to
                // notify on in a batch conversation): ignored, and not echoed back.
                0 => {
                    let echoed = expected
                        .as_object_mut()
                        .unwrap()
                        .remove("notify_on_complete");
                    assert_eq!(echoed, Some(json!(true)));
                }
                // The reference's log counts its two noise lines.
                3 => {
                    assert_eq!(expected["total_lines"], 6);
                    expected["total_lines"] = json!(4);
                    expected["showing"] = json!("4 lines");
                }
                // Lines from offset 1: the reference's line 0 is its noise line, so its
                // offset 1 is our offset 0; the same call shows ours from `line2`.
                4 => {
                    assert_eq!(expected["output"], "line1\nline2");
                    expected["output"] = json!("line2\nline3");
                    expected["total_lines"] = json!(4);
                }
                _ => {}
            },
        )
        .await;
    replay.close().await;
}

/// `cat` in the background, fed with `write` and `submit`, then `close`d. The reference gives a
/// job started without a PTY no standard input (write and submit fail; `cat` has ended at
/// once), and we offer no PTY; our jobs' standard input is a pipe, so these work as the
/// reference's PTY jobs do (`background_pty_cat_write_submit_close`), without a terminal's echo
/// and carriage returns.
#[tokio::test]
async fn background_cat_write_submit_close() {
    let pty = scenario("background_pty_cat_write_submit_close");
    let pty_results: Vec<Value> = pty.iter().map(|step| step.result.clone()).collect();
    let pty_id = pty[0].result["session_id"].as_str().unwrap().to_owned();
    let mut replay = Replay::new();
    for (index, step) in scenario("background_cat_write_submit_close")
        .iter()
        .enumerate()
    {
        match index {
            3 | 5 => tokio::time::sleep(Duration::from_millis(500)).await,
            _ => {}
        }
        let ours = replay.replay(step).await;
        let our_id = replay.ids.values().next().cloned().unwrap();
        let as_ours = |value: &Value| {
            map_strings(value, &|text| {
                if text == pty_id {
                    our_id.clone()
                } else {
                    text.to_owned()
                }
            })
        };
        let mut expected = replay.expected(step);
        match index {
            0 => without_hint(&mut expected),
            // write, submit: the reference's PTY job's results.
            1 | 2 => {
                assert_eq!(expected["status"], "error");
                expected = as_ours(&pty_results[index]);
            }
            // poll: running, with what `cat` wrote back (once: no terminal echo).
            3 => {
                assert_eq!(expected["status"], "exited");
                expected = as_ours(&pty_results[3]);
                assert_eq!(expected["output_preview"], "hello world\r\nhello world\r\n");
                expected["output_preview"] = json!("hello world\n");
            }
            // close: the reference's message for a pipe (`stdin closed`, in its source; its
            // PTY's is `EOF sent`).
            4 => {
                assert_eq!(expected["status"], "already_exited");
                assert_eq!(
                    pty_results[4],
                    json!({"status": "ok", "message": "EOF sent"})
                );
                expected = json!({"status": "ok", "message": "stdin closed"});
            }
            // wait: `cat` ended at the end of its input.
            5 => {
                expected = as_ours(&pty_results[5]);
                expected["output"] = json!("hello world\n");
            }
            _ => {}
        }
        assert_matches(&ours, &expected, &format!("step {index} {}", step.args));
    }
    replay.close().await;
}

/// The same with `pty: true`, which we do not offer (no PTY: the argument is ignored): the
/// results are the PTY job's without the terminal's echo and carriage returns, and `close`
/// says `stdin closed` rather than `EOF sent`.
#[tokio::test]
async fn background_pty_cat_write_submit_close() {
    let mut replay = Replay::new();
    replay
        .replay_scenario(
            "background_pty_cat_write_submit_close",
            &[(1, 1.0), (3, 0.5), (5, 1.0)],
            |index, expected| match index {
                0 => without_hint(expected),
                3 => expected["output_preview"] = json!("hello world\n"),
                4 => *expected = json!({"status": "ok", "message": "stdin closed"}),
                5 => expected["output"] = json!("hello world\n"),
                6 => {
                    expected["output"] = json!("hello world");
                    expected["total_lines"] = json!(1);
                    expected["showing"] = json!("1 lines");
                }
                _ => {}
            },
        )
        .await;
    replay.close().await;
}

/// `list` shows the conversation's jobs whatever the call (the reference's filters by a task id
/// its batch runs never match, and lists every job of the process without one: the second entry
/// of its recording is another scenario's job).
#[tokio::test]
async fn the_list_shows_the_conversations_jobs() {
    let mut replay = Replay::new();
    let ours_only = |expected: &mut Value, ids: &HashMap<String, String>| {
        let entries = expected["processes"].as_array_mut().unwrap();
        entries.retain(|entry| ids.values().any(|id| entry["session_id"] == *id));
    };
    let mut listed = Value::Null;
    for (index, step) in scenario("process_list_entries").iter().enumerate() {
        if index == 1 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let ours = replay.replay(step).await;
        let mut expected = replay.expected(step);
        match index {
            0 => without_hint(&mut expected),
            1 => {
                assert_eq!(expected["processes"].as_array().unwrap().len(), 2);
                ours_only(&mut expected, &replay.ids);
                assert_eq!(expected["processes"][0]["cwd"], json!(replay.root));
                listed = expected.clone();
            }
            2 => {
                assert_eq!(expected, json!({"processes": []}));
                expected = listed.clone();
            }
            _ => {}
        }
        assert_matches(&ours, &expected, &format!("step {index} {}", step.args));
    }
    replay.close().await;
}

/// A `wait` longer than the limit (the run's default timeout, 180 s, as the reference's) is
/// clamped, with the reference's note.
#[tokio::test]
async fn wait_clamped_finished() {
    let mut replay = Replay::new();
    replay
        .replay_scenario("wait_clamped_finished", &[(1, 1.0)], |index, expected| {
            if index == 0 {
                without_hint(expected);
            }
        })
        .await;
    replay.close().await;
}

#[tokio::test]
async fn background_hint_plain() {
    let mut replay = Replay::new();
    replay
        .replay_scenario("background_hint_plain", &[], |_, expected| {
            without_hint(expected);
        })
        .await;
    replay.close().await;
}

/// After `cd ftest`, the file tools' relative paths start there, as the reference's. The
/// terminal's results are the reference's; the file tools' result shapes are those of the
/// revision the file toolset follows (not 0.19.0's), so only where the file went is compared.
#[tokio::test]
async fn file_tools_relative_path() {
    let mut replay = Replay::new();
    for (index, step) in scenario("file_tools_relative_path").iter().enumerate() {
        let ours = replay.replay(step).await;
        let expected = replay.expected(step);
        match step.tool.as_str() {
            "terminal" => assert_eq!(ours, expected, "step {index}"),
            "write_file" => {
                assert_eq!(ours["bytes_written"], expected["bytes_written"], "{ours}");
                assert_eq!(
                    expected["resolved_path"],
                    json!(format!("{}/ftest/rel.txt", replay.root))
                );
                let written =
                    std::fs::read_to_string(format!("{}/ftest/rel.txt", replay.root)).unwrap();
                assert_eq!(written, "x\n");
                assert!(
                    !std::path::Path::new(&format!("{}/rel.txt", replay.root)).exists(),
                    "not at the root"
                );
            }
            "read_file" => {
                assert_eq!(ours["total_lines"], expected["total_lines"], "{ours}");
                assert!(
                    ours["content"]
                        .as_str()
                        .is_some_and(|text| text.contains("1|x")),
                    "{ours}"
                );
            }
            other => panic!("unexpected tool {other}"),
        }
    }
    replay.close().await;
}

/// Our schemas are the reference's, less what we deliberately do not offer: `pty` (no
/// terminal for jobs), `notify_on_complete` and `watch_patterns` (no channel to notify the model
/// on in a batch conversation). Descriptions that mention only what we offer are the
/// reference's word for word.
#[test]
fn schemas_are_the_references() {
    let text = std::fs::read_to_string(format!("{GOLDEN}/_schemas.json")).unwrap();
    let mut reference: Value = serde_json::from_str(&text).unwrap();
    for omitted in ["pty", "notify_on_complete", "watch_patterns"] {
        let removed = reference["terminal"]["parameters"]["properties"]
            .as_object_mut()
            .unwrap()
            .remove(omitted);
        assert!(removed.is_some(), "the reference offers {omitted}");
    }
    let ours = terminal::tools(&ToolsSpec::default());
    let names: Vec<&str> = ours.iter().map(|tool| tool.spec().name.as_str()).collect();
    assert_eq!(names, ["terminal", "process"]);
    let strip_descriptions = |schema: &Value| {
        let mut schema = schema.clone();
        if let Some(properties) = schema["properties"].as_object_mut() {
            for property in properties.values_mut() {
                property.as_object_mut().unwrap().remove("description");
            }
        }
        schema
    };
    for tool in &ours {
        let spec = tool.spec();
        let theirs = &reference[&spec.name];
        assert_eq!(theirs["name"], json!(spec.name));
        assert_eq!(
            strip_descriptions(&spec.parameters),
            strip_descriptions(&theirs["parameters"]),
            "{}: names, types, enums, defaults, minimums, required",
            spec.name
        );
        let their_properties = theirs["parameters"]["properties"].as_object().unwrap();
        for (name, property) in spec.parameters["properties"].as_object().unwrap() {
            // `background`'s description urges `notify_on_complete`, which we do not offer.
            if spec.name == "terminal" && name == "background" {
                assert!(
                    their_properties[name]["description"]
                        .as_str()
                        .unwrap()
                        .contains("notify_on_complete")
                );
                continue;
            }
            assert_eq!(
                property["description"], their_properties[name]["description"],
                "{}.{name}",
                spec.name
            );
        }
    }
    assert_eq!(
        json!(ours[1].spec().description),
        reference["process"]["description"]
    );
}
