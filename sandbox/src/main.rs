//! `trajectory-executor`: see the `trajectory_sandbox` library.

fn main() {
    std::process::exit(trajectory_sandbox::main(std::env::args_os().skip(1)));
}
