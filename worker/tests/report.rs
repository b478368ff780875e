//! `report.html` of a real local run, opened in headless Chromium (Debian's, which the test suite
//! installs): the page loads nothing and logs nothing, every figure it draws is the run's, its
//! filters and search narrow the list, and one conversation opens with its tool calls; a
//! verified run's page shows its rewards and each verifier's verdict. Screenshots are kept in
//! cargo's test temp dir (`report/report.png`, `report/report-verified.png`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{RunFixture, local_options, no_shutdown, scripted_model, terminal};
use regex::Regex;
use serde_json::{Value, json};
use trajectory_testkit::chromium::{CHROMIUM, headless};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_call_reply};
use trajectory_worker::report::{
    Collector, Histogram, Outcome, PER_STRATUM, RecordFacts, SAMPLE_BYTES, render,
};
use trajectory_worker::run::local::run_local;

/// A word only one conversation's tool call and output contain.
const NEEDLE: &str = "needle-xyzzy";

/// Six prompts, one at a time: two that call the terminal and answer (one of them is refused
/// `/var` by the sandbox), one the server refuses (a failed record), one that calls tools until
/// it runs out of turns, and two that answer at once.
async fn run_with_every_outcome() -> (ScriptedServer, RunFixture) {
    let call = |command: &str| Step::ok(tool_call_reply("terminal", &json!({"command": command})));
    let script = vec![
        call("echo alpha; ls /var"),
        Step::ok(text_reply("done")),
        call(&format!("echo {NEEDLE}")),
        Step::ok(text_reply("done")),
        Step::error(
            400,
            "context_length_exceeded",
            "maximum context length is 10 tokens",
        ),
        call("echo one"),
        call("echo two"),
        call("echo three"),
    ];
    let server = ScriptedServer::start_with_default(script, Step::ok(text_reply("done"))).await;
    let fixture = RunFixture::new(&server.base_url(), 6)
        .with("/batchSize", json!(6))
        .with("/concurrency", json!(1));
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the run finishes");
    (server, fixture)
}

/// The DOM of `page#fragment` once its scripts ran in headless Chromium; checks that the page logged nothing (errors,
/// CSP violations and uncaught exceptions are console messages) and asked the network for
/// nothing: Chromium's net log holds every request, and a page's carry its origin (`file://`)
/// in their isolation key, unlike the browser's own background requests.
fn load(page: &Path, fragment: &str, profile: &Path) -> String {
    let net_log = profile.join("net-log.json");
    let output = headless(profile)
        .arg(format!("--log-net-log={}", net_log.display()))
        .args([
            "--dump-dom",
            &format!("file://{}#{fragment}", page.display()),
        ])
        .output()
        .unwrap_or_else(|err| {
            panic!("{CHROMIUM} cannot run ({err}): scripts/browser/install.sh installs it")
        });
    let log = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "chromium: {log}");
    let console: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(":CONSOLE"))
        .collect();
    assert_eq!(console, Vec::<&str>::new(), "the page logged (#{fragment})");
    assert_eq!(
        page_requests(&net_log),
        Vec::<String>::new(),
        "the page asked the network (#{fragment})"
    );
    String::from_utf8(output.stdout).expect("the DOM is UTF-8")
}

/// The URLs the page (not the browser) requested, from Chromium's net log.
fn page_requests(net_log: &Path) -> Vec<String> {
    let log: Value = serde_json::from_slice(&std::fs::read(net_log).expect("the net log"))
        .expect("the net log is JSON");
    let start_job = &log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"];
    assert!(
        start_job.is_u64(),
        "no URL_REQUEST_START_JOB in the net log"
    );
    log["events"]
        .as_array()
        .expect("net log events")
        .iter()
        .filter(|event| &event["type"] == start_job)
        .filter(|event| {
            event["params"]["network_isolation_key"]
                .as_str()
                .is_some_and(|key| key.starts_with("file://"))
        })
        .map(|event| event["params"]["url"].to_string())
        .collect()
}

/// `data-NAME="…"` of the first element with `data-KEY="VALUE"`.
fn attribute(dom: &str, key: &str, value: &str, name: &str) -> String {
    let element = Regex::new(&format!(
        r#"<[a-z]+ [^>]*data-{key}="{}"[^>]*>"#,
        regex::escape(value)
    ))
    .unwrap();
    let tag = element
        .find(dom)
        .unwrap_or_else(|| {
            let present: Vec<&str> = Regex::new(&format!(r#"data-{key}="[^"]*""#))
                .unwrap()
                .find_iter(dom)
                .map(|found| found.as_str())
                .collect();
            panic!("no element with data-{key}={value:?}, only {present:?}")
        })
        .as_str();
    Regex::new(&format!(r#"data-{name}="([^"]*)""#))
        .unwrap()
        .captures(tag)
        .unwrap_or_else(|| panic!("{tag} has no data-{name}"))[1]
        .to_owned()
}

/// The counts of the bars of the histogram `id`.
fn bars(dom: &str, id: &str) -> Vec<u64> {
    let start = dom
        .find(&format!(r#"id="{id}""#))
        .unwrap_or_else(|| panic!("no {id}"));
    let svg = &dom[start..start + dom[start..].find("</svg>").unwrap()];
    Regex::new(r#"<rect [^>]*data-count="(\d+)""#)
        .unwrap()
        .captures_iter(svg)
        .map(|bar| bar[1].parse().unwrap())
        .collect()
}

fn listed(dom: &str) -> usize {
    dom.matches("<tr data-id=").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_of_a_run_shows_its_numbers_and_its_conversations_in_chromium() {
    let (_server, fixture) = run_with_every_outcome().await;
    let page = fixture.out().join("report.html");
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    let counts = &statistics["counts"];
    assert_eq!(
        (
            counts["succeeded"].as_u64(),
            counts["failed"].as_u64(),
            counts["completed"].as_u64()
        ),
        (Some(5), Some(1), Some(4)),
        "{statistics}"
    );
    let html = std::fs::read_to_string(&page).expect("merge wrote report.html");
    assert!(html.contains("Content-Security-Policy\" content=\"default-src 'none'"));

    let profile = tempfile::tempdir().unwrap();
    let dom = load(&page, "", profile.path());
    assert_figures_are_the_runs(&dom, &statistics, &fixture);
    assert_eq!(listed(&dom), 6, "every record of a small run is listed");

    // Filters and search narrow the list; the state is in the address's fragment.
    for (fragment, expected) in [
        ("outcome=out+of+turns", 1),
        ("outcome=failed%3A+context_length", 1),
        ("tool=terminal", 3),
        (&format!("q={NEEDLE}"), 1),
    ] {
        assert_eq!(
            listed(&load(&page, fragment, profile.path())),
            expected,
            "#{fragment}"
        );
    }

    // One conversation opens with its tool call.
    let needle_record = fixture
        .lines("trajectories.jsonl")
        .into_iter()
        .find(|record| record.to_string().contains(NEEDLE))
        .expect("the needle's trajectory");
    let id = needle_record["id"].as_str().unwrap();
    let opened = load(&page, &format!("q={NEEDLE}&open={id}"), profile.path());
    assert!(
        opened.contains(&format!(r#"id="open-conversation" data-id="{id}""#)),
        "not opened"
    );
    assert!(
        opened.contains(r#"class="tool-call" data-name="terminal""#),
        "no tool call shown"
    );
    assert!(opened.contains(&format!("echo {NEEDLE}")));

    take_screenshot(&page, &format!("open={id}"), profile.path(), "report.png");
}

/// Every figure the page draws is the run's: its cards, the bars of its plots, its tools,
/// failure reasons and toolset combinations, against `statistics.json` and the trajectories.
fn assert_figures_are_the_runs(dom: &str, statistics: &Value, fixture: &RunFixture) {
    let counts = &statistics["counts"];
    for (stat, value) in [
        ("records", &counts["records"]),
        ("succeeded", &counts["succeeded"]),
        ("completed", &counts["completed"]),
        ("partial", &counts["partial"]),
        ("out_of_turns", &json!(1)),
        ("failed", &counts["failed"]),
        ("tokens_total", &statistics["tokens"]["total"]),
    ] {
        assert_eq!(
            attribute(dom, "stat", stat, "value"),
            value.to_string(),
            "{stat}"
        );
    }
    let trajectories = counts["succeeded"].as_u64().unwrap();
    for plot in ["plot-turns", "plot-tokens", "plot-duration"] {
        assert_eq!(bars(dom, plot).iter().sum::<u64>(), trajectories, "{plot}");
    }
    // The bars are the trajectories' own turns, bucket by bucket.
    let mut turns = std::collections::BTreeMap::<u64, u64>::new();
    for record in fixture.lines("trajectories.jsonl") {
        let bucket = Histogram::bucket_of(record["api_calls"].as_u64().unwrap());
        *turns.entry(bucket).or_default() += 1;
    }
    assert!(turns.len() > 1, "{turns:?}");
    assert_eq!(
        bars(dom, "plot-turns"),
        turns.into_values().collect::<Vec<_>>()
    );
    let terminal = &statistics["tool_statistics"]["terminal"];
    assert_eq!(
        attribute(dom, "tool", "terminal", "calls"),
        terminal["count"].to_string()
    );
    assert_eq!(
        attribute(dom, "tool", "terminal", "errors"),
        terminal["failure"].to_string()
    );
    assert_eq!(
        attribute(dom, "reason", "failed: context_length", "records"),
        "1"
    );
    assert_eq!(
        attribute(dom, "combo", "terminal+file", "conversations"),
        "5"
    );
    assert_eq!(statistics["sandbox_refusals"], json!({"/var": 1}));
    assert_eq!(attribute(dom, "prefix", "/var", "refusals"), "1");
}

/// What the model does in each task of the verified run.
fn verified_work(task: &str) -> Vec<(&'static str, Value)> {
    match task {
        "fix" | "fix again" => vec![terminal("echo 42 > answer.txt")],
        _ => vec![terminal(
            "echo 41 > answer.txt && echo the verifier reads this",
        )],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_of_a_verified_run_shows_its_rewards_and_each_verifiers_verdict() {
    let server = ScriptedServer::start_responding(scripted_model(verified_work)).await;
    let check = r#"echo "checked $(cat answer.txt)"; test "$(cat answer.txt)" = 42"#;
    let lines: Vec<String> = [
        json!({"prompt": "fix", "test": check}),
        json!({"prompt": "fix again", "test": check}),
        json!({"prompt": "miss", "test": check}),
        json!({"prompt": "absent", "verify": "./run_tests.sh"}),
        json!({"prompt": "unverified"}),
    ]
    .iter()
    .map(Value::to_string)
    .collect();
    // Priced too: the page shows what the run cost (USD per million tokens).
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/model/pricing", json!({"input": 3.0, "output": 15.0}));
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the run finishes");
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    let verification = &statistics["verification"];
    assert_eq!(
        (
            verification["verified"].as_u64(),
            verification["passed"].as_u64()
        ),
        (Some(4), Some(2)),
        "{statistics}"
    );
    let page = fixture.out().join("report.html");
    let profile = tempfile::tempdir().unwrap();
    let dom = load(&page, "", profile.path());
    assert_verification_figures_are_the_runs(&dom, &statistics);
    assert!(
        statistics.get("sandbox_refusals").is_none() && !dom.contains("data-prefix="),
        "a run the sandbox refused nothing shows no refusals"
    );
    for (fragment, expected) in [("reward=1", 2), ("reward=0", 2), ("reward=not+verified", 1)] {
        assert_eq!(
            listed(&load(&page, fragment, profile.path())),
            expected,
            "#{fragment}"
        );
    }
    // A conversation opens with its verifier's verdict and the end of its output.
    let missed = fixture
        .lines("trajectories.jsonl")
        .into_iter()
        .find(|record| record["conversations"][1]["value"] == "miss")
        .expect("the missed task's trajectory");
    let id = missed["id"].as_str().unwrap();
    let opened = load(&page, &format!("open={id}"), profile.path());
    assert!(
        opened.contains(r#"data-from="verifier" data-passed="false" data-reward="0""#),
        "no verdict shown"
    );
    assert!(opened.contains("checked 41"), "no verifier output shown");
    let absent = fixture
        .lines("trajectories.jsonl")
        .into_iter()
        .find(|record| record["conversations"][1]["value"] == "absent")
        .expect("the absent verifier's trajectory");
    let error = absent["verification"]["error"].as_str().unwrap();
    let opened = load(
        &page,
        &format!("open={}", absent["id"].as_str().unwrap()),
        profile.path(),
    );
    assert!(
        opened.contains(&format!(r#"<pre class="verifier-error">{error}</pre>"#)),
        "the verifier's error is not shown: {error}"
    );
    take_screenshot(
        &page,
        &format!("open={id}"),
        profile.path(),
        "report-verified.png",
    );
}

/// The verification cards, the rewards' bars, the pass rate per toolsets and the cost cards of
/// a verified, priced run's page are its `statistics.json`'s.
fn assert_verification_figures_are_the_runs(dom: &str, statistics: &Value) {
    let verification = &statistics["verification"];
    for stat in [
        "verified",
        "passed",
        "pass_rate",
        "mean_reward",
        "verifier_errors",
        "below_reward",
    ] {
        let shown: f64 = attribute(dom, "stat", stat, "value").parse().unwrap();
        assert_eq!(Some(shown), verification[stat].as_f64(), "{stat}");
    }
    let cost = &statistics["cost"];
    assert!(cost["total"].as_f64().unwrap() > 0.0, "{statistics}");
    for (stat, field) in [
        ("cost_total", "total"),
        ("cost_per_trajectory", "per_trajectory"),
    ] {
        let shown: f64 = attribute(dom, "stat", stat, "value").parse().unwrap();
        assert_eq!(Some(shown), cost[field].as_f64(), "{stat}");
    }
    // The rewards' bars are the statistics' counts, value by value.
    let counts = verification["reward"]["counts"].as_object().unwrap();
    assert_eq!(counts.len(), 2, "{counts:?}");
    assert_eq!(
        bars(dom, "plot-reward"),
        [&counts["0"], &counts["1"]].map(|count| count.as_u64().unwrap())
    );
    let drawn = &verification["by_toolsets_drawn"]["terminal+file"];
    for (column, field) in [("pass-rate", "pass_rate"), ("verified", "verified")] {
        let shown: f64 = attribute(dom, "drawn", "terminal+file", column)
            .parse()
            .unwrap();
        assert_eq!(Some(shown), drawn[field].as_f64(), "{column}");
    }
}

/// A screenshot of `page#fragment`, kept in cargo's test temp dir.
fn take_screenshot(page: &Path, fragment: &str, profile: &Path, name: &str) {
    let shot = screenshot_path(name);
    let output = headless(profile)
        .args([
            "--hide-scrollbars",
            "--window-size=1400,1700",
            &format!("--screenshot={}", shot.display()),
            &format!("file://{}#{fragment}", page.display()),
        ])
        .output()
        .unwrap();
    assert_succeeded(&output);
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    eprintln!("screenshot: {}", shot.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_command_writes_the_same_page_from_the_outputs() {
    let (_server, fixture) = run_with_every_outcome().await;
    let page = fixture.out().join("report.html");
    let merged = std::fs::read_to_string(&page).unwrap();
    std::fs::remove_file(&page).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_trajectory-worker"))
        .arg("report")
        .arg(fixture.out())
        .output()
        .unwrap();
    assert_succeeded(&output);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        page.display().to_string()
    );
    // The same records, histograms and sample: only the page's place in time could differ, and
    // it comes from statistics.json, which both read.
    assert_eq!(std::fs::read_to_string(&page).unwrap(), merged);
}

fn assert_succeeded(output: &std::process::Output) {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn screenshot_path(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A report of a synthetic run of a million records (94 % completed, 2 % out of turns, 2 %
/// discarded, 2 % failed, with 2-5 KB conversations): gathered as merge gathers it, its page
/// stays within the sample's budget, shows every outcome, and opens in Chromium with the run's
/// counts. Its size and the time to gather and write it are printed; docs/benchmarks.md has the
/// figures of the release build on a real merged run.
#[test]
fn the_report_of_a_million_records_stays_small_and_opens() {
    const RECORDS: u64 = 1_000_000;
    let started = std::time::Instant::now();
    let mut collected = Collector::default();
    // A JSON string's content, 48 bytes with escapes and a non-ASCII character.
    let unit = r#"a line of output with \"quotes\" and \u00fc ok\n"#;
    for index in 0..RECORDS {
        let (status, outcome) = match index % 50 {
            0 => (
                r#""status":"failed","error_class":"timeout","#,
                Outcome::Failed { class: "timeout" },
            ),
            1 => (
                r#""status":"discarded","filter":"require_reasoning","#,
                Outcome::Discarded {
                    filter: "require_reasoning",
                },
            ),
            2 => (
                "",
                Outcome::Trajectory {
                    completed: false,
                    partial: false,
                },
            ),
            _ => (
                "",
                Outcome::Trajectory {
                    completed: true,
                    partial: false,
                },
            ),
        };
        let api_calls = 1 + index % 7;
        let line = format!(
            r#"{{"prompt_index":{index},"sample":0,"id":"r-{index}",{status}"api_calls":{api_calls},"conversations":[{{"from":"system","value":"You are a function calling AI model."}},{{"from":"human","value":"Task {index}"}},{{"from":"gpt","value":"<tool_call>\n{{\"name\": \"terminal\", \"arguments\": {{\"command\": \"ls\"}}}}\n</tool_call>"}},{{"from":"tool","value":"{}"}},{{"from":"gpt","value":"done"}}],"toolsets_used":["terminal","file"]}}"#,
            unit.repeat(usize::try_from(index % 3).unwrap() * 20 + 20)
        );
        let facts = RecordFacts {
            prompt_index: index,
            sample: 0,
            outcome,
            api_calls,
            tokens: 500 + index % 5000,
            duration_ms: 300 + index % 60_000,
            tool_calls: api_calls - 1,
            tool_failures: u64::from(index % 10 == 0),
        };
        collected.add(&facts, ["terminal", "file"], line.as_bytes());
    }
    let gathered = started.elapsed();
    let statistics = json!({
        "run_name": "a-million",
        "counts": {"records": RECORDS, "succeeded": RECORDS / 50 * 48, "discarded": RECORDS / 50, "failed": RECORDS / 50},
    });
    let started = std::time::Instant::now();
    let page = render(&statistics, collected);
    let rendered = started.elapsed();
    eprintln!(
        "report of {RECORDS} records: {:.2} MiB; gathered in {gathered:?}, written in {rendered:?} (this build's)",
        page.len() as f64 / f64::from(1 << 20)
    );
    assert!(
        page.len() < SAMPLE_BYTES + (1 << 20),
        "{} bytes",
        page.len()
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("report.html");
    std::fs::write(&path, &page).unwrap();
    let dom = load(&path, "", dir.path());
    assert_eq!(
        attribute(&dom, "stat", "records", "value"),
        RECORDS.to_string()
    );
    assert_eq!(
        bars(&dom, "plot-turns").iter().sum::<u64>(),
        RECORDS / 50 * 48
    );
    // Every outcome is in the sample, as many of each as the budget allows.
    for outcome in [
        "completed",
        "out of turns",
        "discarded: require_reasoning",
        "failed: timeout",
    ] {
        let shown = listed(&load(
            &path,
            &format!("outcome={}", outcome.replace(' ', "+").replace(':', "%3A")),
            dir.path(),
        ));
        assert!((1..=PER_STRATUM).contains(&shown), "{outcome}: {shown}");
    }
}

/// A batch-priced run's page shows its rounds, how long its turns waited for their batches, the
/// calls that went live and what it saved, as `statistics.json` says: eight three-turn
/// conversations through the test kit's batch server (a test double of a provider's Batch API)
/// with a turnaround of one second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_of_a_batch_priced_run_shows_its_rounds_turnaround_and_savings() {
    use trajectory_testkit::batch_server::{BatchServer, Behaviour};
    let model = ScriptedServer::start_responding(|body| {
        let replies = body["messages"].as_array().map_or(0, |messages| {
            messages.iter().filter(|m| m["role"] == "assistant").count()
        });
        let mut reply = if replies < 2 {
            tool_call_reply("terminal", &json!({"command": "true"}))
        } else {
            text_reply("done")
        };
        reply["usage"] = json!({"prompt_tokens": 1000, "completion_tokens": 100});
        Step::ok(reply)
    })
    .await;
    let behaviour = Behaviour {
        turnaround: std::time::Duration::from_secs(1),
        ..Behaviour::default()
    };
    let batches = BatchServer::start(&model.base_url(), behaviour).await;
    let fixture = RunFixture::new(&model.base_url(), 8)
        .with("/batchSize", json!(8))
        .with("/concurrency", json!(8))
        .with(
            "/model/batch",
            json!({"baseUrl": batches.base_url(), "maxRequests": 8, "maxWaitSeconds": 1,
                   "pollSeconds": 1, "liveTailPercent": 0}),
        )
        .with("/model/pricing", json!({"input": 2.0, "output": 8.0}));
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the run finishes");
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    let batch_mode = &statistics["batch_mode"];
    assert_eq!(batch_mode["calls"], 24, "{statistics}");
    assert_eq!(batch_mode["live_calls"], 0, "{statistics}");
    assert_eq!(batch_mode["rounds_per_conversation"]["max"], 3);
    let turnaround = &batch_mode["turnaround_ms"];
    assert!(turnaround["p50"].as_u64().unwrap() >= 1000, "{turnaround}");
    // Half the standard price: $0.0028 a call at the standard tier.
    assert!((statistics["cost"]["saved"].as_f64().unwrap() - 24.0 * 0.0014).abs() < 1e-9);

    let profile = tempfile::tempdir().unwrap();
    let dom = load(&fixture.out().join("report.html"), "", profile.path());
    for (stat, value) in [
        ("batch_calls", &batch_mode["calls"]),
        ("batch_live_calls", &batch_mode["live_calls"]),
        (
            "batch_rounds_max",
            &batch_mode["rounds_per_conversation"]["max"],
        ),
        ("batch_turnaround_p50", &turnaround["p50"]),
        ("batch_turnaround_p90", &turnaround["p90"]),
        ("cost_saved", &statistics["cost"]["saved"]),
    ] {
        let shown: f64 = attribute(&dom, "stat", stat, "value").parse().unwrap();
        assert_eq!(Some(shown), value.as_f64(), "{stat}");
    }
}
