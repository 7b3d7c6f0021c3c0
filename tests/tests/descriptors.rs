//! What a worker inherits: stdin, stdout, stderr and its wire's
//! descriptor, never what `berth serve` itself was started with.

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;

use berth_tests::python::python_worker_command;
use berth_tests::*;
use serde_json::json;

/// Each open descriptor of `pid` and what it points at.
fn descriptors(pid: u32) -> Vec<(i32, String)> {
    let mut fds: Vec<(i32, String)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let fd = e.file_name().to_string_lossy().parse().ok()?;
            let target = std::fs::read_link(e.path()).ok()?;
            Some((fd, target.display().to_string()))
        })
        .collect();
    fds.sort();
    fds
}

/// `berth serve` started by a shell that left descriptors open without
/// close-on-exec (fd 10 on `/dev/null`, fd 251 a pipe): its workers, on
/// both wires, have neither.
#[test]
fn workers_inherit_no_stray_descriptor_of_the_supervisor() {
    let devnull = std::fs::File::open("/dev/null").unwrap();
    let mut pipe = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array; they are closed
    // below, once the server is gone.
    assert_eq!(
        unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) },
        0
    );
    let pipe_inode = std::fs::read_link(format!("/proc/self/fd/{}", pipe[0]))
        .unwrap()
        .display()
        .to_string();
    let (null_fd, stray_pipe) = (devnull.as_raw_fd(), pipe[0]);
    let argv = serde_json::to_string(&python_worker_command()).unwrap();
    let config = std::env::temp_dir().join(format!("berth-fds-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        format!(
            "[[model]]\nname = \"rust\"\nbackend = \"echo\"\n\n\
             [[model]]\nname = \"python\"\nbackend = \"echo\"\ncommand = {argv}\n"
        ),
    )
    .unwrap();
    let server = Server::start_custom(&config, None, &[], &[], &mut |command| {
        // SAFETY: dup2 is async-signal-safe; the copies it makes have
        // close-on-exec cleared, as a careless shell leaves them.
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(null_fd, 10) != 10 || libc::dup2(stray_pipe, 251) != 251 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    let berths = descriptors(server.pid());
    assert!(
        berths.iter().any(|(fd, _)| *fd == 10) && berths.iter().any(|(fd, _)| *fd == 251),
        "the test gave berth its strays: {berths:?}"
    );
    for model in ["rust", "python"] {
        let (status, reply) = server.post(&format!("/api/models/{model}/infer"), json!({"x": 1}));
        assert_eq!(status, 200, "{model}: {reply}");
        let pid = server
            .ps()
            .into_iter()
            .find(|m| m["name"] == model)
            .and_then(|m| m["pid"].as_u64())
            .unwrap() as u32;
        let fds = descriptors(pid);
        for (fd, target) in &fds {
            assert!(
                *fd != 10 && *fd != 251 && *target != pipe_inode,
                "{model}: worker pid {pid} holds berth's stray descriptor {fd} -> {target}: {fds:?}"
            );
        }
        assert!(
            fds.iter().take(3).map(|(fd, _)| *fd).eq([0, 1, 2]),
            "{model}: stdio: {fds:?}"
        );
    }
    drop(server);
    // SAFETY: the pipe's descriptors are ours and used no more.
    unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
    }
    let _ = std::fs::remove_file(&config);
}
