//! Children that outlive the process that started them: brokers, SPARQL servers and services
//! started for a run (a test, `agentctl up`) are stopped when their owner drops them, but an
//! owner that aborts (a stack overflow, SIGKILL) leaves them running, each a JVM or a broker that
//! loads the machine for every run after it. Each child is marked with its owner; the next owner
//! to start a child stops those whose owner is gone.

use std::process::Command;

/// The variable that names a child's owner: `<pid>:<start time>` of the process that started it
/// (the start time so that a pid used again by another process is not taken for the owner).
/// Inherited by whatever the child starts in turn.
pub const OWNER_VAR: &str = "PULSAR_AGENTS_CHILD_OWNER";

/// Marks `command` as a child of this process and, the first time in this process, stops the
/// children of owners that are gone.
pub fn owned(command: &mut Command) -> &mut Command {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(stop_orphans);
    match owner_of(std::process::id()) {
        Some(owner) => command.env(OWNER_VAR, owner),
        None => command,
    }
}

/// `<pid>:<start time in clock ticks since boot>` of the process `pid`, if it runs.
fn owner_of(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after its end.
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Field 22 (start time) is the 20th after the name.
    let started = after_name.split_whitespace().nth(19)?;
    Some(format!("{pid}:{started}"))
}

/// SIGKILLs every process marked with an owner that no longer runs. Only this user's processes
/// can be read, so only those are touched.
fn stop_orphans() {
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return;
    };
    for process in processes.flatten() {
        let Some(pid) = process
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(process.path().join("environ")) else {
            continue;
        };
        let marker = format!("{OWNER_VAR}=");
        let Some(owner) = environ
            .split(|&b| b == 0)
            .filter_map(|var| std::str::from_utf8(var).ok())
            .find_map(|var| var.strip_prefix(&marker))
        else {
            continue;
        };
        let Some(owner_pid) = owner.split(':').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if owner_of(owner_pid).as_deref() == Some(owner) {
            continue;
        }
        tracing::warn!(pid, owner, "stopping a child whose owner is gone");
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child marked with an owner that is gone is stopped by the next sweep; one marked with
    /// this process is not.
    #[test]
    fn a_child_whose_owner_is_gone_is_stopped() {
        // No process has this pid (Linux's pids stop at 2^22).
        let gone = "4294967295:0";
        let mut orphan = Command::new("sleep")
            .arg("30")
            .env(OWNER_VAR, gone)
            .spawn()
            .unwrap();
        let mut kept = owned(&mut Command::new("sleep")).arg("30").spawn().unwrap();
        stop_orphans();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while orphan.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "the orphan still runs"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(
            kept.try_wait().unwrap().is_none(),
            "a child of a live owner was stopped"
        );
        let _ = kept.kill();
        let _ = kept.wait();
    }
}
