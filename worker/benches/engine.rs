//! Worker engine benchmark: throughput and client CPU of the production path (`ModelClient` +
//! `run_conversation`) against an OpenAI-compatible server with fixed latency and unbounded
//! concurrency (design §12).
//!
//! ```text
//! cargo bench -p trajectory-worker --bench engine
//! ```
//!
//! The server is the scripted test server in fixed-latency mode, run in a child process (this
//! binary re-executed with `ENGINE_BENCH_SERVER` set), so `getrusage(RUSAGE_SELF)` of this process
//! counts the client alone. Each conversation is two model calls: a tool call of a no-op tool, then
//! a final answer. For each concurrency C, C conversations warm the connection pool, then N =
//! max(ROUNDS × C, 200) conversations are timed. Knobs (environment): `ENGINE_BENCH_LATENCY_MS`
//! (100), `ENGINE_BENCH_CONCURRENCY` ("16,256,1000"), `ENGINE_BENCH_ROUNDS` (4).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use nix::sys::resource::{Resource, UsageWho, getrlimit, getrusage, setrlimit};
use nix::sys::time::TimeValLike;
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use trajectory_worker::agent::{AgentConfig, run_conversation};
use trajectory_worker::model::{ModelClient, RetryPolicy};
use trajectory_worker::scripted_server::{FixedLatency, ScriptedServer};
use trajectory_worker::tools::{Tool, ToolContext, ToolFuture, ToolLimits, ToolOutcome, ToolSpec, Workspace};

const SERVER_ENV: &str = "ENGINE_BENCH_SERVER";
const TOOL: &str = "noop";

/// A tool that does nothing, so the measurement is the engine's own overhead.
#[derive(Debug)]
struct Noop(ToolSpec);

impl Tool for Noop {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }

    fn call<'a>(&'a self, _args: Map<String, Value>, _ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async { ToolOutcome::Ok(json!({"ok": true})) })
    }
}

struct Row {
    concurrency: usize,
    conversations: usize,
    elapsed: Duration,
    cpu: Cpu,
    /// Model-call time as the client saw it, summed over all calls.
    model_time: Duration,
}

#[derive(Clone, Copy)]
struct Cpu {
    user: Duration,
    system: Duration,
}

impl Cpu {
    fn total(self) -> Duration {
        self.user + self.system
    }

    fn since(self, before: Self) -> Self {
        Self { user: self.user - before.user, system: self.system - before.system }
    }
}

fn main() -> anyhow::Result<()> {
    let latency = Duration::from_millis(env_number("ENGINE_BENCH_LATENCY_MS", 100)?);
    if std::env::var_os(SERVER_ENV).is_some() {
        return serve(latency);
    }
    let concurrencies: Vec<usize> = std::env::var("ENGINE_BENCH_CONCURRENCY")
        .unwrap_or_else(|_| "16,256,1000".into())
        .split(',')
        .map(|c| c.trim().parse().context("ENGINE_BENCH_CONCURRENCY is a comma-separated list of numbers"))
        .collect::<Result<_, _>>()?;
    raise_open_files_limit(concurrencies.iter().copied().max().unwrap_or(0))?;
    let rounds = usize::try_from(env_number("ENGINE_BENCH_ROUNDS", 4)?)?;

    let mut server = Command::new(std::env::current_exe()?)
        .env(SERVER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the server process")?;
    let mut base_url = String::new();
    BufReader::new(server.stdout.take().context("server stdout is piped")?).read_line(&mut base_url)?;
    let base_url = base_url.trim().to_owned();
    ensure!(base_url.starts_with("http://"), "the server process printed {base_url:?}, not its URL");

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let rows = runtime.block_on(async {
        let mut rows = Vec::new();
        for &concurrency in &concurrencies {
            // Whole rounds of C, so the last round is not a partial one that the ideal ignores.
            let conversations = (rounds * concurrency).max(200).div_ceil(concurrency) * concurrency;
            rows.push(measure(&base_url, concurrency, conversations).await?);
        }
        anyhow::Ok(rows)
    })?;
    drop(runtime);

    // Closing its stdin tells the server process to exit.
    drop(server.stdin.take());
    server.wait()?;
    let server_cpu = cpu_time(UsageWho::RUSAGE_CHILDREN)?;

    report(&rows, latency, server_cpu);
    Ok(())
}

async fn measure(base_url: &str, concurrency: usize, conversations: usize) -> anyhow::Result<Row> {
    let settings = trajectory_worker::model::ModelSettings {
        base_url: base_url.to_owned(),
        model: trajectory_worker::scripted_server::MODEL.to_owned(),
        api_key: None,
        max_tokens: Some(256),
        temperature: Some(0.0),
        reasoning_fields: Map::new(),
        extra_body: Map::new(),
        request_timeout: Duration::from_secs(60),
        stream: false,
        retry: RetryPolicy::default(),
    };
    let client = Arc::new(ModelClient::new(settings)?);
    let workspace = tempfile::tempdir()?;
    let ctx = Arc::new(ToolContext { workspace: Workspace::new(workspace.path())?, limits: ToolLimits::default() });
    let spec = ToolSpec {
        name: TOOL.into(),
        description: "Does nothing.".into(),
        parameters: json!({"type": "object", "properties": {}}),
    };
    let tools: Arc<[Arc<dyn Tool>]> = Arc::new([Arc::new(Noop(spec)) as Arc<dyn Tool>]);
    let config = Arc::new(AgentConfig {
        max_turns: 10,
        prompt_timeout: Duration::from_secs(120),
        ephemeral_system_prompt: Some("You are a benchmark.".into()),
    });
    let run = |count: usize| {
        let (client, ctx, tools, config) = (client.clone(), ctx.clone(), tools.clone(), config.clone());
        async move {
            let permits = Arc::new(Semaphore::new(concurrency));
            let mut tasks = JoinSet::new();
            let mut model_time = Duration::ZERO;
            for index in 0..count {
                let permit = permits.clone().acquire_owned().await?;
                let (client, ctx, tools, config) = (client.clone(), ctx.clone(), tools.clone(), config.clone());
                tasks.spawn(async move {
                    let prompt = format!("Benchmark prompt {index}: call the tool, then answer.");
                    let result = run_conversation(&client, &tools, &ctx, &prompt, &config).await;
                    drop(permit);
                    result
                });
            }
            while let Some(done) = tasks.join_next().await {
                let conversation = done??;
                ensure!(conversation.completed && conversation.api_calls == 2, "unexpected conversation shape");
                model_time += conversation.model_time;
            }
            anyhow::Ok(model_time)
        }
    };
    run(concurrency).await.context("warm-up")?;
    let cpu_before = cpu_time(UsageWho::RUSAGE_SELF)?;
    let started = Instant::now();
    let model_time = run(conversations).await?;
    let elapsed = started.elapsed();
    let cpu = cpu_time(UsageWho::RUSAGE_SELF)?.since(cpu_before);
    Ok(Row { concurrency, conversations, elapsed, cpu, model_time })
}

fn report(rows: &[Row], latency: Duration, server_cpu: Cpu) {
    let ideal = |row: &Row| row.concurrency as f64 / (2.0 * latency.as_secs_f64());
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    println!(
        "latency {} ms per call, 2 calls per conversation; client in this process, server in a child; {cores} CPUs",
        latency.as_millis()
    );
    println!();
    println!(
        "| C | conversations | elapsed s | throughput conv/s | ideal C/(2×latency) | ratio \
         | client CPU s / trajectory (user + sys) | mean call as seen by the client ms |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        let throughput = row.conversations as f64 / row.elapsed.as_secs_f64();
        let per = |time: Duration| time.as_secs_f64() / row.conversations as f64;
        println!(
            "| {} | {} | {:.3} | {:.1} | {:.1} | {:.3} | {:.6} ({:.6} + {:.6}) | {:.1} |",
            row.concurrency,
            row.conversations,
            row.elapsed.as_secs_f64(),
            throughput,
            ideal(row),
            throughput / ideal(row),
            per(row.cpu.total()),
            per(row.cpu.user),
            per(row.cpu.system),
            per(row.model_time) * 1000.0 / 2.0,
        );
    }
    println!();
    println!("targets: ratio >= 0.95; client CPU <= 0.007 s per trajectory");
    println!(
        "server process CPU over the whole run (all C, warm-ups included): {:.2} s user + {:.2} s sys",
        server_cpu.user.as_secs_f64(),
        server_cpu.system.as_secs_f64()
    );
}

/// The server process: serve until the parent closes stdin.
fn serve(latency: Duration) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let server = runtime.block_on(ScriptedServer::start_fixed_latency(FixedLatency::new(latency, TOOL)));
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{}", server.base_url())?;
    stdout.flush()?;
    // Returns at EOF, when the parent is done or died.
    std::io::stdin().read_to_end(&mut Vec::new())?;
    drop(server);
    runtime.shutdown_background();
    Ok(())
}

/// A thousand connections need more descriptors than the usual soft limit of 1024. The server
/// process inherits the raised limit.
fn raise_open_files_limit(concurrency: usize) -> anyhow::Result<()> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE)?;
    let needed = u64::try_from(concurrency)? + 100;
    if soft < needed {
        bail!("the open-files limit is {soft}; concurrency {concurrency} needs about {needed}");
    }
    Ok(())
}

fn cpu_time(who: UsageWho) -> anyhow::Result<Cpu> {
    let usage = getrusage(who)?;
    let duration = |time: nix::sys::time::TimeVal| u64::try_from(time.num_microseconds()).map(Duration::from_micros);
    Ok(Cpu { user: duration(usage.user_time())?, system: duration(usage.system_time())? })
}

fn env_number(name: &str, default: u64) -> anyhow::Result<u64> {
    match std::env::var(name) {
        Ok(value) => value.trim().parse().with_context(|| format!("{name} must be a number, got {value:?}")),
        Err(_) => Ok(default),
    }
}
