//! The images of Harbor tasks a run builds (`spec.sandbox.builds`): the build Job's completion
//! index *i* builds line *i* of the run's build list (`harbor-builds.jsonl`, written by the plan).
//!
//! A build pod has two containers, so that the one running the dataset's `RUN` steps, which
//! must be privileged, holds nothing of the run's:
//!
//! ```text
//! init  build-context  worker image, unprivileged, the run's storage mounted: unpacks line i's
//!                      context into /build/context (its digest checked), its Dockerfile's base
//!                      images rewritten as the run pulls images (spec.sandbox.imageRewrite),
//!                      and writes the line beside it
//! main  build          builder image, privileged, only /build (and the push credentials):
//!                      asks the registry for the tag; else buildah builds and pushes; reports
//!                      how it went as its termination message
//! ```
//!
//! A failed build is the tasks' outcome, not the pod's: the pod reports it and exits 0, and the
//! operator records those tasks' conversations failed (`image_build_failed`).

use std::fmt::Write as _;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{RunError, RunLocation};
use crate::contract::{BuildEntry, BuildOutcome, BuildReport};
use crate::harbor::hex_sha256;
use crate::spec::registry_host;

/// What the build container is handed in the build directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BuildOrder {
    /// The line of the build list (the completion index).
    pub line: u32,
    pub entry: BuildEntry,
    /// The registries spoken to over plain HTTP (`spec.sandbox.builds.insecure`): the
    /// repository's, and the mirrors `spec.sandbox.imageRewrite` names. Every other registry is
    /// spoken to over verified TLS.
    pub insecure_registries: Vec<String>,
}

/// The file of the [`BuildOrder`] in the build directory.
const ORDER_FILE: &str = "order.json";
/// The unpacked context in the build directory.
const CONTEXT_DIR: &str = "context";
/// The most bytes of the builder's output a failure report keeps (its end).
const ERROR_TAIL_BYTES: usize = 2048;

/// `trajectory-worker build-context`: line `line` of the run's build list, its context unpacked
/// into `dir` with its base images rewritten, and the order beside it.
pub fn prepare(location: &RunLocation, line: u32, dir: &Path) -> Result<BuildOrder, RunError> {
    let spec = &location.plan.spec;
    if spec.sandbox.builds.is_none() {
        return Err(RunError::Spec(
            "the run builds no images (spec.sandbox.builds is not set)".into(),
        ));
    }
    let run_dir = location.run_dir();
    let list = run_dir.harbor_builds();
    let text = location.store.read_to_string(&list)?;
    let bad = |why: String| RunError::BadBatchInput(format!("{}: {why}", list.display()));
    let entry_text = text
        .lines()
        .nth(usize::try_from(line).unwrap_or(usize::MAX))
        .ok_or_else(|| bad(format!("has no line {}", u64::from(line) + 1)))?;
    let entry: BuildEntry = serde_json::from_str(entry_text)
        .map_err(|err| bad(format!("line {}: {err}", u64::from(line) + 1)))?;
    let context_path = Path::new(&entry.context);
    if context_path.is_absolute()
        || context_path
            .components()
            .any(|part| !matches!(part, std::path::Component::Normal(_)))
    {
        return Err(bad(format!(
            "line {}: the context {:?} is not in the run's directory",
            u64::from(line) + 1,
            entry.context
        )));
    }
    let packed = location.store.read(&run_dir.root().join(context_path))?;
    let mut tar = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(packed.as_slice()),
        &mut tar,
    )
    .map_err(|err| bad(format!("{}: not a gzipped tar: {err}", entry.context)))?;
    if hex_sha256(&tar) != entry.hash {
        return Err(bad(format!(
            "{}: its digest is not {}: the context changed after the plan",
            entry.context, entry.hash
        )));
    }
    let context = dir.join(CONTEXT_DIR);
    let io = |what: &str, path: &Path, err: std::io::Error| {
        RunError::Internal(format!("{what} {}: {err}", path.display()))
    };
    std::fs::create_dir_all(&context).map_err(|err| io("creating", &context, err))?;
    tar::Archive::new(tar.as_slice())
        .unpack(&context)
        .map_err(|err| io("unpacking the context into", &context, err))?;
    let dockerfile = context.join("Dockerfile");
    let text =
        std::fs::read_to_string(&dockerfile).map_err(|err| io("reading", &dockerfile, err))?;
    let rewritten = rewrite_bases(&text, |image| spec.sandbox.rewritten_image(image));
    std::fs::write(&dockerfile, rewritten).map_err(|err| io("writing", &dockerfile, err))?;
    let order = BuildOrder {
        line,
        entry,
        insecure_registries: insecure_registries(spec),
    };
    let path = dir.join(ORDER_FILE);
    let json = serde_json::to_vec(&order).expect("an order serialises");
    std::fs::write(&path, json).map_err(|err| io("writing", &path, err))?;
    info!(image = %order.entry.image, tasks = ?order.entry.tasks, "build context ready");
    Ok(order)
}

/// `dockerfile` with the image of each `FROM` line (its first word that is not a `--flag`)
/// replaced by `rewrite`'s, then named in full as Docker reads a short name (`python:3.12` is
/// `docker.io/library/python:3.12`): buildah, unlike Docker, does not guess a registry. A stage
/// named earlier (`FROM deps`), `scratch` and an `ARG` (`$BASE`) are left as they are.
pub fn rewrite_bases(dockerfile: &str, rewrite: impl Fn(&str) -> String) -> String {
    let mut stages: Vec<String> = Vec::new();
    let mut out = String::with_capacity(dockerfile.len());
    for line in dockerfile.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let mut words: Vec<String> = trimmed.split_whitespace().map(str::to_owned).collect();
        if !words
            .first()
            .is_some_and(|word| word.eq_ignore_ascii_case("FROM"))
        {
            out.push_str(line);
            continue;
        }
        if let Some(image) = words
            .iter_mut()
            .skip(1)
            .find(|word| !word.starts_with("--"))
        {
            let named = stages.iter().any(|stage| stage.eq_ignore_ascii_case(image));
            if !(named || image == "scratch" || image.contains('$')) {
                *image = qualified(&rewrite(image));
            }
        }
        if let [.., as_word, stage] = words.as_slice()
            && as_word.eq_ignore_ascii_case("AS")
        {
            stages.push(stage.clone());
        }
        out.push_str(&line[..line.len() - trimmed.len()]);
        out.push_str(&words.join(" "));
        if line.ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

/// `image` with the registry Docker assumes when it names none: `docker.io`, and `library/`
/// for an official image.
fn qualified(image: &str) -> String {
    if registry_host(image).is_some() {
        image.to_owned()
    } else if image.contains('/') {
        format!("docker.io/{image}")
    } else {
        format!("docker.io/library/{image}")
    }
}

/// `trajectory-worker build`: the order in `dir` built with `buildah` and pushed, unless the
/// registry holds its tag already. Only an order that cannot be read is an error; a failed build
/// is reported.
pub async fn build(dir: &Path, buildah: &Path) -> Result<BuildReport, RunError> {
    let path = dir.join(ORDER_FILE);
    let text = std::fs::read_to_string(&path)
        .map_err(|err| RunError::Internal(format!("reading {}: {err}", path.display())))?;
    let order: BuildOrder = serde_json::from_str(&text)
        .map_err(|err| RunError::Internal(format!("{}: {err}", path.display())))?;
    let started = Instant::now();
    let image = order.entry.image.clone();
    let report = |outcome, error: Option<String>| BuildReport {
        build: order.line,
        image: image.clone(),
        outcome,
        seconds: (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        error,
    };
    if registry_has(&image, &order.insecure_registries).await {
        info!(%image, "the registry holds it already: nothing to build");
        return Ok(report(BuildOutcome::Present, None));
    }
    let timeout = Duration::from_secs_f64(order.entry.timeout_sec.clamp(1.0, 86_400.0));
    let deadline = started + timeout;
    let storage = [
        "--storage-driver".to_owned(),
        "vfs".to_owned(),
        "--root".to_owned(),
        dir.join("storage").display().to_string(),
        "--runroot".to_owned(),
        dir.join("run").display().to_string(),
    ];
    // Plain HTTP for the registries named insecure alone: `--tls-verify=false` would also
    // drop TLS for a base pulled from anywhere else.
    let registries = dir.join(REGISTRIES_FILE);
    std::fs::write(&registries, registries_conf(&order.insecure_registries))
        .map_err(|err| RunError::Internal(format!("writing {}: {err}", registries.display())))?;
    let context = dir.join(CONTEXT_DIR).display().to_string();
    let steps: [(&str, Vec<String>); 2] = [
        (
            "build",
            [
                "bud",
                "--isolation",
                "chroot",
                "--pull-always=false",
                "--tag",
                &image,
                &context,
            ]
            .map(str::to_owned)
            .to_vec(),
        ),
        (
            "push",
            [
                "push".to_owned(),
                image.clone(),
                format!("docker://{image}"),
            ]
            .to_vec(),
        ),
    ];
    for (step, args) in steps {
        let mut command = tokio::process::Command::new(buildah);
        command
            .args(&storage)
            .args(&args)
            .env("CONTAINERS_REGISTRIES_CONF", &registries);
        let left = deadline.saturating_duration_since(Instant::now());
        if let Err(why) = run_step(command, left).await {
            let why = format!(
                "{step} of {image} (tasks {}) failed: {why}",
                order.entry.tasks.join(", ")
            );
            warn!("{why}");
            return Ok(report(BuildOutcome::Failed, Some(why)));
        }
    }
    info!(%image, seconds = started.elapsed().as_secs_f64(), "built and pushed");
    Ok(report(BuildOutcome::Built, None))
}

/// Runs `command` for at most `left`; why it failed: its exit and the end of its output (its
/// standard output, then its standard error, both read as they come).
async fn run_step(mut command: tokio::process::Command, left: Duration) -> Result<(), String> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = command
        .spawn()
        .map_err(|err| format!("cannot start buildah: {err}"))?;
    // Dropped at the timeout, the child is killed with the future.
    let Ok(output) = tokio::time::timeout(left, child.wait_with_output()).await else {
        return Err(format!(
            "it took longer than the build timeout ({} s, the tasks' build_timeout_sec)",
            left.as_secs()
        ));
    };
    match output {
        Ok(output) if output.status.success() => Ok(()),
        Ok(output) => {
            let mut text = output.stdout;
            text.extend(output.stderr);
            Err(format!("{}: {}", output.status, tail(&text)))
        }
        Err(err) => Err(err.to_string()),
    }
}

/// The end of `output`, at most [`ERROR_TAIL_BYTES`], on a character boundary.
fn tail(output: &[u8]) -> String {
    let text = String::from_utf8_lossy(output);
    let text = text.trim_end();
    let mut start = text.len().saturating_sub(ERROR_TAIL_BYTES);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_owned()
}

/// Whether the registry answers for `image`'s manifest: then it was built before (the tag is the
/// context's digest). Anything else, a registry that wants credentials included, is a build.
async fn registry_has(image: &str, insecure: &[String]) -> bool {
    let Some((registry, repository, tag)) = split_reference(image) else {
        return false;
    };
    let scheme = if insecure.iter().any(|host| host == registry) {
        "http"
    } else {
        "https"
    };
    let url = format!("{scheme}://{registry}/v2/{repository}/manifests/{tag}");
    let Ok(client) = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
    else {
        return false;
    };
    let accept = "application/vnd.oci.image.manifest.v1+json, \
                  application/vnd.oci.image.index.v1+json, \
                  application/vnd.docker.distribution.manifest.v2+json, \
                  application/vnd.docker.distribution.manifest.list.v2+json";
    match client
        .head(&url)
        .header(reqwest::header::ACCEPT, accept)
        .send()
        .await
    {
        Ok(response) => response.status().is_success(),
        Err(err) => {
            warn!(%url, %err, "cannot ask the registry for the image: building it");
            false
        }
    }
}

/// The file of the build's registry configuration in the build directory.
const REGISTRIES_FILE: &str = "registries.conf";

/// The registries a run's builds speak plain HTTP to, when `spec.sandbox.builds.insecure`: the
/// repository's, and those of the mirrors `spec.sandbox.imageRewrite` rewrites to.
fn insecure_registries(spec: &crate::spec::RunSpec) -> Vec<String> {
    let Some(builds) = spec
        .sandbox
        .builds
        .as_ref()
        .filter(|builds| builds.insecure)
    else {
        return Vec::new();
    };
    let host = |reference: &str| registry_host(reference).map(|(host, _)| host.to_owned());
    let mut hosts: Vec<String> = std::iter::once(builds.repository.as_str())
        .chain(
            spec.sandbox
                .image_rewrite
                .iter()
                .map(|rewrite| rewrite.to.as_str()),
        )
        .filter_map(host)
        .collect();
    hosts.sort();
    hosts.dedup();
    hosts
}

/// The registries.conf (containers-registries.conf(5)) of a build: short names are Docker
/// Hub's, and the `insecure` registries are spoken to over plain HTTP.
fn registries_conf(insecure: &[String]) -> String {
    let mut conf = String::from("unqualified-search-registries = [\"docker.io\"]\n");
    for host in insecure {
        let location = serde_json::Value::from(host.as_str());
        let _ = write!(
            conf,
            "\n[[registry]]\nlocation = {location}\ninsecure = true\n"
        );
    }
    conf
}

/// `host[:port]/path:tag` as its registry, repository and tag; `None` for a reference without a
/// registry host or a tag.
fn split_reference(image: &str) -> Option<(&str, &str, &str)> {
    let (registry, rest) = registry_host(image)?;
    let (repository, tag) = rest.rsplit_once(':')?;
    (!tag.contains('/')).then_some((registry, repository, tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_base_is_rewritten_and_named_in_full_and_nothing_else() {
        let dockerfile = "# FROM in a comment\nFROM --platform=linux/amd64 python:3.12-slim AS deps\nRUN echo FROM x\n  from team/tool:1 as Tool\nFROM deps\nFROM tool\nFROM scratch\nFROM $BASE\nFROM ghcr.io/o/i:2\nCOPY a /a";
        let rewritten = rewrite_bases(dockerfile, |image| {
            if image == "python:3.12-slim" {
                "mirror:5000/python:1".into()
            } else {
                image.into()
            }
        });
        assert_eq!(
            rewritten,
            "# FROM in a comment\nFROM --platform=linux/amd64 mirror:5000/python:1 AS deps\nRUN echo FROM x\n  from docker.io/team/tool:1 as Tool\nFROM deps\nFROM tool\nFROM scratch\nFROM $BASE\nFROM ghcr.io/o/i:2\nCOPY a /a"
        );
    }

    #[test]
    fn references_split_into_registry_repository_and_tag() {
        assert_eq!(
            split_reference("registry.internal:5000/team/envs:ab12"),
            Some(("registry.internal:5000", "team/envs", "ab12"))
        );
        assert_eq!(
            split_reference("localhost/envs:1"),
            Some(("localhost", "envs", "1"))
        );
        assert_eq!(split_reference("team/envs:1"), None, "no registry host");
        assert_eq!(split_reference("registry.io/envs"), None, "no tag");
    }

    #[test]
    fn only_the_runs_own_registries_are_spoken_to_over_plain_http() {
        let spec: crate::spec::RunSpec = serde_json::from_value(serde_json::json!({
            "dataset": {"path": "tasks", "format": "HarborTasks"},
            "model": {"baseUrl": "http://127.0.0.1:1/v1", "name": "m"},
            "sandbox": {
                "builds": {"repository": "10.0.0.1:5000/envs", "insecure": true},
                "imageRewrite": [
                    {"from": "python:", "to": "mirror.internal:5000/python:"},
                    {"from": "debian:", "to": "10.0.0.1:5000/debian:"},
                    {"from": "x", "to": "library/x"},
                ],
            },
        }))
        .unwrap();
        let hosts = insecure_registries(&spec);
        assert_eq!(hosts, ["10.0.0.1:5000", "mirror.internal:5000"]);
        assert_eq!(
            registries_conf(&hosts),
            "unqualified-search-registries = [\"docker.io\"]\n\n[[registry]]\nlocation = \"10.0.0.1:5000\"\ninsecure = true\n\n[[registry]]\nlocation = \"mirror.internal:5000\"\ninsecure = true\n"
        );
        let mut secure = spec;
        secure.sandbox.builds.as_mut().unwrap().insecure = false;
        assert!(insecure_registries(&secure).is_empty());
    }

    #[test]
    fn a_failure_keeps_the_end_of_the_output() {
        let output = format!("{}é{}", "a".repeat(3000), "z".repeat(100));
        let kept = tail(output.as_bytes());
        assert!(
            kept.len() <= ERROR_TAIL_BYTES && kept.ends_with("zzz"),
            "{kept}"
        );
    }
}
