//! What the benchmark that runs Harbor itself beside this project shares between its two halves
//! (`docs/benchmarks.md`, "Side by side with Harbor"): the same Harbor task directory, the same
//! scripted model's one command, and the machine's CPU time read the same way.
//!
//! The tasks are Harbor's own layout (`harbor init`, schema 1.4) and alike but for their names: a
//! Dockerfile-only environment over one base image, the instruction to write 42 to
//! `/app/answer.txt`, a `solve.sh` that does, and a `test.sh` writing the reward to
//! `/logs/verifier/reward.txt`. The verifier runs in the agent's environment (`shared`), as this
//! project's does, so both sides verify the same way.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::scripted_server::ScriptedServer;

/// The command the scripted model asks the terminal to run: it solves every task.
pub const ANSWER_COMMAND: &str = "echo 42 > /app/answer.txt";

/// Writes `count` tasks, `answer-000` on, under `dir`, their Dockerfiles `FROM base_image`.
/// Returns their directory names.
pub fn write_answer_tasks(dir: &Path, count: usize, base_image: &str) -> Vec<String> {
    (0..count)
        .map(|index| {
            let name = format!("answer-{index:03}");
            let task = dir.join(&name);
            let files = [
                ("instruction.md", "Write the number 42 to /app/answer.txt.\n".to_owned()),
                (
                    "task.toml",
                    format!(
                        "schema_version = \"1.4\"\n\n[task]\nname = \"side-by-side/{name}\"\n\n\
                         [verifier]\ntimeout_sec = 60.0\nenvironment_mode = \"shared\"\n\n\
                         [agent]\ntimeout_sec = 60.0\n\n[environment]\nbuild_timeout_sec = 300.0\n"
                    ),
                ),
                (
                    "environment/Dockerfile",
                    format!("FROM {base_image}\nWORKDIR /app\n"),
                ),
                (
                    "solution/solve.sh",
                    format!("#!/bin/bash\n{ANSWER_COMMAND}\n"),
                ),
                (
                    "tests/test.sh",
                    "#!/bin/bash\nmkdir -p /logs/verifier\n\
                     if [ \"$(cat /app/answer.txt 2>/dev/null)\" = 42 ]; then echo 1; else echo 0; fi \
                     > /logs/verifier/reward.txt\n"
                        .to_owned(),
                ),
            ];
            for (file, text) in files {
                let path = task.join(file);
                std::fs::create_dir_all(path.parent().expect("a task file has a directory"))
                    .unwrap_or_else(|e| panic!("creating the directory of {}: {e}", path.display()));
                std::fs::write(&path, text)
                    .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            }
            name
        })
        .collect()
}

/// The whole machine's busy CPU time so far (every CPU's time but idle and iowait, from
/// `/proc/stat`): the difference over a run is what the run cost the machine, whichever
/// processes spent it (the harness, the container runtime, the control plane, the kernel).
pub fn machine_busy() -> Duration {
    let stat = std::fs::read_to_string("/proc/stat").expect("reading /proc/stat");
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .and_then(|line| line.strip_prefix("cpu "))
        .expect("/proc/stat starts with the cpu line")
        .split_whitespace()
        .map(|field| field.parse().expect("a number of ticks"))
        .collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    let busy: u64 = fields
        .iter()
        .take(8)
        .enumerate()
        .filter(|(index, _)| !matches!(index, 3 | 4))
        .map(|(_, ticks)| ticks)
        .sum();
    // USER_HZ is 100 on Linux's every architecture that this runs on.
    Duration::from_millis(busy * 10)
}

/// What one side's run cost the machine, from [`RunClock::start`] on.
#[derive(Debug)]
pub struct RunClock {
    /// The machine's busy CPU time a second while nothing was asked of it (what runs anyway: a
    /// control plane, dockerd), subtracted from the run's to leave the run's own.
    idle: f64,
    started: Instant,
    busy_before: Duration,
}

impl RunClock {
    /// Measures the idle machine over 10 s, then starts the clock.
    pub async fn start() -> Self {
        let over = Duration::from_secs(10);
        let before = machine_busy();
        tokio::time::sleep(over).await;
        let idle = machine_busy().saturating_sub(before).as_secs_f64() / over.as_secs_f64();
        Self {
            idle,
            started: Instant::now(),
            busy_before: machine_busy(),
        }
    }

    /// The figures of a run that made `trajectories` and has just ended: wall time, trajectories
    /// an hour, the machine's CPU time a trajectory (the idle machine's subtracted, then not), and
    /// the time to `model`'s first request.
    pub fn summary(&self, model: &ScriptedServer, trajectories: usize) -> String {
        let wall = self.started.elapsed().as_secs_f64();
        let busy = machine_busy()
            .saturating_sub(self.busy_before)
            .as_secs_f64();
        let first_request = model
            .first_request_at()
            .map_or(f64::NAN, |at| at.duration_since(self.started).as_secs_f64());
        let count = trajectories.max(1) as f64;
        format!(
            "{wall:.1} s: {:.0} trajectories an hour; machine CPU {:.2} s a trajectory ({:.2} with \
             the idle machine's {:.2} CPU-s/s); first model request after {first_request:.2} s",
            count / wall * 3600.0,
            (busy - self.idle * wall) / count,
            busy / count,
            self.idle,
        )
    }
}
