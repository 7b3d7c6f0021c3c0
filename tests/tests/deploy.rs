//! `deploy/`: the systemd unit passes `systemd-analyze verify`, berth speaks
//! the service manager's readiness protocol, the Kubernetes manifests pass
//! a pinned version's schemas (the InferencePool its CRD's, pinned in
//! `deploy/k8s/crds`) and the checks in `deploy/check.py`, and
//! `berth health` answers the probes that cannot speak HTTP.

use std::os::unix::net::UnixDatagram;
use std::process::Command;
use std::time::Duration;

use berth_tests::python::{deploy_python, repo_root};
use berth_tests::{Server, berth_bin};

/// The Kubernetes version the manifests are checked against.
const KUBERNETES: &str = "1.34.0";

#[test]
fn the_systemd_unit_and_its_container_drop_in_verify_without_a_warning() {
    let unit = std::fs::read_to_string(repo_root().join("deploy/systemd/berth.service")).unwrap();
    for line in [
        "Type=notify",
        "Delegate=memory pids",
        "MemoryMax=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "User=berth",
        "KillMode=mixed",
        "ExecReload=/bin/kill -HUP $MAINPID",
    ] {
        assert!(unit.contains(line), "the unit lacks `{line}`");
    }
    // verify checks that ExecStart exists: point it at the built binary.
    let dir = std::env::temp_dir().join(format!("berth-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("berth.service");
    let unit = unit.replace("/usr/local/bin/berth", &berth_bin().display().to_string());
    std::fs::write(&path, unit).unwrap();
    // With the drop-in for servers in containers, read from beside it.
    let drop_in =
        std::fs::read_to_string(repo_root().join("deploy/systemd/berth.service.d/containers.conf"))
            .unwrap();
    for line in [
        "Delegate=yes",
        "User=root",
        "ExecStopPost=/usr/local/bin/berth reap",
    ] {
        assert!(drop_in.contains(line), "the drop-in lacks `{line}`");
    }
    std::fs::create_dir_all(dir.join("berth.service.d")).unwrap();
    std::fs::write(
        dir.join("berth.service.d/containers.conf"),
        drop_in.replace("/usr/local/bin/berth", &berth_bin().display().to_string()),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze (Debian's systemd package) runs");
    std::fs::remove_dir_all(&dir).unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    // An unknown key or a bad value is only a warning: refuse those too.
    assert!(
        said.trim().is_empty(),
        "systemd-analyze verify said:\n{said}"
    );
}

#[test]
fn the_sysusers_file_makes_berth_its_user_and_the_build_script_parses() {
    let root = std::env::temp_dir().join(format!("berth-sysusers-{}", std::process::id()));
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let out = Command::new("systemd-sysusers")
        .arg(format!("--root={}", root.display()))
        .arg(repo_root().join("deploy/systemd/berth.sysusers"))
        .output()
        .expect("systemd-sysusers runs");
    assert!(out.status.success(), "{out:?}");
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
    std::fs::remove_dir_all(&root).unwrap();
    let berth = passwd
        .lines()
        .find(|l| l.starts_with("berth:"))
        .unwrap_or_else(|| panic!("no berth user in {passwd}"));
    assert!(
        berth.ends_with(":/var/lib/berth:/usr/sbin/nologin"),
        "{berth}"
    );
    // The image's build and its smoke check need root, a container engine
    // and minutes (docs/production.md has a run's output); here their
    // scripts are checked for syntax.
    for script in ["build.sh", "smoke.sh", "limits.sh"] {
        let out = Command::new("bash")
            .arg("-n")
            .arg(repo_root().join("deploy/container").join(script))
            .output()
            .unwrap();
        assert!(out.status.success(), "{script}: {out:?}");
    }
}

fn receive(socket: &UnixDatagram, want: &str) -> String {
    let mut buf = [0u8; 4096];
    loop {
        let n = socket
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no `{want}` from berth: {e}"));
        let text = String::from_utf8_lossy(&buf[..n]).to_string();
        if text.lines().any(|l| l == want) {
            return text;
        }
    }
}

#[test]
fn berth_tells_the_service_manager_when_it_is_ready_reloading_and_stopping() {
    let dir = std::env::temp_dir().join(format!("berth-notify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let notify = path.display().to_string();
    let mut server = Server::start_env(
        "",
        &[],
        &[
            ("NOTIFY_SOCKET", notify.as_str()),
            ("WATCHDOG_USEC", "200000"),
        ],
    );
    let ready = receive(&socket, "READY=1");
    assert!(
        ready.contains(&format!("MAINPID={}", server.pid())),
        "{ready}"
    );
    assert!(ready.contains("STATUS=listening on"), "{ready}");
    // The watchdog is petted at half of WATCHDOG_USEC.
    receive(&socket, "WATCHDOG=1");
    receive(&socket, "WATCHDOG=1");
    // SIGHUP (`ExecReload=`): a reload, framed as systemd's notify-reload
    // asks, then ready again.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.pid() as i32),
        nix::sys::signal::Signal::SIGHUP,
    );
    let reloading = receive(&socket, "RELOADING=1");
    assert!(reloading.contains("MONOTONIC_USEC="), "{reloading}");
    let ready = receive(&socket, "READY=1");
    assert!(ready.contains("STATUS=serving"), "{ready}");
    // SIGTERM: it says it is stopping, then exits 0.
    let pid = server.pid();
    let status = {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let stopping = receive(&socket, "STOPPING=1");
        assert!(stopping.contains("STATUS=draining"), "{stopping}");
        // Not `terminate`: a second SIGTERM means "stop at once" (exit 130).
        server.wait_exit(Duration::from_secs(15))
    };
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn berth_health_answers_probes_and_readyz_needs_no_token() {
    let server = Server::start_with("", &["--token", "s3cret"]);
    let url = server.url.clone();
    let health = |extra: &[&str]| {
        Command::new(berth_bin())
            .arg("health")
            .args(["--url", &url])
            .args(extra)
            .env_remove("BERTH_TOKEN")
            .output()
            .unwrap()
    };
    let alive = health(&[]);
    assert!(alive.status.success(), "{alive:?}");
    assert_eq!(String::from_utf8_lossy(&alive.stdout).trim(), "ok");
    let ready = health(&["--ready"]);
    assert!(ready.status.success(), "{ready:?}");
    assert_eq!(String::from_utf8_lossy(&ready.stdout).trim(), "ready");
    // The rest still wants the token.
    assert_eq!(server.get("/readyz").0, 200);
    let (status, _) = ureq::get(format!("{}/api/ps", server.url))
        .config()
        .http_status_as_error(false)
        .build()
        .call()
        .map(|r| (r.status().as_u16(), ()))
        .unwrap();
    assert_eq!(status, 401);
    drop(server);
    // Nothing there: exit 1, saying where it looked.
    let gone = health(&[]);
    assert!(!gone.status.success());
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("cannot reach berth"),
        "{gone:?}"
    );
}

#[test]
fn the_kubernetes_manifests_pass_the_schemas_and_the_deploy_checks() {
    let python = deploy_python();
    let validator = python.with_file_name("kubernetes-validate");
    let manifests: Vec<_> = [
        "sidecar.yaml",
        "daemonset.yaml",
        "deployment.yaml",
        "inference-pool.yaml",
    ]
    .iter()
    .map(|f| repo_root().join("deploy/k8s").join(f))
    .collect();
    let out = Command::new(&validator)
        .args(["--strict", "-k", KUBERNETES])
        .args(&manifests)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    for resource in [
        "deployment/app",
        "service/app",
        "configmap/app-berth-config",
        "daemonset/berth",
        "service/berth",
        "configmap/berth-node-config",
        "configmap/berth-config",
        "deployment/berth",
        "service/berth-direct",
        "serviceaccount/berth-epp",
        "role/berth-epp",
        "rolebinding/berth-epp",
        "configmap/berth-epp",
        "deployment/berth-epp",
        "service/berth-epp",
    ] {
        assert!(
            said.contains(&format!("passed for resource {resource}")),
            "{resource} not validated:\n{said}"
        );
    }
    let out = Command::new(&python)
        .arg(repo_root().join("deploy/check.py"))
        .arg(repo_root().join("deploy"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The custom resources (the InferencePool) against the inference
    // extension's CRD, pinned in deploy/k8s/crds (kubernetes-validate
    // knows only Kubernetes' own kinds); the check also shows it refuses
    // broken copies of each.
    let out = Command::new(&python)
        .arg(repo_root().join("deploy/crd_check.py"))
        .arg(repo_root().join("deploy"))
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("validated InferencePool/berth in inference-pool.yaml"),
        "{said}"
    );
    // The configs in deploy/ parse as berth configs (unknown keys, bad
    // sizes and durations are refused); their model folders exist only
    // once `berth serve` has fetched them on the target host.
    for config in ["deploy/systemd/berth.toml", "deploy/container/berth.toml"] {
        berth::daemon::ServeConfig::read(&repo_root().join(config))
            .unwrap_or_else(|e| panic!("{config}: {e}"));
    }
    // So do those the manifests' ConfigMaps hold (`public_metrics`
    // misspelt would stop berth at start, not fail a schema).
    let dir = std::env::temp_dir().join(format!("berth-k8s-configs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // One Python reads them all: [manifest, berth.toml] pairs.
    let out = Command::new(&python)
        .args([
            "-c",
            "import json, sys, yaml\n\
             print(json.dumps([[path, d['data']['berth.toml']] for path in sys.argv[1:] \
             for d in yaml.safe_load_all(open(path)) \
             if d and d['kind'] == 'ConfigMap' and 'berth.toml' in d.get('data', {})]))",
        ])
        .args(&manifests)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let configs: Vec<(String, String)> = serde_json::from_slice(&out.stdout).unwrap();
    for (i, (manifest, text)) in configs.iter().enumerate() {
        let path = dir.join(format!("{i}.toml"));
        std::fs::write(&path, text).unwrap();
        berth::daemon::ServeConfig::read(&path)
            .unwrap_or_else(|e| panic!("{manifest}: berth.toml: {e}"));
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        configs.len(),
        3,
        "the sidecar's, the DaemonSet's and the Deployment's"
    );
}
