//! Sessions (protocol version 2): long-lived programs under the executor, their standard
//! streams and `DevTools` pipe carried over one connection. Each test runs both under an
//! executor the worker starts (local runs) and through a `trajectory-executor serve` of its own
//! (a generation pod's sandbox container).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::SandboxServer;
use nix::sys::signal::kill;
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use trajectory_worker::tools::sandbox::{
    Ended, LandlockMode, Limits, REFUSED_EXIT, Sandbox, Session, SessionRequest,
};

#[derive(Debug, Clone, Copy)]
enum Where {
    Local,
    Pod,
}

const PLACES: [Where; 2] = [Where::Local, Where::Pod];

/// A sandbox at `place`, with its server (for a pod) and the workspace root that server serves.
struct Place {
    sandbox: Sandbox,
    server: Option<SandboxServer>,
    root: tempfile::TempDir,
}

fn place(at: Where, landlock: LandlockMode) -> Place {
    let root = tempfile::tempdir().unwrap();
    let (sandbox, server) = match at {
        Where::Local => (common::local_sandbox(landlock), None),
        Where::Pod => {
            let server = SandboxServer::start(root.path());
            (server.sandbox(landlock), Some(server))
        }
    };
    Place {
        sandbox: sandbox.with_limits(Limits::DEFAULT),
        server,
        root,
    }
}

fn argv(list: &[&str]) -> Vec<String> {
    list.iter().map(|arg| (*arg).to_owned()).collect()
}

async fn start(place: &Place, shell: &str, env: &[(&str, &str)]) -> Session {
    let env: BTreeMap<String, String> = env
        .iter()
        .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
        .collect();
    let request = place
        .sandbox
        .session_request(argv(&["sh", "-c", shell]), env);
    place.sandbox.start_session(&request).await.unwrap()
}

/// Everything the session's standard output holds until its end.
async fn read_all(session: &mut Session) -> String {
    let mut text = String::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        session.stdio.read_to_string(&mut text),
    )
    .await
    .expect("the session ended")
    .unwrap();
    text
}

fn gone(pid: Pid) -> bool {
    kill(pid, None).is_err()
}

/// Waits until `check` holds, for at most 10 s.
async fn eventually(what: &str, check: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < until, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_connection_carries_standard_input_and_output_both_ways() {
    for at in PLACES {
        let place = place(at, LandlockMode::Auto);
        let session = start(&place, "while read line; do echo \"got $line\"; done", &[]).await;
        let (reader, mut writer) = tokio::io::split(session.stdio);
        let mut lines = BufReader::new(reader).lines();
        for n in 0..3 {
            writer.write_all(format!("{n}\n").as_bytes()).await.unwrap();
            let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(line.as_deref(), Some(format!("got {n}").as_str()), "{at:?}");
        }
        // A megabyte through and back: the frames and the queues in between keep up.
        let big = "x".repeat(1 << 20);
        let ((), echoed) = tokio::join!(
            async {
                writer.write_all(big.as_bytes()).await.unwrap();
                writer.write_all(b"\n").await.unwrap();
            },
            lines.next_line()
        );
        assert_eq!(echoed.unwrap().unwrap().len(), big.len() + 4, "{at:?}");
    }
}

#[tokio::test]
async fn the_program_gets_a_cleared_environment_the_given_variables_and_a_private_home() {
    for at in PLACES {
        let place = place(at, LandlockMode::Auto);
        let mut session = start(
            &place,
            "env; echo cwd=$(pwd); touch $HOME/mine && echo wrote",
            &[("GIVEN", "yes")],
        )
        .await;
        let text = read_all(&mut session).await;
        assert!(text.contains("GIVEN=yes"), "{at:?}: {text}");
        assert!(text.contains("wrote"), "{at:?}: {text}");
        // The test process's own environment (cargo's variables) never reaches the program.
        assert!(!text.contains("CARGO"), "{at:?}: {text}");
        let home = text
            .lines()
            .find_map(|line| line.strip_prefix("HOME="))
            .expect("HOME is set");
        assert!(text.contains(&format!("cwd={home}")), "{at:?}: {text}");
        assert_eq!(session.end.wait().await, Ended::Exited(0), "{at:?}");
        // The private directory goes with the session.
        eventually("the private directory is removed", || {
            !Path::new(home).exists()
        })
        .await;
        if let Some(server) = &place.server {
            assert!(home.starts_with(&server.sessions().display().to_string()));
        }
    }
}

#[tokio::test]
async fn landlock_keeps_the_program_to_its_private_directory_and_the_system() {
    let probe = common::local_sandbox(LandlockMode::Auto);
    let scratch = tempfile::tempdir().unwrap();
    assert!(
        probe.landlock_enforced(scratch.path()).await.unwrap(),
        "this kernel enforces Landlock (the test needs it to mean anything)"
    );
    for at in PLACES {
        let place = place(at, LandlockMode::Required);
        // Another conversation's workspace, under the very root the server serves.
        let other = place.root.path().join("c-other");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("secret.txt"), "theirs").unwrap();
        let outside = scratch.path().join("outside");
        let shell = format!(
            "cat {other}/secret.txt || echo no-read; echo x > {outside} || echo no-write; \
             ls /usr >/dev/null && echo system-read; echo y > $HOME/f && echo home-write",
            other = other.display(),
            outside = outside.display(),
        );
        let mut session = start(&place, &shell, &[]).await;
        let text = read_all(&mut session).await;
        for expected in ["no-read", "no-write", "system-read", "home-write"] {
            assert!(text.contains(expected), "{at:?}: {expected} in {text}");
        }
        assert!(!text.contains("theirs"), "{at:?}: {text}");
        assert!(!outside.exists(), "{at:?}");
    }
}

#[tokio::test]
async fn the_devtools_pipe_is_fds_3_and_4() {
    for at in PLACES {
        let place = place(at, LandlockMode::Auto);
        let mut request = place.sandbox.session_request(
            argv(&["sh", "-c", "echo ready; cat <&3 >&4"]),
            BTreeMap::new(),
        );
        request.cdp_pipe = true;
        let mut session = place.sandbox.start_session(&request).await.unwrap();
        let mut ready = [0_u8; 6];
        if let Err(err) = session.stdio.read_exact(&mut ready).await {
            session.end.wait().await;
            panic!("{at:?}: {err}: {}", session.end.stderr_tail());
        }
        assert_eq!(&ready, b"ready\n");
        let mut cdp = session.cdp.take().expect("a DevTools pipe");
        let messages = b"{\"id\":1}\0{\"id\":2}\0";
        cdp.write_all(messages).await.unwrap();
        let mut back = vec![0_u8; messages.len()];
        tokio::time::timeout(Duration::from_secs(20), cdp.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(back, messages, "{at:?}");
        // The pipe is the session's primary stream: dropping it ends the program.
        let end = session.end.clone();
        drop(cdp);
        let ended = tokio::time::timeout(Duration::from_secs(20), end.wait())
            .await
            .unwrap();
        assert_ne!(ended, Ended::Exited(0), "{at:?}");
    }
}

#[tokio::test]
async fn hanging_up_kills_the_program_and_everything_it_started() {
    for at in PLACES {
        let place = place(at, LandlockMode::Auto);
        let session = start(
            &place,
            "sleep 600 & echo $!; setsid sleep 601 & echo $!; echo $$; wait",
            &[],
        )
        .await;
        let mut lines = BufReader::new(session.stdio).lines();
        let mut pids = Vec::new();
        for _ in 0..3 {
            let line = lines.next_line().await.unwrap().unwrap();
            pids.push(Pid::from_raw(line.trim().parse().unwrap()));
        }
        assert!(pids.iter().all(|pid| !gone(*pid)), "{at:?}: all running");
        drop(lines);
        eventually("every process of the session ends", || {
            pids.iter().all(|pid| gone(*pid))
        })
        .await;
        assert!(matches!(
            session.end.wait().await,
            Ended::Exited(_) | Ended::Lost
        ));
    }
}

#[tokio::test]
async fn the_exit_code_ends_the_session_and_a_refusal_says_why() {
    for at in PLACES {
        let place = place(at, LandlockMode::Auto);
        let mut session = start(&place, "echo bye; echo oops >&2; exit 7", &[]).await;
        assert_eq!(read_all(&mut session).await, "bye\n");
        assert_eq!(session.end.wait().await, Ended::Exited(7), "{at:?}");
        assert!(session.end.stderr_tail().contains("oops"), "{at:?}");

        let request = place
            .sandbox
            .session_request(argv(&["no-such-program-here"]), BTreeMap::new());
        let session = place.sandbox.start_session(&request).await.unwrap();
        assert_eq!(session.end.wait().await, Ended::Exited(REFUSED_EXIT));
        let why = session.end.stderr_tail();
        assert!(
            why.starts_with("sandbox: cannot start") && why.contains("no-such-program-here"),
            "{at:?}: {why}"
        );
    }
}

#[tokio::test]
async fn a_session_past_its_process_limit_is_stopped() {
    for at in PLACES {
        let mut place = place(at, LandlockMode::Auto);
        place.sandbox = place.sandbox.clone().with_limits(Limits {
            processes: 8,
            ..Limits::DEFAULT
        });
        let mut session = start(&place, "for i in $(seq 40); do sleep 30 & done; wait", &[]).await;
        read_all(&mut session).await;
        assert_eq!(
            session.end.wait().await,
            Ended::Exited(trajectory_worker::tools::sandbox::LIMIT_EXIT),
            "{at:?}"
        );
        assert!(
            session.end.stderr_tail().contains("process limit"),
            "{at:?}: {}",
            session.end.stderr_tail()
        );
    }
}

/// Raw lines against the server: the version 1 command line works as before, a version it
/// does not speak (the one after this side's) is refused saying so.
#[tokio::test]
async fn the_server_speaks_versions_1_and_2_and_refuses_later_ones() {
    let root = tempfile::tempdir().unwrap();
    let server = SandboxServer::start(root.path());
    let exchange = |line: String| {
        let socket: PathBuf = server.socket();
        async move {
            let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
            stream.write_all(line.as_bytes()).await.unwrap();
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await.unwrap();
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    let command = format!(
        r#"{{"workspace":"{}","command":"echo v1","landlock":"auto","graceMs":0}}"#,
        root.path().display()
    );
    assert!(exchange(format!("{command}\n")).await.contains("v1\n"));
    let versioned = format!("{{\"version\":2,\"request\":{{\"command\":{command}}}}}\n");
    assert!(exchange(versioned).await.contains("v1\n"));
    let next = trajectory_sandbox::protocol::VERSION + 1;
    let future = exchange(format!("{{\"version\":{next},\"request\":{{}}}}\n")).await;
    assert!(
        future.contains(&format!("protocol version {next}")),
        "{future}"
    );
}

/// A session request serialises as the versioned line the protocol documents.
#[test]
fn a_session_line_is_versioned() {
    let request = SessionRequest {
        argv: argv(&["cat"]),
        env: BTreeMap::new(),
        landlock: LandlockMode::Off,
        limits: Limits::NONE,
        cdp_pipe: false,
        workspace: None,
        cwd: None,
    };
    let line = trajectory_sandbox::protocol::session_line(&request);
    let value: serde_json::Value = serde_json::from_slice(&line).unwrap();
    assert_eq!(value["version"], trajectory_sandbox::protocol::VERSION);
    assert_eq!(value["request"]["session"]["argv"][0], "cat");
}

/// What a model's command in the same sandbox sees of a session's program: its environment
/// (where an MCP server's secrets would be) must stay out of reach.
#[tokio::test]
async fn a_command_cannot_read_a_sessions_environment() {
    let root = tempfile::tempdir().unwrap();
    let server = SandboxServer::start(root.path());
    let sandbox = server.sandbox(LandlockMode::Auto);
    let marker = format!("SESSION_SECRET_{}", std::process::id());
    let request = sandbox.session_request(
        argv(&["sh", "-c", "echo $$; exec sleep 600"]),
        BTreeMap::from([(marker.clone(), "hidden-value".to_owned())]),
    );
    let session = sandbox.start_session(&request).await.unwrap();
    let mut lines = BufReader::new(session.stdio).lines();
    let pid = lines.next_line().await.unwrap().unwrap();
    let workspace = root.path().join("c1");
    std::fs::create_dir(&workspace).unwrap();
    let request = trajectory_sandbox::protocol::Request {
        workspace: workspace.display().to_string(),
        command: format!("cat /proc/{pid}/environ; echo; echo done"),
        landlock: LandlockMode::Auto,
        grace_ms: 0,
        limits: Limits::DEFAULT,
    };
    let mut output = Vec::new();
    trajectory_worker::tools::sandbox::run_in_pod(&server.socket(), &request, &mut |bytes| {
        output.extend_from_slice(bytes);
    })
    .await
    .unwrap();
    let output = String::from_utf8_lossy(&output);
    assert!(output.contains("done"), "{output}");
    assert!(!output.contains("hidden-value"), "{output}");
    assert!(output.contains("Permission denied"), "{output}");
}
