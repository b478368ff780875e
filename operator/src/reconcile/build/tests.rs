//! Tests of the builders: every child object a run can have, from a validated run.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{EnvVar, PodSpec};
use serde_json::json;
use trajectory_worker::contract::{RunPlan, env, exit, paths};

use super::*;
use crate::api::TrajectoryRun;
use crate::reconcile::decide::{Pending, Shard, Tasks};
use crate::reconcile::validate::{Validation, validate};

/// (pending list given, batches expected in the plan).
type PendingCase = (Option<&'static [u32]>, Option<Vec<u32>>);

fn valid(run: &TrajectoryRun) -> ValidatedRun<'_> {
    match validate(run) {
        Ok(Validation::Valid(valid)) => *valid,
        other => panic!("the run is valid: {other:?}"),
    }
}

fn pending(batches: &[u32]) -> Pending {
    Pending::new(batches.to_vec()).expect("batches")
}

/// The generation Job of `attempt` over `batches`, with all of the run's workers (one Job).
fn gen_job(run: &TrajectoryRun, attempt: u32, batches: &[u32], exists: bool) -> Job {
    let shard = Shard {
        attempt,
        shard: 0,
        pending: pending(batches),
        exists,
        parallelism: run.spec.run.workers,
        tasks: Tasks::Sandbox,
        held: false,
        prefer_node: None,
        task_resources: None,
    };
    generation_job(&valid(run), &settings(), &shard)
}

/// A run whose model key comes from the Secret `llm-key`, key `api-key`.
fn run_with_a_key_secret() -> TrajectoryRun {
    TrajectoryRun::test()
        .with(|spec| {
            spec.model.api_key_secret_ref = Some(trajectory_worker::spec::SecretKeyRef {
                name: "llm-key".into(),
                key: "api-key".into(),
            });
        })
        .build()
}

fn settings() -> Settings {
    Settings::default()
}

fn pod(job: &Job) -> &PodSpec {
    job.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

/// The metadata of the Job's pods.
fn pod_metadata(job: &Job) -> &ObjectMeta {
    job.spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
}

/// The Secret (name, key) the worker's variable `name` comes from; it must have no inline value.
fn secret_of(job: &Job, name: &str) -> (String, String) {
    let var = env_value(job, name).unwrap_or_else(|| panic!("{name} in the worker's env"));
    assert_eq!(var.value, None, "{name} comes from its Secret only");
    let selector = var
        .value_from
        .as_ref()
        .and_then(|from| from.secret_key_ref.as_ref())
        .unwrap_or_else(|| panic!("{name} from a secretKeyRef"));
    (selector.name.clone(), selector.key.clone())
}

fn env_value<'a>(job: &'a Job, name: &str) -> Option<&'a EnvVar> {
    pod(job).containers[0]
        .env
        .iter()
        .flatten()
        .rev()
        .find(|var| var.name == name)
}

#[test]
fn empty_pending_list_makes_no_generation_job() {
    assert_eq!(Pending::new(Vec::new()), None);
}

#[test]
fn children_are_built_for_what_the_decision_wants() {
    let run = TrajectoryRun::test().build();
    let wanted = [
        Child::Plan {
            round: 1,
            exists: true,
        },
        Child::Generation(Shard {
            attempt: 2,
            shard: 0,
            pending: pending(&[1, 4]),
            exists: false,
            parallelism: 1,
            tasks: Tasks::Sandbox,
            held: false,
            prefer_node: None,
            task_resources: None,
        }),
        Child::Merge {
            round: 1,
            exists: false,
        },
    ];
    let built = children(&valid(&run), &settings(), &wanted);
    let names = |metas: Vec<&ObjectMeta>| -> Vec<String> {
        metas.into_iter().map(|m| m.name.clone().unwrap()).collect()
    };
    assert_eq!(
        names(built.jobs.iter().map(|j| &j.metadata).collect()),
        ["coding-v1-plan", "coding-v1-gen-2", "coding-v1-merge"]
    );
    // An existing Job's ConfigMap is already there.
    assert_eq!(
        names(built.config_maps.iter().map(|m| &m.metadata).collect()),
        ["coding-v1-gen-2", "coding-v1-merge"]
    );
}

#[test]
fn generation_job_is_indexed_with_retry_limits_and_failure_policy() {
    let run = TrajectoryRun::test()
        .with(|spec| {
            spec.workers = 8;
            spec.retry.per_batch = 2;
            spec.retry.max_failed_batches = 5;
        })
        .build();
    let batches = [3, 4, 9];
    let many: Vec<u32> = (0..40).collect();
    let big = gen_job(&run, 1, &many, false);
    assert_eq!(big.spec.as_ref().unwrap().max_failed_indexes, Some(5));
    let job = gen_job(&run, 2, &batches, false);
    assert_eq!(job.metadata.name.as_deref(), Some("coding-v1-gen-2"));
    let spec = job.spec.as_ref().unwrap();
    assert_eq!(spec.completion_mode.as_deref(), Some("Indexed"));
    assert_eq!(spec.completions, Some(3));
    assert_eq!(spec.parallelism, Some(8));
    assert_eq!(spec.backoff_limit_per_index, Some(2));
    // At most `completions`, or the API server refuses the Job.
    assert_eq!(spec.max_failed_indexes, Some(3));
    assert_eq!(spec.suspend, Some(false));
    assert_eq!(pod(&job).restart_policy.as_deref(), Some("Never"));
    assert_eq!(
        pod(&job).containers[0].args.as_deref(),
        Some(&["batch".to_owned()][..])
    );

    let rules = &spec.pod_failure_policy.as_ref().unwrap().rules;
    let summary: Vec<(String, Option<i32>, Option<String>)> = rules
        .iter()
        .map(|rule| {
            (
                rule.action.clone(),
                rule.on_exit_codes.as_ref().map(|codes| codes.values[0]),
                rule.on_pod_conditions
                    .as_ref()
                    .map(|conditions| conditions[0].type_.clone()),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                "Ignore".to_owned(),
                None,
                Some("DisruptionTarget".to_owned())
            ),
            ("FailJob".to_owned(), Some(exit::PERMANENT_CONFIG), None),
            ("FailIndex".to_owned(), Some(exit::BAD_BATCH_INPUT), None),
            ("Ignore".to_owned(), Some(exit::BUDGET_EXHAUSTED), None),
        ]
    );
}

#[test]
fn plan_and_merge_jobs_run_one_pod_of_their_worker_mode() {
    for (job, mode, name) in [
        (
            plan_job(
                &valid(&TrajectoryRun::test().build()),
                &settings(),
                1,
                false,
            ),
            "plan",
            "coding-v1-plan",
        ),
        (
            merge_job(
                &valid(&TrajectoryRun::test().build()),
                &settings(),
                1,
                false,
            ),
            "merge",
            "coding-v1-merge",
        ),
    ] {
        assert_eq!(job.metadata.name.as_deref(), Some(name));
        let spec = job.spec.as_ref().unwrap();
        assert_eq!((spec.completions, spec.parallelism), (Some(1), Some(1)));
        assert_eq!(spec.completion_mode, None);
        assert_eq!(spec.backoff_limit, Some(3));
        let actions: Vec<_> = spec
            .pod_failure_policy
            .as_ref()
            .unwrap()
            .rules
            .iter()
            .map(|rule| rule.action.as_str())
            .collect();
        assert_eq!(actions, ["Ignore", "FailJob"]);
        assert_eq!(
            pod(&job).containers[0].args.as_deref(),
            Some(&[mode.to_owned()][..])
        );
        // The plan ConfigMap is the Job's namesake.
        let volume = &pod(&job).volumes.as_ref().unwrap()[0];
        assert_eq!(volume.config_map.as_ref().unwrap().name, name);
    }
}

#[test]
fn children_carry_common_labels_and_a_controller_owner_reference() {
    let run = TrajectoryRun::test().build();
    let job = gen_job(&run, 1, &[0, 1], false);
    let map = plan_config_map(
        &valid(&run),
        Component::generation(1),
        Some(&pending(&[0, 1])),
    );
    for metadata in [&job.metadata, &map.metadata] {
        let labels = metadata.labels.as_ref().unwrap();
        assert_eq!(labels[labels::RUN], "coding-v1");
        assert_eq!(labels[labels::MANAGED_BY], MANAGER);
        assert_eq!(labels[labels::COMPONENT], "generate");
        assert_eq!(labels[labels::ATTEMPT], "1");
        assert_eq!(metadata.namespace.as_deref(), Some("research"));
        let owner = &metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("TrajectoryRun", "coding-v1", "0b7c-uid")
        );
        assert_eq!(owner.controller, Some(true));
        assert_eq!(owner.block_owner_deletion, Some(true));
    }
    let pod_labels = pod_metadata(&job);
    assert_eq!(
        pod_labels.labels.as_ref().unwrap()[labels::RUN],
        "coding-v1"
    );
}

#[test]
fn plan_config_map_lists_pending_batches_only_when_not_the_identity() {
    let run = TrajectoryRun::test()
        .with(|spec| spec.storage.output_path = Some("runs/coding".into()))
        .build();
    let cases: [PendingCase; 4] = [
        (None, None),
        (Some(&[0, 1, 2]), None),
        (Some(&[1, 2]), Some(vec![1, 2])),
        (Some(&[0, 4, 7]), Some(vec![0, 4, 7])),
    ];
    for (pending, expected) in cases {
        let pending = pending.map(|batches| Pending::new(batches.to_vec()).unwrap());
        let map = plan_config_map(&valid(&run), Component::generation(2), pending.as_ref());
        assert_eq!(map.metadata.name.as_deref(), Some("coding-v1-gen-2"));
        let text = &map.data.as_ref().unwrap()[paths::PLAN_FILE];
        let plan: RunPlan = serde_json::from_str(text).unwrap();
        assert_eq!(plan.batches, expected, "pending {pending:?}");
        assert_eq!(plan.output_path, "runs/coding");
        assert_eq!(
            (plan.name.as_str(), plan.namespace.as_str()),
            ("coding-v1", "research")
        );
        assert_eq!(plan.uid, "0b7c-uid");
        assert_eq!(plan.spec, run.spec.run);
    }
}

#[test]
fn pods_get_the_worker_contract_environment_and_the_key_only_by_secret_ref() {
    let run = run_with_a_key_secret();
    let job = gen_job(&run, 1, &[0], false);
    let value = |name| env_value(&job, name).and_then(|var| var.value.clone());
    assert_eq!(
        value(env::PLAN_PATH).as_deref(),
        Some("/etc/trajectory/plan.json")
    );
    assert_eq!(
        value(env::STORAGE_ROOT).as_deref(),
        Some(paths::STORAGE_ROOT)
    );
    assert_eq!(
        value(env::WORKSPACE_ROOT).as_deref(),
        Some(paths::WORKSPACE_ROOT)
    );
    assert_eq!(
        value(env::TERMINATION_LOG).as_deref(),
        Some(paths::TERMINATION_LOG)
    );
    assert_eq!(value(env::LOG_FORMAT).as_deref(), Some("json"));
    assert_eq!(
        secret_of(&job, env::MODEL_API_KEY),
        ("llm-key".to_owned(), "api-key".to_owned())
    );

    let without = gen_job(&TrajectoryRun::test().build(), 1, &[0], false);
    assert!(env_value(&without, env::MODEL_API_KEY).is_none());
    assert!(env_value(&job, env::USER_SIMULATOR_API_KEY).is_none());
}

#[test]
fn a_simulated_users_key_reaches_the_worker_by_its_own_secret_ref() {
    let run = TrajectoryRun::test()
        .with(|spec| {
            let mut model = spec.model.clone();
            model.api_key_secret_ref = Some(trajectory_worker::spec::SecretKeyRef {
                name: "simulator-key".into(),
                key: "token".into(),
            });
            spec.user_simulator = Some(Box::new(trajectory_worker::spec::UserSimulatorSpec {
                model,
                max_turns: 3,
                stop_tokens: vec!["###STOP###".into()],
            }));
        })
        .build();
    let job = gen_job(&run, 1, &[0], false);
    assert_eq!(
        secret_of(&job, env::USER_SIMULATOR_API_KEY),
        ("simulator-key".to_owned(), "token".to_owned())
    );
    assert!(env_value(&job, env::MODEL_API_KEY).is_none());
}

#[test]
fn every_pod_meets_the_restricted_pod_security_standard() {
    let run = TrajectoryRun::test().build();
    let jobs = [
        plan_job(&valid(&run), &settings(), 1, false),
        gen_job(&run, 1, &[0], false),
        merge_job(&valid(&run), &settings(), 1, false),
    ];
    for job in &jobs {
        let pod = pod(job);
        assert_eq!(pod.automount_service_account_token, Some(false));
        let pod_context = pod.security_context.as_ref().unwrap();
        assert_eq!(pod_context.run_as_non_root, Some(true));
        assert_eq!(pod_context.fs_group, Some(65532));
        assert_eq!(
            pod_context.fs_group_change_policy.as_deref(),
            Some("OnRootMismatch")
        );
        assert_eq!(
            pod_context.seccomp_profile.as_ref().unwrap().type_,
            "RuntimeDefault"
        );
        let all_containers = pod.init_containers.iter().flatten().chain(&pod.containers);
        for container in all_containers {
            let context = container.security_context.as_ref().unwrap();
            assert_eq!(context.allow_privilege_escalation, Some(false));
            assert_eq!(context.read_only_root_filesystem, Some(true));
            assert_eq!(context.run_as_non_root, Some(true));
            assert_eq!(
                context.capabilities.as_ref().unwrap().drop.as_deref(),
                Some(&["ALL".to_owned()][..])
            );
            assert_eq!(
                context.seccomp_profile.as_ref().unwrap().type_,
                "RuntimeDefault"
            );
        }
        // The worker's read-only root needs writable scratch: the workspace and /tmp are emptyDirs.
        let mounts: Vec<_> = pod.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| (m.name.as_str(), m.mount_path.as_str()))
            .collect();
        assert!(mounts.contains(&("workspace", paths::WORKSPACE_ROOT)));
        assert!(mounts.contains(&("tmp", "/tmp")));
        let empty_dirs: Vec<_> = pod
            .volumes
            .iter()
            .flatten()
            .filter(|v| v.empty_dir.is_some())
            .map(|v| v.name.as_str())
            .collect();
        if pod.init_containers.is_some() {
            assert_eq!(
                empty_dirs,
                [
                    "workspace",
                    "tmp",
                    "sandbox-bin",
                    "sandbox-socket",
                    "sandbox-tmp"
                ]
            );
        } else {
            assert_eq!(empty_dirs, ["workspace", "tmp"]);
        }
    }
}

#[test]
fn generation_pods_run_commands_in_a_sandbox_sidecar_that_holds_no_secret_and_no_storage() {
    let run = run_with_a_key_secret();
    let job = gen_job(&run, 1, &[0], false);
    let pod_spec = pod(&job);
    let init = pod_spec.init_containers.as_ref().expect("init containers");
    let names: Vec<_> = init.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["install-executor", "sandbox"]);
    let (install, sandbox) = (&init[0], &init[1]);
    assert_eq!(
        install.image, pod_spec.containers[0].image,
        "the worker image"
    );
    assert_eq!(
        sandbox.image, pod_spec.containers[0].image,
        "default: the worker image"
    );
    assert_eq!(
        sandbox.restart_policy.as_deref(),
        Some("Always"),
        "a native sidecar"
    );
    assert_eq!(
        pod_spec.share_process_namespace, None,
        "separate process namespaces"
    );
    let context = sandbox.security_context.as_ref().unwrap();
    assert_eq!(
        (context.run_as_user, context.run_as_group),
        (Some(65532), Some(65532))
    );

    // The sandbox mounts its binary, the socket and the workspaces: no data volume, no plan.
    let mounts =
        |container: &k8s_openapi::api::core::v1::Container| -> Vec<(String, String, bool)> {
            container
                .volume_mounts
                .iter()
                .flatten()
                .map(|m| {
                    (
                        m.name.clone(),
                        m.mount_path.clone(),
                        m.read_only == Some(true),
                    )
                })
                .collect()
        };
    assert_eq!(
        mounts(sandbox),
        [
            (
                "sandbox-bin".to_owned(),
                paths::SANDBOX_BIN_DIR.to_owned(),
                true
            ),
            (
                "sandbox-socket".to_owned(),
                paths::SANDBOX_SOCKET_DIR.to_owned(),
                false
            ),
            (
                "workspace".to_owned(),
                paths::WORKSPACE_ROOT.to_owned(),
                false
            ),
            ("sandbox-tmp".to_owned(), "/tmp".to_owned(), false),
        ]
    );
    let command = sandbox.command.as_ref().unwrap();
    assert!(
        command
            .windows(2)
            .any(|pair| pair == ["--session-root", "/tmp"]),
        "the sessions' private directories go to the sandbox's own /tmp: {command:?}"
    );
    assert!(
        sandbox.env.is_none() && sandbox.env_from.is_none(),
        "no environment at all"
    );
    // The worker holds the key and the data volume, and reaches the sandbox through the socket.
    let worker_mounts = mounts(&pod_spec.containers[0]);
    assert!(worker_mounts.iter().any(|(name, ..)| name == "data"));
    assert!(
        worker_mounts
            .iter()
            .any(|(name, ..)| name == "sandbox-socket")
    );
    assert!(env_value(&job, env::MODEL_API_KEY).is_some());
    let socket = env_value(&job, env::SANDBOX_SOCKET).and_then(|var| var.value.clone());
    assert_eq!(
        socket,
        Some(format!(
            "{}/{}",
            paths::SANDBOX_SOCKET_DIR,
            paths::SANDBOX_SOCKET_FILE
        ))
    );
    assert!(
        sandbox.command.as_ref().unwrap().contains(&socket.unwrap()),
        "the sidecar listens where the worker connects"
    );
}

#[test]
fn the_sandbox_runs_the_task_image_in_generation_pods_only() {
    let run = run_with_a_key_secret();
    // The task image, when the run names one.
    let task = TrajectoryRun::test()
        .with(|spec| spec.sandbox.image = Some("python:3.12-slim".into()))
        .build();
    let task_job = gen_job(&task, 1, &[0], false);
    let task_init = pod(&task_job).init_containers.as_ref().unwrap();
    assert_eq!(task_init[1].image.as_deref(), Some("python:3.12-slim"));
    assert_eq!(task_init[0].image, pod(&task_job).containers[0].image);
    // Its files are the task's; the worker image's are not the model's business.
    let serves_image = |init: &[k8s_openapi::api::core::v1::Container]| {
        init[1]
            .command
            .iter()
            .flatten()
            .any(|arg| arg == "--image-readable")
    };
    assert!(serves_image(task_init));
    let default_job = gen_job(&run, 1, &[0], false);
    assert!(!serves_image(
        pod(&default_job).init_containers.as_ref().unwrap()
    ));

    // Plan and merge pods run no command of the model's: no sandbox.
    for job in [
        plan_job(&valid(&run), &settings(), 1, false),
        merge_job(&valid(&run), &settings(), 1, false),
    ] {
        assert!(pod(&job).init_containers.is_none());
        assert!(env_value(&job, env::SANDBOX_SOCKET).is_none());
        assert!(
            pod(&job)
                .volumes
                .iter()
                .flatten()
                .all(|v| !v.name.starts_with("sandbox-"))
        );
    }
}

#[test]
fn a_plan_pod_has_the_sandbox_when_the_run_declares_stdio_mcp_servers() {
    let with_mcp = |servers: serde_json::Value| {
        TrajectoryRun::test()
            .with(|spec| {
                spec.sandbox.image = Some("mcp-tools:1".into());
                spec.tools = serde_json::from_value(json!({"mcp": servers})).unwrap();
            })
            .build()
    };
    let stdio = with_mcp(json!([
        {"name": "http", "streamableHttp": {"url": "http://mcp.tools:8080/mcp"}},
        {"name": "time", "stdio": {"command": "mcp-server-time"}},
    ]));
    let job = plan_job(&valid(&stdio), &settings(), 1, false);
    let plan_pod = pod(&job);
    let init = plan_pod
        .init_containers
        .as_ref()
        .expect("a sandbox sidecar");
    assert_eq!(init[1].name, pod_spec::containers::SANDBOX);
    assert_eq!(init[1].image.as_deref(), Some("mcp-tools:1"));
    let socket = env_value(&job, env::SANDBOX_SOCKET).and_then(|var| var.value.clone());
    assert!(
        init[1].command.as_ref().unwrap().contains(&socket.unwrap()),
        "the plan's worker connects where the sidecar listens"
    );
    assert!(
        plan_pod.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "sandbox-socket")
    );
    // Its merge pod, and the plan pod of a run with HTTP servers only, have none.
    assert!(
        pod(&merge_job(&valid(&stdio), &settings(), 1, false))
            .init_containers
            .is_none()
    );
    let http = with_mcp(json!([
        {"name": "http", "streamableHttp": {"url": "http://mcp.tools:8080/mcp"}},
    ]));
    let job = plan_job(&valid(&http), &settings(), 1, false);
    assert!(pod(&job).init_containers.is_none());
    assert!(env_value(&job, env::SANDBOX_SOCKET).is_none());
}

#[test]
fn sandbox_resources_go_to_the_sandbox_container_only() {
    let run = TrajectoryRun::test()
        .with(|spec| {
            spec.sandbox.resources = Some(json!({
                "requests": {"memory": "1Gi"},
                "limits": {"memory": "4Gi", "ephemeral-storage": "8Gi"},
            }));
        })
        .with_pod_template(json!({"resources": {"limits": {"memory": "512Mi"}}}))
        .build();
    let job = gen_job(&run, 1, &[0], false);
    let pod_spec = pod(&job);
    let init = pod_spec.init_containers.as_ref().unwrap();
    let (install, sandbox) = (&init[0], &init[1]);
    let limits = sandbox.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(limits["memory"].0, "4Gi");
    assert_eq!(limits["ephemeral-storage"].0, "8Gi");
    assert!(install.resources.is_none());
    let worker = pod_spec.containers[0].resources.as_ref().unwrap();
    assert_eq!(
        worker.limits.as_ref().unwrap()["memory"].0,
        "512Mi",
        "the worker's own"
    );

    let plain = gen_job(&TrajectoryRun::test().build(), 1, &[0], false);
    assert!(
        pod(&plain).init_containers.as_ref().unwrap()[1]
            .resources
            .is_none()
    );
}

#[test]
fn storage_volume_is_mounted_as_the_data_volume() {
    let job = plan_job(
        &valid(&TrajectoryRun::test().build()),
        &settings(),
        1,
        false,
    );
    let data = pod(&job)
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "data")
        .unwrap();
    assert_eq!(
        data.persistent_volume_claim.as_ref().unwrap().claim_name,
        "trajectories"
    );
}

#[test]
fn a_run_on_a_bucket_mounts_no_storage_and_gives_its_keys_to_the_worker_container_alone() {
    let run = TrajectoryRun::test()
        .with(|spec| {
            spec.storage.volume = None;
            spec.storage.object = Some(trajectory_worker::spec::ObjectStorageSpec {
                url: "s3://trajectories/experiments".into(),
                credentials_secret: Some("bucket-keys".into()),
                ..Default::default()
            });
        })
        .build();
    for job in [
        plan_job(&valid(&run), &settings(), 1, false),
        gen_job(&run, 1, &[0], false),
    ] {
        let pod_spec = pod(&job);
        assert!(
            pod_spec.volumes.iter().flatten().all(|v| v.name != "data"),
            "no data volume"
        );
        let worker = &pod_spec.containers[0];
        assert!(
            worker
                .volume_mounts
                .iter()
                .flatten()
                .all(|m| m.mount_path != paths::STORAGE_ROOT)
        );
        for key in [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
        ] {
            assert_eq!(
                secret_of(&job, key),
                ("bucket-keys".to_owned(), key.to_owned())
            );
            let selector = env_value(&job, key)
                .and_then(|var| var.value_from.as_ref())
                .and_then(|from| from.secret_key_ref.as_ref())
                .unwrap();
            assert_eq!(selector.optional, Some(key == "AWS_SESSION_TOKEN"), "{key}");
        }
        // The containers the model's commands may run in get none of it.
        for container in pod_spec.init_containers.iter().flatten() {
            assert!(
                container
                    .env
                    .iter()
                    .flatten()
                    .all(|var| !var.name.starts_with("AWS_")),
                "{}",
                container.name
            );
        }
    }
}

#[test]
fn queue_name_labels_the_job_for_kueue_and_creates_it_suspended() {
    let cases = [
        // (exists, spec.suspend) -> suspend asserted by the operator: created suspended, and never
        // asserted once it exists, also while the run is suspended (Kueue would unsuspend it
        // again at once; the run deactivates its Workload instead).
        (false, false, Some(true)),
        (false, true, Some(true)),
        (true, false, None),
        (true, true, None),
    ];
    for (exists, suspend, expected) in cases {
        let run = TrajectoryRun::test()
            .with(|spec| spec.queue_name = Some("team-a".into()))
            .with(|spec| spec.suspend = suspend)
            .build();
        // Every stage goes through the queue: plan, generation and merge alike.
        let jobs = [
            plan_job(&valid(&run), &settings(), 1, exists),
            gen_job(&run, 1, &[0], exists),
            merge_job(&valid(&run), &settings(), 1, exists),
        ];
        for job in jobs {
            let name = job.metadata.name.clone().unwrap();
            assert_eq!(
                job.spec.as_ref().unwrap().suspend,
                expected,
                "{name}: exists {exists}"
            );
            let labels = job.metadata.labels.as_ref().unwrap();
            assert_eq!(
                labels.get(labels::KUEUE_QUEUE).map(String::as_str),
                Some("team-a"),
                "{name}: exists {exists}"
            );
        }
    }
    let plain = gen_job(&TrajectoryRun::test().build(), 1, &[0], false);
    assert!(
        !plain
            .metadata
            .labels
            .as_ref()
            .unwrap()
            .contains_key(labels::KUEUE_QUEUE)
    );
    let suspended = TrajectoryRun::test()
        .with(|spec| spec.suspend = true)
        .build();
    let job = gen_job(&suspended, 1, &[0], true);
    assert_eq!(job.spec.as_ref().unwrap().suspend, Some(true));
}

#[test]
fn a_queued_generation_job_is_elastic_and_a_stopped_queued_run_creates_no_job() {
    let queued = TrajectoryRun::test()
        .with(|spec| spec.queue_name = Some("team-a".into()))
        .build();
    let job = gen_job(&queued, 1, &[0], false);
    assert_eq!(
        job.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::reconcile::queue::ELASTIC_JOB))
            .map(String::as_str),
        Some("true")
    );
    let plain = gen_job(&TrajectoryRun::test().build(), 1, &[0], false);
    assert!(plain.metadata.annotations.is_none());

    let wanted = [Child::Plan {
        round: 1,
        exists: false,
    }];
    for (queue, suspend, jobs) in [(true, true, 0), (true, false, 1), (false, true, 1)] {
        let run = TrajectoryRun::test()
            .with(|spec| spec.queue_name = queue.then(|| "team-a".into()))
            .with(|spec| spec.suspend = suspend)
            .build();
        let built = children(&valid(&run), &settings(), &wanted);
        assert_eq!(
            (built.jobs.len(), built.config_maps.len()),
            (jobs, jobs),
            "queue {queue}, suspend {suspend}"
        );
    }
}

#[test]
fn pod_template_fields_reach_the_pods() {
    let run = TrajectoryRun::test().with_pod_template(json!({
        "image": "registry.local/worker:1.2",
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
        }}},
        "serviceAccountName": "trajectories",
        "priorityClassName": "batch-low",
        "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}, {"name": "TRAJ_STORAGE_ROOT", "value": "/elsewhere"}],
        "imagePullSecrets": [{"name": "registry"}],
        "annotations": {"karpenter.sh/do-not-disrupt": "true"},
        "terminationGracePeriodSeconds": 600,
    }))
    .build();
    let job = gen_job(&run, 1, &[0], false);
    let pod = pod(&job);
    assert_eq!(
        pod_metadata(&job).annotations.as_ref().unwrap()["karpenter.sh/do-not-disrupt"],
        "true"
    );
    assert_eq!(pod.termination_grace_period_seconds, Some(600));
    // The conversations in flight end 5 s before the kubelet may stop the pod's sidecars.
    let grace = env_value(&job, env::SHUTDOWN_GRACE_SECONDS).and_then(|var| var.value.clone());
    assert_eq!(grace.as_deref(), Some("595"));
    let default = gen_job(&TrajectoryRun::test().build(), 1, &[0], false);
    let grace = env_value(&default, env::SHUTDOWN_GRACE_SECONDS).and_then(|var| var.value.clone());
    assert_eq!(
        grace.as_deref(),
        Some("25"),
        "Kubernetes' 30 s, less the margin"
    );
    let container = &pod.containers[0];
    assert_eq!(
        container.image.as_deref(),
        Some("registry.local/worker:1.2")
    );
    let requests = container
        .resources
        .as_ref()
        .unwrap()
        .requests
        .as_ref()
        .unwrap();
    assert_eq!(requests["cpu"].0, "2");
    assert_eq!(pod.node_selector.as_ref().unwrap()["pool"], "cpu");
    assert_eq!(
        pod.tolerations.as_ref().unwrap()[0].key.as_deref(),
        Some("spot")
    );
    assert!(pod.affinity.as_ref().unwrap().node_affinity.is_some());
    assert_eq!(pod.service_account_name.as_deref(), Some("trajectories"));
    assert_eq!(pod.priority_class_name.as_deref(), Some("batch-low"));
    assert_eq!(pod.image_pull_secrets.as_ref().unwrap()[0].name, "registry");
    assert_eq!(
        env_value(&job, "HTTPS_PROXY").unwrap().value.as_deref(),
        Some("http://proxy:3128")
    );
    // The contract's variables come last, so they win over a user's.
    assert_eq!(
        env_value(&job, env::STORAGE_ROOT).unwrap().value.as_deref(),
        Some(paths::STORAGE_ROOT)
    );

    let default = gen_job(&TrajectoryRun::test().build(), 1, &[0], false);
    assert_eq!(
        default
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0]
            .image
            .as_deref(),
        Some(settings().worker_image.as_str())
    );
}

#[test]
fn a_pending_list_is_written_as_ranges_and_as_a_list_only_while_short() {
    let run = TrajectoryRun::test().build();
    let plan_of = |batches: Vec<u32>| -> RunPlan {
        let pending = Pending::new(batches).unwrap();
        let map = plan_config_map(&valid(&run), Component::generation(2), Some(&pending));
        serde_json::from_str(&map.data.as_ref().unwrap()[paths::PLAN_FILE]).unwrap()
    };
    let short = plan_of(vec![0, 4, 5, 6, 9]);
    assert_eq!(short.batch_ranges.as_deref(), Some("0,4-6,9"));
    assert_eq!(short.batches, Some(vec![0, 4, 5, 6, 9]));
    let long = plan_of((1..=20_000).chain(30_000..30_005).collect());
    assert_eq!(long.batch_ranges.as_deref(), Some("1-20000,30000-30004"));
    assert_eq!(long.batches, None);
    assert_eq!(long.batch_for_index(20_000), Some(30_000));
}

#[test]
fn tool_backend_secrets_reach_the_worker_container_only() {
    let tools = json!({
        "web": {"search": {"backend": "json", "url": "https://search.example/api?q={query}",
                           "apiKeySecretRef": {"name": "search", "key": "token"}}},
        "mcp": [{"name": "team", "streamableHttp": {"url": "http://mcp.team:8080/mcp",
                 "headers": [{"name": "Authorization",
                              "valueFrom": {"secretKeyRef": {"name": "mcp-auth", "key": "bearer"}}}]}}],
        "vision": {"baseUrl": "http://vllm-vl:8000/v1", "model": "vl",
                   "apiKey": {"secretKeyRef": {"name": "vl", "key": "api-key"}}},
        "imageGen": {"baseUrl": "https://api.openai.com/v1", "model": "gpt-image-1",
                     "apiKey": {"secretKeyRef": {"name": "openai", "key": "key"}}},
    });
    let run = TrajectoryRun::test()
        .with(|spec| spec.tools = serde_json::from_value(tools.clone()).unwrap())
        .build();
    let job = gen_job(&run, 1, &[0], false);
    assert_eq!(
        secret_of(&job, env::WEB_SEARCH_API_KEY),
        ("search".to_owned(), "token".to_owned())
    );
    assert_eq!(
        secret_of(&job, "TRAJ_SECRET_MCP_AUTH__BEARER"),
        ("mcp-auth".to_owned(), "bearer".to_owned())
    );
    assert_eq!(
        secret_of(&job, "TRAJ_SECRET_VL__API_KEY"),
        ("vl".to_owned(), "api-key".to_owned())
    );
    assert_eq!(
        secret_of(&job, "TRAJ_SECRET_OPENAI__KEY"),
        ("openai".to_owned(), "key".to_owned())
    );
    let sandbox = &pod(&job).init_containers.as_ref().unwrap()[1];
    assert!(sandbox.env.is_none(), "the sandbox gets no secret");
}
