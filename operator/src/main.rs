use clap::{Parser, Subcommand};

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
}

fn main() {
    match Cli::parse().command {
        Command::Crd => print!("{}", trajectory_operator::crd::yaml()),
    }
}
