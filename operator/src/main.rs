use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use trajectory_operator::leader::LeaseConfig;
use trajectory_operator::metrics;
use trajectory_operator::service::{self, Exit};
use trajectory_operator::settings::{Pacing, Settings};

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
    /// Print the API reference (markdown) rendered from the custom resource definition.
    ApiReference,
    /// Run the controller against the cluster of the current kubeconfig or service account.
    Run {
        /// Worker image for runs that do not set `spec.podTemplate.image`.
        #[arg(long, env = "TRAJ_WORKER_IMAGE", default_value_t = Settings::default().worker_image)]
        worker_image: String,
        /// Log output of the operator (and of the worker pods).
        #[arg(long, env = "TRAJ_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
        log_format: LogFormat,
        /// Address of the HTTP listener for `/metrics`, `/healthz` and `/readyz`.
        #[arg(long, env = "TRAJ_OPERATOR_HTTP_ADDR", default_value = "0.0.0.0:8080")]
        http_addr: SocketAddr,
        /// Act only on the runs of this namespace (when RBAC grants nothing elsewhere); unset:
        /// every namespace.
        #[arg(long, env = "TRAJ_WATCH_NAMESPACE")]
        watch_namespace: Option<String>,
        /// Milliseconds between two status writes of one run that change only its progress
        /// (phase and condition changes are written at once); 0 writes every change.
        #[arg(long, env = "TRAJ_STATUS_INTERVAL_MS", default_value_t = 3000)]
        status_interval_ms: u64,
        #[command(flatten)]
        leader: LeaderArgs,
    },
}

#[derive(Debug, Args)]
struct LeaderArgs {
    /// Reconcile only while holding a Lease, so that several replicas can run (`false`: always).
    #[arg(long, env = "TRAJ_LEADER_ELECTION", action = ArgAction::Set, default_value_t = true)]
    leader_election: bool,
    /// Name of the leader Lease.
    #[arg(long, env = "TRAJ_LEASE_NAME", default_value = "trajectory-operator")]
    lease_name: String,
    /// Namespace of the leader Lease: the operator's own (the downward API's `POD_NAMESPACE`).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// This replica's name in the Lease: the pod name.
    #[arg(long, env = "HOSTNAME")]
    identity: Option<String>,
    /// Seconds the Lease holds without renewal; a stand-by takes over at most this long after
    /// the leader dies.
    #[arg(long, env = "TRAJ_LEASE_DURATION_SECONDS", default_value_t = 15)]
    lease_duration_seconds: u64,
    /// Seconds before expiry at which the leader renews the Lease (less than the duration).
    #[arg(long, env = "TRAJ_LEASE_GRACE_SECONDS", default_value_t = 5)]
    lease_grace_seconds: u64,
}

impl LeaderArgs {
    fn lease(self) -> Option<LeaseConfig> {
        self.leader_election.then(|| LeaseConfig {
            name: self.lease_name,
            namespace: self.lease_namespace,
            // Without a pod name, a name no other process has.
            identity: self
                .identity
                .unwrap_or_else(|| format!("trajectory-operator-{}", std::process::id())),
            duration: Duration::from_secs(self.lease_duration_seconds),
            grace: Duration::from_secs(self.lease_grace_seconds),
        })
    }
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
        Command::ApiReference => print!("{}", trajectory_operator::reference::markdown()),
        Command::Run {
            worker_image,
            log_format,
            http_addr,
            watch_namespace,
            status_interval_ms,
            leader,
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
            let listener = tokio::net::TcpListener::bind(http_addr)
                .await
                .with_context(|| format!("binding the HTTP listener to {http_addr}"))?;
            let client = metrics::counted_client(kube::Config::infer().await?)?;
            let settings = Settings {
                worker_image,
                worker_log_format: worker_log_format.to_owned(),
                watch_namespace,
                pacing: Pacing {
                    status_interval: Duration::from_millis(status_interval_ms),
                    ..Pacing::default()
                },
            };
            let exit = service::run(
                client,
                settings,
                listener,
                leader.lease(),
                service::termination_signal(),
            )
            .await?;
            if exit == Exit::LostLease {
                // Non-zero, so the Deployment restarts this pod as a stand-by.
                anyhow::bail!("lost the leader Lease");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn leader_election_is_on_by_default_and_can_be_turned_off() {
        let run = |args: &[&str]| {
            let cli = Cli::try_parse_from([&["trajectory-operator", "run"], args].concat())
                .expect("valid arguments");
            match cli.command {
                Command::Run {
                    http_addr, leader, ..
                } => (http_addr, leader.lease()),
                Command::Crd | Command::ApiReference => unreachable!("parsed `run`"),
            }
        };
        let (addr, lease) = run(&["--identity", "pod-0", "--lease-namespace", "ops"]);
        assert_eq!(addr, "0.0.0.0:8080".parse().expect("an address"));
        let lease = lease.expect("leader election is on");
        assert_eq!(
            (
                lease.name.as_str(),
                lease.namespace.as_str(),
                lease.identity.as_str()
            ),
            ("trajectory-operator", "ops", "pod-0")
        );
        let (addr, lease) = run(&["--leader-election=false", "--http-addr", "127.0.0.1:9090"]);
        assert_eq!(addr, "127.0.0.1:9090".parse().expect("an address"));
        assert_eq!(lease, None);
    }

    #[test]
    fn the_watched_namespace_is_every_one_unless_named() {
        let watched = |args: &[&str]| {
            let cli = Cli::try_parse_from([&["trajectory-operator", "run"], args].concat())
                .expect("valid arguments");
            match cli.command {
                Command::Run {
                    watch_namespace, ..
                } => watch_namespace,
                Command::Crd | Command::ApiReference => unreachable!("parsed `run`"),
            }
        };
        assert_eq!(watched(&[]), None);
        assert_eq!(
            watched(&["--watch-namespace", "team-a"]).as_deref(),
            Some("team-a")
        );
    }
}
