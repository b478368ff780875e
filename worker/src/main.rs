//! `trajectory-worker`: see the library for everything it does.

// Conversations, records and their buffers are allocated on many threads and often freed on
// another (the writer's); mimalloc's thread-local heaps cost a fraction of glibc's malloc there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(trajectory_worker::cli::main());
}
