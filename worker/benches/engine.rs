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
//! a final answer. For each concurrency C a semaphore keeps C conversations in flight; after 2 × C
//! warm-up conversations, the next N = max(ROUNDS × C, 200) completions are timed (wall clock and
//! this process's CPU), so neither the start nor the drain at the end is counted.
//!
//! Each C runs twice: with the first C conversations spread over one conversation's duration
//! (`staggered`, the steady state of a real batch, whose prompts take different times) and all
//! started at once (`lockstep`: against a fixed latency they then stay in step, so C requests
//! arrive together and C replies return together — a worst case for a machine with few cores).
//!
//! Each also runs with each kind of model traffic (issue 25): `plain`, one endpoint and the
//! client as it is, and `routed`, three endpoints (three server processes) with each
//! conversation routed by its identity (`ModelClient::for_conversation`, as a batch does it),
//! every completion priced (`spec.model.pricing`), and every request metered against rate limits
//! that never bind (`spec.model.limits`: requests, input and output tokens a minute, and the
//! limits not set learnt from the answers' headers). What `routed` costs more per request is what
//! routing, limiting and pricing add; adaptive concurrency (a lock and a wake-up a request) is in
//! both.
//!
//! Knobs (environment): `ENGINE_BENCH_LATENCY_MS` (100), `ENGINE_BENCH_CONCURRENCY`
//! ("16,256,1000"), `ENGINE_BENCH_ROUNDS` (4), `ENGINE_BENCH_START` ("staggered,lockstep"),
//! `ENGINE_BENCH_TRAFFIC` ("plain,routed").

mod common;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use nix::sys::resource::{UsageWho, getrusage};
use nix::sys::time::{TimeVal, TimeValLike};
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;
use trajectory_testkit::scripted_server::{MODEL, tool_call_reply};
use trajectory_worker::agent::{AgentConfig, run_conversation};
use trajectory_worker::model::limits::Limits;
use trajectory_worker::model::{ModelClient, ModelSettings, RetryPolicy};
use trajectory_worker::pricing::Prices;
use trajectory_worker::spec::{LimitsSpec, PricingSpec};
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_worker::tools::{
    Tool, ToolContext, ToolFuture, ToolLimits, ToolOutcome, ToolSpec, Workspace,
};

// The allocator of the `trajectory-worker` binary, so that the client costs what it costs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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

/// How the first C conversations start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    Staggered,
    Lockstep,
}

impl Start {
    fn as_str(self) -> &'static str {
        match self {
            Self::Staggered => "staggered",
            Self::Lockstep => "lockstep",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Cpu {
    user: Duration,
    system: Duration,
}

impl Cpu {
    fn total(self) -> Duration {
        self.user + self.system
    }

    fn since(self, before: Self) -> Self {
        Self {
            user: self.user.saturating_sub(before.user),
            system: self.system.saturating_sub(before.system),
        }
    }
}

/// How the conversations' requests reach the servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Traffic {
    Plain,
    Routed,
}

impl Traffic {
    fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Routed => "routed",
        }
    }
}

/// One measured configuration.
#[derive(Debug)]
struct Row {
    traffic: Traffic,
    start: Start,
    concurrency: usize,
    conversations: usize,
    elapsed: Duration,
    cpu: Cpu,
    /// Model-call time as the client saw it, summed over the measured conversations.
    model_time: Duration,
}

/// What the conversations themselves record: the completion that ends the warm-up opens the
/// window, the N-th completion after it closes it.
#[derive(Debug, Default)]
struct Window {
    completed: AtomicUsize,
    failed: AtomicUsize,
    model_micros: AtomicU64,
    opened: OnceLock<(Instant, Cpu)>,
    closed: OnceLock<(Instant, Cpu)>,
}

/// Everything one conversation needs, shared by all of them.
#[derive(Debug)]
struct Engine {
    traffic: Traffic,
    client: ModelClient,
    tools: Vec<Arc<dyn Tool>>,
    ctx: ToolContext,
    config: AgentConfig,
}

fn main() -> anyhow::Result<()> {
    let latency = Duration::from_millis(common::env_number("ENGINE_BENCH_LATENCY_MS", 100)?);
    if std::env::var_os(SERVER_ENV).is_some() {
        return common::serve(latency, tool_call_reply(TOOL, &json!({})));
    }
    let concurrencies: Vec<usize> = std::env::var("ENGINE_BENCH_CONCURRENCY")
        .unwrap_or_else(|_| "16,256,1000".into())
        .split(',')
        .map(|c| {
            c.trim()
                .parse()
                .context("ENGINE_BENCH_CONCURRENCY is a comma-separated list of numbers")
        })
        .collect::<Result<_, _>>()?;
    let rounds = usize::try_from(common::env_number("ENGINE_BENCH_ROUNDS", 4)?)?;
    let starts: Vec<Start> = std::env::var("ENGINE_BENCH_START")
        .unwrap_or_else(|_| "staggered,lockstep".into())
        .split(',')
        .map(|start| match start.trim() {
            "staggered" => Ok(Start::Staggered),
            "lockstep" => Ok(Start::Lockstep),
            other => bail!("ENGINE_BENCH_START lists `staggered` and `lockstep`, not {other:?}"),
        })
        .collect::<Result<_, _>>()?;
    let traffics: Vec<Traffic> = std::env::var("ENGINE_BENCH_TRAFFIC")
        .unwrap_or_else(|_| "plain,routed".into())
        .split(',')
        .map(|traffic| match traffic.trim() {
            "plain" => Ok(Traffic::Plain),
            "routed" => Ok(Traffic::Routed),
            other => bail!("ENGINE_BENCH_TRAFFIC lists `plain` and `routed`, not {other:?}"),
        })
        .collect::<Result<_, _>>()?;
    // A thousand connections need more descriptors than the usual soft limit of 1024; the server
    // process inherits the raised limit.
    let most = concurrencies.iter().copied().max().unwrap_or(0);
    common::raise_open_files_limit(u64::try_from(most)? + 100)?;

    let servers_needed = if traffics.contains(&Traffic::Routed) {
        3
    } else {
        1
    };
    let mut servers = Vec::new();
    let mut base_urls = Vec::new();
    for _ in 0..servers_needed {
        let (server, base_url) = common::start_server_process(&[(SERVER_ENV, "1")])?;
        servers.push(server);
        base_urls.push(base_url);
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let rows = runtime.block_on(async {
        let mut rows = Vec::new();
        for &traffic in &traffics {
            for &start in &starts {
                for &concurrency in &concurrencies {
                    // Whole rounds of C, so that in lockstep the window ends with a round.
                    let conversations =
                        (rounds * concurrency).max(200).div_ceil(concurrency) * concurrency;
                    let engine = Arc::new(engine(&base_urls, traffic)?);
                    let measured = (traffic, start, concurrency, conversations);
                    rows.push(measure(engine, latency, measured).await?);
                }
            }
        }
        anyhow::Ok(rows)
    })?;
    drop(runtime);

    // Closing its stdin tells a server process to exit.
    for mut server in servers {
        drop(server.stdin.take());
        server.wait()?;
    }
    let server_cpu = cpu_time(UsageWho::RUSAGE_CHILDREN)?;

    report(&rows, latency, server_cpu);
    Ok(())
}

/// A fresh client (and connection pool) per measurement, as a batch process has.
fn engine(base_urls: &[String], traffic: Traffic) -> anyhow::Result<Engine> {
    let (base_urls, prices) = match traffic {
        Traffic::Plain => (base_urls[..1].to_vec(), None),
        Traffic::Routed => (
            base_urls.to_vec(),
            Some(Prices::from_spec(&PricingSpec {
                input: Some(2.5),
                cached_input: Some(1.25),
                output: Some(10.0),
                ..PricingSpec::default()
            })?),
        ),
    };
    let settings = ModelSettings {
        base_urls,
        routing: trajectory_worker::model::RoutingSettings::default(),
        model: MODEL.to_owned(),
        api_key: None,
        max_tokens: Some(256),
        temperature: Some(0.0),
        reasoning_fields: Map::new(),
        extra_body: Map::new(),
        request_timeout: Duration::from_secs(60),
        stream: false,
        retry: RetryPolicy::default(),
        prices,
        tokens: None,
        service_tier: None,
        batch: None,
    };
    let spec = ToolSpec {
        name: TOOL.into(),
        description: "Does nothing.".into(),
        parameters: json!({"type": "object", "properties": {}}),
    };
    let mut client = ModelClient::new(settings)?;
    if traffic == Traffic::Routed {
        let never_binding = LimitsSpec {
            requests_per_minute: Some(1 << 40),
            input_tokens_per_minute: Some(1 << 50),
            output_tokens_per_minute: Some(1 << 50),
            ..LimitsSpec::default()
        };
        let limits = Limits::share(Some(&never_binding), 1).context("limits are set")?;
        client = client.with_limits(Arc::new(limits));
    }
    Ok(Engine {
        traffic,
        client,
        tools: vec![Arc::new(Noop(spec))],
        // The no-op tool never touches its workspace.
        ctx: ToolContext {
            workspace: Workspace::new(std::env::temp_dir())?,
            limits: ToolLimits::default(),
            sandbox: Sandbox::local(LandlockMode::Auto),
            browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
            terminal: trajectory_worker::tools::terminal::Terminal::default(),
        },
        config: AgentConfig {
            max_turns: 10,
            prompt_timeout: Duration::from_secs(120),
            ephemeral_system_prompt: Some("You are a benchmark.".into()),
        },
    })
}

async fn measure(
    engine: Arc<Engine>,
    latency: Duration,
    (traffic, start, concurrency, conversations): (Traffic, Start, usize, usize),
) -> anyhow::Result<Row> {
    let warm_up = 2 * concurrency;
    let last = warm_up + conversations;
    let window = Arc::new(Window::default());
    let permits = Arc::new(Semaphore::new(concurrency));
    let began = tokio::time::Instant::now();
    let spacing = latency.mul_f64(2.0 / concurrency as f64);
    for index in 0u32.. {
        let permit = Arc::clone(&permits).acquire_owned().await?;
        ensure!(
            window.failed.load(Ordering::SeqCst) == 0,
            "a benchmark conversation failed"
        );
        if window.closed.get().is_some() {
            break;
        }
        if start == Start::Staggered && (index as usize) < concurrency {
            tokio::time::sleep_until(began + spacing * index).await;
        }
        let (engine, window) = (Arc::clone(&engine), Arc::clone(&window));
        tokio::spawn(async move {
            let prompt = format!("Benchmark prompt {index}: call the tool, then answer.");
            let client = match engine.traffic {
                Traffic::Plain => engine.client.clone(),
                Traffic::Routed => engine.client.for_conversation(&format!("bench-{index}-0")),
            };
            let result =
                run_conversation(&client, &engine.tools, &engine.ctx, &prompt, &engine.config)
                    .await;
            match result {
                Ok(conversation) if conversation.completed && conversation.api_calls == 2 => {
                    let done = window.completed.fetch_add(1, Ordering::SeqCst) + 1;
                    if done > warm_up && done <= last {
                        let micros =
                            u64::try_from(conversation.model_time.as_micros()).unwrap_or(u64::MAX);
                        window.model_micros.fetch_add(micros, Ordering::Relaxed);
                    }
                    if done == warm_up || done == last {
                        let mark = if done == warm_up {
                            &window.opened
                        } else {
                            &window.closed
                        };
                        if let Ok(cpu) = cpu_time(UsageWho::RUSAGE_SELF) {
                            let _ = mark.set((Instant::now(), cpu));
                        }
                    }
                }
                _ => {
                    window.failed.fetch_add(1, Ordering::SeqCst);
                }
            }
            drop(permit);
        });
    }
    // The conversations still in flight finish before the next measurement starts.
    let _all = permits.acquire_many(u32::try_from(concurrency)?).await?;
    let (opened, cpu_opened) = *window.opened.get().context("the window never opened")?;
    let (closed, cpu_closed) = *window.closed.get().context("the window never closed")?;
    Ok(Row {
        traffic,
        start,
        concurrency,
        conversations,
        elapsed: closed - opened,
        cpu: cpu_closed.since(cpu_opened),
        model_time: Duration::from_micros(window.model_micros.load(Ordering::Relaxed)),
    })
}

fn report(rows: &[Row], latency: Duration, server_cpu: Cpu) {
    let ideal = |row: &Row| row.concurrency as f64 / (2.0 * latency.as_secs_f64());
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    // Other work on the machine competes for the same cores; say how much there was.
    println!(
        "latency {} ms per call, 2 calls per conversation; client in this process, server in a child; \
         {cores} CPUs; load average at the end {}",
        latency.as_millis(),
        common::load_average(),
    );
    println!();
    println!(
        "| traffic | start | C | conversations | elapsed s | throughput conv/s | ideal C/(2×latency) \
         | ratio | client CPU s / trajectory (user + sys) | mean call as seen by the client ms |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        let throughput = row.conversations as f64 / row.elapsed.as_secs_f64();
        let per = |time: Duration| time.as_secs_f64() / row.conversations as f64;
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.1} | {:.1} | {:.3} | {:.6} ({:.6} + {:.6}) | {:.1} |",
            row.traffic.as_str(),
            row.start.as_str(),
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
    // What routing and pricing add: routed against plain at the same start and C.
    for routed in rows.iter().filter(|row| row.traffic == Traffic::Routed) {
        let plain = rows.iter().find(|row| {
            row.traffic == Traffic::Plain
                && row.start == routed.start
                && row.concurrency == routed.concurrency
        });
        if let Some(plain) = plain {
            // Two requests a conversation.
            let per_request =
                |row: &Row| row.cpu.total().as_secs_f64() / (2.0 * row.conversations as f64);
            println!(
                "routed - plain, {} C={}: {:+.4} ms client CPU per request (target <= 0.05 ms)",
                routed.start.as_str(),
                routed.concurrency,
                (per_request(routed) - per_request(plain)) * 1000.0,
            );
        }
    }
    println!(
        "server process CPU over the whole run (warm-ups included): {:.2} s user + {:.2} s sys",
        server_cpu.user.as_secs_f64(),
        server_cpu.system.as_secs_f64()
    );
}

fn cpu_time(who: UsageWho) -> anyhow::Result<Cpu> {
    let usage = getrusage(who)?;
    let duration =
        |time: TimeVal| u64::try_from(time.num_microseconds()).map(Duration::from_micros);
    Ok(Cpu {
        user: duration(usage.user_time())?,
        system: duration(usage.system_time())?,
    })
}
