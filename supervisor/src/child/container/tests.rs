use super::sweep::owner_alive;
use super::*;

fn argv(line: &str) -> Vec<String> {
    line.split_whitespace().map(String::from).collect()
}

/// Every start: berth's flags, a name of its own, the owner and model
/// labels, the mark, the cgroup, the GPUs by UUID; the operator's
/// options and the server's arguments as given.
#[test]
fn a_start_carries_berths_flags_and_a_name_of_its_own() {
    let run = RunCommand::parse(&argv(
        "podman --runtime=runc run --name mine --rm --network=host img:1 --port {port}",
    ))
    .unwrap()
    .unwrap();
    let gpus = vec!["GPU-1111".to_string(), "GPU-2222".to_string()];
    let v1 = Host {
        cgroup_v2: false,
        runc: true,
        nofile: Some(20000),
        nproc: Some(32768),
    };
    let (first, args) = Container::plan("m/x", &run, &gpus, &v1).unwrap();
    let (second, _) = Container::plan("m/x", &run, &gpus, &v1).unwrap();
    assert_ne!(first.name, second.name);
    assert!(first.name.starts_with("berth-m_x-"), "{}", first.name);
    let line = args.join(" ");
    for want in [
        "--runtime=runc --cgroup-manager=cgroupfs run --rm --init --replace --sdnotify=ignore",
        &format!("--name {}", first.name),
        &format!("--label {OWNER_LABEL}={}", owner()),
        &format!("--label {MODEL_LABEL}=m/x"),
        "--env BERTH_WORKER_MARK",
        "--label=berth.cgroup={cgroup}",
        "--cgroup-parent={cgroup}",
        "--ulimit=nofile=20000:20000 --ulimit=nproc=32768:32768",
        "--device nvidia.com/gpu=GPU-1111 --device nvidia.com/gpu=GPU-2222",
        "--network=host img:1 --port {port}",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    assert!(!line.contains("mine"), "{line}");
    assert!(owner_alive(&owner()));
    assert!(!owner_alive("1.0") && !owner_alive("junk"));
    // The command's own runtime is kept, no second one given.
    assert_eq!(line.matches("--runtime").count(), 1, "{line}");
    let v2 = Host {
        cgroup_v2: true,
        ..v1.clone()
    };
    let (_, args) = Container::plan("m", &run, &[], &v2).unwrap();
    assert!(args.contains(&SPLIT.to_string()) && !args.join(" ").contains("cgroup-parent"));
    // On a v1 host, runc where none is named; the command's limits kept.
    let bare = RunCommand::parse(&argv("podman run --ulimit nofile=10:10 img"))
        .unwrap()
        .unwrap();
    let (_, args) = Container::plan("m", &bare, &[], &v1).unwrap();
    let line = args.join(" ");
    assert!(line.contains("--runtime=runc"), "{line}");
    assert!(
        !line.contains("nofile=20000") && line.contains("--ulimit=nproc=32768:32768"),
        "{line}"
    );
    let (_, args) = Container::plan("m", &bare, &[], &v2).unwrap();
    assert!(!args.join(" ").contains("--runtime"));
    let docker = RunCommand::parse(&argv("docker run img")).unwrap().unwrap();
    let (_, d) = Container::plan("m", &docker, &gpus, &v1).unwrap();
    let d = d.join(" ");
    assert!(d.contains("--gpus \"device=GPU-1111,GPU-2222\""), "{d}");
    assert!(!d.contains("--replace") && !d.contains("sdnotify"), "{d}");
}

#[test]
fn a_port_published_everywhere_is_published_on_the_loopback() {
    let options = argv("-p {port}:8080 --publish=9000:80 -p 10.0.0.1:1:2 -v a:b -p 18099");
    assert_eq!(
        loopback_only(&options),
        argv(
            "-p 127.0.0.1:{port}:8080 --publish=127.0.0.1:9000:80 -p 10.0.0.1:1:2 -v a:b \
             -p 127.0.0.1::18099"
        )
    );
}

#[test]
fn without_a_cgroup_its_arguments_are_left_out() {
    let args = argv("run --cgroup-parent={cgroup} {cgroups=split} img");
    assert_eq!(fill_cgroup(&args, None), argv("run img"));
}

/// The sweep kills a cgroup only where its name's maker is the dead owner:
/// a forged `berth.cgroup` label naming another berth's cgroup kills
/// nothing.
#[test]
fn a_cgroup_is_the_owners_only_by_its_makers_pid() {
    use std::path::Path;
    assert!(super::sweep::made_by(
        Path::new("/sys/fs/cgroup/x/berth/m-4121-3"),
        "4121.998"
    ));
    assert!(!super::sweep::made_by(
        Path::new("/sys/fs/cgroup/x/berth/m-4121-3"),
        "77.998"
    ));
    assert!(super::sweep::made_by(
        Path::new("/sys/fs/cgroup/x/berth/a-b-55-0"),
        "55.1"
    ));
    assert!(!super::sweep::made_by(
        Path::new("/sys/fs/cgroup/x/berth/m"),
        "55.1"
    ));
}
