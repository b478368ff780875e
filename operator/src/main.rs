use clap::{Parser, Subcommand, ValueEnum};
use trajectory_operator::controller::{self, Context};
use trajectory_operator::desired::Settings;

/// The trajectory-operator control plane.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the custom resource definition and its admission policy as YAML.
    Crd,
    /// Run the controller against the cluster of the current kubeconfig or service account.
    Run {
        /// Worker image for runs that do not set `spec.podTemplate.image`.
        #[arg(long, env = "TRAJ_WORKER_IMAGE", default_value_t = Settings::default().worker_image)]
        worker_image: String,
        /// Log output of the operator (and of the worker pods).
        #[arg(long, env = "TRAJ_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
        log_format: LogFormat,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Pretty,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crd => print!("{}", trajectory_operator::crd::yaml()),
        Command::Run {
            worker_image,
            log_format,
        } => {
            let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
            let builder = tracing_subscriber::fmt().with_env_filter(filter);
            let worker_log_format = match log_format {
                LogFormat::Json => {
                    builder.json().init();
                    "json"
                }
                LogFormat::Pretty => {
                    builder.init();
                    "pretty"
                }
            };
            let client = kube::Client::try_default().await?;
            let settings = Settings {
                worker_image,
                worker_log_format: worker_log_format.to_owned(),
            };
            let shutdown = async {
                // Without a signal handler the process still stops on SIGTERM, just not gracefully.
                let _ = tokio::signal::ctrl_c().await;
            };
            controller::run(Context::new(client, settings), shutdown).await;
        }
    }
    Ok(())
}
