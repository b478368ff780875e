//! `trajectory-worker`: see the library for everything it does.

use clap::Parser;
use trajectory_worker::cli::{Cli, init_tracing, run};

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    std::process::exit(run(cli).await);
}
