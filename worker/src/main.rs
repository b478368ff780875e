//! `trajectory-worker`: see the library for everything it does.

use clap::Parser;
use trajectory_worker::cli::{Cli, init_tracing, run};

// Conversations, records and their buffers are allocated on many threads and often freed on
// another (the writer's); mimalloc's thread-local heaps cost a fraction of glibc's malloc there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    std::process::exit(run(cli).await);
}
